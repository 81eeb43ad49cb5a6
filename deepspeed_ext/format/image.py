"""The byte image of a fragment file, laid out before any byte is copied.

A rank's share of a checkpoint is one safetensors file. Instead of serializing tensors
into it at write time, MoC computes the file's exact bytes layout first (a pure
function, :func:`layout_image`), copies every fragment into its place in one host
buffer (:func:`fill_image`), and later writes that buffer to storage as is. This is what
lets a save return after a memory copy: the buffer is the snapshot, and the file on
storage is byte-for-byte the buffer.

Layout of a standard safetensors file::

    [8-byte little-endian header length H][H bytes of JSON header, space-padded to 8]
    [tensor data, each tensor at header-relative data_offsets]

Tensors are ordered by decreasing element size, then by key, so every tensor starts at
an offset divisible by its element size and can be filled through a typed view of the
buffer (a misaligned view would fail, or force a copy). With ``keep_order`` the given
order is kept within each element size instead of the key order: the fragments of one
flat source (a ZeRO partition) then sit side by side in the image as in memory, and
:mod:`deepspeed_ext.format.copy_plan` fills them with one copy.
"""

import functools
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_ext.format.dtypes import CODES_BY_NAME, dtype_from_name, dtype_name
from deepspeed_ext.format.image_entry import ImageEntry


@dataclass(frozen=True)
class ImageLayout:
    """The exact bytes layout of one safetensors file (see the module docstring)."""

    header: bytes
    """The 8-byte length prefix followed by the padded JSON header."""
    entries: Tuple[ImageEntry, ...]
    """Tensors in file order."""

    @property
    def nbytes(self) -> int:
        """Size of the whole file."""
        if not self.entries:
            return len(self.header)
        last = self.entries[-1]
        return last.start + last.nbytes

    def entry(self, key: str) -> ImageEntry:
        for e in self.entries:
            if e.key == key:
                return e
        raise KeyError(key)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    # Cached: a snapshot lays out hundreds of tensors every iteration.
    return torch.empty(0, dtype=dtype_from_name(dtype)).element_size()


def layout_image(tensors: Sequence[Tuple[str, Sequence[int], str]],
                 metadata: Optional[Mapping[str, str]] = None,
                 keep_order: bool = False) -> ImageLayout:
    """Lay out a safetensors file holding ``tensors``; pure, no tensor data needed.

    Args:
        tensors: ``(key, shape, dtype name)`` of every tensor, in any order.
        metadata: optional string->string header metadata.
        keep_order: keep the given order (stably sorted by decreasing element size, which
            keeps every tensor aligned) instead of the key order; the layout then depends
            on the order of ``tensors``.

    Raises:
        ValueError: a duplicate or reserved key, or a dtype safetensors cannot store.
    """
    if sys.byteorder != "little":  # safetensors stores little-endian bytes
        raise ValueError("MoC images need a little-endian machine")
    if keep_order:
        ordered = sorted(tensors, key=lambda t: -_itemsize(t[2]))  # stable: the given order
    else:
        ordered = sorted(tensors, key=lambda t: (-_itemsize(t[2]), t[0]))
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    spans = []
    offset = 0
    for key, shape, dtype in ordered:
        if key in header or key == "__metadata__":
            raise ValueError(f"tensor key {key!r} is duplicate or reserved")
        nbytes = math.prod(shape) * _itemsize(dtype)
        header[key] = {"dtype": CODES_BY_NAME[dtype], "shape": [int(s) for s in shape],
                       "data_offsets": [offset, offset + nbytes]}
        spans.append((key, dtype, tuple(int(s) for s in shape), offset, nbytes))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * ((-(8 + len(blob))) % 8)
    prefix = struct.pack("<Q", len(blob)) + blob
    base = len(prefix)
    return ImageLayout(prefix, tuple(ImageEntry(k, d, s, base + o, n) for k, d, s, o, n in spans))


def layout_of(tensors: Mapping[str, torch.Tensor],
              metadata: Optional[Mapping[str, str]] = None,
              keep_order: bool = False) -> ImageLayout:
    """:func:`layout_image` for actual tensors (``keep_order``: the mapping's iteration order)."""
    return layout_image([(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()],
                        metadata, keep_order)


def fill_image(buffer: torch.Tensor, layout: ImageLayout,
               tensors: Mapping[str, torch.Tensor], non_blocking: bool = False,
               filled: Optional[Callable[[torch.Tensor], None]] = None) -> None:
    """Copy the header and every tensor into ``buffer`` (uint8, at least ``layout.nbytes``).

    The caller owns synchronisation: with ``non_blocking`` on a CUDA source and a pinned
    buffer the copies are only queued on the current stream.

    Args:
        filled: called (blocking copies only) with each next piece of the image once its
            bytes are in place, in order, together covering ``buffer[:layout.nbytes]``:
            a checksum can read them while they are still in the cache.

    Raises:
        ValueError: the buffer is too small or not uint8, or a tensor does not match its
            layout entry (named by key).
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("an image buffer must be a 1-D uint8 tensor")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"image buffer holds {buffer.numel()} bytes, the image needs {layout.nbytes}")
    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    buffer[:len(layout.header)].copy_(header)
    done = 0  # bytes handed to ``filled`` so far
    for entry in layout.entries:
        tensor = tensors[entry.key]
        if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
            raise ValueError(f"tensor {entry.key!r} is {dtype_name(tensor.dtype)} "
                             f"{list(tensor.shape)}, the image expects {entry.dtype} {list(entry.shape)}")
        if entry.nbytes == 0:
            continue
        target = buffer[entry.start:entry.start + entry.nbytes].view(tensor.dtype)
        target.copy_(tensor.detach().reshape(-1), non_blocking=non_blocking)
        if filled is not None:
            filled(buffer[done:entry.start + entry.nbytes])
            done = entry.start + entry.nbytes
    if filled is not None and done < layout.nbytes:
        filled(buffer[done:layout.nbytes])


def image_view(buffer: torch.Tensor, layout: ImageLayout) -> memoryview:
    """The image's bytes as a memoryview of ``buffer`` (no copy), for writing and hashing."""
    return memoryview(buffer[:layout.nbytes].numpy()).cast("B")
