"""Level 1: one rank's snapshot slots in its node's shared memory.

Each rank owns ``SLOTS`` (three) slots under the keeper's directory
``<node dir>/rankNNNNN/``: ``slotI.img`` (the snapshot's bytes, laid out by
:mod:`deepspeed_ext.format.image`, mapped into the training process), ``slotI.json`` (what
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

Trust: the rank directory is private (:mod:`deepspeed_ext.private_dir`); a slot's
metadata counts only when it names this job's run id (:mod:`deepspeed_ext.job_identity`)
and its image is long enough for its layout; recovery checks the image's checksum
(:meth:`SnapshotSlots.verify`, :mod:`deepspeed_ext.format.memsum`) before reading from it.
"""

import json
import mmap
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.format import memsum
from deepspeed_ext.format.dtypes import dtype_from_name
from deepspeed_ext.format.storage import atomic_write_json
from deepspeed_ext.private_dir import make_private_dir, open_private

SLOTS = 3
MAX_META_BYTES = 256 << 20
"""Longest slot metadata file read (a layout record per tensor: far below this)."""


class SnapshotSlots:
    """The slots of one rank; created by that rank (and re-created after a restart)."""

    def __init__(self, node_dir: str, rank: int, slots: int = SLOTS,
                 on_map: Optional[Callable[[torch.Tensor], None]] = None,
                 on_unmap: Optional[Callable[[torch.Tensor], None]] = None,
                 run_id: Optional[str] = None):
        """
        Args:
            on_map, on_unmap: called with a whole mapping when it is created and before
                it is dropped (a grown slot): CUDA page-locks the mapping there.
            run_id: the job's run id, recorded in every slot's metadata; slots of another
                run id are no snapshots of this job (None: not checked).

        Raises:
            UnsafeDirectoryError: the rank directory is not private to this user.
        """
        self.dir = os.path.join(node_dir, f"rank{rank:05d}")
        self.slots = slots
        self.run_id = run_id
        make_private_dir(self.dir, root=node_dir)
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
            self._metas[i] = self._read_meta(i)
        return self._metas[i]

    def _read_meta(self, i: int) -> Optional[Dict[str, Any]]:
        try:
            with os.fdopen(open_private(self._path(i, "json"), os.O_RDONLY), "rb") as f:
                data = f.read(MAX_META_BYTES + 1)
            if len(data) > MAX_META_BYTES:
                return None
            meta = json.loads(data)
            if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
                return None
            if self.run_id is not None and meta.get("run_id") != self.run_id:
                return None  # another job's (a shared --moc-shm-dir), or an older version's
            # A metadata file whose image is missing or shorter than its layout (the
            # node's memory was lost under a running rank) is no snapshot: reading it
            # would fail, or SIGBUS on the missing pages.
            end = image_end(meta)
            return meta if os.path.getsize(self.image_path(i)) >= end else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def verify(self, i: int) -> Optional[str]:
        """Recovery, before using slot ``i``: None when its image matches the checksum
        its metadata records; else why not (a slot without a checksum fails too)."""
        meta = self.meta(i)
        if meta is None:
            return "no complete snapshot"
        end = image_end(meta)
        if end == 0:
            return memsum.verify(b"", meta.get("checksum"))
        with open(self.image_path(i), "rb") as f:
            with mmap.mmap(f.fileno(), end, prot=mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return memsum.verify(view, meta.get("checksum"))
                finally:
                    view.release()

    def complete(self) -> List[Tuple[int, Dict[str, Any]]]:
        """``(slot, meta)`` of every complete snapshot, oldest step first."""
        found = [(i, m) for i in range(self.slots) if (m := self.meta(i)) is not None]
        return sorted(found, key=lambda im: im[1]["step"])

    def persisting(self, i: int) -> bool:
        return os.path.exists(self._path(i, "persisting"))

    def persist_marker(self, i: int) -> str:
        """Create and return the file the keeper deletes once slot ``i`` is persisted."""
        path = self._path(i, "persisting")
        os.close(open_private(path, os.O_WRONLY | os.O_CREAT))
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
        fd = open_private(path, os.O_RDWR | os.O_CREAT)  # never through a planted link
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
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
        gone = RuntimeError(f"{self.dir} vanished (the node's shared memory was lost); "
                            f"the snapshot of step {meta.get('step')} is not kept")
        if not os.path.isdir(self.dir):
            raise gone
        try:
            # make_parent=False: a wipe between the check above and this write (another
            # rank's lose-memory) must fail it; recreating the directory with the umask's
            # mode made the restart refuse the node's memory as readable by others.
            atomic_write_json(self._path(i, "json"), meta, make_parent=False)
        except FileNotFoundError:
            raise gone from None
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
            RuntimeError: ``out`` has a different number of elements than the record, or
                the record lies outside the image. (``copy_`` alone would broadcast a
                one-element record into the whole tensor.)
        """
        dtype = dtype_from_name(entry["dtype"])
        first, nbytes = entry["start"], entry["nbytes"]
        if nbytes % dtype.itemsize or nbytes // dtype.itemsize != out.numel():
            raise RuntimeError(f"{self.path}: record {entry.get('key')!r} holds {nbytes} bytes "
                               f"of {entry['dtype']}, the tensor has {out.numel()} elements")
        if nbytes == 0:
            return
        if first < 0 or first + nbytes > len(self._map):
            raise RuntimeError(f"{self.path}: record {entry.get('key')!r} lies outside the image")
        view = memoryview(self._map)[first:first + nbytes]
        try:
            src = torch.frombuffer(view, dtype=dtype)
            out.copy_(src)
            del src  # releases its hold on the view, which the map's close needs
        finally:
            view.release()

    def close(self) -> None:
        self._map.close()


def image_end(meta: Dict[str, Any]) -> int:
    """Bytes of a snapshot image: the end of its last tensor (0 when it has none)."""
    return max((e["start"] + e["nbytes"] for e in meta.get("entries", [])), default=0)
