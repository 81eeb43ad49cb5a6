"""Ending a process that used torch.distributed, with the exit code it chose.

Once a job has destroyed its process group and flushed its output, what is left of
the interpreter's normal teardown is C++ destructors, and one of them (a gloo or
DeepSpeed communication thread still joinable) aborts the process now and then:
"terminate called without an active exception", exit -6 where the run had succeeded
(seen in the bad-input test, the accuracy experiment under torchrun, and a two-rank
test worker in CI). The exit code is what tells the user, the launcher and the tests
what happened, so every entry point that used a process group ends through
:func:`exit_without_teardown`.
"""

import os
import sys


def exit_without_teardown(code: int) -> None:
    """Flush stdout/stderr and end the process with ``code``, skipping C++ teardown.

    Every rank calls it last, after its own cleanup (checkpoint threads joined, the
    process group destroyed, files closed): atexit handlers and finalizers do not run.

    Args:
        code: the exit status (``None`` counts as 0, like ``sys.exit``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else int(code))
