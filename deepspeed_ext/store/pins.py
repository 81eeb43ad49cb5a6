"""Readers' pins: a reader (``moc-ckpt verify``) pins a checkpoint against retention for
as long as it reads it; retention probes the pins before it deletes."""

import contextlib
import fcntl
import hashlib
import os
import struct
import threading
from typing import Dict, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.store.locking import locked_dir

READERS_FILE = ".moc-readers"
"""The file whose byte ranges pin checkpoints against retention (:func:`reading`), one
range per tag; apart from :data:`~deepspeed_ext.store.locking.LOCK_FILE`, because closing any descriptor of a file
drops every POSIX lock the process holds on it (retention's probe would release
:func:`~deepspeed_ext.store.locking.locked_dir`'s lock)."""
_READING: Dict[Tuple[str, str], int] = {}
"""Pins held by this process (POSIX locks do not exclude the process holding them)."""
_READING_GUARD = threading.Lock()


def _reader_range(tag: str) -> int:
    """The byte of :data:`READERS_FILE` that stands for ``tag`` (a hash: two tags sharing
    one only keep each other a little longer)."""
    return 1 + int.from_bytes(hashlib.sha256(tag.encode("utf-8")).digest()[:5], "big")


def _reading_key(save_dir: str, tag: str) -> Tuple[str, str]:
    return (fs.identity(save_dir) if fs.is_url(save_dir) else os.path.realpath(save_dir), tag)


@contextlib.contextmanager
def reading(save_dir: str, tag: str):
    """Pin checkpoint ``tag`` against retention for the ``with`` block: a reader
    (``moc-ckpt verify``) takes it before it reads the tag's manifest and files.

    A shared lock on the tag's byte of ``<save_dir>/.moc-readers`` for a local directory
    (retention, :func:`~deepspeed_ext.store.retention.apply_retention`, skips a tag whose byte it cannot lock
    exclusively), and this process's own count. The failure it prevents: retention run by
    a committer (a keeper finishing a dead job's persist) deleted a checkpoint while
    verify read it, and verify reported a healthy checkpoint directory as damaged.
    Retention that held the byte first finishes its deletion before the pin is granted:
    the reader must look for the manifest after entering (a pinned tag without one was
    deleted). Without write access to ``save_dir`` the pin is this process's only.
    """
    key = _reading_key(save_dir, tag)
    with _READING_GUARD:
        _READING[key] = _READING.get(key, 0) + 1
    fd = None
    try:
        if not fs.is_url(save_dir):
            try:
                fd = _pin(save_dir, tag)
            except OSError:  # read-only storage: nothing for other processes to see
                fd = None
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the pin
        with _READING_GUARD:
            _READING[key] -= 1
            if not _READING[key]:
                del _READING[key]


def _pin(save_dir: str, tag: str) -> int:
    """:func:`reading`'s shared lock; returns the descriptor holding it."""
    path = os.path.join(save_dir, READERS_FILE)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        # Created under the directory's lock, which retention holds from its look for
        # the file to its last deletion: a file made in between went unseen.
        with locked_dir(save_dir):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            return _lock_shared(fd, tag)
    return _lock_shared(fd, tag)


def _lock_shared(fd: int, tag: str) -> int:
    try:
        _lock_byte(fd, _reader_range(tag), exclusive=False, wait=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_byte(fd: int, offset: int, exclusive: bool, wait: bool) -> None:
    """Lock one byte of ``fd``'s file; raises OSError (EAGAIN/EACCES) when ``wait`` is
    False and another holder conflicts.

    Linux: an open-file-description lock, held by ``fd`` alone. The failure it prevents:
    a POSIX ``lockf`` lock belongs to the process and is dropped when the process closes
    *any* descriptor of the file, so one pin ending (or retention's probe closing its
    descriptor) silently unpinned a checkpoint another reader of the same process was
    still loading. Elsewhere: ``lockf`` (that gap remains there)."""
    command = getattr(fcntl, "F_OFD_SETLKW" if wait else "F_OFD_SETLK", None)
    if command is None:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        fcntl.lockf(fd, mode, 1, offset)
        return
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: required for OFD locks)
    fcntl.fcntl(fd, command, struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))


class RetentionProbe:
    """Retention's side of :func:`reading`: :meth:`claim` locks a tag's byte exclusively
    (held until :meth:`close`, so that a reader arriving during the deletion waits and
    then finds the manifest gone), or says that a reader holds it. Made under
    :func:`~deepspeed_ext.store.locking.locked_dir` (as :func:`~deepspeed_ext.store.retention.retain_unless_superseded` does)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.fd = None
        if not fs.is_url(save_dir):
            try:  # none: no reader ever pinned here (see _pin)
                self.fd = os.open(os.path.join(save_dir, READERS_FILE), os.O_RDWR)
            except OSError:
                self.fd = None

    def claim(self, tag: str) -> bool:
        """False while a reader pins ``tag`` (in this process, or another one)."""
        with _READING_GUARD:
            if _READING.get(_reading_key(self.save_dir, tag)):
                return False
        if self.fd is None:
            return True
        try:
            _lock_byte(self.fd, _reader_range(tag), exclusive=True, wait=False)
        except OSError:  # EAGAIN/EACCES: a reader holds it
            return False
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

