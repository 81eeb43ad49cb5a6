"""The keeper's log lines: one logger for the whole keeper package.

Every module of :mod:`deepspeed_ext.keeper` logs through :data:`logger`, named
``deepspeed_ext.keeper`` (not one logger per module): the keeper process's stdout is the
node directory's ``keeper.log``, and a user who set a level for ``deepspeed_ext.keeper``
keeps seeing (or silencing) every keeper line as before the keeper became a package.
"""

import logging
import os
import time

from deepspeed_ext.runtime.log import log_line

logger = logging.getLogger("deepspeed_ext.keeper")


def keeper_log(message: str) -> None:
    """One line of the keeper's, stamped with its pid and the time: several keepers may
    have served one node directory and append to its ``keeper.log`` (their stdout)."""
    log_line(logger, f"[moc keeper {os.getpid()} {time.strftime('%H:%M:%S')}] {message}")


def default_log(line: str) -> None:
    """A persist job's log when its caller names none (a rank persisting in-process)."""
    log_line(logger, line)
