"""The library's output: every line goes through :mod:`logging`.

Every module logs to its own logger, ``logging.getLogger(__name__)``, a child of the
package logger ``deepspeed_ext``. Importing the package (``deepspeed_ext/__init__.py``
imports this module) sets up that package logger, each part only where nobody did before:

* level INFO when its level is unset, so the library's lines are on by default;
* a console handler that writes each record as its bare message (``%(message)s``) to the
  current ``sys.stdout``, flushed at once: the lines read exactly as the library's prints
  did (``[moc] ...``, ``[moc keeper <pid> ...] ...``; scripts and tests grep them) and
  interleave with the trainer's own prints. It writes a record only while no other
  handler gets it: none on the logger that made it, on ``deepspeed_ext``, or on the root
  logger (up to a logger that does not propagate). A program that configures logging
  (``logging.basicConfig``, a handler of its own on ``deepspeed_ext``, pytest's log
  capture) therefore gets every record once, through its own handlers, in its own
  format; a process that never configures logging (a rank of the trainer, the keeper,
  whose stdout is its ``keeper.log``) still gets every line on stdout.

Levels: a line that says ``WARNING:`` is logged at WARNING, one that says ``ERROR:`` at
ERROR, the others at INFO. Lines about the job as a whole come from rank 0 only
(:func:`rank_zero_lines`); lines about one rank (``[moc] rank N: WARNING: ...``) from
that rank.

To silence or redirect the lines, from a script that calls ``enable_moc_checkpointing``::

    import logging
    moc = logging.getLogger("deepspeed_ext")
    moc.setLevel(logging.WARNING)                 # warnings only
    moc.addHandler(logging.NullHandler())         # nothing on stdout (with propagate=False: nothing at all)
    moc.addHandler(logging.FileHandler("moc.log"))  # into a file instead of stdout
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
                                                  # through the root logger, in its format

``logging.config.dictConfig`` disables the loggers that exist when it runs unless it is
given ``disable_existing_loggers=False`` (or names ``deepspeed_ext`` under ``loggers``):
configure logging that way before importing ``deepspeed_ext``, or pass that flag.
"""

import logging
import re
import sys
from typing import Callable

PACKAGE_LOGGER = "deepspeed_ext"
"""Name of the package logger every module's logger is a child of."""

_LEVEL_WORD = re.compile(r"^(?:\[moc[^\]]*\] )?(?:(?:rank|node) \d+: )?(WARNING|ERROR)\b")


def line_level(message: str) -> int:
    """The level of one of the library's lines: WARNING or ERROR when it says so at its
    start (after a ``[moc ...]`` and a ``rank N:`` or ``node N:`` prefix), else INFO."""
    match = _LEVEL_WORD.match(message)
    if match is None:
        return logging.INFO
    return logging.WARNING if match.group(1) == "WARNING" else logging.ERROR


def log_line(logger: logging.Logger, message: str) -> None:
    """Log one of the library's lines, as it reads, at :func:`line_level`."""
    logger.log(line_level(message), message)


def _global_rank() -> int:
    """This process's rank, 0 without an initialized process group. Reads torch only
    when something imported ``torch.distributed`` already (this module stays light: the
    command lines import the package without torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank()


def rank_zero_lines(logger: logging.Logger, prefix: str = "[moc] ") -> Callable[[str], None]:
    """A ``log`` callable for lines about the whole job: on rank 0 (or without a process
    group) it logs ``prefix + message`` to ``logger`` at :func:`line_level`; other ranks
    drop it (every rank says the same, one copy is enough). Safe to call from any rank in
    any order: it runs no collective."""
    def log(message: str) -> None:
        if _global_rank() == 0:
            log_line(logger, prefix + message)
    return log


class ConsoleFallback(logging.Handler):
    """The package logger's default handler: each record's message on ``sys.stdout``,
    flushed, but only when no other handler gets the record (module docstring).

    ``sys.stdout`` is read per record, not kept: a redirected or replaced stdout (a
    test's capture, ``contextlib.redirect_stdout``) gets the lines as prints did.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    def _others_get(self, record: logging.LogRecord) -> bool:
        """Whether a handler other than this one sees ``record`` (the loggers from its
        own up to the root, stopping after one that does not propagate)."""
        current = logging.getLogger(record.name)
        while current is not None:
            if any(handler is not self for handler in current.handlers):
                return True
            if not current.propagate:
                return False
            current = current.parent
        return False

    def emit(self, record: logging.LogRecord) -> None:
        if self._others_get(record):
            return  # the program configured logging: its handlers have the line (no double)
        stream = sys.stdout
        if stream is None:  # no console at all (a detached interpreter): nowhere to write
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()  # launchers interleave the ranks' lines as they come
        except Exception:
            self.handleError(record)


def install_console() -> None:
    """Give the package logger its defaults (level INFO, :class:`ConsoleFallback`) where
    nobody set them; idempotent (a module imported twice adds no second handler)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
    if not any(isinstance(handler, ConsoleFallback) for handler in package.handlers):
        package.addHandler(ConsoleFallback())


install_console()
