"""``python -m deepspeed_ext.supervisor``: :func:`deepspeed_ext.supervisor.main.main`."""

import sys

from deepspeed_ext.supervisor.main import main

if __name__ == "__main__":
    sys.exit(main())
