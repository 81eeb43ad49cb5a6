"""A private, verified home in shared memory: directories only this job's user can touch.

``/dev/shm`` is visible to every local user. A job's snapshot directory there has a
predictable name, so another user could create it first (world-writable) and plant
links at the names MoC writes (the job then overwrites the links' targets) or plant
snapshot files that recovery would load as the job's own state. Every directory MoC
creates under shared memory therefore goes through :func:`make_private_dir`:

* created with mode 0700 (never wider, whatever the umask);
* checked with ``lstat`` before use: owned by this process's effective user, no group
  or other permission bits, not a link. A directory that fails is refused, never
  "repaired": its contents may already be someone else's;
* its ancestors are checked too: each must be owned by root or this user, and one that
  others may write must be sticky (``/dev/shm``, ``/tmp``), or another user could
  rename the private directory away and put their own in its place.

Files inside such a directory are created with :func:`open_private` (mode 0600, never
following a link). Every rank calls these functions; they touch only local paths and
run no collective, so the callers decide how a refusal reaches every rank.
"""

import os
import stat
from typing import Optional

DIR_MODE = 0o700
FILE_MODE = 0o600


class UnsafeDirectoryError(RuntimeError):
    """A shared-memory directory that another user could read or plant files in."""


def _describe(path: str, st: os.stat_result) -> Optional[str]:
    """Why ``st`` (an ``lstat`` of ``path``) is not a private directory; None if it is."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this job's user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return (f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read or "
                f"write it (MoC's own directories are 0700)")
    return None


def _refuse(problem: str, flag: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(
        f"{problem}; MoC keeps the job's snapshots there and must own it alone: point {flag} "
        f"at a directory of your own, or remove this one if it is yours")


def check_ancestors(path: str, flag: str = "--moc-shm-dir") -> None:
    """Refuse when an existing ancestor of ``path`` lets another user replace ``path``:
    it must be owned by root or this user, and be sticky if others may write it.

    Raises:
        UnsafeDirectoryError: naming the ancestor and ``flag``.
    """
    me = os.geteuid()
    current = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (0, me):
                raise _refuse(f"{current} (above {path}) belongs to uid {st.st_uid}", flag)
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise _refuse(f"{current} (above {path}) is writable by other users and not "
                              f"sticky (mode {stat.S_IMODE(st.st_mode):04o})", flag)
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def check_private_dir(path: str, flag: str = "--moc-shm-dir") -> None:
    """Refuse ``path`` unless it is a directory of this user, mode 0700 or narrower, and
    not a link (``lstat``: a link is never followed).

    Raises:
        UnsafeDirectoryError: what is wrong, naming ``flag``.
        FileNotFoundError: it does not exist.
    """
    problem = _describe(path, os.lstat(path))
    if problem is not None:
        raise _refuse(problem, flag)


def make_private_dir(path: str, root: Optional[str] = None, flag: str = "--moc-shm-dir") -> str:
    """Create ``path`` (and the directories between ``root`` and it) with mode 0700, or
    check the existing ones; returns ``path``. Every directory from ``root`` (default:
    ``path`` itself) down to ``path`` must be private (:func:`check_private_dir`), and
    the ancestors above ``root`` safe (:func:`check_ancestors`).

    Safe to call from every rank of a node at once (one creates, the others check).

    Raises:
        UnsafeDirectoryError: one of them is not private, naming ``flag``.
        OSError: one could not be created (no such parent above ``root``, say).
    """
    path = os.path.abspath(path)
    root = os.path.abspath(root) if root is not None else path
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{path} is not under {root}")
    check_ancestors(root, flag)
    chain = [path]
    while chain[-1] != root:
        chain.append(os.path.dirname(chain[-1]))
    for directory in reversed(chain):
        parent = os.path.dirname(directory)
        if directory == root and not os.path.isdir(parent):
            os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        try:
            # mkdir's mode is only narrowed by the umask, never widened: 0700 at most.
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            pass  # another rank's, or another user's: the check below decides
        check_private_dir(directory, flag)
    return path


def open_private(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """``os.open`` of a file in a private directory: created 0600, never through a link
    (``O_NOFOLLOW``: a link planted at the name fails with ``ELOOP`` instead of the job
    writing into its target). Returns the descriptor."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)


def open_private_file(path: str, mode: str = "ab"):
    """A file object for :func:`open_private` (``mode``: ``"ab"``, ``"a"``, ``"wb"``, ``"w"``)."""
    flags = os.O_WRONLY | os.O_CREAT
    if mode.startswith("a"):
        flags |= os.O_APPEND
    elif mode.startswith("w"):
        flags |= os.O_TRUNC
    else:
        raise ValueError(f"open_private_file: mode {mode!r} is not a write mode")
    return os.fdopen(open_private(path, flags), mode)
