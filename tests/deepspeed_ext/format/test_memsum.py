"""The chunked memory checksum (deepspeed_ext.format.memsum): the same value on any number
of threads, every damaged chunk caught, old values still verified, recorded chunk sizes
checked before use."""

import mmap
import random
import struct
import threading
import zlib

import pytest
import torch

from deepspeed_ext.format import memsum

xxhash = pytest.importorskip("xxhash")

SMALL = "xxh3_64x64k"  # the smallest chunk size accepted: keeps these tests fast
CHUNK = 64 << 10
LENGTHS = [0, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _reference(data: bytes, chunk: int = CHUNK) -> str:
    """The documented definition, written out independently of memsum."""
    parts = [xxhash.xxh3_64_intdigest(data[s:s + chunk]) for s in range(0, len(data), chunk)]
    message = struct.pack("<QQ", chunk, len(data)) + b"".join(p.to_bytes(8, "little")
                                                               for p in parts)
    return f"{SMALL}:{xxhash.xxh3_64_hexdigest(message)}"


@pytest.mark.parametrize("n", LENGTHS)
def test_the_digest_does_not_depend_on_the_threads(n):
    data = _data(n)
    values = {memsum.digest(data, SMALL, threads) for threads in (1, 2, 3, 4)}
    assert values == {_reference(data)}


@pytest.mark.parametrize("n", LENGTHS)
def test_a_running_checksum_fed_in_pieces_equals_the_digest(n):
    data = _data(n, seed=1)
    running = memsum.Running(SMALL)
    cuts = sorted({0, n, *(random.Random(n).randrange(n + 1) for _ in range(5))})
    for a, b in zip(cuts, cuts[1:]):
        running.update(data[a:b])
    assert running.value() == memsum.digest(data, SMALL, 1) == _reference(data)


def test_the_default_is_chunked_16m_and_the_threads_automatic():
    assert memsum.default_algorithm() == "xxh3_64x16m"
    assert memsum.digest(b"abc").startswith("xxh3_64x16m:")
    assert 1 <= memsum.default_threads() <= 4
    assert memsum.resolve_threads(0) == memsum.default_threads()
    assert memsum.resolve_threads(3) == 3
    with pytest.raises(ValueError):
        memsum.resolve_threads(-1)


@pytest.mark.parametrize("where", [0, CHUNK + 7, 3 * CHUNK + 4])  # first, middle, last chunk
@pytest.mark.parametrize("threads", [1, 3])
def test_a_flipped_byte_in_any_chunk_is_caught(where, threads):
    data = bytearray(_data(3 * CHUNK + 5))
    value = memsum.digest(data, SMALL, threads)
    assert memsum.verify(data, value, threads) is None
    data[where] ^= 0x04
    assert "mismatch" in memsum.verify(data, value, threads)


def test_reordered_or_truncated_chunks_are_caught():
    data = _data(3 * CHUNK)
    value = memsum.digest(data, SMALL, 2)
    a, b, c = data[:CHUNK], data[CHUNK:2 * CHUNK], data[2 * CHUNK:]
    assert memsum.verify(b + a + c, value, 2) is not None
    assert memsum.verify(a + b, value, 2) is not None  # a whole chunk dropped
    assert memsum.verify(data[:-1], value, 2) is not None
    assert memsum.verify(data + b"\x00", value, 2) is not None


def test_values_written_before_chunking_still_verify():
    data = bytearray(_data(3 * CHUNK + 5, seed=2))
    old_xxh = f"xxh3_64:{xxhash.xxh3_64_hexdigest(bytes(data))}"
    old_crc = f"crc32:{zlib.crc32(bytes(data)):08x}"
    for old in (old_xxh, old_crc):
        assert memsum.verify(data, old) is None
        wrong = old[:-1] + ("0" if old[-1] != "0" else "1")
        assert "mismatch" in memsum.verify(data, wrong)
    assert memsum.digest(data, "xxh3_64") == old_xxh
    assert memsum.digest(data, "crc32") == old_crc
    data[CHUNK] ^= 1
    assert memsum.verify(data, old_xxh) is not None
    assert memsum.verify(data, old_crc) is not None


@pytest.mark.parametrize("recorded", [
    "xxh3_64x32k:00", "xxh3_64x2g:00", "xxh3_64x48k:00", "xxh3_64x1024k:00", "xxh3_64x016m:00",
    "xxh3_64x0k:00", "xxh3_64x99999999999g:00", "xxh3_64x16q:00", "xxh3_64x:00", "sha1x16m:00",
    "crc32x3m:00", ":00", "xxh3_64x16m", None, 7])
def test_a_bad_recorded_algorithm_is_refused_with_a_reason_before_hashing(recorded):
    # Not even a buffer: had verify read the data, this would raise.
    reason = memsum.verify(object(), recorded)
    assert isinstance(reason, str) and reason


def test_the_crc_fallback_is_chunked_and_verifies(monkeypatch):
    xxh_value = memsum.digest(_data(CHUNK + 1), SMALL)
    data = bytearray(_data(3 * CHUNK + 5, seed=3))
    parts = [zlib.crc32(data[s:s + CHUNK]) for s in range(0, len(data), CHUNK)]
    reference = zlib.crc32(struct.pack("<QQ", CHUNK, len(data)) + b"".join(
        p.to_bytes(4, "little") for p in parts))
    with_xxhash = memsum.digest(data, "crc32x64k", 2)
    monkeypatch.setattr(memsum, "xxhash", None)
    algorithm = memsum.default_algorithm()
    assert algorithm == "crc32x16m"
    values = {memsum.digest(data, "crc32x64k", threads) for threads in (1, 2, 4)}
    assert values == {with_xxhash, f"crc32x64k:{reference:08x}"}
    value = values.pop()
    assert value.startswith("crc32x64k:")
    assert memsum.verify(data, value, 2) is None
    assert memsum.verify(data, memsum.digest(data)) is None
    running = memsum.Running("crc32x64k")
    running.update(data[:100])
    running.update(data[100:])
    assert running.value() == value
    data[2 * CHUNK] ^= 1
    assert "mismatch" in memsum.verify(data, value, 2)
    assert "xxhash" in memsum.verify(data, xxh_value)


def test_a_uint8_tensor_gives_the_bytes_digest():
    data = _data(3 * CHUNK + 5, seed=4)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert memsum.digest(tensor, SMALL, 2) == memsum.digest(data, SMALL, 2)
    assert memsum.verify(tensor, memsum.digest(data, SMALL, 1), 3) is None


class _SpyXxhash:
    """Stands in for the xxhash module memsum uses (its public seam ``memsum.xxhash``):
    records the thread of every chunk hashed, runs ``on_hash`` first when set."""

    def __init__(self, on_hash=None):
        self.threads, self.pieces, self.on_hash = set(), [], on_hash

    def __getattr__(self, name):
        return getattr(xxhash, name)

    def xxh3_64_intdigest(self, piece):
        self.threads.add(threading.current_thread().name)
        self.pieces.append(piece)
        if self.on_hash is not None:
            self.on_hash()
        return xxhash.xxh3_64_intdigest(piece)


def test_small_data_or_one_thread_is_hashed_inline(monkeypatch):
    spy = _SpyXxhash()
    monkeypatch.setattr(memsum, "xxhash", spy)
    memsum.digest(_data(CHUNK), SMALL, 4)
    memsum.digest(_data(3 * CHUNK), SMALL, 1)
    assert spy.threads == {threading.current_thread().name}


def test_several_chunks_are_hashed_on_the_checksum_pool(monkeypatch):
    spy = _SpyXxhash()
    monkeypatch.setattr(memsum, "xxhash", spy)
    assert memsum.digest(_data(8 * CHUNK), SMALL, 2) == _reference(_data(8 * CHUNK))
    assert any(n.startswith("moc-checksum") for n in spy.threads)


def test_concurrent_callers_and_a_call_from_a_pool_thread_do_not_deadlock(monkeypatch):
    data = _data(6 * CHUNK + 3, seed=5)
    expected = _reference(data)
    nested, lock, started = [], threading.Lock(), []

    def digest_from_the_pool():
        # A pool thread computing a digest of its own: had it queued its chunks on the
        # same pool and waited, with every pool thread doing the same nothing would run.
        if not threading.current_thread().name.startswith("moc-checksum"):
            return
        with lock:
            if len(started) >= 2:
                return
            started.append(True)
        value = memsum.digest(data, SMALL, 2)
        with lock:
            nested.append(value)
    monkeypatch.setattr(memsum, "xxhash", _SpyXxhash(digest_from_the_pool))
    results = []
    callers = [threading.Thread(target=lambda: results.append(memsum.digest(data, SMALL, 2)))
               for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=20)
    assert results == [expected] * 4
    assert nested == [expected] * 2


def test_an_mmap_can_be_closed_right_after_a_digest(tmp_path, monkeypatch):
    """The keeper and recovery hash a mapped slot image and close the map at once; were
    any view of the map still alive (a chunk's slice kept by a pool thread), close()
    would raise BufferError. Here every chunk handed to the hash is kept on purpose."""
    spy = _SpyXxhash()
    monkeypatch.setattr(memsum, "xxhash", spy)
    path = tmp_path / "slot.img"
    path.write_bytes(_data(4 * CHUNK + 9, seed=6))
    for threads in (1, 3):
        with open(path, "rb") as f:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                try:
                    value = memsum.digest(view[:4 * CHUNK + 1], SMALL, threads)
                    assert memsum.verify(view[:4 * CHUNK + 1], value, threads) is None
                finally:
                    view.release()
    assert len(spy.pieces) >= 2 * 2 * 5