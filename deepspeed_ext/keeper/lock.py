"""The node directory's lock: taken by a rank attaching to the keeper and by the keeper
leaving, so that neither strands the other (see :func:`deepspeed_ext.keeper.bootstrap.
ensure_keeper` and :func:`deepspeed_ext.keeper.server.leave`)."""

import fcntl
import os
from typing import IO, Optional

from deepspeed_ext.keeper.protocol import LOCK_NAME
from deepspeed_ext.private_dir import make_private_dir, open_private


def lock_node(directory: str, wait: bool = True, make: bool = True) -> Optional[IO[str]]:
    """The node directory's lock file, open and exclusively locked (None: another
    process holds it and ``wait`` is False). Retried when the file was replaced while
    this process waited (an exiting keeper deleted the directory): a lock on the
    deleted file would exclude nobody who comes later.

    The directory and its parent (the job's ``--moc-shm-dir``) are made private or
    checked to be, every time: a directory another user created first (they are
    predictable names in a world-writable ``/dev/shm``) is refused before anything is
    written into it. ``make`` False (the keeper leaving): only the lock file is
    opened, never through a link."""
    while True:
        if make:
            make_private_dir(directory, root=os.path.dirname(os.path.abspath(directory)))
        path = os.path.join(directory, LOCK_NAME)
        lock = os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(path).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()
