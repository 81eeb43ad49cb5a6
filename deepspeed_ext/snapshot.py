"""Level 1: one rank's snapshot slots in its node's shared memory.

Each rank owns ``SLOTS`` (three) slots under the keeper's directory
``<node dir>/rankNNNNN/``: ``slotI.img`` (the snapshot's bytes, laid out by
:mod:`deepspeed_ext.image`, mapped into the training process), ``slotI.json`` (what
the image holds; its presence is the "complete" mark) and ``slotI.persisting`` (exists
while the keeper writes the slot to storage). The three roles of triple buffering:
the newest complete slot is kept for recovery, a slot being persisted is left alone,
and the next snapshot goes into the remaining one.

Order for one snapshot (the training process)::

    i = slots.choose()                # neither the newest complete nor a persisting slot
    slots.invalidate(i)               # remove slotI.json BEFORE touching the bytes
    buf = slots.buffer(i, nbytes)     # the mapping, grown if needed (allocated once)
    fill_image(buf, layout, tensors)  # background thread; overlaps forward/backward
    slots.publish(i, meta)            # slotI.json, atomically: now complete

A process killed anywhere in between leaves a slot without ``slotI.json``, which
recovery ignores: a half-written snapshot is never taken for a complete one.
"""

import json
import mmap
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.storage import atomic_write_json, dtype_from_name

SLOTS = 3


class SnapshotSlots:
    """The slots of one rank; created by that rank (and re-created after a restart)."""

    def __init__(self, node_dir: str, rank: int, slots: int = SLOTS,
                 on_map: Optional[Callable[[torch.Tensor], None]] = None,
                 on_unmap: Optional[Callable[[torch.Tensor], None]] = None):
        """
        Args:
            on_map, on_unmap: called with a whole mapping when it is created and before
                it is dropped (a grown slot): CUDA page-locks the mapping there.
        """
        self.dir = os.path.join(node_dir, f"rank{rank:05d}")
        self.slots = slots
        os.makedirs(self.dir, exist_ok=True)
        self._maps: Dict[int, torch.Tensor] = {}
        self._on_map, self._on_unmap = on_map, on_unmap
        self._metas: Dict[int, Optional[Dict[str, Any]]] = {}

    def _path(self, i: int, suffix: str) -> str:
        return os.path.join(self.dir, f"slot{i}.{suffix}")

    def image_path(self, i: int) -> str:
        return self._path(i, "img")

    def meta(self, i: int) -> Optional[Dict[str, Any]]:
        """The slot's metadata if it holds a complete snapshot, else None.

        Read from disk once per process (a restarted process finds its predecessor's
        snapshots there); after that this process's own publish/invalidate keep it,
        because only the rank that owns a slot writes its metadata.
        """
        if i not in self._metas:
            try:
                with open(self._path(i, "json"), encoding="utf-8") as f:
                    meta = json.load(f)
                # A metadata file whose image is missing or shorter than its layout (the
                # node's memory was lost under a running rank) is no snapshot: reading it
                # would fail, or SIGBUS on the missing pages.
                end = max((e["start"] + e["nbytes"] for e in meta.get("entries", [])), default=0)
                self._metas[i] = meta if os.path.getsize(self.image_path(i)) >= end else None
            except (OSError, ValueError, KeyError, TypeError):
                self._metas[i] = None
        return self._metas[i]

    def complete(self) -> List[Tuple[int, Dict[str, Any]]]:
        """``(slot, meta)`` of every complete snapshot, oldest step first."""
        found = [(i, m) for i in range(self.slots) if (m := self.meta(i)) is not None]
        return sorted(found, key=lambda im: im[1]["step"])

    def persisting(self, i: int) -> bool:
        return os.path.exists(self._path(i, "persisting"))

    def persist_marker(self, i: int) -> str:
        """Create and return the file the keeper deletes once slot ``i`` is persisted."""
        path = self._path(i, "persisting")
        with open(path, "w"):
            pass
        return path

    def choose(self, exclude=()) -> int:
        """The slot for the next snapshot: never the newest complete one (recovery needs
        it), one being persisted, or one in ``exclude`` (still sent to peers); among the
        rest, an empty or the oldest one.

        Raises:
            RuntimeError: every other slot is still being persisted (storage is slower
                than snapshots are taken: snapshot less often or persist less often).
        """
        complete = self.complete()
        newest = complete[-1][0] if complete else None
        steps = {i: m["step"] for i, m in complete}
        free = [i for i in range(self.slots)
                if i != newest and i not in exclude and not self.persisting(i)]
        if not free:
            raise RuntimeError(f"no free snapshot slot in {self.dir}: the other slots are "
                               f"still being persisted (storage slower than the snapshots: "
                               f"raise --moc-persist-interval or --moc-snapshot-interval)")
        return min(free, key=lambda i: steps.get(i, -1))

    def invalidate(self, i: int) -> None:
        """Unmark slot ``i`` as complete; must precede any write into its bytes."""
        self._metas[i] = None
        try:
            os.remove(self._path(i, "json"))
        except FileNotFoundError:
            pass

    def buffer(self, i: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of slot ``i``'s bytes in shared memory, at least ``nbytes`` long.

        The file is created (or grown) once and stays mapped; later snapshots of the
        same size reuse the same pages.
        """
        current = self._maps.get(i)
        if current is not None and current.numel() >= nbytes:
            return current[:nbytes]
        path = self.image_path(i)
        size = max(nbytes, os.path.getsize(path) if os.path.exists(path) else 0, 1)
        with open(path, "ab") as f:
            os.ftruncate(f.fileno(), size)
        if current is not None and self._on_unmap is not None:
            self._on_unmap(current)
        self._maps[i] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        if self._on_map is not None:
            self._on_map(self._maps[i])
        return self._maps[i][:nbytes]

    def publish(self, i: int, meta: Dict[str, Any]) -> None:
        """Mark slot ``i`` complete (atomic; after every byte is in place).

        Raises:
            RuntimeError: the slot directory is gone (the node's shared memory was wiped
                while this rank ran): the bytes went to deleted files, and recreating the
                directory for the metadata alone would publish a snapshot without them.
        """
        if not os.path.isdir(self.dir):
            raise RuntimeError(f"{self.dir} vanished (the node's shared memory was lost); "
                               f"the snapshot of step {meta.get('step')} is not kept")
        atomic_write_json(self._path(i, "json"), meta)
        self._metas[i] = meta

    def host_bytes(self) -> int:
        """Bytes of shared memory the slot images take."""
        total = 0
        for i in range(self.slots):
            try:
                total += os.path.getsize(self.image_path(i))
            except OSError:
                pass
        return total


class SlotImage:
    """Read access to one slot image: mapped once, tensors copied out by layout record.

    Recovery reads hundreds of fragments from a few slots; mapping each slot once keeps
    that at memory-copy speed instead of an open and a map per fragment.
    """

    def __init__(self, image_path: str):
        self.path = image_path
        with open(image_path, "rb") as f:
            # A private (copy-on-write) map: writable as torch.frombuffer wants, without
            # anything written through it ever reaching the snapshot in shared memory.
            # (Not MAP_POPULATE: on a writable private map it copies every page.)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def read(self, entry: Dict[str, Any]) -> torch.Tensor:
        """One tensor, as a new tensor (flat). ``entry`` is its layout record (``dtype``,
        ``start``, ``nbytes``)."""
        dtype = dtype_from_name(entry["dtype"])
        out = torch.empty(entry["nbytes"] // dtype.itemsize, dtype=dtype)
        self.read_into(entry, out)
        return out

    def read_into(self, entry: Dict[str, Any], out: torch.Tensor) -> None:
        """Copy one tensor straight from the map into ``out`` (flat, as many elements;
        ``copy_`` converts dtype and device): one copy, where :meth:`read` and a copy
        into the engine would make two, for a recovery that restores a whole rank.

        Raises:
            RuntimeError: ``out`` has a different number of elements (from ``copy_``).
        """
        if entry["nbytes"] == 0:
            if out.numel():
                raise RuntimeError(f"{self.path}: empty record for a tensor of {out.numel()} elements")
            return
        first = entry["start"]
        view = memoryview(self._map)[first:first + entry["nbytes"]]
        try:
            src = torch.frombuffer(view, dtype=dtype_from_name(entry["dtype"]))
            out.copy_(src)
            del src  # releases its hold on the view, which the map's close needs
        finally:
            view.release()

    def close(self) -> None:
        self._map.close()
