"""Boundaries of :mod:`deepspeed_ext.two_level.memory_images` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/two_level``), on slots made up here."""

import logging
import types

import pytest

from deepspeed_ext.two_level.memory_images import MemorySnapshots, checked_slots


class _Slots:
    """``complete()`` and ``verify()`` of snapshot slots, with the damage given."""

    def __init__(self, metas, damaged=()):
        self.metas, self.damaged, self.verified = metas, set(damaged), []

    def complete(self):
        return list(enumerate(self.metas))

    def verify(self, slot):
        self.verified.append(slot)
        return "checksum mismatch" if slot in self.damaged else None

    def image_path(self, slot):
        return f"/shm/rank00000/slot{slot}.img"


def _place(metas, damaged=()):
    return types.SimpleNamespace(rank=0, slots=_Slots(metas, damaged))


def _meta(step, signature="s"):
    return {"step": step, "signature": signature, "entries": [{"key": f"k{step}"}]}


def test_only_the_newest_intact_slot_of_the_layout_is_verified_up_front():
    place = _place([_meta(10), _meta(20), _meta(30, "other"), _meta(15), _meta(40, "t")])
    assert [(i, m["step"], ok) for i, m, ok in checked_slots(place, "s")] == [
        (0, 10, False), (1, 20, False), (3, 15, True)]
    assert place.slots.verified == [3]


def test_a_damaged_newest_slot_is_left_out_with_a_warning(caplog):
    place = _place([_meta(10), _meta(20), _meta(30)], damaged={2})
    with caplog.at_level(logging.WARNING, logger="deepspeed_ext.two_level.memory_images"):
        checked = checked_slots(place, "s")
    assert [(i, ok) for i, _, ok in checked] == [(0, False), (1, True)]
    assert place.slots.verified == [2, 1]
    assert ("[moc] rank 0: WARNING: not recovering from the step-30 snapshot in "
            "/shm/rank00000/slot2.img: checksum mismatch") in caplog.text
    assert checked_slots(_place([_meta(10)], damaged={0}), "s") == []


def test_the_snapshots_of_a_load_and_an_older_damaged_one_failing_when_read(caplog):
    place = _place([_meta(20), _meta(10), _meta(20)], damaged={0})
    snaps = MemorySnapshots(place, "s")
    assert snaps.steps() == [10, 20]
    oldest = snaps.mine[0]
    assert (oldest["_slot"], oldest["_verified"]) == (0, False)
    assert oldest["_entries"] == {"k20": {"key": "k20"}}
    with caplog.at_level(logging.WARNING, logger="deepspeed_ext.two_level.memory_images"):
        with pytest.raises(RuntimeError, match="the step-20 snapshot is damaged: checksum"):
            snaps.image(oldest)
    assert "not recovering from the step-20 snapshot" in caplog.text
    snaps.close()
