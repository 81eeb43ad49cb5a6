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
