"""Assembling tensors across checkpoints (deepspeed_ext.store.reader)."""

import os
import random
import shutil

import numpy as np
import pytest
import torch

from deepspeed_ext.format import fragment_reader
from deepspeed_ext.format import manifest as mf
from deepspeed_ext.store.reader import CheckpointError, CheckpointReader, find_loadable
from tests.deepspeed_ext.format.test_manifest import (ALL_EXPERTS, EXPERT_PARAMS, KINDS,
                                                      NON_EXPERT, FakeRun, expert_param,
                                                      flip_last_byte, no_fsync, rank_file,
                                                      three_checkpoints, value)

assert no_fsync  # autouse fixture, imported to apply here too

EXPECTED_STEP = {(0, 0): 10, (0, 1): 20, (0, 2): 30, (0, 3): 10,
                 (1, 0): 10, (1, 1): 10, (1, 2): 10, (1, 3): 30}
"""Where each expert's newest version is after three_checkpoints()."""


@pytest.fixture
def run(tmp_path):
    return three_checkpoints(tmp_path)


def test_newest_versions_assembled_across_checkpoints(run, tmp_path):
    with CheckpointReader(str(tmp_path)) as ckpt:  # tag None: latest
        assert (ckpt.tag, ckpt.step) == ("global_step30", 30)
        assert ckpt.kinds() == sorted(KINDS)
        assert len(ckpt.tensor_names("fp32")) == len(NON_EXPERT) + 8 * len(EXPERT_PARAMS)
        for name, shape in NON_EXPERT.items():
            for kind in KINDS:
                assert torch.equal(ckpt.read_full(name, kind), value(name, kind, 30, shape))
        for (layer, expert), step in EXPECTED_STEP.items():
            for param, shape in EXPERT_PARAMS.items():
                name = expert_param(layer, expert, param)
                info = ckpt.info(name, "exp_avg")
                assert (info.step, info.tag, info.expert) == (step, f"global_step{step}",
                                                              (layer, expert))
                assert info.shape == shape and info.dtype is torch.float32
                for kind in KINDS:
                    got = ckpt.read_full(name, kind)
                    assert torch.equal(got, value(name, kind, step, shape)), (name, kind)
                    assert torch.equal(got, run.truth[(name, kind)])
        assert ckpt.expert_versions()[(0, 1)] == (20, "global_step20")


def test_older_tag_loads_its_own_versions(run, tmp_path):
    with CheckpointReader(str(tmp_path), "global_step20") as ckpt:
        name = expert_param(1, 3, "w1")
        assert torch.equal(ckpt.read_full(name, "fp32"), value(name, "fp32", 20, (3, 5)))
        name = expert_param(0, 2, "w1")  # saved again only at step 30
        assert torch.equal(ckpt.read_full(name, "fp32"), value(name, "fp32", 10, (3, 5)))


def test_partial_ranges_cross_fragment_boundaries(run, tmp_path):
    rng = random.Random(1)
    with CheckpointReader(str(tmp_path)) as ckpt:
        for name, kind in ckpt.keys():
            full = run.truth[(name, kind)].reshape(-1)
            cuts = sorted({0, full.numel(), *(rng.randrange(full.numel()) for _ in range(3))})
            # a different partitioning (a resumed run with another world size)
            pieces = [ckpt.read(name, kind, a, b - a) for a, b in zip(cuts, cuts[1:])]
            assert torch.equal(torch.cat(pieces), full)
            for _ in range(4):
                start = rng.randrange(full.numel())
                length = rng.randrange(full.numel() - start + 1)
                out = torch.empty(length)
                assert ckpt.read(name, kind, start, length, out=out) is out
                assert torch.equal(out, full[start:start + length])
        with pytest.raises(IndexError):
            ckpt.read("embed.weight", "fp32", 50, 11)
        with pytest.raises(KeyError, match="no tensor"):
            ckpt.read("embed.weight", "bogus")
        with pytest.raises(ValueError, match="out must be"):
            ckpt.read("embed.weight", "fp32", 0, 4, out=torch.empty(4, dtype=torch.float64))


def test_reads_only_the_needed_fragment_ranges(run, tmp_path, monkeypatch):
    calls = []
    original = fragment_reader.FragmentReader.read

    def spy(self, key, start=0, length=None, out=None):
        calls.append((os.path.relpath(self.path, str(tmp_path)), key, start, length))
        return original(self, key, start, length, out)

    opened = []
    real_open = fragment_reader.FragmentReader.__init__

    def spy_open(self, path):
        opened.append(os.path.relpath(path, str(tmp_path)))
        real_open(self, path)

    monkeypatch.setattr(fragment_reader.FragmentReader, "read", spy)
    with CheckpointReader(str(tmp_path), verify_checksums=False) as ckpt:
        name = expert_param(0, 0, "w1")  # its newest version is in global_step10 only
        assert f"{name}|fp32" not in ckpt.manifest.tensors
        assert ckpt.info(name, "fp32").tag == "global_step10"
        entry = mf.read_manifest(str(tmp_path / "global_step10")).tensors[f"{name}|fp32"]
        frag = max(entry.fragments, key=lambda f: f.length)
        monkeypatch.setattr(fragment_reader.FragmentReader, "__init__", spy_open)
        assert frag.length >= 2
        got = ckpt.read(name, "fp32", frag.offset + 1, frag.length - 1)
        assert torch.equal(got, run.truth[(name, "fp32")].reshape(-1)[
            frag.offset + 1:frag.offset + frag.length])
        # one ranged read of one fragment, in the old checkpoint's file
        assert calls == [(os.path.join("global_step10", frag.file), frag.key, 1,
                          frag.length - 1)]
        # and only that file opened (files are opened once, then cached)
        assert opened == [os.path.join("global_step10", frag.file)]


def test_objects_round_trip(run, tmp_path):
    with CheckpointReader(str(tmp_path)) as ckpt:
        objects = ckpt.objects()
    assert objects["iteration"] == 30
    assert objects["scheduler"] == {"last_epoch": 30, "lrs": (0.1, 0.01)}
    assert objects["rng"]["python"] == run.objects["rng"]["python"]
    assert torch.equal(objects["rng"]["torch"], run.objects["rng"]["torch"])
    saved, loaded = run.objects["rng"]["numpy"], objects["rng"]["numpy"]
    assert loaded[0] == saved[0] and np.array_equal(loaded[1], saved[1])
    assert loaded[2:] == saved[2:]


def test_invalid_checkpoint_raises_naming_the_problem(run, tmp_path):
    shutil.rmtree(tmp_path / "global_step10")
    with pytest.raises(CheckpointError, match="global_step10"):
        CheckpointReader(str(tmp_path), "global_step30")
    with pytest.raises(CheckpointError, match="manifest.json"):
        CheckpointReader(str(tmp_path), "global_step10")
    os.remove(tmp_path / "latest")
    with pytest.raises(CheckpointError, match="latest"):
        CheckpointReader(str(tmp_path))


def test_checksum_verified_before_first_use(run, tmp_path):
    path = rank_file(tmp_path, "global_step30", 1)
    flip_last_byte(path)
    with CheckpointReader(str(tmp_path), "global_step30") as ckpt:  # opening reads no data
        with pytest.raises(CheckpointError, match="rank00001.safetensors.*checksum"):
            for name, kind in ckpt.keys():
                ckpt.read(name, kind)
    with CheckpointReader(str(tmp_path), "global_step30", verify_checksums=False) as ckpt:
        differs = [not torch.equal(ckpt.read_full(n, k), run.truth[(n, k)])
                   for n, k in ckpt.keys()]
    assert sum(differs) == 1  # the flipped byte went undetected without checksums


def test_find_loadable_falls_back(run, tmp_path):
    assert find_loadable(str(tmp_path)) == ("global_step30", [])
    flip_last_byte(rank_file(tmp_path, "global_step30", 0))
    tag, skipped = find_loadable(str(tmp_path))
    assert tag == "global_step20"
    assert len(skipped) == 1 and "global_step30" in skipped[0] and "checksum" in skipped[0]
    shutil.rmtree(tmp_path / "global_step10")  # everything needs it
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        find_loadable(str(tmp_path))


def test_without_the_structure_check_only_the_files_read_are_opened(run, tmp_path):
    # Every rank of a load opening every rank's files is O(world^2) opens on a shared
    # filesystem: with check_structure=False a reader touches only the files it reads.
    os.remove(rank_file(tmp_path, "global_step30", 1))
    with pytest.raises(CheckpointError, match="rank00001.safetensors"):
        CheckpointReader(str(tmp_path), "global_step30")
    with CheckpointReader(str(tmp_path), "global_step30", check_structure=False) as ckpt:
        readable, missing = 0, 0
        for name, kind in ckpt.keys():
            try:
                got = ckpt.read_full(name, kind)
            except CheckpointError as err:  # its bytes were in the removed file
                assert "rank00001.safetensors" in str(err)
                missing += 1
                continue
            assert torch.equal(got, run.truth[(name, kind)])
            readable += 1
        assert readable and missing


def test_find_loadable_passes_over_excluded_tags(run, tmp_path):
    tag, skipped = find_loadable(str(tmp_path), exclude={"global_step30": "rank 1: bad"})
    assert tag == "global_step20"
    assert skipped == ["skipped checkpoint global_step30: rank 1: bad"]


def test_find_loadable_empty_dir_is_fresh_start(tmp_path):
    assert find_loadable(str(tmp_path)) == (None, [])
    assert find_loadable(str(tmp_path / "does-not-exist")) == (None, [])


def test_latest_wins_over_a_newer_step(tmp_path):
    # A crash between write_manifest and update_latest leaves a complete step 20 that
    # latest does not name; loading latest loses those steps but can never jump onto
    # an abandoned timeline (a run resumed from an older tag leaves newer steps behind).
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2, ALL_EXPERTS)
    run.save("global_step20", 20, 2, [(0, 0)])
    (tmp_path / "latest").write_text("global_step10")  # crash between manifest and latest
    assert find_loadable(str(tmp_path)) == ("global_step10", [])
    with CheckpointReader(str(tmp_path)) as ckpt:
        assert ckpt.tag == "global_step10"


_RETENTION = """
import sys
from deepspeed_ext.store.retention import apply_retention
print(",".join(apply_retention(sys.argv[1], keep=1)))
"""


def _full_checkpoints(save_dir) -> FakeRun:
    """global_step10/20/30, each holding every expert (no expert index reaches back):
    retention with keep=1 may delete 10 and 20."""
    run = FakeRun(save_dir)
    for step in (10, 20, 30):
        run.save(f"global_step{step}", step, 2)
    return run


def test_retention_in_another_process_spares_a_checkpoint_being_loaded(tmp_path):
    """A loading rank holds global_step10 open while a committer in another process (a
    keeper still persisting) runs retention: the checkpoint stays until the reader is
    closed. Before, retention deleted its files under the reader."""
    from tests.launch import fresh_python
    save_dir = str(tmp_path)
    _full_checkpoints(tmp_path)
    name = sorted(NON_EXPERT)[0]
    with CheckpointReader(save_dir, "global_step10") as reader:
        assert fresh_python(_RETENTION, args=[save_dir]) == ["global_step20"]
        assert torch.equal(reader.read_full(name, KINDS[0]),
                           value(name, KINDS[0], 10, NON_EXPERT[name]))
        assert reader.objects()["iteration"] == 10
    assert fresh_python(_RETENTION, args=[save_dir]) == ["global_step10"]  # unpinned now


def test_find_loadable_pins_each_checkpoint_it_verifies(tmp_path, monkeypatch):
    """``latest``'s global_step30 is damaged, so the loader verifies global_step20, which
    retention (keep=1) may delete: a committer in another process running it meanwhile
    made the fallback fail, and with 10 deleted too the restart found nothing loadable.
    The loader pins what it verifies, so the fallback loads 20."""
    from deepspeed_ext.store import reader as reader_module
    from tests.launch import fresh_python
    save_dir = str(tmp_path)
    _full_checkpoints(tmp_path)
    flip_last_byte(rank_file(tmp_path, "global_step30", 0))
    real = reader_module.verify_checkpoint
    removed = []

    def verify_while_retention_runs(save_dir, tag, **kwargs):
        if tag == "global_step20":
            removed.extend(fresh_python(_RETENTION, args=[save_dir]))
        return real(save_dir, tag, **kwargs)

    monkeypatch.setattr(reader_module, "verify_checkpoint", verify_while_retention_runs)
    tag, skipped = find_loadable(save_dir)
    assert tag == "global_step20", skipped
    assert removed == ["global_step10"]


def test_a_pin_outlives_another_pin_of_the_same_process_ending(tmp_path):
    """Two readers in one process: global_step10 stays pinned while a pin on global_step20
    comes and goes. With per-process (POSIX) locks, closing the second pin's descriptor
    dropped the first pin too, and retention in another process deleted 10 under its
    reader."""
    from deepspeed_ext.store.pins import reading
    from tests.launch import fresh_python
    save_dir = str(tmp_path)
    _full_checkpoints(tmp_path)
    with CheckpointReader(save_dir, "global_step10"):
        with reading(save_dir, "global_step20"):
            pass
        assert fresh_python(_RETENTION, args=[save_dir]) == ["global_step20"]
    assert fresh_python(_RETENTION, args=[save_dir]) == ["global_step10"]
