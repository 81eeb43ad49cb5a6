"""The job's store, as the supervisor keeps it: a ``torch.distributed.TCPStore`` whose
server lives in the supervisor for the job's whole life (no training process's death
takes it along, as rank 0's did when it hosted the store; with several nodes node 0's
supervisor serves it and the others join it), and the writes of the
recovery rounds (:mod:`deepspeed_ext.runtime.rounds`' keys) into it.
"""

import dataclasses
import time
from datetime import timedelta

import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, LEFT_KEY, RoundAssignment,
                                          round_key)

LEAVE_POLL_S = 0.1
"""Between two reads of how many supervisors left, while node 0's waits for them."""

STORE_TIMEOUT = timedelta(seconds=60)
"""The timeout of the supervisor's own store calls (each a local set or get)."""


def host_store(host: str, port: int) -> dist.TCPStore:
    """The job's store, served by this process on ``port`` (0: a free one; read it back
    from ``.port``), reachable at ``host``. Returns at once: no process has to join.

    Raises:
        RuntimeError: the port cannot be served (in use, not allowed); torch's
            ``DistNetworkError`` is one.
    """
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=STORE_TIMEOUT)


def join_store(host: str, port: int) -> dist.TCPStore:
    """The job's store served by node 0's supervisor at ``host:port``, joined (waits up to
    :data:`STORE_TIMEOUT` for it to come up: the nodes start in any order).

    Raises:
        RuntimeError: not reachable there within the timeout.
    """
    return dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)


def write_round(store: dist.Store, assignment: RoundAssignment) -> None:
    """Publish ``assignment``, stamped with the time it is written (``at``: a process's
    recovery phases are measured from it): its record first, then ``current`` (a
    process that reads ``current`` always finds that round's record)."""
    assignment = dataclasses.replace(assignment, at=time.time())
    store.set(round_key(assignment.round), assignment.to_json())
    store.set(CURRENT_KEY, str(assignment.round))


def write_done(store: dist.Store, outcome: str) -> None:
    """End the job in the store: ``ok`` or ``failed: why``; the waiting spares read it and
    exit."""
    store.set(DONE_KEY, outcome)


def leave_store(store: dist.Store, nnodes: int, serves: bool, wait_s: float) -> None:
    """Say this supervisor is done with the store; the one that ``serves`` it waits up to
    ``wait_s`` until every one of the ``nnodes`` nodes' has left (each reads ``done``
    within its poll, then gives its processes their grace time), so none loses the store
    while it still needs it.

    Raises:
        dist.DistError: the store is gone.
    """
    left = store.add(LEFT_KEY, 1)
    deadline = time.monotonic() + wait_s
    while serves and left < nnodes and time.monotonic() < deadline:
        time.sleep(LEAVE_POLL_S)
        left = store.add(LEFT_KEY, 0)
