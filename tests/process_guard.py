"""The guard of the fast subset: in a session whose tests are all unmarked (``--fast``, or
a pure file alone), an audit hook (PEP 578) fails any test that starts a process, naming
the process and the line of the repository that started it (armed by tests/conftest.py).
"""

import os
import sys
from typing import List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GUARDED_EVENTS = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                  "os.system", "multiprocessing.spawnv_passfds")
"""The audit events (PEP 578) of every way Python starts a process; the last one is ours:
multiprocessing's spawn and forkserver start their interpreter through
``_posixsubprocess.fork_exec``, which raises no event (:meth:`ProcessGuard.arm` adds it)."""


class ProcessGuard:
    """Records the processes started while a test runs (:meth:`hook`, an audit hook: any
    thread), and fails the test with them (:meth:`check`, on the main thread after each
    of the test's setup, call and teardown). Armed once per process, at collection."""

    def __init__(self):
        self.active = False
        self.started: List[str] = []

    def arm(self) -> None:
        """Listen from now on (an audit hook cannot be removed: :attr:`active` gates it)."""
        if self.active:
            return
        import multiprocessing.util as mp_util
        spawn = mp_util.spawnv_passfds

        def audited_spawnv_passfds(path, args, passfds):
            sys.audit("multiprocessing.spawnv_passfds", path, args)
            return spawn(path, args, passfds)

        if spawn.__name__ != audited_spawnv_passfds.__name__:  # once per process
            mp_util.spawnv_passfds = audited_spawnv_passfds
        sys.addaudithook(self.hook)
        self.active = True

    def hook(self, event: str, args: tuple) -> None:
        if self.active and event in GUARDED_EVENTS and not _tolerated():
            what = args[1] if event in ("subprocess.Popen", "multiprocessing.spawnv_passfds") \
                else args
            self.started.append(f"{event} {what!r} from {_caller()}")

    def check(self, item) -> None:
        started, self.started = self.started, []
        if started:
            pytest.fail(f"{item.nodeid} started a process but is not marked e2e (the rule in "
                        "tests/conftest.py did not see it): mark it @pytest.mark.e2e, or "
                        "teach the rule the helper:\n  " + "\n  ".join(started),
                        pytrace=False)


TOLERATED = (("deepspeed/ops/op_builder/builder.py", "has_function"),)
"""(file, function) on the stack of a process a library starts by itself, once per process,
in whichever test touches it first: DeepSpeed's op-compatibility probe compiles and links
a test program (is libaio there?) on the first read of ``deepspeed.ops.__compatible_ops__``.
Counted, it would fail whichever pure test happened to come first."""


def _tolerated() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if any(code.co_name == name and code.co_filename.endswith(path)
               for path, name in TOLERATED):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The innermost line of this repository (this file left out) on the current stack."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(REPO + os.sep) and "/.venv/" not in path and path != __file__:
            return f"{os.path.relpath(path, REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the repository"


GUARD = ProcessGuard()
