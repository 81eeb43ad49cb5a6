"""Boundaries of :mod:`deepspeed_ext.two_level.budget` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/two_level``), without ranks."""

import logging
import os
import types

import pytest
import torch

from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.state import FP32
from deepspeed_ext.two_level.budget import (HEADER_BYTES_PER_TENSOR, SLOT_SLACK_BYTES,
                                            bytes_held, check_memory_budget, default_shm_dir,
                                            prepare_slots, short_nodes, slot_bytes)
from tests.deepspeed_ext.runtime.world_of_one import world_of_one


def test_the_shm_dir_is_one_per_job_and_user(tmp_path):
    one = default_shm_dir(str(tmp_path / "run"))
    assert one == default_shm_dir(str(tmp_path / "run"))
    assert one != default_shm_dir(str(tmp_path / "other"))
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    name = os.path.basename(one)
    assert os.path.dirname(one) == root and name.startswith(f"moc-{os.getuid()}-")
    assert len(name) == len(f"moc-{os.getuid()}-") + 12


def test_bytes_held_counts_the_blocks_of_every_file_below(tmp_path):
    (tmp_path / "slot0").mkdir()
    (tmp_path / "slot0" / "image").write_bytes(os.urandom(3 * 4096 + 1))
    (tmp_path / "meta.json").write_bytes(b"{}")
    expected = sum(os.stat(p).st_blocks * 512 for p in (tmp_path / "slot0" / "image",
                                                       tmp_path / "meta.json"))
    assert bytes_held(str(tmp_path)) == expected >= 4 * 4096
    assert bytes_held(str(tmp_path / "none")) == 0


def _frag(kind, numel):
    return types.SimpleNamespace(kind=kind, tensor=torch.zeros(numel))


def test_a_slot_holds_a_full_snapshot_its_header_every_ranks_rng_and_slack():
    full = [_frag(FP32, 100), _frag("exp_avg", 100), _frag("exp_avg_sq", 100)]
    header = HEADER_BYTES_PER_TENSOR * (3 * 1 + 3 + 4 * 2 + 64)
    assert slot_bytes(full, 1000, 2) == 1200 + header + 2 * 1000 + SLOT_SLACK_BYTES
    # More described than masters and moments (another kind's state), on 16 ranks; a
    # kind read from elsewhere is the same kind.
    more = [_frag("".join(("fp", "32")), 100), _frag("other", 500)]
    header = HEADER_BYTES_PER_TENSOR * (3 * 1 + 2 + 4 * 16 + 64)
    assert slot_bytes(more, 0, 16) == 2400 + header + SLOT_SLACK_BYTES
    # Before the optimizer made its moments: they are counted all the same.
    header = HEADER_BYTES_PER_TENSOR * (3 * 1 + 1 + 4 * 3 + 64)
    assert slot_bytes(full[:1], 10, 3) == 1200 + header + 3 * 10 + SLOT_SLACK_BYTES
    assert SLOT_SLACK_BYTES == 1 << 20 and HEADER_BYTES_PER_TENSOR == 512


def test_a_node_short_by_one_byte_is_named_and_one_that_fits_exactly_is_not():
    gib = 2**30
    exact = [(None, 2 * gib, gib, 2 * gib, 3, "/dev/shm"), (None, gib, 0, 2 * gib, 3, "/dev/shm")]
    assert short_nodes(exact) == []   # 1 + 1 GiB more on 2 GiB free
    over = [(None, 2 * gib, gib, 2 * gib - 1, 3, "/dev/shm"), (None, gib, 0, 2 * gib - 1, 3,
                                                              "/dev/shm")]
    assert short_nodes(over) == [
        "node 3: /dev/shm has 2.000 GiB free, its 2 rank(s)' snapshot slots need 2.000 GiB "
        "more (point --moc-shm-dir at a larger shared-memory filesystem, or enlarge it)"]
    # A rank holding more than it needs frees nothing for the others.
    assert short_nodes([(None, 0, gib, gib, 0, "/s"), (None, 2 * gib, 0, gib, 0, "/s")])


def _place(tmp_path, host_memory_gb, num_slots=2):
    node_dir = tmp_path / "shm" / "moc-test" / "node0"
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(host_memory_gb=host_memory_gb, shm_dir=str(node_dir.parent)),
        spec=types.SimpleNamespace(enabled=False), num_slots=num_slots, rank=0, world=1, node=0,
        node_dir=str(node_dir), run_id="run-1", slots=None, budget_bytes=0,
        copier=types.SimpleNamespace(register=lambda t: None, unregister=lambda t: None))


def test_the_memory_budget_counts_masters_and_both_moments_per_slot(tmp_path):
    frags = [types.SimpleNamespace(length=1000), types.SimpleNamespace(length=24)]
    needed = 2 * 3 * 1024 * 4   # 2 slots of fp32 masters and two moments
    big = [types.SimpleNamespace(length=2**25)]   # 2 x 3 x 2**25 x 4 bytes: 0.75 GiB
    with world_of_one(tmp_path):
        place = _place(tmp_path, host_memory_gb=needed / 2**30)   # exactly enough
        check_memory_budget(place, frags)   # makes its slots' directory, maps nothing yet
        assert place.budget_bytes == needed and place.slots is not None
        short = _place(tmp_path, host_memory_gb=(needed - 1) / 2**30)
        with pytest.raises(MoCCheckpointError, match="--moc-host-memory-gb allows"):
            check_memory_budget(short, frags)
        with pytest.raises(MoCCheckpointError,
                           match=r"rank 0: its 2 snapshot slots need 0\.750 GiB of host memory, "
                                 r"--moc-host-memory-gb allows 0\.5"):
            check_memory_budget(_place(tmp_path, host_memory_gb=0.5), big)


def test_preparing_the_slots_sizes_them_for_a_full_snapshot_and_says_so(tmp_path, caplog):
    frags = [_frag(FP32, 1000)]
    prepared = []

    class Slots:
        def prepare(self, nbytes):
            prepared.append(nbytes)
            return 0.25

    with world_of_one(tmp_path):
        place = _place(tmp_path, 0)
        place.slots, place.copier.cuda = Slots(), False
        with caplog.at_level(logging.INFO, logger="deepspeed_ext.two_level.budget"):
            assert prepare_slots(place, frags) == 0.25
        (nbytes,) = prepared
        assert nbytes > slot_bytes(frags, 0, 1) and nbytes - slot_bytes(frags, 0, 1) < 2**20
        assert (f"two-level checkpointing: 2 snapshot slots of {nbytes / 2**20:.1f} MiB per "
                f"rank ready in 0.250 s (allocated, mapped)") in caplog.text

        def full(nbytes):
            raise OSError(28, "No space left on device")
        place.slots.prepare = full
        with pytest.raises(MoCCheckpointError) as err:
            prepare_slots(place, frags)
        assert (f"rank 0: preparing 2 snapshot slots of {nbytes / 2**20:.1f} MiB under "
                f"{place.node_dir}: [Errno 28] No space left on device") in str(err.value)
