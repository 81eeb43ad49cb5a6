"""Non-tensor training state (iteration, LR scheduler, RNG states, client state) stored
as JSON plus safetensors, without pickle.

A pickled checkpoint runs arbitrary code when it is loaded and breaks when a class is
renamed; this encoding is plain data, and :func:`decode` only ever builds the types
listed below (nothing is imported or unpickled).

Supported: ``None``, ``bool``, ``int`` (any size), ``float`` (exact, NaN/inf included),
``str``, ``bytes``, ``list``, ``tuple``, ``dict`` and ``OrderedDict`` (keys may be any
supported hashable value; their types are kept: ``{1: ..}`` stays an int key),
``torch.Tensor`` (any device; decoded on CPU), ``torch.Size``, ``torch.dtype``, numpy
arrays and numpy scalars. That covers ``random.getstate()``,
``numpy.random.get_state()`` (legacy tuple or dict form), ``torch.get_rng_state()`` and
``torch.cuda.get_rng_state_all()``. Anything else raises TypeError naming its path.

Tensors and arrays are moved out of the JSON tree into a tensor dict under keys
``obj/<path>`` (``obj/rng/torch``) and written with the rank's safetensors file.

Call order (rank 0, inside a save)::

    tree, obj_tensors = encode(state)                   # snapshot: tensors are copied
    tensors.update(obj_tensors)                         # into rank 0's fragment file
    write_fragment_file(rank_file, tensors)
    record = write_objects_file(tag_dir, tree, rank_file_name(0))
    # record goes into the manifest's files as "objects.json" (rank 0)

and when loading: ``CheckpointReader.objects()`` (or :func:`read_objects_file` +
:func:`decode` with the tensors from the named file).
"""

import collections
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from deepspeed_ext.format.dtypes import dtype_from_name, dtype_name
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import (JSON_MAX_DEPTH, FileRecord, atomic_write_json,
                                          check_depth, read_json)

OBJECTS_FILE = "objects.json"
"""File name of the encoded objects inside a checkpoint directory."""
OBJECTS_MAX_BYTES = 256 << 20
"""Largest ``objects.json`` read (the client state, scheduler, counters, token ledger:
megabytes at most); a bigger one is damage, read whole into memory otherwise."""
OBJECTS_TENSOR_FILE = "objects.safetensors"
"""The small file of the tensors the objects reference (every rank's RNG state), beside
``objects.json``: kept out of rank 0's file, which every rank of a load would otherwise
checksum whole to read its RNG state (checkpoints written before it still load)."""
OBJECTS_FORMAT = "moc-objects"
OBJECTS_VERSION = 1
TENSOR_PREFIX = "obj/"
"""Prefix of the tensor keys :func:`encode` produces; fragment keys never start with it
(they are ``name|kind|offset`` of parameters), so both fit in one safetensors file."""

_TAG = "__moc__"
"""Marks a JSON object that encodes a non-JSON value. A user dict that itself has this
key is encoded in the tagged ``dict`` form, so it can never be mistaken for a tag."""

_NUMPY_KINDS = "biufcmMSU"
"""numpy dtype kinds whose bytes fully describe the value (no objects, no structs)."""


# ----------------------------------------------------------------------------- encode

class _Encoder:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.tensors: Dict[str, torch.Tensor] = {}
        self._by_id: Dict[int, Tuple[str, torch.Tensor]] = {}
        self._active: set = set()  # ids of containers on the current path (cycles)

    def _key(self, path: str) -> str:
        key = self.prefix + (path or "_")
        if key in self.tensors:
            # {1: t, "1": t} or keys containing "/" can map two paths to one key.
            n = 2
            while f"{key}#{n}" in self.tensors:
                n += 1
            key = f"{key}#{n}"
        return key

    def encode(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str or t is int:
            return obj
        if t is float:
            if math.isfinite(obj):
                return obj
            # Strict JSON has no NaN/Infinity; spell them out.
            return {_TAG: "float", "value": repr(obj)}
        if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
            return self._np_scalar(obj, path)
        if t is bytes:
            return {_TAG: "bytes", "hex": obj.hex()}
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if t is np.ndarray:
            return self._ndarray(obj, path)
        if t is torch.Size:
            return {_TAG: "torch.Size", "items": list(obj)}
        if t is torch.dtype:
            return {_TAG: "torch.dtype", "name": str(obj).rsplit(".", 1)[-1]}
        if t in (list, tuple, dict, collections.OrderedDict):
            if id(obj) in self._active:
                raise ValueError(f"objects: reference cycle at {path or '<root>'!r}")
            self._active.add(id(obj))
            try:
                return self._container(obj, path)
            finally:
                self._active.discard(id(obj))
        raise TypeError(f"objects: cannot store a {t.__module__}.{t.__qualname__} at "
                        f"{path or '<root>'!r}; convert it to dict/list/tuple/str/int/"
                        f"float/bool/None, a tensor or a numpy array first")

    def _container(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is list:
            # The token ledger's count lists and version histories (lists of lists of
            # ints), encoded at every snapshot: copied whole, no path per element.
            copied = _copy_plain(obj, _PLAIN_DEPTH)
            if copied is not None:
                return copied
            return [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]
        if t is tuple:  # Python's RNG state holds a tuple of 625 ints
            items = _copy_plain(obj, _PLAIN_DEPTH)
            if items is None:
                items = [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]
            return {_TAG: "tuple", "items": items}
        plain = t is dict and all(type(k) is str for k in obj) and _TAG not in obj
        if plain:
            return {k: self.encode(v, _join(path, k)) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            key_path = _join(path, k)
            if isinstance(k, (torch.Tensor, np.ndarray)):
                raise TypeError(f"objects: a tensor cannot be a dict key (at {key_path!r})")
            items.append([self.encode(k, key_path + "#key"), self.encode(v, key_path)])
        return {_TAG: "odict" if t is collections.OrderedDict else "dict", "items": items}

    def _tensor(self, tensor: torch.Tensor, path: str) -> Dict[str, Any]:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"objects: tensor at {path!r} is {tensor.layout}"
                            f"{' quantized' if tensor.is_quantized else ''}; only dense "
                            f"tensors can be stored")
        try:
            name = dtype_name(tensor.dtype)
        except ValueError as err:
            raise TypeError(f"objects: tensor at {path!r}: {err}") from None
        seen = self._by_id.get(id(tensor))
        if seen is not None and seen[1] is tensor:
            key = seen[0]  # the same tensor object twice: store once, decode to one object
        else:
            key = self._key(path)
            # A copy: the state is captured now, not when a background writer gets to it,
            # and overlapping views (which safetensors refuses) become separate buffers.
            self.tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
            self._by_id[id(tensor)] = (key, tensor)
        node = {_TAG: "tensor", "key": key, "dtype": name, "shape": list(tensor.shape)}
        if tensor.requires_grad:
            node["requires_grad"] = True
        return node

    def _ndarray(self, array: np.ndarray, path: str) -> Dict[str, Any]:
        if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
            raise TypeError(f"objects: numpy array at {path!r} has dtype {array.dtype}; "
                            f"object and structured arrays cannot be stored")
        key = self._key(path)
        # Raw bytes + the dtype string (with byte order) make the round trip exact for
        # every plain dtype, including ones torch lacks (uint32 on old torch, '>f8', 'U7').
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy()
        self.tensors[key] = torch.from_numpy(raw)
        return {_TAG: "ndarray", "key": key, "dtype": array.dtype.str,
                "shape": list(array.shape)}

    def _np_scalar(self, value: np.generic, path: str) -> Dict[str, Any]:
        if value.dtype.kind not in _NUMPY_KINDS or value.dtype.fields is not None:
            raise TypeError(f"objects: numpy scalar at {path!r} has dtype {value.dtype}; "
                            f"it cannot be stored")
        return {_TAG: "npscalar", "dtype": value.dtype.str, "hex": value.tobytes().hex()}


_PLAIN_DEPTH = 4
"""Nesting of lists :func:`_copy_plain` copies whole; deeper ones take the general path
(which also catches a list that contains itself)."""


def _copy_plain(items, depth: int) -> Optional[list]:
    """A list copy of ``items`` (a list or tuple) if it holds only values that encode as
    themselves (None, bool, int, str, finite floats) and lists of them, nested at most
    ``depth`` deep; else None."""
    out = []
    for v in items:
        t = type(v)
        if t is list:
            if depth <= 1:
                return None
            v = _copy_plain(v, depth - 1)
            if v is None:
                return None
        elif not (v is None or t is int or t is bool or t is str
                  or (t is float and math.isfinite(v))):
            return None
        out.append(v)
    return out


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def encode(obj: Any, prefix: str = TENSOR_PREFIX) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-compatible tree and a dict of tensors.

    Args:
        obj: the state to store (see the module docstring for the supported types).
        prefix: prefix of the tensor keys (default ``obj/``).

    Returns:
        ``(tree, tensors)``: ``tree`` is made of dict/list/str/int/float/bool/None only
        and is written with :func:`write_objects_file`; ``tensors`` maps keys
        ``<prefix><path>`` to contiguous CPU tensors (copies, so later in-place updates
        of the live state do not leak into the checkpoint), to be written into the
        safetensors file that :func:`write_objects_file` names.

    Raises:
        TypeError: an unsupported type, naming its path (``'rng/numpy/1'``).
        ValueError: a reference cycle.
    """
    enc = _Encoder(prefix)
    tree = enc.encode(obj, "")
    return tree, enc.tensors


# ----------------------------------------------------------------------------- decode

def decode(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild what :func:`encode` split.

    Args:
        tree: the JSON tree (from :func:`read_objects_file`).
        tensors: key -> tensor, at least every key in :func:`tensor_keys` ``(tree)``.
            They are used as given (no copy); a key referenced twice decodes to the same
            object, as it was when encoded.

    Raises:
        ValueError: a malformed tree, a missing tensor, a tensor whose dtype/shape is
            not the one recorded (the message names the key), or a tree nested deeper
            than this recursive decoder can follow (RecursionError escaped a load).
    """
    try:
        return _decode(tree, tensors, "")
    except RecursionError:
        raise ValueError("objects: the tree is nested too deeply to decode") from None


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, _join(path, i)) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        raise ValueError(f"objects: unexpected JSON value {type(node).__name__} at {path!r}")
    if _TAG not in node:
        return {k: _decode(v, tensors, _join(path, k)) for k, v in node.items()}
    kind = node[_TAG]
    try:
        if kind == "tuple":
            return tuple(_decode(v, tensors, _join(path, i))
                         for i, v in enumerate(node["items"]))
        if kind in ("dict", "odict"):
            out = {} if kind == "dict" else collections.OrderedDict()
            for k, v in node["items"]:
                out[_decode(k, tensors, path + "#key")] = _decode(v, tensors, _join(path, k))
            return out
        if kind == "float":
            value = float(node["value"])
            if math.isfinite(value):
                raise ValueError("finite value in a non-finite float node")
            return value
        if kind == "bytes":
            return bytes.fromhex(node["hex"])
        if kind == "torch.Size":
            return torch.Size(int(v) for v in node["items"])
        if kind == "torch.dtype":
            return dtype_from_name(node["name"])
        if kind == "npscalar":
            dtype = _np_dtype(node["dtype"])
            return np.frombuffer(bytes.fromhex(node["hex"]), dtype=dtype)[0]
        if kind == "tensor":
            return _decode_tensor(node, tensors)
        if kind == "ndarray":
            return _decode_ndarray(node, tensors)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"objects: malformed {kind!r} node at {path or '<root>'!r}: "
                         f"{err}") from None
    raise ValueError(f"objects: unknown node type {kind!r} at {path or '<root>'!r}")


def _lookup(key: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise ValueError(f"tensor {key!r} is missing") from None


def _decode_tensor(node: Dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tensor = _lookup(node["key"], tensors)
    dtype = dtype_from_name(node["dtype"])
    if tensor.dtype != dtype or list(tensor.shape) != list(node["shape"]):
        raise ValueError(f"tensor {node['key']!r} is {tensor.dtype} {list(tensor.shape)}, "
                         f"recorded {dtype} {node['shape']}")
    if node.get("requires_grad"):
        tensor.requires_grad_(True)
    return tensor


def _np_dtype(text: str) -> np.dtype:
    dtype = np.dtype(text)
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise ValueError(f"numpy dtype {text!r} is not allowed")
    return dtype


def _decode_ndarray(node: Dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
    raw = _lookup(node["key"], tensors)
    dtype = _np_dtype(node["dtype"])
    shape = [int(s) for s in node["shape"]]
    count = math.prod(shape)
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != count * dtype.itemsize:
        raise ValueError(f"tensor {node['key']!r} holds {raw.numel()} {raw.dtype} elements, "
                         f"expected {count * dtype.itemsize} uint8 bytes")
    return np.frombuffer(raw.numpy().tobytes(), dtype=dtype).reshape(shape).copy()


def tensor_keys(tree: Any) -> List[str]:
    """Every tensor key a tree references (sorted, unique): what a reader must load."""
    found = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(_TAG) in ("tensor", "ndarray") and isinstance(node.get("key"), str):
                found.add(node["key"])
            for v in node.values():
                walk(v)

    walk(tree)
    return sorted(found)


# ------------------------------------------------------------------------------ files

@dataclass
class ObjectsFile:
    """Contents of ``objects.json``."""

    tree: Any
    """The encoded tree (pass to :func:`decode`)."""
    tensor_file: Optional[str]
    """File (relative to the checkpoint directory) holding the tree's tensors; None when
    the tree references none."""


def write_objects_file(ckpt_dir: str, tree: Any, tensor_file: Optional[str]) -> FileRecord:
    """Write ``<ckpt_dir>/objects.json`` atomically (rank 0, before the manifest).

    Args:
        ckpt_dir: the checkpoint's tag directory.
        tree: from :func:`encode`.
        tensor_file: name, relative to ``ckpt_dir``, of the safetensors file into which
            the caller wrote encode's tensors (normally ``rank00000.safetensors``); None
            only if the tree references no tensors.

    Returns:
        The file's :class:`~deepspeed_ext.format.storage.FileRecord`, for the manifest's
        ``files`` (as ``objects.json``, rank 0) so that verification covers it.

    Raises:
        ValueError: the tree references tensors but ``tensor_file`` is None.
    """
    if tensor_file is None and tensor_keys(tree):
        raise ValueError("objects: the tree references tensors; name the file holding them")
    doc = {"format": OBJECTS_FORMAT, "version": OBJECTS_VERSION,
           "tensor_file": tensor_file, "tree": tree}
    return atomic_write_json(os.path.join(ckpt_dir, OBJECTS_FILE), doc)


def read_objects_file(ckpt_dir: str) -> ObjectsFile:
    """Read ``<ckpt_dir>/objects.json``.

    Raises:
        CheckpointError: naming the file, when it is missing, not JSON or not ours.
    """
    path = os.path.join(ckpt_dir, OBJECTS_FILE)
    try:
        doc = read_json(path, OBJECTS_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    if not isinstance(doc, dict) or doc.get("format") != OBJECTS_FORMAT:
        raise CheckpointError(f"{path}: not a MoC objects file (format "
                              f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != OBJECTS_VERSION:
        raise CheckpointError(f"{path}: unsupported version {doc.get('version')!r} "
                              f"(this code reads {OBJECTS_VERSION})")
    tensor_file = doc.get("tensor_file")
    if tensor_file is not None and (not isinstance(tensor_file, str)
                                    or os.path.basename(tensor_file) != tensor_file):
        raise CheckpointError(f"{path}: bad tensor_file {tensor_file!r}")
    try:
        # The tree is walked recursively (tensor_keys, decode): nesting that parsed here
        # raised RecursionError deeper in a load's stack.
        check_depth(doc.get("tree"), JSON_MAX_DEPTH)
    except ValueError as err:
        raise CheckpointError(f"{path}: the tree is {err}") from None
    return ObjectsFile(tree=doc.get("tree"), tensor_file=tensor_file)
