"""Level 1: one rank's snapshot slots in its node's shared memory.

Each rank owns ``SLOTS`` (three) slots under the keeper's directory
``<node dir>/rankNNNNN/``: ``slotI.img`` (the snapshot's bytes, laid out by
:mod:`deepspeed_ext.format.image`, mapped into the training process), ``slotI.json`` (what
the image holds; its presence is the "complete" mark) and ``slotI.persisting`` (exists
while the keeper writes the slot to storage). The three roles of triple buffering:
the newest complete slot is kept for recovery, a slot being persisted is left alone,
and the next snapshot goes into the remaining one.

A snapshot's metadata has a static part, the same for every snapshot of one layout
(``entries``: a layout record per tensor; ``specs``: a manifest spec per tensor), and a
small part of its own (step, tag, checksum, objects tree, ...). Published with a layout
id, the static part goes once per layout into ``layout-<id>-<sha256 prefix>.json``
(:class:`deepspeed_ext.slot_layouts.LayoutFiles`) and ``slotI.json`` holds the rest plus the id and the file's
SHA-256: a few KB per snapshot instead of hundreds, written without pretty-printing
(the GIL is held while JSON is encoded, and the training thread needs it).

Order of operations on one rank::

    slots = SnapshotSlots(node_dir, rank, on_map=copier.register, ...)
    slots.prepare(nbytes)             # main thread, start-up: every slot allocated,
                                      # mapped, page-locked (on_map) and touched
    # per snapshot:
    i = slots.choose()                # neither the newest complete nor a persisting slot
    slots.invalidate(i)               # save call: remove slotI.json BEFORE touching the bytes
    buf = slots.buffer(i, nbytes)     # save call: the prepared mapping (no syscall)
    fill_image(buf, layout, tensors)  # side stream / copy thread; overlaps forward/backward
    slots.publish(i, meta, layout_id) # seal thread, after the checksum: layout file once
                                      # per layout, then slotI.json atomically: complete

A process killed anywhere in between leaves a slot without ``slotI.json``, which
recovery ignores: a half-written snapshot is never taken for a complete one. A layout
file is written (temp, fsync, rename) before the first ``slotI.json`` naming it, and
removed only once no complete slot names it.

Trust: the rank directory is private (:mod:`deepspeed_ext.private_dir`); a slot's
metadata counts only when it names this job's run id (:mod:`deepspeed_ext.job_identity`),
its layout file (if any) has the recorded SHA-256, and its image is long enough for its
layout; recovery checks the image's checksum (:meth:`SnapshotSlots.verify`,
:mod:`deepspeed_ext.format.memsum`) before reading from it.
"""

import errno
import json
import logging
import mmap
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.format import memsum
from deepspeed_ext.format.dtypes import dtype_from_name
from deepspeed_ext.format.storage import atomic_write_bytes
from deepspeed_ext.private_dir import make_private_dir, open_private
from deepspeed_ext.slot_layouts import (LAYOUT_KEYS, LAYOUT_REF_KEYS, MAX_FILE_BYTES,
                                        LayoutFiles, check_layout_id, compact_json,
                                        layout_file_name, read_capped)

logger = logging.getLogger(__name__)

SLOTS = 3
MAX_META_BYTES = MAX_FILE_BYTES
"""Longest slot metadata or layout file read (a layout record per tensor: far below this)."""

_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)


class SnapshotSlots:
    """The slots of one rank; created by that rank (and re-created after a restart).

    Threads: :meth:`prepare` on the main thread at start-up, before training;
    :meth:`choose`, :meth:`invalidate` and :meth:`buffer` on the save call's thread;
    :meth:`publish` on the seal thread (after the checksum), or the main thread when a
    peer rebuild restores a snapshot; :meth:`meta`/:meth:`complete`/:meth:`verify` on
    any of them. Only this rank writes its slots' metadata, so the in-memory view stays
    true once read.

    Counters (public, read by benchmarks and tests): ``maps_created`` (mappings made:
    ``torch.from_file`` / ``on_map`` calls), ``grown`` (mappings grown after
    :meth:`prepare`, each one a remap and page-lock inside training),
    ``prepared_bytes`` (the size :meth:`prepare` made every slot; 0 before).
    """

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
        self._slot_layout: Dict[int, Optional[str]] = {}  # slot -> layout file it names
        self.layouts = LayoutFiles(self.dir)
        self.maps_created = 0
        self.grown = 0
        self.prepared_bytes = 0

    def _path(self, i: int, suffix: str) -> str:
        return os.path.join(self.dir, f"slot{i}.{suffix}")

    def image_path(self, i: int) -> str:
        return self._path(i, "img")

    # -- metadata ---------------------------------------------------------------------

    def meta(self, i: int) -> Optional[Dict[str, Any]]:
        """The slot's metadata if it holds a complete snapshot, else None: the full
        dict (``entries`` and ``specs`` inlined even when published with a layout id).

        Read from disk once per process (a restarted process finds its predecessor's
        snapshots there); after that this process's own publish/invalidate keep it,
        because only the rank that owns a slot writes its metadata.
        """
        if i not in self._metas:
            self._metas[i] = self._read_meta(i)
        return self._metas[i]

    def _read_meta(self, i: int) -> Optional[Dict[str, Any]]:
        """Slot ``i``'s metadata from disk (and, when complete, which layout file it names)."""
        try:
            data = read_capped(self._path(i, "json"))
            meta = json.loads(data) if data is not None else None
            if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
                return None
            if self.run_id is not None and meta.get("run_id") != self.run_id:
                return None  # another job's (a shared --moc-shm-dir), or an older version's
            name: Optional[str] = None
            if "layout" in meta:
                found = self._inline_layout(meta)
                if found is None:
                    return None
                meta, name = found
            # A metadata file whose image is missing or shorter than its layout (the
            # node's memory was lost under a running rank) is no snapshot: reading it
            # would fail, or SIGBUS on the missing pages.
            if os.path.getsize(self.image_path(i)) < image_end(meta):
                return None
            self._slot_layout[i] = name
            return meta
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def _inline_layout(self, record: Dict[str, Any]) -> Optional[Tuple[Dict[str, Any], str]]:
        """A compact record with its layout file's ``entries``/``specs`` put back, and
        that file's name; None when the file is missing, altered or malformed, or the
        record holds both."""
        layout_id, sha = record.get("layout"), record.get("layout_sha256")
        static = self.layouts.load(layout_id, sha)
        if static is None or any(k in record for k in LAYOUT_KEYS):
            return None
        meta = {k: v for k, v in record.items() if k not in LAYOUT_REF_KEYS}
        meta.update(static)
        return meta, layout_file_name(layout_id, sha)

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
        self._slot_layout[i] = None
        try:
            os.remove(self._path(i, "json"))
        except FileNotFoundError:
            pass

    # -- the images -------------------------------------------------------------------

    def prepare(self, nbytes: int) -> float:
        """Main thread, once at start-up on every rank, before training: every slot's
        image allocated to at least ``nbytes`` bytes (a larger existing file keeps its
        size), mapped, passed to ``on_map`` (CUDA: page-locked) and its pages touched,
        so that no snapshot maps, grows, registers or page-faults a slot inside training.

        Bytes already in the images are left as they are: a restarted process still
        recovers the snapshots its predecessor left in the slots.

        Returns:
            The seconds it took.

        Raises:
            OSError: naming the image and size, when the memory cannot be allocated (a
                full ``/dev/shm``: better refused now than a SIGBUS in the middle of a
                copy when a page cannot be supplied).
        """
        start = time.perf_counter()
        size = max(nbytes, 1)
        for i in range(self.slots):
            current = self._maps.get(i)
            total = _allocate(self.image_path(i), size)
            if current is None or current.numel() < size:
                current = self._map(i, total)
            _touch(current)
        self.prepared_bytes = size
        return time.perf_counter() - start

    def buffer(self, i: int, nbytes: int) -> torch.Tensor:
        """Save call's thread: a uint8 view of slot ``i``'s bytes in shared memory, at
        least ``nbytes`` long.

        Prepared slots (:meth:`prepare`) answer from the mapping without any system call.
        A slot too small is grown (allocated, remapped, ``on_unmap``/``on_map`` again):
        correct, but slow inside training; after :meth:`prepare` it is counted
        (``grown``) and logged once per object. Without :meth:`prepare` (tools, tests,
        a peer rebuild before it) slots are created here on first use.
        """
        current = self._maps.get(i)
        if current is not None and current.numel() >= nbytes:
            return current[:nbytes]
        total = _allocate(self.image_path(i), max(nbytes, 1))
        if self.prepared_bytes:
            self.grown += 1
            if self.grown == 1:
                logger.warning(
                    "slot grew during training: slot %d of %s needs %d bytes, prepared "
                    "%d (mapped %d): remapped and page-locked inside a save; prepare() "
                    "should be given the largest snapshot's size (reported once)",
                    i, self.dir, nbytes, self.prepared_bytes,
                    current.numel() if current is not None else 0)
        return self._map(i, total)[:nbytes]

    def _map(self, i: int, size: int) -> torch.Tensor:
        """Map ``size`` bytes of slot ``i``'s image (shared), replacing its old mapping."""
        old = self._maps.pop(i, None)
        if old is not None and self._on_unmap is not None:
            self._on_unmap(old)
        mapping = torch.from_file(self.image_path(i), shared=True, size=size, dtype=torch.uint8)
        self._maps[i] = mapping
        self.maps_created += 1
        if self._on_map is not None:
            self._on_map(mapping)
        return mapping

    # -- publishing -------------------------------------------------------------------

    def publish(self, i: int, meta: Dict[str, Any], layout_id: Optional[str] = None) -> None:
        """Seal thread: mark slot ``i`` complete (atomic; after every byte is in place).

        Args:
            meta: the full metadata; kept in memory as given (:meth:`meta` returns it).
            layout_id: the caller's id for this metadata's layout (1-64 of
                ``[A-Za-z0-9_-]``, the same id for equal ``entries`` and ``specs``): those
                two go into a layout file, written once per id by this process (again if
                other content comes under the id), and ``slotI.json`` keeps the rest plus
                the id and the file's SHA-256. ``entries`` and ``specs`` must not be
                changed afterwards (shared by later snapshots, compared by identity).
                Writing a new layout file removes those no complete slot names. None:
                everything in ``slotI.json``.

        Raises:
            ValueError: an invalid layout id, or ``meta`` using a reserved key
                (``layout``, ``layout_sha256``).
            RuntimeError: the slot directory is gone (the node's shared memory was wiped
                while this rank ran): the bytes went to deleted files, and recreating the
                directory for the metadata alone would publish a snapshot without them.
        """
        if layout_id is not None:
            check_layout_id(layout_id)
        if any(k in meta for k in LAYOUT_REF_KEYS):
            raise ValueError(f"snapshot metadata must not use the keys {LAYOUT_REF_KEYS}")
        gone = RuntimeError(f"{self.dir} vanished (the node's shared memory was lost); "
                            f"the snapshot of step {meta.get('step')} is not kept")
        if not os.path.isdir(self.dir):
            raise gone
        record, name, wrote = meta, None, False
        try:
            if layout_id is not None:
                sha, name, wrote = self.layouts.store(
                    layout_id, {k: meta[k] for k in LAYOUT_KEYS if k in meta})
                record = {k: v for k, v in meta.items() if k not in LAYOUT_KEYS}
                record.update(layout=layout_id, layout_sha256=sha)
            # make_parent=False: a wipe between the check above and this write (another
            # rank's lose-memory) must fail it; recreating the directory with the umask's
            # mode made the restart refuse the node's memory as readable by others.
            atomic_write_bytes(self._path(i, "json"), compact_json(record), make_parent=False)
        except FileNotFoundError:
            raise gone from None
        self._metas[i] = meta
        self._slot_layout[i] = name
        if wrote:
            self._remove_unreferenced_layouts()

    def _remove_unreferenced_layouts(self) -> None:
        """Bounded disk use: drop the layout files no complete slot names (this
        process's view; slots not read yet are read now)."""
        keep = {self._slot_layout.get(j) for j in range(self.slots) if self.meta(j) is not None}
        self.layouts.remove_unreferenced({name for name in keep if name is not None})

    def host_bytes(self) -> int:
        """Bytes of shared memory the slot images take."""
        total = 0
        for i in range(self.slots):
            try:
                total += os.path.getsize(self.image_path(i))
            except OSError:
                pass
        return total


def _allocate(path: str, nbytes: int) -> int:
    """Make the image at ``path`` at least ``nbytes`` long with its pages allocated now
    (``posix_fallocate``; plain ``ftruncate`` where the filesystem cannot), never
    through a planted link; existing bytes and a larger size are kept. Returns its size.

    Raises:
        OSError: naming the file and size: the memory or disk is full (ENOSPC), ...
    """
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        size = max(nbytes, os.fstat(fd).st_size)
        try:
            if not hasattr(os, "posix_fallocate"):
                raise OSError(errno.ENOSYS, "no posix_fallocate")
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in _NO_FALLOCATE:
                raise OSError(e.errno, f"cannot allocate {size} bytes for the snapshot "
                                       f"slot {path}: {os.strerror(e.errno or 0)} (is "
                                       f"its filesystem full? see --moc-shm-dir)") from e
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # unsupported here: sparse, as before
        return size
    finally:
        os.close(fd)


def _touch(mapping: torch.Tensor) -> None:
    """Read one byte per page of ``mapping``: maps every page into this process now, so
    the first snapshot's copy does not take a page fault per 4 KiB (tmpfs maps an
    allocated page on a read, writable for a shared mapping). Changes no byte."""
    if mapping.numel():
        int(mapping[::mmap.PAGESIZE].max())


PERSIST_WAIT_S = 60.0
"""How long a snapshot waits for the keeper to read a slot it persists, when every other
slot is still being persisted, before it fails: storage slower than the snapshots for
longer is a setting to change (``--moc-persist-interval``), not a wait to sit out."""


def choose_waiting(slots: "SnapshotSlots", exclude=(), timeout_s: Optional[float] = None,
                   poll_s: float = 0.01) -> Tuple[int, float]:
    """:meth:`SnapshotSlots.choose`, waiting up to ``timeout_s`` (default
    :data:`PERSIST_WAIT_S`) while no slot is free (the keeper removes a slot's
    ``persisting`` mark once it has read it); returns the slot and the seconds waited (0
    when one was free at once). Right after an in-job restart the keeper can still be
    reading the failed run's persisted slots when the new run's first persisted snapshot
    takes the last one: on a loaded machine the next snapshot then failed, and with it
    the job (``MoCCheckpointError`` at the next persisted snapshot).

    Raises:
        RuntimeError: still no free slot after ``timeout_s``.
    """
    limit = PERSIST_WAIT_S if timeout_s is None else timeout_s
    start = None
    while True:
        try:
            slot = slots.choose(exclude=exclude)
            return slot, 0.0 if start is None else time.monotonic() - start
        except RuntimeError:
            start = time.monotonic() if start is None else start
            if time.monotonic() - start >= limit:
                raise
        time.sleep(poll_s)


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
