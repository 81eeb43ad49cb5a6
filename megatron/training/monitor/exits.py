"""How a monitor stops its rank, and what it prints on the way.

A rank stopped by the monitor ends with a status of its own, :data:`EXIT_HANG` or
:data:`EXIT_STRAGGLER`, so that the launcher's restart machinery (torchrun
``--max-restarts``) restarts the job and an operator can tell the two apart.
:func:`exit_now` ends the process without clean-up: the main thread of a stopping rank
may be blocked in a collective that never finishes. Lines and events are printed
flushed, since :func:`exit_now` would drop anything still buffered.

Called from the :class:`~megatron.training.monitor.watchdog.Watchdog`'s thread and the
:class:`~megatron.training.monitor.startup.StartupWatch`'s thread on every rank.
"""

import json
import os
import sys
from typing import Dict


EXIT_HANG = 75
"""Exit status of a rank stopped by a detected hang (``EX_TEMPFAIL``: try again)."""
EXIT_STRAGGLER = 76
"""Exit status of a rank stopped by a detected straggler (``--moc-straggler-action stop``)."""


def exit_now(status: int) -> None:
    """Flush stdout and stderr, then end this process at once with ``status`` (no clean-up:
    a rank that stops for a hang or a straggler must not wait in a collective).

    Called by :meth:`Watchdog.stop_job` on every rank that stops (from the watchdog's
    thread, and from the atexit handler it registers first) and by
    :class:`StartupWatch`'s default ``on_hang``; tests replace it to observe the status
    instead of exiting.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def print_line(message: str) -> None:
    """Print one detection line (a monitor's default ``log``), flushed."""
    print(message, flush=True)  # flushed: os._exit follows and would drop a buffered line


def print_event(event: Dict) -> None:
    """Print one event as JSON (a monitor's default ``emit``), flushed."""
    print(json.dumps(event), flush=True)
