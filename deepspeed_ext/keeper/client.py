"""What a training process asks of its node's keeper once it runs: hand a persist job
over, drain, shut it down; and whether it (or its process) is still there.

Who calls what: every rank's copy thread calls :func:`hand_over` per snapshot (with
:func:`job_id`); the first rank of a node calls :func:`drain_keeper` at the end of a
two-level wait and :func:`shutdown_keeper` at the end of training. Starting the keeper
is :mod:`deepspeed_ext.keeper.bootstrap`'s. Stdlib only: no torch.
"""

import os
import shutil
import socket
import time
import uuid
from typing import Any, Dict, List, Optional

from deepspeed_ext.job_identity import NODE_RECORD, ForeignJobError, bind_node_dir, node_run_id
from deepspeed_ext.keeper.protocol import KeeperError, request, socket_path
from deepspeed_ext.private_dir import UnsafeDirectoryError, check_private_dir
from deepspeed_ext.runtime.retry import Backoff, poll_until

HAND_OVER_BACKOFF = Backoff(first_s=0.05, max_s=1.0)
"""Sleeps between the requests of :func:`hand_over` to a keeper that does not answer."""

PROCESS_TOKEN = uuid.uuid4().hex[:12]
"""Part of every job ``id`` a training process sends (:func:`job_id`)."""


def hand_over(directory: str, job: Dict[str, Any], patience_s: float = 600.0,
              timeout_s: float = 10.0) -> bool:
    """Queue a persist job with the keeper of ``directory``; the training process calls
    it from its copy thread.

    A keeper that does not answer in time but still listens is busy, not dead: the
    request is sent again until ``patience_s`` (the keeper queues a job ``id`` once, so
    a first request that did arrive is not persisted twice). Only a dead keeper lets
    the caller persist the job itself: a busy one may still have it queued, and two
    writers of one slot let the slower one read a slot the next snapshot had already
    reused, publishing wrong bytes under a matching checksum.

    Returns:
        True once the keeper has the job; False when it is dead (nothing listens).

    Raises:
        KeeperError: it still listens but took no request within ``patience_s``: the
            job may be in its queue, so the caller must fail this persist, not write it.
    """
    last_error: List[KeeperError] = []

    def attempt() -> Optional[bool]:
        try:
            message = {"op": "persist", "job": job}
            if job.get("run_id") is not None:
                message["run_id"] = job["run_id"]
            request(directory, message, timeout_s=timeout_s)
            return True
        except KeeperError as e:
            if is_dead(directory):
                return False
            last_error[:] = [e]
            return None

    def timed_out() -> bool:
        raise KeeperError(f"the keeper of {directory} still listens but took no "
                          f"request within {patience_s:.0f} s ({last_error[0]})") from None

    # The backoff: a request failing fast (a full backlog) would otherwise spin for
    # patience_s, taking the GIL from the training step.
    return poll_until(attempt, patience_s, HAND_OVER_BACKOFF, timed_out)


def job_id(name: str, rank: int, attempt: float = 0.0) -> str:
    """The ``id`` of a job (``name``: a tag or frame) this process hands over in job
    attempt ``attempt`` (its start time): the same for its retries, new in every process
    and every attempt. Names repeat across attempts (a restarted job saving a tag, or
    taking a frame, again), and the keeper, which outlives them, dropped the new
    attempt's job as a retry of the old one: that save never committed, and every later
    persist waited behind it. An in-job restart's survivors start their next attempt in
    the same process, so the process alone does not tell attempts apart."""
    return f"{name}:{PROCESS_TOKEN}:{attempt:.6f}:rank{rank}"


def alive(directory: str) -> bool:
    """Whether a keeper answers a ping in ``directory`` within 2 s."""
    try:
        request(directory, {"op": "ping"}, timeout_s=2.0)
        return True
    except KeeperError:
        return False


def is_dead(directory: str) -> bool:
    """True only when nothing listens on the keeper's socket (refused or no socket file).

    A keeper that is merely busy (a slow or timed-out answer) is not dead: declaring it
    dead would abandon a persist it is still writing.
    """
    path = socket_path(directory)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        try:
            sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def drain_keeper(directory: str, timeout_s: float = 600.0, run_id: Optional[str] = None,
                 attempt_started: Optional[float] = None) -> bool:
    """The first rank of a node, at the end of a two-level wait: return once the node's
    keeper has run every persist job queued so far and finished every commit of the
    attempt ``attempt_started`` (manifest, ``latest``, retention) and every commit past
    its reports (:func:`deepspeed_ext.keeper.commits.commits_to_finish`). The keeper
    serves on.

    Returns:
        True when the keeper answered; False when none listens (nothing is running).

    Raises:
        KeeperError: it still listens but did not answer within ``timeout_s``.
    """
    message: Dict[str, Any] = {"op": "drain", "attempt_started": attempt_started}
    if run_id is not None:
        message["run_id"] = run_id
    try:
        request(directory, message, timeout_s=timeout_s)
    except KeeperError:
        if is_dead(directory):
            return False
        raise
    return True


def keeper_pid(directory: str) -> Optional[int]:
    """The pid the node's keeper answers a ping with (None: none answers)."""
    try:
        pid = request(directory, {"op": "ping"}, timeout_s=2.0).get("pid")
    except KeeperError:
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def has_exited(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie (not yet reaped by the rank
    that started it; its exit is under way, none of its code runs any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def shutdown_keeper(directory: str, timeout_s: float = 600.0,
                    run_id: Optional[str] = None,
                    attempt_started: Optional[float] = None) -> bool:
    """Ask the keeper to finish its queue, delete ``directory`` and exit; returns once it
    has exited (or after 30 s more).

    The keeper first finishes every persist queued and every commit
    :func:`~deepspeed_ext.keeper.commits.commits_to_finish` names for
    ``attempt_started``; other commits stand down. Waiting for the process itself, not
    only for its directory to go: a trainer that returned while its keeper still ran
    could be followed by a reader or the next job that saw the keeper's last writes land.

    Args:
        run_id: the job asking (a keeper of another job refuses); None: the job the
            directory is bound to (tools and tests that stop whatever this user left).
        attempt_started: the asking job attempt's start (its commits are waited for).

    Returns:
        True when a keeper answered; False when none was running (its directory, if
        any, is then deleted here so no shared memory is left, but only when it is
        this job's: private, and bound to ``run_id`` or to no job).
    """
    if run_id is None:
        run_id = node_run_id(directory)
    message: Dict[str, Any] = {"op": "shutdown", "attempt_started": attempt_started}
    if run_id is not None:
        message["run_id"] = run_id
    pid = keeper_pid(directory)
    if pid == os.getpid():
        # A keeper served by a thread of this very process (keeper.serve: tests and tools)
        # never exits before us: waiting for that would always run to the deadline.
        pid = None
    try:
        request(directory, message, timeout_s=timeout_s)
    except KeeperError:
        if is_dead(directory) and deletable(directory, run_id):
            shutil.rmtree(directory, ignore_errors=True)
        # else: alive but slow (its queue or a commit outlasted the timeout): deleting the
        # directory under it would remove the snapshots it is still persisting; it exits
        # on its own once no training process is alive.
        return False
    # The keeper deletes the directory right after answering; wait for it, so that a
    # caller checking for leftovers (or starting the next job) sees it gone.
    deadline = time.monotonic() + 30
    while (os.path.exists(directory) or (pid is not None and not has_exited(pid))) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def deletable(directory: str, run_id: Optional[str]) -> bool:
    """Whether ``directory`` may be deleted by this job: private to this user and not
    bound to another job (:mod:`deepspeed_ext.job_identity`)."""
    try:
        check_private_dir(directory)
    except (OSError, UnsafeDirectoryError):
        return False
    if run_id is None or not os.path.lexists(os.path.join(directory, NODE_RECORD)):
        return True
    try:
        bind_node_dir(directory, run_id)  # the record exists: only checked
        return True
    except (ForeignJobError, OSError):
        return False
