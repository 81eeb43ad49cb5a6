"""Reading tensors, or element ranges of them, from one safetensors fragment file, local
(through safetensors' mmap) or behind a URL (ranged requests), with the header checked
as safetensors checks it."""

import math
from typing import Any, Dict, List, Optional

import torch
from safetensors import safe_open

from deepspeed_ext.format import fs
from deepspeed_ext.format.dtypes import DTYPES, ITEM_SIZES, SAFETENSORS_CODES
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import parse_json


class FragmentReader:
    """Reads tensors, or element ranges of 1-D tensors, from one safetensors file.

    The file is opened with ``safetensors.safe_open(framework="pt")`` and its default
    ``mmap`` backend: opening reads only the JSON header, and :meth:`read` slices with
    ``get_slice(key)[start:stop]``, which maps the file instead of reading it, so the
    only bytes read from storage are the pages of the requested range, touched when they
    are copied into the result. (safetensors' ``"pread"`` backend, by contrast, reads the
    whole tensor even for a small slice; the tests check that a small range stays small.)

    Results are always copies owning their memory: a tensor viewing the mapping would
    break (SIGBUS) if the file were later truncated in place, and would keep the mapping
    alive after :meth:`close`.

    A URL (:mod:`deepspeed_ext.format.fs`) is read without safetensors' mmap: the header with
    two ranged requests at open, then one ranged request per :meth:`read`, so a small
    range still costs only its own bytes.

    Not thread-safe; one reader per thread.

    Raises:
        CheckpointError: naming the file, when it is missing or not a safetensors file.
    """

    def __init__(self, path: str):
        self.path = path
        self._url: Optional[_UrlSafetensors] = None
        self._slices: Dict[str, Any] = {}
        if fs.is_url(path):
            self._url = _UrlSafetensors(path)
            self._file = self._url
            self._keys = set(self._url.entries)
            return
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file missing") from None
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
        self._keys = set(self._file.keys())

    def __enter__(self) -> "FragmentReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the file handle and mapping; the reader is unusable afterwards."""
        self._slices.clear()
        self._file = None

    def keys(self) -> List[str]:
        """Every key in the file, sorted."""
        return sorted(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def metadata(self) -> Dict[str, str]:
        """The file's header metadata (empty when none was written)."""
        return dict(self._handle().metadata() or {})  # _UrlSafetensors has metadata() too

    def _handle(self):
        if self._file is None:
            raise ValueError(f"{self.path}: reader is closed")
        return self._file

    def _slice(self, key: str):
        sl = self._slices.get(key)
        if sl is None:
            if key not in self._keys:
                raise CheckpointError(f"{self.path}: no tensor {key!r} in the file")
            sl = self._handle().get_slice(key)
            self._slices[key] = sl
        return sl

    def shape(self, key: str) -> List[int]:
        """Shape of ``key`` as stored (from the header; no data is read)."""
        if self._url is not None:
            return list(self._url.entry(key)["shape"])
        return list(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """dtype of ``key`` as stored (from the header; no data is read)."""
        code = (self._url.entry(key)["dtype"] if self._url is not None
                else self._slice(key).get_dtype())
        name = SAFETENSORS_CODES.get(code)
        if name is None or name not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {code}")
        return DTYPES[name]

    def read(self, key: str, start: int = 0, length: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the 1-D tensor ``key``.

        Args:
            key: a 1-D tensor in the file (fragments are stored flat).
            start: first element.
            length: number of elements; None = to the end.
            out: optional 1-D CPU tensor of exactly ``length`` elements and the stored
                dtype to copy into (no intermediate allocation); returned.

        Raises:
            CheckpointError: the key is missing or not 1-D.
            IndexError: the range is outside the tensor (safetensors itself would
                silently clip it and return fewer elements).
            ValueError: ``out`` has the wrong size or dtype.
        """
        shape = self.shape(key)
        if len(shape) != 1:
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {shape}; "
                                  f"fragments must be 1-D")
        numel = shape[0]
        if length is None:
            length = numel - start
        if start < 0 or length < 0 or start + length > numel:
            raise IndexError(f"{self.path}: range [{start}, {start + length}) outside "
                             f"tensor {key!r} of {numel} elements")
        dtype = self.dtype(key)
        if out is not None and (out.dim() != 1 or out.numel() != length or out.dtype != dtype):
            raise ValueError(f"{self.path}: out must be 1-D {dtype} with {length} elements, "
                             f"got {tuple(out.shape)} {out.dtype}")
        if length == 0:
            return out if out is not None else torch.empty(0, dtype=dtype)
        if self._url is not None:
            view = self._url.read(key, start, length, dtype)
            if out is None:
                return view
            out.copy_(view)
            return out
        view = self._slice(key)[start:start + length]
        if out is None:
            return view.clone()
        out.copy_(view)
        return out

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` in its stored shape (any rank, scalars included)."""
        self._handle()
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the file")
        if self._url is not None:
            shape = self.shape(key)
            numel = 1
            for n in shape:
                numel *= n
            return self._url.read(key, 0, numel, self.dtype(key)).reshape(shape)
        return self._file.get_tensor(key).clone()


_MAX_HEADER = 256 << 20
"""Largest safetensors header accepted from a URL: a bigger length field means the file
is not safetensors (safetensors itself refuses headers over 100 MB)."""




def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def check_safetensors_header(header: Any, data_size: int) -> Dict[str, Dict[str, Any]]:
    """The tensor entries of a parsed safetensors header, checked as safetensors' own
    reader checks a local file's: each entry an object with a known ``dtype`` code, a
    ``shape`` of non-negative ints and ``data_offsets`` ``[begin, end]`` whose span is
    exactly the shape's bytes; the spans, in order, tile ``[0, data_size)`` without gap
    or overlap; ``__metadata__`` (optional) maps strings to strings.

    A header used unchecked raised TypeError/ValueError out of a load on a dtype list or
    a shape of strings (not the checkpoint error that skips to an older checkpoint),
    and offsets past a tensor's own span read another tensor's bytes as its data.

    Raises:
        ValueError: naming the entry and what is wrong with it.
    """
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values())):
        raise ValueError("__metadata__ is not an object of strings")
    entries, spans = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {key!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
            raise ValueError(f"tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise ValueError(f"tensor {key!r}: shape {shape!r} is not a list of "
                             f"non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(n) for n in offsets) or offsets[0] > offsets[1]):
            raise ValueError(f"tensor {key!r}: data_offsets {offsets!r} are not two ordered "
                             f"non-negative ints")
        nbytes = math.prod(shape) * ITEM_SIZES[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"tensor {key!r}: data_offsets {offsets} span "
                             f"{offsets[1] - offsets[0]} bytes, its {dtype} {shape} needs {nbytes}")
        entries[key] = entry
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise ValueError(f"tensor {key!r}: data_offsets start at {begin}, the previous "
                             f"tensor ends at {end} ({'overlap' if begin < end else 'gap'})")
        end = stop
    if end > data_size:
        raise ValueError(f"truncated: the tensors end at byte {end} of the data, the file "
                         f"holds {data_size}")
    if end < data_size:
        raise ValueError(f"{data_size - end} bytes after the last tensor's data")
    return entries


class _UrlSafetensors:
    """The safetensors header of a file behind a URL, and ranged reads of its tensors
    (the format: 8-byte little-endian header length, the JSON header, then the data)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = fs.getsize(path)
            head = fs.read_range(path, 0, 8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= _MAX_HEADER or 8 + length > size:
                raise ValueError(f"header length field {length} (file of {size} bytes)")
            header = parse_json(fs.read_range(path, 8, 8 + length), path)
            self.entries: Dict[str, Dict[str, Any]] = check_safetensors_header(
                header, size - 8 - length)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file missing") from None
        except (ValueError, CheckpointError) as err:
            text = str(err)
            if text.startswith(path + ": "):
                text = text[len(path) + 2:]
            raise CheckpointError(f"{path}: not a readable safetensors file ({text})") from None
        self._metadata = header.get("__metadata__") or {}
        self.data_start = 8 + length

    def metadata(self) -> Dict[str, str]:
        return self._metadata

    def entry(self, key: str) -> Dict[str, Any]:
        try:
            return self.entries[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the file") from None

    def read(self, key: str, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[start, start + length)`` of ``key`` (flat), as a new tensor."""
        first, end = self.entry(key)["data_offsets"]
        size = torch.empty(0, dtype=dtype).element_size()
        lo = self.data_start + first + start * size
        hi = lo + length * size
        if hi > self.data_start + end:
            raise CheckpointError(f"{self.path}: tensor {key!r} ends before element "
                                  f"{start + length}")
        data = fs.read_range(self.path, lo, hi)
        if len(data) != hi - lo:
            raise CheckpointError(f"{self.path}: truncated: tensor {key!r} needs bytes "
                                  f"[{lo}, {hi}), the file gave {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=dtype)


