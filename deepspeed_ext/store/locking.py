"""The lock that serialises the writers of ``latest``, retention and claims in a save
directory: in-process for every directory, cross-process for a local one."""

import contextlib
import fcntl
import logging
import os
import threading
from typing import Dict, Set

from deepspeed_ext.format import fs

logger = logging.getLogger(__name__)

LOCK_FILE = ".moc-lock"
"""The file :func:`locked_dir` locks in a local directory (hidden: never a checkpoint)."""


@contextlib.contextmanager
def locked_dir(path: str):
    """An exclusive lock on the directory ``path`` for the ``with`` block: within this
    process always (the keeper's commit threads), across processes by a POSIX lock on
    ``<path>/.moc-lock`` for a local directory (none for URLs). A regular file opened
    for writing, not the directory: NFS emulates ``flock`` with POSIX locks, which need
    a writable descriptor, and refused the directory's, so the committers and a
    restarting job went unserialised without a word. Where no lock can be had, this
    says so once per directory and goes on unlocked."""
    with _process_lock(path):
        fd = None
        if not fs.is_url(path):
            try:
                fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.lockf(fd, fcntl.LOCK_EX)
            except OSError as e:
                if fd is not None:
                    os.close(fd)
                fd = None
                _warn_unlocked(path, e)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # closing releases the lock


_UNLOCKED_WARNED: Set[str] = set()


def _warn_unlocked(path: str, error: OSError) -> None:
    key = os.path.realpath(path)
    if key not in _UNLOCKED_WARNED:
        _UNLOCKED_WARNED.add(key)
        logger.warning(f"[moc] WARNING: cannot lock {os.path.join(path, LOCK_FILE)} ({error}); "
                       f"commits into {path} are not serialised with other processes")


_PROCESS_LOCKS: Dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(path: str) -> threading.Lock:
    # Two commit threads of one keeper writing into a URL (no flock there) interleaved
    # their read of ``latest`` and their write of it; the same writer's temporary name
    # (``latest.tmp.<pid>``) was then shared by both.
    key = fs.identity(path) if fs.is_url(path) else os.path.realpath(path)
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(key, threading.Lock())

