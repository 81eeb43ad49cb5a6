"""A snapshot as a handful of large copies: which image entries one ``copy_`` can fill.

ZeRO keeps a rank's fp32 master weights as one flat partition per parameter group and
Adam keeps ``exp_avg``/``exp_avg_sq`` as flat tensors of the same length; every fragment
MoC saves is a view into one of them. Filling an image one ``copy_`` per fragment
(:func:`deepspeed_ext.format.image.fill_image`) costs ~18 us of launch per fragment on a
GPU (648 copies for 216 parameters). When the image lays the fragments out in the order
of their sources (:func:`source_order`, then ``layout_of(..., keep_order=True)``), the
fragments of one flat tensor sit side by side in the image as they do in memory, and one
copy of a flat span fills them all.

Planning is kept apart from copying, like the write plan (``policy.plan.build_write_plan``)::

    order = source_order(tensors)                                   # once per layout
    layout = layout_of({k: tensors[k] for k in order}, keep_order=True)
    plan = plan_copies(layout, tensors)                             # pure; cache it
    ...
    copies = run_copies(buffer, layout, plan, tensors, non_blocking=True)   # every snapshot

Both run on the thread that owns the tensors (the training thread; on CUDA, with the copy
stream current: the caller owns the stream and its synchronisation). A cached plan may
outlive its tensors (a load, a new optimizer state): :func:`run_copies` checks every
multi-entry run against the tensors it gets and copies a run that no longer holds one
entry at a time, so a stale plan is slower, never wrong. A return value above
``plan.copies`` tells the caller to plan again.
"""

import logging
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_ext.format.dtypes import dtype_name
from deepspeed_ext.format.image import ImageLayout
from deepspeed_ext.format.image_entry import ImageEntry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyRun:
    """Consecutive image entries filled by one ``copy_``: contiguous views of one storage
    that follow each other in it as they follow each other in the image."""

    keys: Tuple[str, ...]
    """The entries' keys, in image order."""
    first: int
    """Index of ``keys[0]`` in ``layout.entries`` (the run is ``entries[first:first+len(keys)]``)."""
    start: int
    """Byte offset of the run's first byte in the image."""
    nbytes: int
    """Bytes the run covers (the sum of its entries')."""
    dtype: str
    """dtype name of every entry (``float32``)."""
    device: str
    """Device of the sources when planned (``cuda:0``)."""
    storage_ptr: int
    """``data_ptr`` of the sources' storage when planned (for logs: the check at copy
    time is relative, see :func:`run_copies`)."""
    storage_offset: int
    """Element offset of the first source in that storage when planned."""


@dataclass(frozen=True)
class CopyPlan:
    """Every ``copy_`` that fills one image: the header, then each run in image order."""

    runs: Tuple[CopyRun, ...]
    """Runs in image order; zero-byte entries belong to none."""
    header_nbytes: int
    """Bytes of the layout's header (length prefix and JSON), copied first."""

    @property
    def copies(self) -> int:
        """``copy_`` calls :func:`run_copies` makes while the plan holds, header included."""
        return 1 + len(self.runs)


def _device_key(device: torch.device) -> Tuple[str, int]:
    return device.type, -1 if device.index is None else device.index


def source_order(tensors: Mapping[str, torch.Tensor]) -> List[str]:
    """Keys of ``tensors`` with views of one storage next to each other, in storage order.

    Sorted by (device, storage ``data_ptr``, ``storage_offset``), stable for ties (several
    zero-size views at one place keep the mapping's order). The order depends on memory
    addresses: compute it once per layout and keep it, as the image layout it feeds.
    """
    def where(key: str) -> Tuple[Tuple[str, int], int, int]:
        t = tensors[key]
        return _device_key(t.device), t.untyped_storage().data_ptr(), t.storage_offset()
    return sorted(tensors, key=where)


def _check_entry(entry: ImageEntry, tensor: torch.Tensor) -> None:
    """Raises ValueError when ``tensor`` is not what ``entry`` describes (fill_image's rule)."""
    if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
        raise ValueError(f"tensor {entry.key!r} is {dtype_name(tensor.dtype)} "
                         f"{list(tensor.shape)}, the image expects {entry.dtype} {list(entry.shape)}")


def _joins(prev: Tuple[ImageEntry, torch.Tensor], entry: ImageEntry, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` continues, in memory and in the image, the run ending in ``prev``."""
    prev_entry, prev_tensor = prev
    return (entry.dtype == prev_entry.dtype and tensor.device == prev_tensor.device
            and tensor.is_contiguous() and prev_tensor.is_contiguous()
            and tensor.untyped_storage().data_ptr() == prev_tensor.untyped_storage().data_ptr()
            and prev_tensor.storage_offset() + prev_tensor.numel() == tensor.storage_offset()
            and prev_entry.start + prev_entry.nbytes == entry.start)


def _run(layout: ImageLayout, first: int, last: int,
         tensors: Mapping[str, torch.Tensor]) -> CopyRun:
    entries = layout.entries[first:last + 1]
    source = tensors[entries[0].key]
    return CopyRun(tuple(e.key for e in entries), first, entries[0].start,
                   sum(e.nbytes for e in entries), entries[0].dtype, str(source.device),
                   source.untyped_storage().data_ptr(), source.storage_offset())


def plan_copies(layout: ImageLayout, tensors: Mapping[str, torch.Tensor]) -> CopyPlan:
    """The runs that fill ``layout`` from ``tensors``; pure (reads only shapes, dtypes,
    devices, contiguity and storage places, never tensor data).

    Consecutive non-empty entries share a run when they have one dtype and device, are
    contiguous views of one storage that follow each other in it, and follow each other
    in the image. Zero-byte entries neither start nor break a run (one between two
    joined entries is part of their run's keys). A non-contiguous tensor is a run of
    its own (copied through reshape).

    Raises:
        KeyError: an entry's key is missing from ``tensors``.
        ValueError: a tensor does not match its entry (named by key).
    """
    runs: List[CopyRun] = []
    first, last, prev = 0, 0, None  # the open run: entries[first:last + 1], its last source
    for index, entry in enumerate(layout.entries):
        tensor = tensors[entry.key]
        _check_entry(entry, tensor)
        if entry.nbytes == 0:
            continue
        if prev is None or not _joins(prev, entry, tensor):
            if prev is not None:
                runs.append(_run(layout, first, last, tensors))
            first = index
        last, prev = index, (entry, tensor)
    if prev is not None:
        runs.append(_run(layout, first, last, tensors))
    return CopyPlan(tuple(runs), len(layout.header))


def _span(run: CopyRun, entries: Sequence[ImageEntry],
          tensors: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """A flat view covering ``run`` in its first source, or None when the tensors no longer
    form the run (a stale plan: the caller copies entry by entry).

    The check is relative: each non-empty source must be contiguous, on the run's device
    and start exactly where the span reads it (first ``data_ptr`` + its byte offset in
    the run), and the span must lie inside the first source's storage. That makes the
    span's bytes the sources' bytes wherever the storage now lives (a reallocated flat
    buffer keeps its runs); a replaced or reordered tensor breaks it and is caught here
    instead of a neighbour's bytes being copied into its place.

    Raises:
        ValueError: a tensor does not match its entry (named by key).
    """
    head = tensors[run.keys[0]]
    device, base = head.device, head.data_ptr()
    if str(device) != run.device:
        return None
    fits = True
    for entry in entries:
        tensor = tensors[entry.key]
        _check_entry(entry, tensor)  # a wrong tensor fails as in fill_image, not by fallback
        if entry.nbytes and (tensor.data_ptr() != base + (entry.start - run.start)
                             or not tensor.is_contiguous() or tensor.device != device):
            fits = False
    itemsize = head.element_size()
    if not fits or head.storage_offset() * itemsize + run.nbytes > head.untyped_storage().nbytes():
        return None  # a moved source, or a span reading past the first source's storage
    return head.detach().as_strided((run.nbytes // itemsize,), (1,))


def _copy_entries(buffer: torch.Tensor, entries: Sequence[ImageEntry],
                  tensors: Mapping[str, torch.Tensor], non_blocking: bool) -> int:
    """fill_image's copies for ``entries``: one per non-empty entry; returns their number."""
    copies = 0
    for entry in entries:
        tensor = tensors[entry.key]
        _check_entry(entry, tensor)
        if entry.nbytes == 0:
            continue
        target = buffer[entry.start:entry.start + entry.nbytes].view(tensor.dtype)
        target.copy_(tensor.detach().reshape(-1), non_blocking=non_blocking)
        copies += 1
    return copies


def run_copies(buffer: torch.Tensor, layout: ImageLayout, plan: CopyPlan,
               tensors: Mapping[str, torch.Tensor], non_blocking: bool = False) -> int:
    """Copy the header and every run of ``plan`` into ``buffer`` (uint8, 1-D, at least
    ``layout.nbytes``); the bytes equal :func:`~deepspeed_ext.format.image.fill_image`'s.

    Called on the thread that owns ``tensors``. The caller owns synchronisation: with
    ``non_blocking`` on CUDA sources and a pinned buffer the copies are only queued on the
    current stream.

    Returns:
        The number of ``copy_`` calls made: ``plan.copies`` while the plan holds, more when
        a run went stale and was copied entry by entry (then plan again).

    Raises:
        ValueError: the buffer is too small or not uint8, the plan was made for another
            layout, or a tensor does not match its entry (named by key).
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("an image buffer must be a 1-D uint8 tensor")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"image buffer holds {buffer.numel()} bytes, the image needs {layout.nbytes}")
    if plan.header_nbytes != len(layout.header):
        raise ValueError(f"the copy plan is for a {plan.header_nbytes}-byte header, "
                         f"the layout's is {len(layout.header)} bytes")
    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    buffer[:len(layout.header)].copy_(header)
    copies = 1
    for run in plan.runs:
        entries = layout.entries[run.first:run.first + len(run.keys)]
        if tuple(e.key for e in entries) != run.keys or entries[0].start != run.start:
            raise ValueError(f"the copy plan's run {run.keys[0]!r}... does not match the layout")
        span = _span(run, entries, tensors) if len(run.keys) > 1 else None
        if span is None:
            if len(run.keys) > 1:
                logger.debug("copy run of %d entries at byte %d (planned from storage %#x) is "
                             "stale; copying them one by one", len(run.keys), run.start,
                             run.storage_ptr)
            copies += _copy_entries(buffer, entries, tensors, non_blocking)
            continue
        target = buffer[run.start:run.start + run.nbytes].view(span.dtype)
        target.copy_(span, non_blocking=non_blocking)
        copies += 1
    return copies
