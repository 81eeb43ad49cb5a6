"""Checksums of snapshots held in memory (slots, rebuilt replicas and parities).

A bit flipped in host memory between a snapshot and its use would otherwise be loaded by
a recovery, or persisted under a fresh SHA-256 that then vouches for the damaged bytes.
Memory checksums must cost little on the snapshot's copy thread (which shares the host
with training), so they use a fast non-cryptographic hash: xxHash's XXH3 (64 bits) from
the ``xxhash`` package, measured here at 14.9 GiB/s against zlib's CRC-32 at 2.1 GiB/s
and SHA-256 at 1.3 GiB/s on one core (``python benchmarks/two_level_bench.py
--checksum-speed``). Where ``xxhash`` is not installed, CRC-32 is used; the algorithm
is recorded with the value, so a checksum is verified with the algorithm that made it.
Storage keeps SHA-256 (:mod:`deepspeed_ext.format.storage`).

The value is a string ``"<algorithm>:<hex>"``.
"""

import zlib
from typing import Optional

try:
    import xxhash
except ImportError:  # optional: CRC-32 then
    xxhash = None

_CHUNK = 64 << 20


def default_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


def digest(data, algorithm: Optional[str] = None) -> str:
    """The checksum of ``data`` (bytes-like, or a CPU uint8 tensor)."""
    running = Running(algorithm)
    running.update(data)
    return running.value()


class Running:
    """A checksum fed in order, piece by piece (the same value as :func:`digest` of the
    pieces joined): the CPU snapshot copy hashes each tensor's bytes right after copying
    them, while they are still in the cache, instead of reading the image again."""

    def __init__(self, algorithm: Optional[str] = None):
        self.algorithm = algorithm or default_algorithm()
        if self.algorithm == "xxh3_64":
            if xxhash is None:
                raise ValueError("checksum xxh3_64 needs the xxhash package")
            self._state = xxhash.xxh3_64()
        elif self.algorithm == "crc32":
            self._crc = 0
        else:
            raise ValueError(f"unknown memory checksum algorithm {self.algorithm!r}")

    def update(self, data) -> None:
        view = _view(data)
        for start in range(0, len(view), _CHUNK):
            if self.algorithm == "xxh3_64":
                self._state.update(view[start:start + _CHUNK])
            else:
                self._crc = zlib.crc32(view[start:start + _CHUNK], self._crc)

    def value(self) -> str:
        if self.algorithm == "xxh3_64":
            return f"xxh3_64:{self._state.hexdigest()}"
        return f"crc32:{self._crc:08x}"


def verify(data, expected) -> Optional[str]:
    """None when ``data`` has the checksum ``expected``; else why not (a mismatch, an
    unknown algorithm, or a malformed value: each means "do not use these bytes")."""
    if not isinstance(expected, str) or ":" not in expected:
        return f"no valid checksum recorded ({expected!r})"
    algorithm = expected.split(":", 1)[0]
    try:
        found = digest(data, algorithm)
    except ValueError as e:
        return str(e)
    if found != expected:
        return f"checksum mismatch (recorded {expected}, found {found})"
    return None


def _view(data) -> memoryview:
    if hasattr(data, "numpy"):  # a torch tensor: its bytes, without a copy
        data = data.detach().contiguous().view(-1).numpy()
    view = memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
