"""Snapshot slots in shared memory (deepspeed_ext.snapshot): what counts as complete when
the node's memory is lost under a running rank."""

import os
import shutil

import pytest
import torch

from deepspeed_ext.snapshot import SlotImage, SnapshotSlots


def _fill(slots, i, step, values):
    data = torch.tensor(values, dtype=torch.float32)
    nbytes = data.numel() * 4
    buf = slots.buffer(i, nbytes)
    buf.copy_(data.view(torch.uint8))
    meta = {"step": step, "entries": [{"key": "w", "dtype": "float32", "shape": [len(values)],
                                       "start": 0, "nbytes": nbytes}]}
    slots.publish(i, meta)
    return meta


def test_complete_snapshot_is_found_by_a_restarted_rank(tmp_path):
    meta = _fill(SnapshotSlots(str(tmp_path), 1), 0, 7, [1.0, 2.0, 3.0])
    again = SnapshotSlots(str(tmp_path), 1)  # a new process of the same rank
    assert again.complete() == [(0, meta)]
    image = SlotImage(again.image_path(0))
    assert image.read(meta["entries"][0]).tolist() == [1.0, 2.0, 3.0]
    image.close()


def test_read_into_copies_straight_into_the_target_and_leaves_the_snapshot_alone(tmp_path):
    """read_into converts into the target's dtype, refuses a target of another size, and
    neither it nor writing to what read returned changes the snapshot; the image then
    closes (no view of its map is left behind)."""
    slots = SnapshotSlots(str(tmp_path), 1)
    meta = _fill(slots, 0, 7, [1.5, -2.0, 3.25])
    entry = meta["entries"][0]
    image = SlotImage(slots.image_path(0))
    target = torch.zeros(3, dtype=torch.float64)
    image.read_into(entry, target)
    assert target.tolist() == [1.5, -2.0, 3.25]
    with pytest.raises(RuntimeError):
        image.read_into(entry, torch.zeros(4))
    first = image.read(entry)
    first.fill_(9.0)
    assert image.read(entry).tolist() == [1.5, -2.0, 3.25]
    image.close()
    again = SlotImage(slots.image_path(0))  # what another process would map
    assert again.read(entry).tolist() == [1.5, -2.0, 3.25]
    again.close()


def test_metadata_without_its_bytes_is_not_a_snapshot(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 3, [1.0] * 64)
    _fill(slots, 1, 4, [2.0] * 64)
    os.remove(slots.image_path(0))                      # image gone, metadata left
    with open(slots.image_path(1), "r+b") as f:         # image cut short
        f.truncate(16)
    assert SnapshotSlots(str(tmp_path), 0).complete() == []


def test_publish_after_the_node_memory_vanished_refuses(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 1, [1.0, 2.0])
    shutil.rmtree(tmp_path / "rank00000")               # the node's memory is wiped
    buf = slots.buffer(0, 8)                            # the old mapping is still writable
    buf.zero_()
    with pytest.raises(RuntimeError, match="vanished"):
        slots.publish(0, {"step": 2, "entries": []})
    assert not (tmp_path / "rank00000").exists()        # nothing re-created half-way


def test_a_wipe_between_the_check_and_the_write_does_not_recreate_the_directory(
        tmp_path, monkeypatch):
    """Another rank's lose-memory can wipe the node's memory right after publish's check:
    the write must fail, not recreate the directory with the umask's mode (0755), which
    made the restart refuse the node's memory as readable by other users."""
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 1, [1.0, 2.0])
    shutil.rmtree(tmp_path / "rank00000")
    real_isdir, calls = os.path.isdir, []

    def isdir_stale_once(path):                          # the check saw it still there
        calls.append(path)
        return True if len(calls) == 1 else real_isdir(path)

    monkeypatch.setattr(os.path, "isdir", isdir_stale_once)
    with pytest.raises(RuntimeError, match="vanished"):
        slots.publish(1, {"step": 2, "entries": []})
    monkeypatch.undo()
    assert calls and not (tmp_path / "rank00000").exists()


def test_a_one_element_record_is_not_broadcast_into_a_larger_tensor(tmp_path):
    """``copy_`` broadcasts a one-element source: a record of one float read into a
    tensor of 4 filled it with that value instead of failing."""
    slots = SnapshotSlots(str(tmp_path), 0)
    meta = _fill(slots, 0, 3, [7.0])
    image = SlotImage(slots.image_path(0))
    with pytest.raises(RuntimeError, match="elements"):
        image.read_into(meta["entries"][0], torch.zeros(4))
    outside = dict(meta["entries"][0], start=1 << 20)
    with pytest.raises(RuntimeError, match="outside"):
        image.read_into(outside, torch.zeros(1))
    image.close()


def test_slots_of_another_run_are_no_snapshots_of_this_job(tmp_path):
    """A slot another job wrote (a shared --moc-shm-dir, or planted) is not this job's
    to recover from; it is free to be overwritten."""
    theirs = SnapshotSlots(str(tmp_path), 0, run_id="b" * 32)
    meta = _fill(theirs, 0, 9, [1.0, 2.0])
    meta["run_id"] = "b" * 32
    theirs.publish(0, meta)
    ours = SnapshotSlots(str(tmp_path), 0, run_id="a" * 32)
    assert ours.complete() == []
    assert SnapshotSlots(str(tmp_path), 0, run_id="b" * 32).complete() == [(0, meta)]


def test_a_flipped_bit_in_a_slot_is_found_before_recovery_uses_it(tmp_path):
    from deepspeed_ext.format import memsum
    slots = SnapshotSlots(str(tmp_path), 0)
    data = torch.arange(16, dtype=torch.float32)
    buf = slots.buffer(0, 64)
    buf.copy_(data.view(torch.uint8))
    meta = {"step": 5, "entries": [{"key": "w", "dtype": "float32", "shape": [16], "start": 0,
                                    "nbytes": 64}], "checksum": memsum.digest(buf)}
    slots.publish(0, meta)
    assert slots.verify(0) is None
    buf[17] ^= 1  # memory damaged after the snapshot
    assert "mismatch" in slots.verify(0)
    del meta["checksum"]
    slots.publish(0, meta)
    assert "no valid checksum" in slots.verify(0)  # unverifiable counts as damaged


def test_planted_links_in_a_rank_directory_are_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    slots = SnapshotSlots(str(node), 0)
    os.symlink(victim, slots.image_path(1))
    with pytest.raises(OSError):
        slots.buffer(1, 64)
    os.symlink(victim, os.path.join(slots.dir, "slot2.json"))
    assert slots.meta(2) is None
    assert victim.read_bytes() == b"precious"
