"""``python -m deepspeed_ext.keeper --dir <node dir>``: run a node's keeper by hand.

Ranks start it through :data:`deepspeed_ext.keeper.bootstrap.BOOTSTRAP` instead (with the
working directory off the import path); both command lines contain
``deepspeed_ext.keeper --dir``, which ``pkill -f`` matches.
"""

import sys

from deepspeed_ext.keeper.server import main

if __name__ == "__main__":
    sys.exit(main())
