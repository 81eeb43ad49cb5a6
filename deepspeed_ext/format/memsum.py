"""Checksums of snapshots held in memory (slots, rebuilt replicas and parities).

A bit flipped in host memory between a snapshot and its use would otherwise be loaded by
a recovery, or persisted under a fresh SHA-256 that then vouches for the damaged bytes.
Memory checksums must cost little on the host that training shares, so they use a fast
non-cryptographic hash: xxHash's XXH3 (64 bits) from the ``xxhash`` package. Over 1 GiB
on a shared 2-core machine (``python benchmarks/two_level_bench.py --checksum-speed``):
XXH3-64 13.0 GiB/s in one pass, chunked 8.1 on one thread and 15.8 on two; zlib's CRC-32
3.3 and SHA-256 1.2 on one core. Where ``xxhash`` is not
installed, CRC-32 is used. Storage keeps SHA-256 (:mod:`deepspeed_ext.format.storage`).

Why chunked: a snapshot's seal stage hashes a 1-16 GB slot image right after the copy,
and the keeper and recovery hash it again before using it; one thread over 16 GB is a
second or more. The data is therefore cut into fixed-size chunks (16 MiB by default),
each chunk hashed on its own by a small pool of threads (both hashes release the GIL),
and the checksum is the same hash over ``chunk size, total length, chunk digests in
order`` (little-endian): moving, dropping or truncating a chunk changes it, and the value
does not depend on the number of threads.

The value is a string ``"<algorithm>:<hex>"``. Algorithms:

- ``xxh3_64x<size>`` / ``crc32x<size>``: chunked, ``<size>`` the chunk size as a power
  of two from 64 KiB to 1 GiB written with a unit, e.g. ``xxh3_64x16m``, ``crc32x64k``,
  ``xxh3_64x1g`` (only this spelling: ``1024k`` is refused). The recorded size is
  untrusted: anything else makes :func:`verify` answer why, without hashing.
- ``xxh3_64`` / ``crc32``: one pass over the whole image, written before chunking. Such
  values still verify exactly as before; :class:`Running` still makes them.

The pool: created on first use per thread count, reused by every later call, threads
named ``moc-checksum``; data of at most one chunk, or ``threads == 1``, is hashed on the
calling thread. Several threads may call :func:`digest` / :func:`verify` at once (the
seal thread and a recovery): their chunks share the pool, and a pool thread never waits
on another task, so nothing deadlocks.
"""

import os
import re
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Dict, List, Optional

try:
    import xxhash
except ImportError:  # optional: CRC-32 then
    xxhash = None

DEFAULT_CHUNK = 16 << 20
"""Chunk size of :func:`default_algorithm`: a chunk is ~1 ms of hashing, so the per-task
cost of the pool stays under a few percent and a 1 GB image still splits into ~64 tasks."""

MIN_CHUNK = 64 << 10
MAX_CHUNK = 1 << 30

_PIECE = 64 << 20  # one-pass algorithms feed the hash in pieces of this size
_UNITS = {"k": 10, "m": 20, "g": 30}
_CHUNKED = re.compile(r"(xxh3_64|crc32)x([0-9]{1,4})([kmg])")


@dataclass(frozen=True)
class _Algorithm:
    """A parsed algorithm name."""

    family: str
    """``"xxh3_64"`` or ``"crc32"``: the hash of each chunk and of the chunk digests."""
    chunk: int
    """Chunk size in bytes; 0 for the one-pass algorithms written before chunking."""

    @property
    def name(self) -> str:
        if not self.chunk:
            return self.family
        unit = max((u for u, shift in _UNITS.items() if self.chunk >= 1 << shift),
                   key=_UNITS.get)
        return f"{self.family}x{self.chunk >> _UNITS[unit]}{unit}"


def _parse(name: str) -> _Algorithm:
    """The algorithm ``name`` stands for.

    Raises:
        ValueError: an unknown name, a chunk size outside the accepted set, or a family
            whose package is not installed (the message is the reason verify reports).
    """
    if name in ("xxh3_64", "crc32"):
        algorithm = _Algorithm(name, 0)
    else:
        match = _CHUNKED.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"unknown memory checksum algorithm {name!r}")
        family, count, unit = match.groups()
        # The size comes from a recorded value: bound it before anything uses it.
        chunk = int(count) << _UNITS[unit]
        algorithm = _Algorithm(family, chunk)
        if (chunk & (chunk - 1) or not MIN_CHUNK <= chunk <= MAX_CHUNK
                or algorithm.name != name):
            raise ValueError(f"unsupported chunk size in memory checksum algorithm {name!r} "
                             f"(a power of two from 64k to 1g, written as e.g. 16m)")
    if algorithm.family == "xxh3_64" and xxhash is None:
        raise ValueError(f"checksum {name} needs the xxhash package")
    return algorithm


def default_algorithm() -> str:
    """Chunked XXH3-64 over 16 MiB chunks (``xxh3_64x16m``); chunked CRC-32 without
    the ``xxhash`` package."""
    return _Algorithm("xxh3_64" if xxhash is not None else "crc32", DEFAULT_CHUNK).name


def default_threads() -> int:
    """Hashing threads when the caller names none: half the CPUs this process may run on
    (training and the other ranks of the node share them), at least 1 and at most 4
    (memory bandwidth, not cores, bounds XXH3 beyond that)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return min(4, max(1, cpus // 2))


def resolve_threads(requested: int) -> int:
    """A configured thread count: 0 means :func:`default_threads`, else ``requested``.

    Raises:
        ValueError: ``requested`` is negative.
    """
    if requested < 0:
        raise ValueError(f"checksum threads must be >= 0 (0: automatic), got {requested}")
    return requested or default_threads()


def digest(data, algorithm: Optional[str] = None, threads: Optional[int] = None) -> str:
    """The checksum of ``data`` (bytes-like, or a CPU uint8 tensor).

    Args:
        algorithm: see the module docstring; None: :func:`default_algorithm`.
        threads: how many pool threads hash the chunks (None or 0: :func:`default_threads`);
            the value does not depend on it. Ignored by the one-pass algorithms.

    Raises:
        ValueError: an unknown or unusable ``algorithm``, or negative ``threads``.
    """
    parsed = _parse(algorithm or default_algorithm())
    count = resolve_threads(threads or 0)
    if not parsed.chunk:
        running = Running(parsed.name)
        running.update(data)
        return running.value()
    view = _view(data)
    try:
        parts = _chunk_digests(view, parsed, count)
        return _combine(parsed, len(view), parts)
    finally:
        # The caller may close an mmap under ``data`` right after: no view of ours may
        # outlive this call (a pool thread's reference would make close() fail).
        view.release()


def verify(data, expected, threads: Optional[int] = None) -> Optional[str]:
    """None when ``data`` has the checksum ``expected``; else why not (a mismatch, an
    unknown algorithm or chunk size, or a malformed value: each means "do not use these
    bytes"). ``expected`` is untrusted: it never raises for it."""
    if not isinstance(expected, str) or ":" not in expected:
        return f"no valid checksum recorded ({expected!r})"
    try:
        algorithm = _parse(expected.split(":", 1)[0]).name
    except ValueError as e:
        return str(e)
    found = digest(data, algorithm, threads)
    if found != expected:
        return f"checksum mismatch (recorded {expected}, found {found})"
    return None


class Running:
    """A checksum fed in order, piece by piece (the same value as :func:`digest` of the
    pieces joined), on the calling thread: the CPU snapshot copy hashes each tensor's
    bytes right after copying them, while they are still in the cache."""

    def __init__(self, algorithm: Optional[str] = None):
        self._algorithm = _parse(algorithm or default_algorithm())
        self.algorithm = self._algorithm.name
        self._state = _Stream(self._algorithm.family)
        self._in_chunk = 0  # bytes of the current chunk hashed so far
        self._total = 0
        self._parts: List[int] = []

    def update(self, data) -> None:
        view = _view(data)
        try:
            start = 0
            while start < len(view):
                room = (self._algorithm.chunk - self._in_chunk if self._algorithm.chunk
                        else _PIECE)
                end = min(len(view), start + room)
                with view[start:end] as piece:
                    self._state.update(piece)
                self._total += end - start
                if self._algorithm.chunk:
                    self._in_chunk += end - start
                    if self._in_chunk == self._algorithm.chunk:
                        self._parts.append(self._state.take())
                        self._in_chunk = 0
                start = end
        finally:
            view.release()

    def value(self) -> str:
        if not self._algorithm.chunk:
            return f"{self.algorithm}:{self._state.value():0{_width(self.algorithm) * 2}x}"
        parts = self._parts + ([self._state.value()] if self._in_chunk else [])
        return _combine(self._algorithm, self._total, parts)


class _Stream:
    """One hash of ``family`` fed piece by piece; :meth:`take` ends it and starts anew."""

    def __init__(self, family: str):
        self._xxh = xxhash.xxh3_64() if family == "xxh3_64" else None
        self._crc = 0

    def update(self, piece) -> None:
        if self._xxh is not None:
            self._xxh.update(piece)
        else:
            self._crc = zlib.crc32(piece, self._crc)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc

    def take(self) -> int:
        value = self.value()
        if self._xxh is not None:
            self._xxh.reset()
        self._crc = 0
        return value


def _hash_once(family: str, piece) -> int:
    return xxhash.xxh3_64_intdigest(piece) if family == "xxh3_64" else zlib.crc32(piece)


def _width(family: str) -> int:
    """Bytes of one digest of ``family``."""
    return 8 if family == "xxh3_64" else 4


def _combine(algorithm: _Algorithm, total: int, parts: List[int]) -> str:
    """The value over the chunk size, the total length and the chunk digests in order."""
    width = _width(algorithm.family)
    message = struct.pack("<QQ", algorithm.chunk, total) + b"".join(
        part.to_bytes(width, "little") for part in parts)
    return f"{algorithm.name}:{_hash_once(algorithm.family, message):0{width * 2}x}"


def _hash_range(family: str, view: memoryview, start: int, end: int) -> int:
    """Pool thread (or the caller): the digest of ``view[start:end]``; the slice is
    released before returning, so it never outlives the call that made it."""
    with view[start:end] as piece:
        return _hash_once(family, piece)


def _chunk_digests(view: memoryview, algorithm: _Algorithm, threads: int) -> List[int]:
    """The digests of ``view``'s chunks in order: inline for one chunk, one thread, or a
    caller that is itself a pool thread; else on the pool. Returns only once no pool
    thread still reads ``view``."""
    family, size = algorithm.family, algorithm.chunk
    ranges = [(s, min(s + size, len(view))) for s in range(0, len(view), size)]
    # A pool thread waiting on tasks of its own pool could wait forever (all threads
    # waiting): it hashes inline.
    if len(ranges) <= 1 or threads == 1 or getattr(_local, "pool_thread", False):
        return [_hash_range(family, view, s, e) for s, e in ranges]
    futures = []
    try:
        try:
            pool = _pool(threads)
            for s, e in ranges:
                futures.append(pool.submit(_hash_range, family, view, s, e))
        except RuntimeError:
            # The interpreter is shutting down and the pool takes no new work (a seal
            # still running at exit): hash inline rather than lose the checksum.
            _settle(futures)
            return [_hash_range(family, view, s, e) for s, e in ranges]
        return [f.result() for f in futures]
    finally:
        # On an error (a chunk failed, an interrupt), drop the chunks not started and
        # wait for the running ones: the caller releases the view next, and a pool thread
        # still reading it would then fail or read unmapped memory.
        _settle(futures)


def _settle(futures) -> None:
    for f in futures:
        f.cancel()
    wait(futures)


_pools: Dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_local = threading.local()  # pool_thread: True on the pools' threads


def _mark_pool_thread() -> None:
    _local.pool_thread = True


def _pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool of ``threads`` threads, made on first use."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix="moc-checksum", initializer=_mark_pool_thread)
        return pool


def _forget_pools() -> None:
    """In a forked child: the parent's pool threads do not exist there, and a pool that
    believes they do would queue chunks nobody hashes (a hang). Start with none."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _view(data) -> memoryview:
    """A flat byte view of ``data``, owned by the caller (who releases it)."""
    if hasattr(data, "numpy"):  # a torch tensor: its bytes, without a copy
        data = data.detach().contiguous().view(-1).numpy()
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    with view:
        return view.cast("B")
