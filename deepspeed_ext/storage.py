"""How bytes of a MoC checkpoint reach the disk and come back: atomic writes, checksums,
safetensors fragment files and ranged reads from them.

Nothing here knows about ranks, experts or DeepSpeed; :mod:`deepspeed_ext.manifest`
describes what a checkpoint holds, :mod:`deepspeed_ext.reader` assembles it again.

Every file of a checkpoint is written the same way (:func:`atomic_write_bytes`,
:func:`write_image_file`): into ``<path>.tmp.<pid>``, flushed, fsynced, renamed over
``<path>`` and the directory fsynced. A crash therefore leaves either the old file, the
complete new one, or a stray ``*.tmp.<pid>`` file; never a half-written file under the
real name. A URL (``s3://...``, see :mod:`deepspeed_ext.fs`) has no rename: each file
is written as one object, which the store publishes only when it is complete.

Call order on one rank (the orchestration sits on top of this)::

    ensure_dir(tag_dir)                                   # every rank, idempotent
    record = write_image_file(path, image)                # FileRecord(nbytes, sha256)
    ...                                                   # publish a report (deepspeed_ext.commit)
    problem = check_file(path, record.nbytes, record.sha256)   # when verifying / loading
    with FragmentReader(path) as f:
        part = f.read(key, start, length)
"""

import concurrent.futures
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from deepspeed_ext import fs

_HASH_CHUNK = 8 << 20
"""Bytes hashed per read: large enough for throughput, small enough not to hold a
multi-GiB rank file in memory at once."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete or corrupt.

    The message names the file (or tensor) at fault, so that the user knows what to
    delete or which tag to load instead.
    """


# ----------------------------------------------------------------- untrusted JSON

SMALL_RECORD_MAX_BYTES = 1 << 20
"""Cap on a small JSON record read from a checkpoint directory (``latest``, the attempt
record, a claim, a failure record): each holds a few dozen bytes when MoC writes it."""

JSON_MAX_DEPTH = 100
"""Deepest nesting accepted in the free-form parts of a checkpoint's JSON (a manifest's
``layout`` and ``extra``, the objects tree). MoC writes a handful of levels; a crafted
file nesting hundreds deep parses, then raises RecursionError in whatever walks it at a
deeper point of a load's stack (a checksum's ``json.dumps``, decoding the objects)."""


def parse_json(data: Any, source: str) -> Any:
    """``json.loads(data)`` for text read from a checkpoint.

    Raises:
        CheckpointError: naming ``source``: not UTF-8, not JSON, nested too deeply for
            the parser (``[[[...]]]`` 100000 deep raises RecursionError, which escaped
            every ``except ValueError`` and stopped a load instead of skipping the
            checkpoint), or too large to hold parsed in memory.
    """
    try:
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("utf-8")
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{source}: unreadable (JSON nested too deeply)") from None
    except MemoryError:
        raise CheckpointError(f"{source}: unreadable (too large to parse in memory)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{source}: unreadable ({err})") from None


def read_json(path: str, limit: int) -> Any:
    """The parsed JSON file ``path``, read only up to ``limit`` bytes (:func:`fs.read_bytes`).

    Raises:
        FileNotFoundError: the file is missing (callers tell that apart: an incomplete
            checkpoint, no record yet).
        CheckpointError: naming the file: larger than ``limit``, unreadable, or not
            JSON (:func:`parse_json`).
    """
    try:
        data = fs.read_bytes(path, limit=limit)
    except (FileNotFoundError, CheckpointError):
        raise
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    return parse_json(data, path)


def check_depth(value: Any, max_depth: int = JSON_MAX_DEPTH) -> None:
    """ValueError when parsed JSON nests lists/objects deeper than ``max_depth``.

    Iterative (a recursive walk would itself overflow on the input it refuses); its
    cost is one visit per container.
    """
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))


@dataclass(frozen=True)
class FileRecord:
    """Size and checksum of a file exactly as it was written."""

    nbytes: int
    """File size in bytes."""
    sha256: str
    """Hex SHA-256 of the whole file."""

    def to_json(self) -> Dict[str, Any]:
        return {"nbytes": self.nbytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "FileRecord":
        return cls(nbytes=int(data["nbytes"]), sha256=str(data["sha256"]))


# --------------------------------------------------------------------------- dtypes

_DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                 "int8", "uint8", "bool", "uint16", "uint32", "uint64", "complex64",
                 "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""Tensor dtypes a checkpoint may hold, by the name the manifest stores (``float32``)."""

_SAFETENSORS_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
"""safetensors header dtype codes -> our dtype names."""
_CODES_BY_NAME = {name: code for code, name in _SAFETENSORS_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The name the manifest stores for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: for a dtype safetensors cannot store (the save would fail later,
            on a background thread, with a less helpful message).
    """
    name = str(dtype).rsplit(".", 1)[-1]
    if _DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint; "
                         f"supported: {', '.join(sorted(_DTYPES))}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for an unknown name."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tensor dtype {name!r}; expected one of "
                         f"{', '.join(sorted(_DTYPES))}") from None


# --------------------------------------------------------------------- atomic writes

def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it survive a power loss.

    Without it a crash right after ``os.replace`` can bring back the old directory
    entry (or none), even though the file's data itself was fsynced.
    """
    if fs.is_url(path):  # object stores have no directory entries to sync
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform that cannot open directories: nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def ensure_dir(path: str) -> None:
    """Create ``path`` (and parents) if missing, and make the new entry durable.

    Safe to call from every rank at once.
    """
    if fs.is_url(path):
        fs.makedirs(path)
        return
    if os.path.isdir(path):
        return
    os.makedirs(path, exist_ok=True)
    # The new directory's entry lives in its parent: sync it, or a crash may lose the
    # directory together with every fsynced file inside it.
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _tmp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def _publish(tmp: str, path: str) -> None:
    """Rename a fully written, fsynced temp file over ``path`` and sync the directory."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(path: str, data: bytes, durable: bool = True) -> FileRecord:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    Writes ``path.tmp.<pid>``, flushes and fsyncs it, ``os.replace``-s it over ``path``
    and fsyncs the directory. The parent directory is created if missing.

    Args:
        durable: fsync the file and the directory. False only for coordination files
            that need not survive a machine crash (nothing that waits on them does),
            where an fsync would add storage latency to the training loop.

    Returns:
        The written file's size and SHA-256 (computed from ``data``, no re-read).
    """
    ensure_dir(fs.parent(path))
    if fs.is_url(path):
        fs.write_bytes(path, data)
        return FileRecord(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if durable:
            _publish(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        # Leave no stray temp file behind on a failed write (disk full, interrupt).
        _remove_quietly(tmp)
        raise
    return FileRecord(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def atomic_write_text(path: str, text: str, durable: bool = True) -> FileRecord:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: str, obj: Any, *, sort_keys: bool = False,
                      durable: bool = True) -> FileRecord:
    """:func:`atomic_write_bytes` for strict JSON (NaN/Infinity are refused: other JSON
    readers reject them, and :mod:`deepspeed_ext.objects` encodes them explicitly)."""
    text = json.dumps(obj, indent=1, sort_keys=sort_keys, allow_nan=False)
    return atomic_write_text(path, text + "\n", durable=durable)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ------------------------------------------------------------------------ checksums

def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in chunks (constant memory for any file size)."""
    digest = hashlib.sha256()
    with fs.open_read(path) as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def check_file(path: str, nbytes: int, sha256: Optional[str] = None) -> Optional[str]:
    """Compare a file on disk with what was recorded when it was written.

    The size is checked first (cheap: catches files cut short by a crash or a full
    disk); the checksum, when given, only for a file of the right size (catches flipped
    bits and files overwritten by another run).

    Args:
        path: the file.
        nbytes: recorded size.
        sha256: recorded hex SHA-256, or None to check only existence and size.

    Returns:
        None when the file matches, else one line naming the file and the problem.
    """
    try:
        size = fs.getsize(path)
    except FileNotFoundError:
        return f"{path}: file missing"
    except (OSError, ValueError) as err:  # ValueError: a NUL in a name a manifest lists
        return f"{path}: cannot stat ({err})"
    if size != nbytes:
        how = "truncated" if size < nbytes else "larger than recorded"
        return f"{path}: {how}: {size} bytes on disk, manifest records {nbytes}"
    if sha256 is not None:
        try:
            actual = sha256_file(path)
        except OSError as err:
            return f"{path}: cannot read ({err})"
        if actual != sha256:
            return f"{path}: checksum mismatch (sha256 {actual}, manifest records {sha256})"
    return None


def verify_file(path: str, record: FileRecord) -> None:
    """:func:`check_file` that raises.

    Raises:
        CheckpointError: naming the file, when it is missing, has the wrong size or
            the wrong checksum.
    """
    problem = check_file(path, record.nbytes, record.sha256)
    if problem is not None:
        raise CheckpointError(problem)


# --------------------------------------------------------------------- fragment files

def _refuse_overlap(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Views of one buffer are fine; two keys covering the same bytes are a caller's bug
    (the file would hold the same data twice under different names)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
                   for k, t in tensors.items() if t.numel())
    for (_, end, key), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{path}: tensors {key!r} and {other!r} overlap in memory")


def write_fragment_file(path: str, tensors: Mapping[str, torch.Tensor],
                        metadata: Optional[Dict[str, str]] = None) -> FileRecord:
    """Write tensors into a safetensors file, atomically, and return its size/checksum.

    For small files and tools (tests, ``objects``); the checkpointer itself stages its
    rank file into a reused buffer and calls :func:`write_image_file`. This builds the
    same image in a fresh buffer.

    Args:
        path: final file name; ``path.tmp.<pid>`` is written first.
        tensors: safetensors key -> CPU tensor. Tensors must be contiguous; views of one
            buffer are fine as long as they do not overlap. Fragment keys come from
            :func:`deepspeed_ext.manifest.fragment_key`.
        metadata: optional string->string header metadata (informative only).

    Returns:
        :class:`FileRecord` of the published file.

    Raises:
        ValueError: a tensor on an accelerator, non-contiguous, or of an unsupported dtype
            (named by key), or overlapping tensors.
    """
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path}: {key!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type != "cpu":
            # safetensors would copy device tensors synchronously on this thread, which
            # is exactly the stall a background writer exists to avoid.
            raise ValueError(f"{path}: tensor {key!r} is on {tensor.device}; snapshot it to "
                             f"CPU memory before writing")
        if not tensor.is_contiguous():
            raise ValueError(f"{path}: tensor {key!r} is not contiguous")
        try:
            dtype_name(tensor.dtype)
        except ValueError as err:
            raise ValueError(f"{path}: tensor {key!r}: {err}") from None
    from deepspeed_ext.image import fill_image, image_view, layout_of  # image imports storage
    try:
        layout = layout_of(tensors, metadata)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    _refuse_overlap(path, tensors)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    fill_image(buffer, layout, tensors)
    return write_image_file(path, image_view(buffer, layout))


def write_image_file(path: str, image: memoryview) -> FileRecord:
    """Write a prepared file image (:mod:`deepspeed_ext.image`) atomically.

    Called on a background thread (or by a keeper process) with a host buffer that
    nobody modifies until this returns. The SHA-256 is computed from the buffer on a
    second thread while ``fsync`` waits on the disk: both release the GIL, so the write
    pays max(hash, fsync), not their sum.

    Returns:
        The published file's size and checksum.
    """
    ensure_dir(fs.parent(path))
    if fs.is_url(path):
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(lambda: hashlib.sha256(image).hexdigest())
            fs.write_bytes(path, image)
            return FileRecord(nbytes=len(image), sha256=digest.result())
    tmp = _tmp_path(path)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(lambda: hashlib.sha256(image).hexdigest())
            with open(tmp, "wb") as f:
                f.write(image)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            record = FileRecord(nbytes=size, sha256=digest.result())
        if size != len(image):  # a short write the OS did not report as an error
            raise OSError(f"{tmp}: wrote {size} of {len(image)} bytes")
        _publish(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return record


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

    A URL (:mod:`deepspeed_ext.fs`) is read without safetensors' mmap: the header with
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
        name = _SAFETENSORS_CODES.get(code)
        if name is None or name not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {code}")
        return _DTYPES[name]

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

_ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8, "F8_E4M3": 1,
               "F8_E5M2": 1}
"""Bytes per element of each safetensors dtype code of :data:`_SAFETENSORS_CODES`."""


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
        if not isinstance(dtype, str) or dtype not in _ITEM_SIZES:
            raise ValueError(f"tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise ValueError(f"tensor {key!r}: shape {shape!r} is not a list of "
                             f"non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(n) for n in offsets) or offsets[0] > offsets[1]):
            raise ValueError(f"tensor {key!r}: data_offsets {offsets!r} are not two ordered "
                             f"non-negative ints")
        nbytes = math.prod(shape) * _ITEM_SIZES[dtype]
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


def write_safetensors_streaming(path: str, layout: Sequence[Tuple[str, Sequence[int], torch.dtype]],
                                produce: Callable[[str], torch.Tensor],
                                metadata: Optional[Dict[str, str]] = None) -> FileRecord:
    """Write a safetensors file one tensor at a time, atomically.

    For outputs larger than memory (``moc-ckpt consolidate`` of a model with its
    optimizer state): the header is computed from ``layout``, then each tensor is
    produced, written and dropped, so peak memory is one tensor, not the model.
    The file is standard safetensors (little-endian data, 8-byte aligned header),
    readable by ``safetensors.safe_open``.

    Args:
        path: output file (``path.tmp.<pid>`` first).
        layout: ``(key, shape, dtype)`` of every tensor.
        produce: called once per key, in the file's order (:func:`deepspeed_ext.image.layout_image`:
            larger elements first, then by key); returns a tensor of that shape/dtype.
        metadata: optional string->string header metadata.

    Raises:
        ValueError: duplicate or reserved keys, an unsupported dtype, or a produced
            tensor that does not match its layout entry.
    """
    from deepspeed_ext.image import layout_image  # image imports storage
    try:
        image = layout_image([(k, tuple(shape), dtype_name(dtype)) for k, shape, dtype in layout],
                             metadata)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if fs.is_url(path):
        raise ValueError(f"{path}: streamed outputs are written to a local path; copy the "
                         f"file to the store afterwards")
    ensure_dir(os.path.dirname(os.path.abspath(path)))
    tmp = _tmp_path(path)
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            f.write(image.header)
            digest.update(image.header)
            for entry in image.entries:
                tensor = produce(entry.key)
                if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
                    raise ValueError(f"{path}: {entry.key!r} produced {tensor.dtype} "
                                     f"{list(tensor.shape)}, layout says {entry.dtype} "
                                     f"{list(entry.shape)}")
                if tensor.numel() == 0:
                    continue
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data.data)
                digest.update(data.data)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        _publish(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return FileRecord(nbytes=size, sha256=digest.hexdigest())
