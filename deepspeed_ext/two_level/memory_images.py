"""The snapshots a recovery may read from this rank's memory (:mod:`deepspeed_ext.two_level`):
this layout's complete slots, the newest verified up front, older ones when first read."""

import logging
from typing import Any, Dict, List, Optional, Tuple

from deepspeed_ext.snapshot import SlotImage
from deepspeed_ext.two_level.records import RankPlace

logger = logging.getLogger(__name__)


def warn_damaged(place: RankPlace, slot: int, meta: Dict[str, Any], problem: str) -> None:
    """This rank: say that the snapshot in ``slot`` is not recovered from, and why."""
    logger.warning(
        f"[moc] rank {place.rank}: WARNING: not recovering from the step-{meta['step']} "
        f"snapshot in {place.slots.image_path(slot)}: {problem}")


def checked_slots(place: RankPlace, signature: Optional[str]) -> List[Tuple[int, Dict[str, Any], bool]]:
    """``(slot, meta, verified)`` of this rank's complete snapshots of this layout,
    oldest first. The newest intact one is verified against its checksum now (a
    damaged one is logged and left out, so the ranks agree on an older step or
    storage instead of loading flipped bits); older ones, which a recovery seldom
    reads, are verified when first read (:meth:`MemorySnapshots.image`): checking every
    slot up front cost ``moc-full``'s recovery from memory 60 ms of its 85 here."""
    candidates = [(i, m) for i, m in place.slots.complete()
                  if m.get("signature") == signature]
    checked: List[Tuple[int, Dict[str, Any], bool]] = []
    newest_found = False
    for i, meta in reversed(candidates):
        if newest_found:
            checked.append((i, meta, False))
            continue
        problem = place.slots.verify(i)
        if problem is not None:
            warn_damaged(place, i, meta, problem)
            continue
        newest_found = True
        checked.append((i, meta, True))
    return checked[::-1]


class MemorySnapshots:
    """This rank's usable snapshots for one load (``mine``: their metadata, each with
    ``_slot``, ``_entries`` and ``_verified``), and the images the load mapped. Close it
    when the load ends."""

    def __init__(self, place: RankPlace, signature: Optional[str]):
        self.place = place
        self.mine = [dict(m, _slot=i, _entries={e["key"]: e for e in m["entries"]}, _verified=ok)
                     for i, m, ok in checked_slots(place, signature)]
        self._images: Dict[int, SlotImage] = {}
        """Slot images mapped by the load in progress."""

    def steps(self) -> List[int]:
        """The steps this rank holds, sorted."""
        return sorted({m["step"] for m in self.mine})

    def image(self, meta) -> SlotImage:
        """The mapped image of a slot of ``mine``, verified against its checksum on first
        use.

        Raises:
            RuntimeError: the image is damaged (the caller's recovery from memory fails,
                on every rank through its outcome exchange).
        """
        slot = meta["_slot"]
        if slot not in self._images:
            if not meta.get("_verified"):
                problem = self.place.slots.verify(slot)
                if problem is not None:
                    warn_damaged(self.place, slot, meta, problem)
                    raise RuntimeError(f"the step-{meta['step']} snapshot is damaged: {problem}")
                meta["_verified"] = True
            self._images[slot] = SlotImage(self.place.slots.image_path(slot))
        return self._images[slot]

    def read(self, meta, key):
        """One tensor of a complete snapshot of ``mine``, as a new tensor."""
        return self.image(meta).read(meta["_entries"][key])

    def read_into(self, meta, key, out) -> None:
        """One tensor of a complete snapshot of ``mine``, copied straight into ``out``."""
        self.image(meta).read_into(meta["_entries"][key], out)

    def close(self) -> None:
        """Unmap every image this load mapped."""
        for image in self._images.values():
            image.close()
        self._images = {}
