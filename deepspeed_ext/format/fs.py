"""Where checkpoints live: a local (or mounted shared) directory, or an fsspec URL.

Every module that touches checkpoint storage goes through these functions, so that a
``--save``/``--load`` of ``s3://bucket/run1`` (or any other fsspec protocol) works the
same as ``/data/run1``. A path without ``scheme://`` is local and uses the operating
system directly (fsync and rename for atomic writes, see :mod:`deepspeed_ext.format.storage`);
a URL is handed to `fsspec <https://filesystem-spec.readthedocs.io>`_, which must be
installed together with the protocol's own package (``s3fs`` for ``s3://``, ``gcsfs``
for ``gs://``). ``file://`` URLs also go through fsspec, which is how the tests exercise
this path across processes; their whole-file writes alone use the operating system
(temporary name, fsync, rename, directory fsync), as a local path's do.

What the URL path assumes of the store, and nothing more (so object stores qualify):

- a whole-object write (:func:`write_bytes`) is atomic: readers see the old object or
  the whole new one (true of S3, GCS and Azure puts; :mod:`deepspeed_ext.store.commit` also
  checks sizes and checksums, so a torn write on a weaker store is caught at load);
- ranged reads (:func:`read_range`) and listings of a "directory" prefix.

No renames: on a URL a checkpoint is committed by writing its manifest last, and
deleted by removing its manifest first (then the rest), exactly as on a local disk.

All functions are called by whichever rank (or keeper) does the I/O; none is collective.
"""

import datetime
import os
import posixpath
import re
import shutil
from typing import Any, List, Optional, Tuple

from deepspeed_ext.format.errors import CheckpointError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: str) -> bool:
    """True for ``scheme://...`` (handled by fsspec), False for a local path."""
    return bool(_URL.match(str(path)))


def _filesystem(url: str) -> Tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a URL.

    Raises:
        ValueError: fsspec, or the package of the URL's protocol, is not installed, or
            the protocol is unknown; the message names the URL and what to install.
    """
    try:  # optional: only URLs need it
        import fsspec.core
    except ImportError:
        raise ValueError(f"{url}: storage URLs need fsspec (pip install fsspec, plus the "
                         f"protocol's package, e.g. s3fs for s3://)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise ValueError(f"{url}: the package for this protocol is missing ({err})") from None
    except ValueError as err:
        raise ValueError(f"{url}: not a storage URL fsspec knows ({err})") from None


def check_location(path: str) -> None:
    """Fail early (before training) when ``path`` is a URL fsspec cannot open.

    Raises:
        ValueError: naming the URL and the package to install.
    """
    if is_url(path):
        _filesystem(path)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (URLs always use ``/``)."""
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def basename(path: str) -> str:
    """The last component, ignoring a trailing separator (``s3://b/run/`` -> ``run``)."""
    if is_url(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.normpath(path))


def parent(path: str) -> str:
    """The directory holding ``path`` (absolute for local paths)."""
    if is_url(path):
        return posixpath.dirname(path.rstrip("/"))
    return os.path.dirname(os.path.abspath(path))


def identity(path: str) -> str:
    """A string naming the same location for every process of a job (the absolute
    local path, or the URL itself): what per-location names are derived from."""
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def same_location(a: str, b: str) -> bool:
    """Whether two spellings name the same directory (``ckpt`` and ``./ckpt/``, a
    symlink and its target, a URL with and without its trailing slash)."""
    if is_url(a) or is_url(b):
        return identity(a) == identity(b)
    return os.path.realpath(a) == os.path.realpath(b)


# ------------------------------------------------------------------------- queries

def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _filesystem(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    """A directory (local), or a prefix holding at least one object (URL)."""
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _filesystem(path)
    return fs.isdir(p)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = _filesystem(path)
    return fs.isfile(p)


def getsize(path: str) -> int:
    """Size in bytes; FileNotFoundError when missing."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _filesystem(path)
    return int(fs.size(p))


def mtime(path: str) -> Optional[float]:
    """Last modification as a POSIX time, or None when the store does not say."""
    if not is_url(path):
        return os.stat(path).st_mtime
    fs, p = _filesystem(path)
    try:
        when = fs.modified(p)
    except (NotImplementedError, OSError, KeyError):
        return None
    if when.tzinfo is None:  # fsspec's local and memory stores give naive UTC or local times
        return when.timestamp()
    return when.astimezone(datetime.timezone.utc).timestamp()


def listdir(path: str) -> List[str]:
    """Names (not paths) directly under ``path``; FileNotFoundError when it is missing."""
    if not is_url(path):
        return os.listdir(path)
    return [name for name, _ in _entries(path)]


def subdirs(path: str) -> List[str]:
    """Names of the directories directly under ``path``, sorted ([] when it is missing);
    symbolic links to directories are not followed on a local disk."""
    if not is_url(path):
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    try:
        return sorted(name for name, kind in _entries(path) if kind == "directory")
    except FileNotFoundError:
        return []


def _entries(url: str) -> List[Tuple[str, str]]:
    fs, p = _filesystem(url)
    if not fs.isdir(p):
        raise FileNotFoundError(f"{url}: no such directory")
    out = []
    for info in fs.ls(p, detail=True):
        name = posixpath.basename(str(info["name"]).rstrip("/"))
        if name:
            out.append((name, info.get("type", "file")))
    return out


# ------------------------------------------------------------------------ reading

DEFAULT_READ_LIMIT = 256 << 20
"""Bytes a whole-file read takes when its caller names no smaller limit: the largest
file MoC reads whole (a manifest of a very large model) fits with room to spare."""


def read_bytes(path: str, limit: int = DEFAULT_READ_LIMIT) -> bytes:
    """The whole file, at most ``limit`` bytes of it.

    At most ``limit + 1`` bytes are ever read: a ``latest`` linked to ``/dev/zero`` (or
    a multi-GiB file where a small record belongs) was read until memory ran out. A
    local FIFO reads as empty instead of blocking the reader forever.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: naming the file, when it holds more than ``limit`` bytes.
    """
    if not is_url(path):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            data = _read_upto(f, limit + 1)
    else:
        fs, p = _filesystem(path)
        with fs.open(p, "rb") as f:
            data = _read_upto(f, limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes (not a file MoC wrote "
                              f"there, or damaged); refusing to read it whole")
    return data


def _read_upto(f, count: int) -> bytes:
    """Up to ``count`` bytes, fewer only at the end of the file (a raw or buffered
    read may return less than asked before it)."""
    parts, got = [], 0
    while got < count:
        try:
            chunk = f.read(count - got)
        except BlockingIOError:  # a FIFO without data: nothing to read
            break
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_text(path: str, limit: int = DEFAULT_READ_LIMIT) -> str:
    """:func:`read_bytes` as UTF-8; FileNotFoundError when missing, UnicodeDecodeError,
    CheckpointError past ``limit`` bytes."""
    return read_bytes(path, limit).decode("utf-8")


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file (one ranged request on an object store)."""
    if end <= start:
        return b""
    if not is_url(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, p = _filesystem(path)
    return fs.cat_file(p, start=start, end=end)


def open_read(path: str):
    """A binary file object (context manager) for chunked reads, e.g. checksums."""
    if not is_url(path):
        return open(path, "rb")
    fs, p = _filesystem(path)
    return fs.open(p, "rb")


# ------------------------------------------------------------------------ writing
# Local writes stay in deepspeed_ext.format.storage (temp file, fsync, rename, directory fsync);
# these are the URL side.

def makedirs(url: str) -> None:
    """Create a "directory" (a no-op on object stores, where prefixes need none)."""
    fs, p = _filesystem(url)
    fs.makedirs(p, exist_ok=True)


WRITE_CHUNK = 64 << 20
"""Bytes handed to the store's file object per write: it uploads in blocks (multipart on
object stores), so a multi-GiB rank image is never copied whole."""


def write_bytes(url: str, data) -> None:
    """Write a whole object; it becomes visible when complete (object stores publish a
    multipart upload only at its end). On an error the partial upload is discarded and
    whatever reached the store is removed, so no torn file stays under the name."""
    fs, p = _filesystem(url)
    view = memoryview(data).cast("B")
    if _is_local(fs):
        # file:// opens the final name and fills it in place: a reader polling for the
        # file (the committer waiting for reports) could read it half written. A
        # temporary name in the same directory (the local writers' ``.tmp.<pid>``, which
        # the tag-directory checks know) and a rename publish it whole; fsyncs of the
        # file and then its directory make it survive a power loss, as a local path's
        # write does (fsspec's own mv syncs neither, and retention deletes the older
        # checkpoints right after a commit).
        atomic_write_local(p, view)
        return
    _write_chunks(fs, p, view)


def atomic_write_local(path: str, data, durable: bool = True) -> None:
    """Write ``data`` (bytes-like) to the local file ``path`` so that readers see the old
    file or the whole new one: ``path.tmp.<pid>`` (the temporary name the tag-directory
    checks know), flushed and fsynced, ``os.replace``-d over ``path``, then the directory
    fsynced. On an error the temporary file is removed (no stray file on a full disk).

    Plain ``os``, no torch: the keeper copies exact-recovery frames with it before its
    import of torch is done (seconds; a node lost in the first seconds of a job would
    take frames with it that storage never got). Called by whichever rank or keeper does
    the write, never collectively: :func:`deepspeed_ext.format.storage.atomic_write_bytes`
    for local paths, :func:`write_bytes` for ``file://`` URLs, and the keeper's frame
    copies (:func:`deepspeed_ext.keeper.persist.persist_frame`).

    Args:
        durable: fsync the file and the directory. False only for coordination files
            that need not survive a machine crash.

    Raises:
        FileNotFoundError: the parent directory is missing (it is never created here).
    """
    view = memoryview(data).cast("B")
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for start in range(0, len(view), WRITE_CHUNK):
                f.write(view[start:start + WRITE_CHUNK])
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it survive a power loss.

    Without it a crash right after ``os.replace`` can bring back the old directory
    entry (or none), even though the file's data itself was fsynced.
    """
    if is_url(path):  # object stores have no directory entries to sync
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform that cannot open directories: nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _write_chunks(fs, p: str, view: memoryview) -> None:
    f = fs.open(p, "wb")
    try:
        for start in range(0, len(view), WRITE_CHUNK):
            f.write(view[start:start + WRITE_CHUNK])
    except BaseException:
        try:
            f.discard()  # aborts a multipart upload; absent or a no-op on some stores
        except Exception:
            pass
        try:
            fs.rm_file(p)
        except Exception:
            pass
        raise
    f.close()


def remove(path: str) -> None:
    """Delete one file; FileNotFoundError when missing."""
    if not is_url(path):
        os.remove(path)
        return
    fs, p = _filesystem(path)
    if not fs.exists(p):
        raise FileNotFoundError(f"{path}: no such file")
    fs.rm_file(p)


def rmtree(path: str) -> None:
    """Delete a directory and everything under it; errors are ignored (a leftover is
    found again by the next retention pass)."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = _filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except (FileNotFoundError, OSError):
        pass
