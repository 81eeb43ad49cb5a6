"""How bytes of a MoC checkpoint reach the disk and come back: atomic writes, checksums,
safetensors fragment files and ranged reads from them.

Nothing here knows about ranks, experts or DeepSpeed; :mod:`deepspeed_ext.format.manifest`
describes what a checkpoint holds, :mod:`deepspeed_ext.store.reader` assembles it again.

Every file of a checkpoint is written the same way (:func:`atomic_write_bytes`,
:func:`write_image_file`): into ``<path>.tmp.<pid>``, flushed, fsynced, renamed over
``<path>`` and the directory fsynced. A crash therefore leaves either the old file, the
complete new one, or a stray ``*.tmp.<pid>`` file; never a half-written file under the
real name. A URL (``s3://...``, see :mod:`deepspeed_ext.format.fs`) has no rename: each file
is written as one object, which the store publishes only when it is complete.

Call order on one rank (the orchestration sits on top of this)::

    ensure_dir(tag_dir)                                   # every rank, idempotent
    record = write_image_file(path, image)                # FileRecord(nbytes, sha256)
    ...                                                   # publish a report (deepspeed_ext.store.commit)
    problem = check_file(path, record.nbytes, record.sha256)   # when verifying / loading
    with FragmentReader(path) as f:
        part = f.read(key, start, length)
"""

import concurrent.futures
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_ext.format import fs
from deepspeed_ext.format.dtypes import dtype_name
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.image import fill_image, image_view, layout_image, layout_of

HASH_CHUNK = 8 << 20
"""Bytes hashed per read: large enough for throughput, small enough not to hold a
multi-GiB rank file in memory at once."""



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


# --------------------------------------------------------------------- atomic writes

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
    fs.fsync_dir(os.path.dirname(os.path.abspath(path)))


def _tmp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def _publish(tmp: str, path: str) -> None:
    """Rename a fully written, fsynced temp file over ``path`` and sync the directory."""
    os.replace(tmp, path)
    fs.fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(path: str, data: bytes, durable: bool = True, *,
                       make_parent: bool = True) -> FileRecord:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    Writes ``path.tmp.<pid>``, flushes and fsyncs it, ``os.replace``-s it over ``path``
    and fsyncs the directory (:func:`deepspeed_ext.format.fs.atomic_write_local`, which
    also leaves no stray temp file behind on a failed write: disk full, interrupt). The
    parent directory is created if missing.

    Args:
        durable: fsync the file and the directory. False only for coordination files
            that need not survive a machine crash (nothing that waits on them does),
            where an fsync would add storage latency to the training loop.
        make_parent: create a missing parent directory (mode from the umask). False for
            files in a private directory (:mod:`deepspeed_ext.private_dir`): a directory
            deleted meanwhile (a node's memory lost) must fail the write, not come back
            readable by other users.

    Returns:
        The written file's size and SHA-256 (computed from ``data``, no re-read).

    Raises:
        FileNotFoundError: with ``make_parent=False``, the parent directory is missing.
    """
    if make_parent:
        ensure_dir(fs.parent(path))
    if fs.is_url(path):
        fs.write_bytes(path, data)
        return FileRecord(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    fs.atomic_write_local(path, data, durable=durable)
    return FileRecord(nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def atomic_write_text(path: str, text: str, durable: bool = True, *,
                      make_parent: bool = True) -> FileRecord:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable,
                              make_parent=make_parent)


def atomic_write_json(path: str, obj: Any, *, sort_keys: bool = False,
                      durable: bool = True, make_parent: bool = True) -> FileRecord:
    """:func:`atomic_write_bytes` for strict JSON (NaN/Infinity are refused: other JSON
    readers reject them, and :mod:`deepspeed_ext.format.objects` encodes them explicitly)."""
    text = json.dumps(obj, indent=1, sort_keys=sort_keys, allow_nan=False)
    return atomic_write_text(path, text + "\n", durable=durable, make_parent=make_parent)


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
            chunk = f.read(HASH_CHUNK)
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
                        metadata: Optional[Dict[str, str]] = None, *,
                        make_parent: bool = True) -> FileRecord:
    """Write tensors into a safetensors file, atomically, and return its size/checksum.

    For small files and tools (tests, ``objects``); the checkpointer itself stages its
    rank file into a reused buffer and calls :func:`write_image_file`. This builds the
    same image in a fresh buffer.

    Args:
        path: final file name; ``path.tmp.<pid>`` is written first.
        tensors: safetensors key -> CPU tensor. Tensors must be contiguous; views of one
            buffer are fine as long as they do not overlap. Fragment keys come from
            :func:`deepspeed_ext.format.naming.fragment_key`.
        metadata: optional string->string header metadata (informative only).
        make_parent: as for :func:`atomic_write_bytes`.

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
    try:
        layout = layout_of(tensors, metadata)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    _refuse_overlap(path, tensors)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    fill_image(buffer, layout, tensors)
    return write_image_file(path, image_view(buffer, layout), make_parent=make_parent)


def write_image_file(path: str, image: memoryview, *, make_parent: bool = True) -> FileRecord:
    """Write a prepared file image (:mod:`deepspeed_ext.format.image`) atomically.

    Called on a background thread (or by a keeper process) with a host buffer that
    nobody modifies until this returns. The SHA-256 is computed from the buffer on a
    second thread while ``fsync`` waits on the disk: both release the GIL, so the write
    pays max(hash, fsync), not their sum.

    Args:
        make_parent: as for :func:`atomic_write_bytes`.

    Returns:
        The published file's size and checksum.
    """
    if make_parent:
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
        produce: called once per key, in the file's order (:func:`deepspeed_ext.format.image.layout_image`:
            larger elements first, then by key); returns a tensor of that shape/dtype.
        metadata: optional string->string header metadata.

    Raises:
        ValueError: duplicate or reserved keys, an unsupported dtype, or a produced
            tensor that does not match its layout entry.
    """
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
