"""``python -m deepspeed_ext.cli``: the same as the ``moc-ckpt`` console script."""

import sys

from deepspeed_ext.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
