"""Checkpoint storage behind fsspec URLs (deepspeed_ext.format.fs, and the storage, manifest and
reader layers on top of it), in process on fsspec's ``memory://`` store; the multi-rank
runs through ``file://`` URLs are in test_checkpointer and test_two_level."""

import os
import uuid

import pytest
import torch

from deepspeed_ext.format import fs, naming
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.fragment_reader import FragmentReader
from deepspeed_ext.format.storage import atomic_write_json, check_file, write_fragment_file
from deepspeed_ext.store import catalog, latest, prepare, retention, verify
from deepspeed_ext.store.reader import CheckpointReader, find_loadable
from tests.deepspeed_ext.format.test_manifest import FakeRun, three_checkpoints
from tests.deepspeed_ext.store.test_reader import EXPECTED_STEP


@pytest.fixture
def url():
    """A fresh directory URL on the in-process memory store, removed afterwards."""
    base = f"memory://moc-test-{uuid.uuid4().hex[:10]}/ckpt"
    yield base
    fs.rmtree(fs.parent(base))


def _flip_last_byte(path):
    data = bytearray(fs.read_bytes(path))
    data[-1] ^= 0xFF
    fs.write_bytes(path, bytes(data))


def test_paths_and_urls():
    assert fs.is_url("s3://bucket/run") and fs.is_url("file:///tmp/x")
    assert not fs.is_url("/data/run") and not fs.is_url("runs/s3:/x")
    assert fs.join("s3://b/run", "global_step1", "manifest.json") == \
        "s3://b/run/global_step1/manifest.json"
    assert fs.basename("s3://b/run/") == "run" and fs.basename("/data/run/") == "run"
    assert fs.parent("s3://b/run/global_step1") == "s3://b/run"
    assert fs.parent("rel/dir") == os.path.join(os.getcwd(), "rel")
    assert fs.identity("s3://b/run/") == "s3://b/run"
    assert fs.identity("rel") == os.path.join(os.getcwd(), "rel")


def test_unknown_protocol_names_the_url():
    with pytest.raises(ValueError, match="nosuchproto://x/y"):
        fs.check_location("nosuchproto://x/y")
    fs.check_location("/any/local/path")  # local paths are never checked here


def test_listing_and_queries(url):
    assert not fs.isdir(url) and fs.subdirs(url) == []
    with pytest.raises(FileNotFoundError):
        fs.listdir(url)
    atomic_write_json(fs.join(url, "a", "one.json"), {"x": 1})
    atomic_write_json(fs.join(url, "b", "two.json"), {"y": 2})
    atomic_write_json(fs.join(url, "top.json"), [])
    assert fs.subdirs(url) == ["a", "b"]
    assert sorted(fs.listdir(url)) == ["a", "b", "top.json"]
    path = fs.join(url, "a", "one.json")
    assert fs.isfile(path) and not fs.isdir(path) and fs.exists(path)
    assert fs.getsize(path) == len(fs.read_bytes(path))
    assert fs.read_range(path, 0, 1) == b"{"
    assert isinstance(fs.mtime(path), float)
    fs.remove(path)
    with pytest.raises(FileNotFoundError):
        fs.remove(path)
    fs.rmtree(fs.join(url, "b"))
    assert not fs.exists(fs.join(url, "b", "two.json"))


def test_failed_write_leaves_no_object(url, monkeypatch):
    """A write that dies part way (a lost connection) must not leave a torn object under
    the real name: a later size check would catch it, but a listing would show it."""
    import fsspec.implementations.memory as memory
    path = fs.join(url, "rank00000.safetensors")
    calls = []

    def failing_write(self, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError("connection reset")
        return type(self).__mro__[1].write(self, data)

    monkeypatch.setattr(fs, "WRITE_CHUNK", 4)
    monkeypatch.setattr(memory.MemoryFile, "write", failing_write)
    with pytest.raises(OSError, match="connection reset"):
        fs.write_bytes(path, b"0123456789")
    assert calls == [4, 4] and not fs.exists(path)


def test_file_url_write_never_shows_a_partial_file_and_is_durable(tmp_path, monkeypatch):
    """On ``file://`` a reader polling for the name (the committer waiting for reports)
    must never find it half written: the bytes go to a temporary name, then a rename.
    And it survives a power loss like a local path's write: the file is fsynced before
    the rename, its directory after it."""
    import stat
    final = str(tmp_path / "rank00001.report.json")
    synced, replaced = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    def replace(src, dst):
        replaced.append((src, dst, os.path.exists(dst), len(synced)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fs.write_bytes(f"file://{final}", b'{"rank": 1}')
    # nothing under the real name while writing; the file synced before the rename
    assert replaced == [(f"{final}.tmp.{os.getpid()}", final, False, 1)], replaced
    assert synced == [False, True]  # the file, then its directory
    assert os.listdir(tmp_path) == ["rank00001.report.json"]
    assert (tmp_path / "rank00001.report.json").read_bytes() == b'{"rank": 1}'


def test_fragment_reader_over_a_url_matches_the_local_file(url, tmp_path):
    tensors = {"a": torch.arange(1000, dtype=torch.float32),
               "b": torch.arange(7, dtype=torch.bfloat16), "c": torch.ones(3, 4)}
    local, remote = str(tmp_path / "f.safetensors"), fs.join(url, "f.safetensors")
    assert write_fragment_file(local, tensors, {"k": "v"}) == \
        write_fragment_file(remote, tensors, {"k": "v"})
    assert fs.read_bytes(remote) == open(local, "rb").read()
    with FragmentReader(local) as lr, FragmentReader(remote) as rr:
        assert rr.keys() == lr.keys() and rr.metadata() == lr.metadata() == {"k": "v"}
        assert rr.dtype("b") == torch.bfloat16 and rr.shape("a") == [1000]
        assert torch.equal(rr.read("a", 17, 100), lr.read("a", 17, 100))
        assert torch.equal(rr.read("b"), tensors["b"])
        out = torch.empty(5, dtype=torch.float32)
        assert rr.read("a", 995, 5, out=out) is out and out.tolist() == [995, 996, 997, 998, 999]
        assert torch.equal(rr.read_tensor("c"), tensors["c"])
        with pytest.raises(IndexError):
            rr.read("a", 999, 2)
        with pytest.raises(CheckpointError, match="no tensor 'z'"):
            rr.read("z")


def test_url_reader_errors_name_the_object(url):
    missing = fs.join(url, "missing.safetensors")
    with pytest.raises(CheckpointError, match=f"{missing}: file missing"):
        FragmentReader(missing)
    junk = fs.join(url, "junk.safetensors")
    fs.write_bytes(junk, b"\xff" * 64)
    with pytest.raises(CheckpointError, match="junk.safetensors: not a readable safetensors"):
        FragmentReader(junk)
    good = fs.join(url, "good.safetensors")
    record = write_fragment_file(good, {"a": torch.arange(100, dtype=torch.float32)})
    fs.write_bytes(good, fs.read_bytes(good)[:-8])  # cut short, as by a torn upload
    assert "truncated" in check_file(good, record.nbytes, record.sha256)
    # Refused at open, as safetensors refuses a local file cut short: the header's
    # offsets reach past the file (it was read unchecked, and only reads failed).
    with pytest.raises(CheckpointError, match="good.safetensors: .*truncated"):
        FragmentReader(good)


def test_checkpoints_on_a_url_resolve_verify_and_load(url):
    """The core issue's multi-checkpoint format, unchanged, on an object store."""
    run = three_checkpoints(url)
    assert latest.read_latest(url) == "global_step30"
    assert catalog.list_checkpoints(url) == [(10, "global_step10"), (20, "global_step20"),
                                        (30, "global_step30")]
    assert all(verify.verify_checkpoint(url, f"global_step{s}") == [] for s in (10, 20, 30))
    with CheckpointReader(url) as ckpt:
        assert ckpt.tag == "global_step30"
        for name, kind in ckpt.keys():
            assert torch.equal(ckpt.read_full(name, kind), run.truth[(name, kind)])
        assert {k: v[0] for k, v in ckpt.expert_versions().items()} == EXPECTED_STEP
    _flip_last_byte(fs.join(url, "global_step30", naming.rank_file_name(0)))
    tag, skipped = find_loadable(url)
    assert tag == "global_step20" and "checksum" in skipped[0]


def test_retention_and_deletion_on_a_url(url):
    run = FakeRun(url)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2)
    partial = fs.join(url, "global_step15")
    fs.write_bytes(fs.join(partial, "rank00000.safetensors"), b"partial")
    with pytest.raises(FileExistsError, match="complete checkpoint"):
        prepare.prepare_checkpoint_dir(url, "global_step10")
    assert retention.apply_retention(url, keep=1) == ["global_step10"]
    assert fs.subdirs(url) == ["global_step15", "global_step20"]  # the partial one is newer
    retention.remove_checkpoint(url, "global_step20")
    assert catalog.list_checkpoints(url) == [] and not fs.exists(fs.join(url, "global_step20"))
    assert prepare.prepare_checkpoint_dir(url, "global_step15") == partial
    assert not fs.exists(fs.join(partial, "rank00000.safetensors"))


def test_whole_file_reads_stop_past_their_limit(tmp_path, url):
    """``latest`` linked to /dev/zero was read forever (and a multi-GiB file whole into
    memory): a whole-file read takes at most ``limit`` + 1 bytes and refuses more, on a
    local path and a URL alike. A FIFO does not block the read either."""
    small = tmp_path / "small"
    small.write_bytes(b"x" * 10)
    assert fs.read_bytes(str(small), limit=10) == b"x" * 10
    with pytest.raises(CheckpointError, match=r"small: larger than 9 bytes"):
        fs.read_bytes(str(small), limit=9)
    remote = fs.join(url, "small")
    fs.write_bytes(remote, b"y" * 10)
    assert fs.read_text(remote, limit=10) == "y" * 10
    with pytest.raises(CheckpointError, match=f"{remote}: larger than 9 bytes"):
        fs.read_text(remote, limit=9)
    with pytest.raises(FileNotFoundError):
        fs.read_bytes(fs.join(url, "missing"), limit=9)
    if os.path.exists("/dev/zero"):
        os.symlink("/dev/zero", tmp_path / "zero")
        with pytest.raises(CheckpointError, match="larger than 1024 bytes"):
            fs.read_text(str(tmp_path / "zero"), limit=1024)
    os.mkfifo(tmp_path / "fifo")
    assert fs.read_bytes(str(tmp_path / "fifo"), limit=10) == b""
    assert fs.DEFAULT_READ_LIMIT > 0  # a read without its own limit is bounded too


def test_a_url_checkpoint_with_a_malformed_header_is_skipped(url):
    """A rank file on an object store whose header names a dtype list (same size, so
    it passes the size check) raised TypeError out of a restart's search for a
    loadable checkpoint; now that checkpoint is skipped, as a local one is."""
    three_checkpoints(url)
    path = fs.join(url, "global_step30", naming.rank_file_name(0))
    data = fs.read_bytes(path)
    assert b'"dtype":"F32"' in data
    fs.write_bytes(path, data.replace(b'"dtype":"F32"', b'"dtype":[320]', 1))
    tag, skipped = find_loadable(url, checksums=False)
    assert tag == "global_step20" and "not a readable safetensors file" in skipped[0], skipped
    assert naming.rank_file_name(0) in skipped[0]
