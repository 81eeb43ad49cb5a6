"""The node keeper's fault-injection point, armed from outside through its environment.

Tests and demos (``--moc-fault persist-crash@N``) make a node's keeper die while it
persists a snapshot. The trainer's fault injector (``megatron.training.faults``) arms
it; the keeper is a separate process (:mod:`deepspeed_ext.keeper.bootstrap` starts it)
that inherits the environment of the rank that starts it, so the arming is a documented environment
spec rather than an import of the trainer:

- :data:`PERSIST_CRASH_ENV` (``MOC_FAULT_CRASH_PERSIST_STEP``): SIGKILL while persisting
  the snapshot of this step or a later one; unset or empty: never (every normal run);
- :data:`FAULT_KEY_ENV` (``MOC_FAULT_KEY``): the fault's key in the state file
  (default ``persist-crash@<step>``);
- :data:`FAULT_STATE_ENV` (``MOC_FAULT_STATE``): the job's fault state file, where the
  firing is recorded before the SIGKILL, so the restarted job does not arm it again.

The fault state file (``{"job_start": float, "fired": {key: record}}``, JSON) is shared
by every rank and restart of the job and by its keepers; :func:`record_fired` updates
it under a lock on a side file and replaces it atomically. Who calls what: the keeper's
persist thread calls :func:`crash_in_persist_if_due` after writing a rank's file; the
trainer's injector reads and records through the same functions.
"""

import fcntl
import json
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Mapping, Optional

from deepspeed_ext.keeper.log import logger
from deepspeed_ext.runtime.log import log_line

PERSIST_CRASH_ENV = "MOC_FAULT_CRASH_PERSIST_STEP"
"""Set for a node's keeper: it SIGKILLs itself while persisting a snapshot of an
iteration >= this value."""
FAULT_STATE_ENV = "MOC_FAULT_STATE"
"""Set for a node's keeper: the fault state file, where it records the crash first."""
FAULT_KEY_ENV = "MOC_FAULT_KEY"
"""Set for a node's keeper: the fault's key in the state file."""


@contextmanager
def state_lock(state_path: str) -> Iterator[None]:
    """Hold an exclusive lock for a read-modify-write of ``state_path``.

    Without it two ranks recording different faults at once could each rewrite the
    file from the same old content and lose the other's record. The lock is on a side
    file: the state file itself is replaced by rename, which a lock on it would not survive.
    """
    os.makedirs(os.path.dirname(os.path.abspath(state_path)), exist_ok=True)
    with open(state_path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(state_path: str) -> Dict:
    """The state file's content: ``{"job_start": float, "fired": {key: record}}``;
    an empty state when the file does not exist yet.

    Raises:
        RuntimeError: the file is not valid JSON (it names the file and how to recover).
    """
    try:
        with open(state_path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {"fired": {}}
    except ValueError as e:
        raise RuntimeError(f"fault state file {state_path} is not valid JSON ({e}); "
                           "delete it to start the faults over") from None
    state.setdefault("fired", {})
    return state


def write_state(state_path: str, state: Dict) -> None:
    """Replace the state file atomically (temp, fsync, rename); call under :func:`state_lock`."""
    # Imported here: storage imports torch, which the keeper must not wait for at start.
    from deepspeed_ext.format.storage import atomic_write_json
    atomic_write_json(state_path, state, sort_keys=True)


def record_fired(state_path: str, key: str, record: Mapping) -> None:
    """Add ``key`` to the fired faults (fsynced before returning: the caller may SIGKILL
    itself next)."""
    with state_lock(state_path):
        state = read_state(state_path)
        state["fired"][key] = dict(record)
        write_state(state_path, state)


def sigkill_self() -> None:
    """Die like a killed node: no exception, no atexit, no flushing by Python."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered asynchronously; never run on meanwhile


def _flush_handlers(start: logging.Logger) -> None:
    """Flush every handler that gets ``start``'s records (its loggers up to the root,
    stopping after one that does not propagate)."""
    current: Optional[logging.Logger] = start
    while current is not None:
        for handler in current.handlers:
            handler.flush()
        current = current.parent if current.propagate else None


def _log_flushed(message: str) -> None:
    """The keeper's line, through its logger, flushed out of every handler: the SIGKILL
    that follows would lose a buffered line (the tests grep the keeper's log for it)."""
    log_line(logger, message)
    _flush_handlers(logger)


def crash_in_persist_if_due(step: int, environ: Optional[Mapping[str, str]] = None,
                            log: Callable[[str], None] = _log_flushed) -> None:
    """The node keeper, while persisting the snapshot of iteration ``step``: SIGKILL
    itself if :data:`PERSIST_CRASH_ENV` arms a ``persist-crash`` for a step ``<= step``;
    the firing is recorded first (in :data:`FAULT_STATE_ENV`'s file), so the restarted
    job does not re-arm it. Returns at once when nothing is armed."""
    env = os.environ if environ is None else environ
    # Empty counts as unset, as the keeper always treated it (int("") would fail the persist).
    if not env.get(PERSIST_CRASH_ENV) or step < int(env[PERSIST_CRASH_ENV]):
        return
    key = env.get(FAULT_KEY_ENV, f"persist-crash@{env[PERSIST_CRASH_ENV]}")
    if env.get(FAULT_STATE_ENV):
        record_fired(env[FAULT_STATE_ENV], key, {
            "kind": "persist-crash", "iteration": step, "time": time.time(), "pid": os.getpid()})
    log(f"[fault] keeper pid {os.getpid()}: injected persist-crash while persisting "
        f"iteration {step} (--moc-fault {key})")
    sigkill_self()
