"""What a MoC checkpoint holds: the manifest, the expert index, ``latest``, verification
and retention.

On disk::

    <save_dir>/latest                        tag of the newest complete checkpoint
    <save_dir>/<tag>/rank00003.safetensors   fragments rank 3 wrote (key "name|kind|offset")
    <save_dir>/<tag>/objects.json            non-tensor state (deepspeed_ext.objects), rank 0
    <save_dir>/<tag>/manifest.json           written LAST by rank 0; presence = complete

A fragment is elements ``[offset, offset + length)`` of the *flattened* global tensor
``name`` of kind ``kind`` (``fp32`` master weights, ``exp_avg``, ``exp_avg_sq``, ...).
A checkpoint holds every non-expert tensor and the tensors of the experts it saved
(Partial Experts Checkpointing); its ``expert_index`` says, for every expert of every
MoE layer, which checkpoint holds that expert's newest version, so loading a tag needs
that tag plus the older tags its index names (:func:`referenced_tags`). With the paper's
one-part PEC variants (``--moc-pec-scope w`` or ``o``) an expert's weights and its
optimizer state can have different newest versions; the index then names both.

"layer" in an expert index is the MoE layer's ordinal (0 .. num_moe_layers-1), not the
transformer layer number; "expert" is the global expert index within that layer.

Save, multi-rank call order (the orchestration owns the collectives)::

    rank 0:     tag_dir = prepare_checkpoint_dir(save_dir, tag)   # empties a crashed save; claims it
    all:        barrier
    each rank:  specs = [FragmentSpec(...), ...]                    # from the save plan
                tensors = {spec.key: cpu_snapshot_view, ...}
                rank 0 also: tree, obj = objects.encode(state); tensors.update(obj)
                record = write_fragment_file(os.path.join(tag_dir, rank_file_name(rank)),
                                             tensors)               # returns once fsynced
                report = RankReport.from_record(rank, rank_file_name(rank), record, specs)
    all:        gather report.to_json() (or the rank's error) to rank 0
    rank 0:     if any rank failed: stop (no manifest = incomplete; retention cleans it)
                obj_record = objects.write_objects_file(tag_dir, tree, rank_file_name(0))
                index = build_expert_index(previous_manifest, saved_experts, step, tag,
                                           num_moe_layers, num_experts)
                manifest = assemble_manifest(
                    tag, step, world_size, layout, [RankReport.from_json(r) for r in gathered],
                    index, extra_files={OBJECTS_FILE: FileEntry.from_record(obj_record, 0)})
                write_manifest(tag_dir, manifest)                   # the commit point
                advance_latest(save_dir, tag, attempt_started, step)  # not over later work
                retain_unless_superseded(save_dir, keep, attempt_started)  # under the lock
    all:        broadcast rank 0's outcome

Load: :func:`deepspeed_ext.reader.find_loadable` on one rank, broadcast the tag, then
:class:`deepspeed_ext.reader.CheckpointReader` on every rank.
"""

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import struct
import threading
import time
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from deepspeed_ext import fs
from deepspeed_ext.objects import OBJECTS_FILE, read_objects_file, tensor_keys
from deepspeed_ext.storage import (SMALL_RECORD_MAX_BYTES, CheckpointError, FileRecord,
                                   FragmentReader, atomic_write_json, atomic_write_text,
                                   check_depth, check_file, dtype_from_name, ensure_dir,
                                   fsync_dir, read_json)

FORMAT = "moc-ckpt"
VERSION = 2
"""Version 2 added per-part expert versions (``expert_index[...].optim``)."""
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
MANIFEST_MAX_BYTES = 256 << 20
"""Largest manifest read: a manifest of a trillion-parameter model's fragments stays far
below it; a bigger file is damage (or not ours), and reading it whole, then parsing it
(several times its size in memory), could take the node's memory with it."""
LATEST_FILE = "latest"
LATEST_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest ``latest`` read (it holds one tag): one linked to /dev/zero was read forever."""
ATTEMPT_FILE = "moc-attempt.json"
"""``{"attempt_started": t}`` of the newest job attempt training into a save directory
(rank 0 writes it before reading ``latest`` to load): an earlier attempt's committer that
finishes later leaves ``latest`` and retention to it (:func:`later_attempt_started`)."""
ATTEMPT_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest :data:`ATTEMPT_FILE` read (it holds one number)."""
TRASH_PREFIX = ".moc-trash."
SET_ASIDE_PREFIX = ".moc-set-aside."
"""Directories being deleted are renamed to this prefix first (see :func:`remove_checkpoint`)."""

_TAG_DIR_ENTRY = re.compile(
    r"^(rank\d{5,}\.safetensors|rank\d{5,}\.report\.json|commit\.failed\.json|commit\.claim|"
    r"objects\.json|objects\.safetensors|manifest\.json)(\.tmp\.\d+)?$")
"""Names MoC writes into a tag directory. A manifest-less directory is deleted by
retention only if it holds nothing else, so a user's unrelated directory inside
save_dir (tensorboard/, a copied dataset) is never removed."""


# ---------------------------------------------------------------------------- naming

def tensor_key(name: str, kind: str) -> str:
    """Manifest key of a global tensor: ``"name|kind"``."""
    _check_part(name, "tensor name")
    _check_part(kind, "tensor kind")
    return f"{name}|{kind}"


def split_tensor_key(key: str) -> Tuple[str, str]:
    """Inverse of :func:`tensor_key`."""
    parts = key.split("|")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"bad tensor key {key!r}; expected 'name|kind'")
    return parts[0], parts[1]


def fragment_key(name: str, kind: str, offset: int) -> str:
    """safetensors key of a fragment: ``"name|kind|offset"``."""
    return f"{tensor_key(name, kind)}|{int(offset)}"


def expert_key(layer: int, expert: int) -> str:
    """expert_index key: ``"layer/expert"``."""
    return f"{int(layer)}/{int(expert)}"


def parse_expert_key(key: str) -> Tuple[int, int]:
    """Inverse of :func:`expert_key`."""
    match = re.fullmatch(r"(\d+)/(\d+)", key)
    if not match:
        raise ValueError(f"bad expert key {key!r}; expected 'layer/expert'")
    return int(match.group(1)), int(match.group(2))


def rank_file_name(rank: int) -> str:
    """File a rank writes its fragments to: ``rank00003.safetensors``."""
    return f"rank{int(rank):05d}.safetensors"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory, else raise ValueError.

    A tag is one path component: a ``latest`` file or an expert index saying
    ``../elsewhere`` must not make a reader (or retention!) leave ``save_dir``.
    """
    if (not isinstance(tag, str) or not tag or tag in (".", "..", LATEST_FILE)
            or tag.startswith(".") or "/" in tag or "\\" in tag or "\0" in tag
            or tag != tag.strip()):
        raise ValueError(f"bad checkpoint tag {tag!r}: a tag is one directory name, not "
                         f"starting with '.', not {LATEST_FILE!r}")
    return tag


def _check_part(text: str, what: str) -> None:
    if not isinstance(text, str) or not text or "|" in text:
        raise ValueError(f"bad {what} {text!r}: must be a non-empty string without '|'")


def _plain_file_name(name: str) -> bool:
    # A NUL made os.stat raise ValueError out of verification and the load's search.
    return (isinstance(name, str) and name not in ("", ".", "..")
            and os.path.basename(name) == name and "\\" not in name and "\0" not in name)


# ----------------------------------------------------------------------- dataclasses

@dataclass
class FileEntry:
    """A file of the checkpoint as its writer recorded it."""

    nbytes: int
    """Size in bytes."""
    sha256: str
    """Hex SHA-256 of the file."""
    rank: int
    """Rank that wrote it."""

    @classmethod
    def from_record(cls, record: FileRecord, rank: int) -> "FileEntry":
        """From what :func:`~deepspeed_ext.storage.write_fragment_file` or
        :func:`~deepspeed_ext.objects.write_objects_file` returned."""
        return cls(nbytes=record.nbytes, sha256=record.sha256, rank=rank)

    def to_json(self) -> Dict[str, Any]:
        return {"sha256": self.sha256, "nbytes": self.nbytes, "rank": self.rank}


@dataclass
class Fragment:
    """Elements ``[offset, offset + length)`` of a flattened tensor, stored in ``file``."""

    file: str
    """File name relative to the checkpoint directory (``rank00001.safetensors``)."""
    key: str
    """safetensors key (:func:`fragment_key`)."""
    offset: int
    """First element of the flattened global tensor."""
    length: int
    """Number of elements (> 0)."""

    def to_json(self) -> Dict[str, Any]:
        return {"file": self.file, "key": self.key, "offset": self.offset,
                "length": self.length}


@dataclass
class TensorEntry:
    """One global tensor (one name and kind) this checkpoint holds."""

    shape: List[int]
    """Global (unsharded) shape."""
    dtype: str
    """dtype name (``float32``, ``bfloat16``; see :func:`deepspeed_ext.storage.dtype_name`)."""
    expert: Optional[Tuple[int, int]]
    """``(moe_layer, expert)`` for an expert's tensor, None for non-expert state."""
    fragments: List[Fragment] = field(default_factory=list)
    """Where its elements are, sorted by offset; together exactly ``[0, numel)``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> Dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype,
                "expert": list(self.expert) if self.expert is not None else None,
                "fragments": [f.to_json() for f in self.fragments]}


@dataclass
class ExpertVersion:
    """Where the newest saved version of one expert lives.

    ``step``/``tag`` locate its weights and, unless ``optim_tag`` is set, its optimizer
    state too; the one-part PEC variants give the optimizer state its own version.
    """

    step: int
    """Training step of the checkpoint holding the expert's weights."""
    tag: str
    """Its tag (directory name)."""
    optim_step: Optional[int] = None
    """Step of the checkpoint holding its optimizer state, if not ``step``."""
    optim_tag: Optional[str] = None
    """Tag of that checkpoint, if not ``tag``."""

    @classmethod
    def of_parts(cls, weights: Tuple[int, str], optim: Tuple[int, str]) -> "ExpertVersion":
        """The version whose weights live at ``weights`` and optimizer state at ``optim``
        (each ``(step, tag)``); one location when both are the same."""
        if tuple(weights) == tuple(optim):
            return cls(weights[0], weights[1])
        return cls(weights[0], weights[1], optim[0], optim[1])

    def part(self, part: str) -> Tuple[int, str]:
        """``(step, tag)`` of the part ``"w"`` (weights) or ``"o"`` (optimizer state)."""
        if part == "o" and self.optim_tag is not None:
            return self.optim_step, self.optim_tag
        return self.step, self.tag

    @property
    def oldest_step(self) -> int:
        """Step of the older part: the step up to which the whole expert is saved."""
        return min(self.step, self.part("o")[0])

    def tags(self) -> Set[str]:
        """The checkpoints holding this expert's parts."""
        return {self.tag, self.part("o")[1]}

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"step": self.step, "tag": self.tag}
        if self.optim_tag is not None:
            out["optim"] = {"step": self.optim_step, "tag": self.optim_tag}
        return out


@dataclass
class Manifest:
    """``manifest.json``: everything needed to find and check a checkpoint's bytes."""

    tag: str
    """Directory name of this checkpoint."""
    step: int
    """Training step (optimizer steps taken) the state belongs to."""
    world_size: int
    """Ranks that wrote it (loading may use another number)."""
    layout: Dict[str, Any] = field(default_factory=dict)
    """Free-form description of the parallel layout and model (ep_size, zero_stage,
    dtype, num_moe_layers, num_experts, ...). When both ``num_moe_layers`` and
    ``num_experts`` are present, verification checks the expert index is complete."""
    files: Dict[str, FileEntry] = field(default_factory=dict)
    """Every file of this checkpoint (relative name -> entry), objects.json included."""
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)
    """``"name|kind"`` -> entry, for what THIS checkpoint holds."""
    expert_index: Dict[str, ExpertVersion] = field(default_factory=dict)
    """``"layer/expert"`` -> newest saved version, for every expert of every MoE layer."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Free-form, for the orchestration (PLT counters, K_pec, timings, ...)."""
    format: str = FORMAT
    version: int = VERSION

    def held_experts(self) -> Set[Tuple[int, int]]:
        """Experts whose tensors this checkpoint holds."""
        return {e.expert for e in self.tensors.values() if e.expert is not None}

    def held_parts(self) -> Set[Tuple[Tuple[int, int], str]]:
        """``((layer, expert), part)`` for every expert part (``"w"``/``"o"``) held here."""
        from deepspeed_ext.pec import part_of_kind
        return {(e.expert, part_of_kind(_split_or_raw(k)[1]))
                for k, e in self.tensors.items() if e.expert is not None}

    def expert_versions(self) -> Dict[Tuple[int, int], ExpertVersion]:
        """The expert index keyed by ``(layer, expert)``."""
        return {parse_expert_key(k): v for k, v in self.expert_index.items()}

    def to_json(self) -> Dict[str, Any]:
        return {
            "format": self.format, "version": self.version, "tag": self.tag,
            "step": self.step, "world_size": self.world_size, "layout": self.layout,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
            "expert_index": {k: v.to_json() for k, v in
                             sorted(self.expert_index.items(),
                                    key=lambda kv: parse_expert_key(kv[0]))},
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = MANIFEST_FILE) -> "Manifest":
        """Parse and type-check a manifest; ValueError naming ``source`` and the field."""
        return _parse_manifest(data, source)

    def validate(self) -> List[str]:
        """Problems of the manifest on its own (no file system access): bad names,
        fragments naming unknown files, fragments that do not cover each tensor exactly
        once, and an expert index inconsistent with the held experts."""
        where = self.tag
        problems = []
        if self.format != FORMAT or self.version not in READABLE_VERSIONS:
            problems.append(f"{where}: format {self.format!r} version {self.version!r}, "
                            f"expected {FORMAT!r} {VERSION}")
        try:
            check_tag(self.tag)
        except ValueError as err:
            problems.append(str(err))
        if self.world_size < 1 or self.step < 0:
            problems.append(f"{where}: bad world_size {self.world_size} or step {self.step}")
        for name in self.files:
            if not _plain_file_name(name):
                problems.append(f"{where}: file name {name!r} is not a plain file name")
        for tkey, entry in self.tensors.items():
            problems.extend(tensor_problems(where, tkey, entry, self.files))
        for ekey, version in self.expert_index.items():
            try:
                parse_expert_key(ekey)
                for t in version.tags():
                    check_tag(t)
            except ValueError as err:
                problems.append(f"{where}: expert_index[{ekey!r}]: {err}")
                continue
            if max(version.step, version.part("o")[0]) > self.step:
                problems.append(f"{where}: expert_index[{ekey!r}] names a step newer than "
                                f"this checkpoint's step {self.step}: {version.to_json()}")
        held = self.held_experts()
        for (layer, expert), part in sorted(self.held_parts()):
            version = self.expert_index.get(expert_key(layer, expert))
            # A held part the index sends elsewhere would be loaded from an older version.
            if version is None or version.part(part) != (self.step, self.tag):
                problems.append(f"{where}: holds expert {expert_key(layer, expert)} "
                                f"({_PART_NAMES[part]}) but its expert_index entry is "
                                f"{version and version.to_json()}")
        held_parts = self.held_parts()
        # A checkpoint saved before the first optimizer step holds no moments at all.
        has_optim = any(part == "o" for _, part in held_parts)
        for ekey, version in self.expert_index.items():
            if self.tag in version.tags() and _safe_expert(ekey) not in held:
                problems.append(f"{where}: expert_index[{ekey!r}] points to this checkpoint, "
                                f"which holds no tensor of that expert")
                continue
            for part in ("w", "o") if has_optim else ("w",):
                if (version.part(part)[1] == self.tag
                        and (_safe_expert(ekey), part) not in held_parts):
                    problems.append(f"{where}: expert_index[{ekey!r}] puts its "
                                    f"{_PART_NAMES[part]} in this checkpoint, which holds none")
        problems.extend(self._completeness_problems())
        return problems

    def _completeness_problems(self) -> List[str]:
        """Whether the expert index names every expert of the layout's declared
        ``num_moe_layers`` x ``num_experts``.

        Counted from the keys the index lists, never by walking the declared product: a
        crafted layout declaring 10^9 x 10^9 experts made the walk spin for hours and
        fill memory with the missing keys, at every restart, instead of skipping the
        checkpoint. The cost is one step per index entry, plus the few missing keys named.
        """
        where = self.tag
        layers, experts = self.layout.get("num_moe_layers"), self.layout.get("num_experts")
        if any(v is not None and not _is_count(v) for v in (layers, experts)):
            return [f"{where}: layout num_moe_layers {layers!r} / num_experts {experts!r}: "
                    f"expected non-negative ints"]
        if layers is None or experts is None:
            return []
        present = set()
        for ekey in self.expert_index:
            expert = _safe_expert(ekey)
            # A spelling expert_key never makes ("00/1") is not found by the loaders.
            if (expert is not None and expert[0] < layers and expert[1] < experts
                    and expert_key(*expert) == ekey):
                present.add(expert)
        missing = layers * experts - len(present)
        if not missing:
            return []
        first = []
        for layer in range(layers):  # ends after len(present) + 5 steps at the most
            for expert in range(experts):
                if (layer, expert) not in present:
                    first.append(expert_key(layer, expert))
                    if len(first) == 5:
                        break
            if len(first) == 5:
                break
        return [f"{where}: expert_index lacks {missing} of {layers * experts} experts "
                f"(first: {', '.join(first)})"]


_PART_NAMES = {"w": "weights", "o": "optimizer state"}


def _is_count(value: Any) -> bool:
    """A non-negative int read from JSON (``true`` is no count)."""
    return type(value) is int and value >= 0


def _safe_expert(ekey: str) -> Optional[Tuple[int, int]]:
    try:
        return parse_expert_key(ekey)
    except ValueError:
        return None


def tensor_problems(where: str, tkey: str, entry: TensorEntry,
                    files: Mapping[str, FileEntry]) -> List[str]:
    """Problems of one tensor entry: its key, dtype, fragment keys and files, and whether
    its fragments cover ``[0, numel)`` exactly once. ``where`` prefixes each line."""
    problems = []
    label = f"{where}: tensor {tkey}"
    try:
        name, kind = split_tensor_key(tkey)
        dtype_from_name(entry.dtype)
    except ValueError as err:
        return [f"{label}: {err}"]
    if any((not isinstance(s, int)) or s < 0 for s in entry.shape):
        return [f"{label}: bad shape {entry.shape}"]
    for frag in entry.fragments:
        if frag.file not in files:
            problems.append(f"{label}: fragment {frag.key!r} is in {frag.file!r}, which is "
                            f"not among the checkpoint's files")
        if frag.key != fragment_key(name, kind, frag.offset):
            problems.append(f"{label}: fragment key {frag.key!r} does not match its offset "
                            f"{frag.offset}")
    problems.extend(f"{label}: {p}" for p in coverage_problems(entry.fragments, entry.numel))
    return problems


def coverage_problems(fragments: Sequence[Fragment], numel: int) -> List[str]:
    """How ``fragments`` fail to cover ``[0, numel)`` exactly once (empty list if they do).

    Gaps would load uninitialised memory as weights; overlaps mean two ranks wrote the
    same elements, which only happens when the save plan is wrong.
    """
    problems = []
    pos = 0
    for frag in sorted(fragments, key=lambda f: (f.offset, f.length)):
        if frag.length <= 0 or frag.offset < 0:
            problems.append(f"fragment {frag.key!r} has offset {frag.offset} length "
                            f"{frag.length}")
            continue
        if frag.offset > pos:
            problems.append(f"elements [{pos}, {frag.offset}) are in no fragment (gap)")
        elif frag.offset < pos:
            problems.append(f"elements [{frag.offset}, {min(pos, frag.offset + frag.length)}) "
                            f"are in more than one fragment (overlap)")
        pos = max(pos, frag.offset + frag.length)
    if pos < numel:
        problems.append(f"elements [{pos}, {numel}) are in no fragment (gap)")
    elif pos > numel:
        problems.append(f"fragments reach element {pos}, past the tensor's {numel} elements")
    return problems


# --------------------------------------------------------------------------- parsing

def _get(data: Mapping[str, Any], key: str, types: Any, where: str) -> Any:
    """``data[key]`` checked against ``types``; ValueError naming the field otherwise.

    ``bool`` is refused where an int is expected (JSON ``true`` is no step number).
    """
    # JSON gives plain dicts; typing.Mapping's isinstance is slow enough to matter in a
    # manifest of thousands of fields, read at every recovery.
    if (type(data) is not dict and not isinstance(data, abc.Mapping)) or key not in data:
        raise ValueError(f"{where}: missing field {key!r}")
    value = data[key]
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (type(value) is bool and bool not in types):
        expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{where}.{key}: expected {expected}, got {type(value).__name__}")
    return value


def _parse_manifest(data: Any, source: str) -> Manifest:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a JSON object")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ValueError(f"{source}: format is {fmt!r}, not {FORMAT!r} (not a MoC checkpoint "
                         f"manifest)")
    version = data.get("version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{source}: version {version!r} is not supported (this code reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))})")
    files = {}
    for name, f in _get(data, "files", dict, source).items():
        w = f"{source}: files[{name!r}]"
        files[name] = FileEntry(nbytes=_get(f, "nbytes", int, w), sha256=_get(f, "sha256", str, w),
                                rank=_get(f, "rank", int, w))
    tensors = {}
    for tkey, t in _get(data, "tensors", dict, source).items():
        w = f"{source}: tensors[{tkey!r}]"
        expert = _get(t, "expert", (list, type(None)), w)
        if expert is not None:
            if len(expert) != 2 or not all(type(x) is int for x in expert):
                raise ValueError(f"{w}.expert: expected [layer, expert] or null, got {expert}")
            expert = (expert[0], expert[1])
        shape = _get(t, "shape", list, w)
        if not all(type(s) is int for s in shape):
            raise ValueError(f"{w}.shape: expected a list of ints, got {shape}")
        frags = []
        for i, fr in enumerate(_get(t, "fragments", list, w)):
            fw = f"{w}.fragments[{i}]"
            frags.append(Fragment(file=_get(fr, "file", str, fw), key=_get(fr, "key", str, fw),
                                  offset=_get(fr, "offset", int, fw),
                                  length=_get(fr, "length", int, fw)))
        tensors[tkey] = TensorEntry(shape=shape, dtype=_get(t, "dtype", str, w), expert=expert,
                                    fragments=sorted(frags, key=lambda f: f.offset))
    index = {}
    for ekey, v in _get(data, "expert_index", dict, source).items():
        w = f"{source}: expert_index[{ekey!r}]"
        optim = v.get("optim") if isinstance(v, dict) else None
        if optim is not None and not isinstance(optim, dict):
            raise ValueError(f"{w}.optim: expected an object, got {type(optim).__name__}")
        index[ekey] = ExpertVersion(
            step=_get(v, "step", int, w), tag=_get(v, "tag", str, w),
            optim_step=_get(optim, "step", int, w + ".optim") if optim is not None else None,
            optim_tag=_get(optim, "tag", str, w + ".optim") if optim is not None else None)
    layout, extra = _get(data, "layout", dict, source), _get(data, "extra", dict, source)
    for name, free in (("layout", layout), ("extra", extra)):
        try:
            # Free-form: nesting that parsed raised RecursionError later, deeper in a
            # load's stack (the checksum's json.dumps, `moc-ckpt inspect`).
            check_depth(free)
        except ValueError as err:
            raise ValueError(f"{source}: {name} is {err}") from None
    return Manifest(tag=_get(data, "tag", str, source), step=_get(data, "step", int, source),
                    world_size=_get(data, "world_size", int, source),
                    layout=layout, files=files, tensors=tensors,
                    expert_index=index, extra=extra, format=fmt, version=version)


# ------------------------------------------------------------------ building (save)

@dataclass(frozen=True)
class FragmentSpec:
    """One fragment a rank writes, with the global facts of its tensor.

    Built by each rank from the save plan; ``key`` is the safetensors key to write the
    data under.
    """

    name: str
    """Global tensor name (the parameter's name, experts by global index)."""
    kind: str
    """``fp32``, ``exp_avg``, ``exp_avg_sq``, ..."""
    offset: int
    """First element within the flattened global tensor."""
    length: int
    """Number of elements (> 0)."""
    shape: Tuple[int, ...]
    """Global shape of the tensor."""
    dtype: str
    """dtype name as stored (:func:`deepspeed_ext.storage.dtype_name`)."""
    expert: Optional[Tuple[int, int]] = None
    """``(moe_layer, expert)`` for an expert's tensor."""

    def __post_init__(self):
        _check_part(self.name, "tensor name")
        _check_part(self.kind, "tensor kind")
        dtype_from_name(self.dtype)
        numel = math.prod(self.shape)
        if self.offset < 0 or self.length <= 0 or self.offset + self.length > numel:
            raise ValueError(f"fragment {self.name}|{self.kind}: [{self.offset}, "
                             f"{self.offset + self.length}) is not a non-empty range of its "
                             f"{numel} elements")

    @property
    def key(self) -> str:
        return fragment_key(self.name, self.kind, self.offset)

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "offset": self.offset,
                "length": self.length, "shape": list(self.shape), "dtype": self.dtype,
                "expert": list(self.expert) if self.expert is not None else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "fragment") -> "FragmentSpec":
        """Inverse of :meth:`to_json`; ValueError naming the field for anything else (a
        report file's payload is read back from storage: a wrong shape raised
        KeyError/TypeError out of the committer)."""
        shape = _get(d, "shape", list, where)
        if not all(type(s) is int for s in shape):
            raise ValueError(f"{where}.shape: expected a list of ints, got {shape!r}")
        expert = d.get("expert") if isinstance(d, dict) else None
        if expert is not None and (not isinstance(expert, list) or len(expert) != 2
                                   or not all(type(x) is int for x in expert)):
            raise ValueError(f"{where}.expert: expected [layer, expert] or null, got {expert!r}")
        return cls(name=_get(d, "name", str, where), kind=_get(d, "kind", str, where),
                   offset=_get(d, "offset", int, where), length=_get(d, "length", int, where),
                   shape=tuple(shape), dtype=_get(d, "dtype", str, where),
                   expert=tuple(expert) if expert is not None else None)


@dataclass
class RankReport:
    """What one rank wrote, sent to rank 0 (as :meth:`to_json`, plain data) after its
    file is published."""

    rank: int
    file: str
    """File name relative to the tag directory (:func:`rank_file_name`)."""
    nbytes: int
    sha256: str
    fragments: List[FragmentSpec] = field(default_factory=list)

    @classmethod
    def from_record(cls, rank: int, file: str, record: FileRecord,
                    fragments: Iterable[FragmentSpec]) -> "RankReport":
        """Report of a file :func:`~deepspeed_ext.storage.write_fragment_file` published."""
        return cls(rank=rank, file=file, nbytes=record.nbytes, sha256=record.sha256,
                   fragments=list(fragments))

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "nbytes": self.nbytes,
                "sha256": self.sha256, "fragments": [f.to_json() for f in self.fragments]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "report") -> "RankReport":
        """Inverse of :meth:`to_json`; ValueError naming the field for anything else."""
        return cls(rank=_get(d, "rank", int, where), file=_get(d, "file", str, where),
                   nbytes=_get(d, "nbytes", int, where), sha256=_get(d, "sha256", str, where),
                   fragments=[FragmentSpec.from_json(f, f"{where}.fragments[{i}]")
                              for i, f in enumerate(_get(d, "fragments", list, where))])


def assemble_manifest(tag: str, step: int, world_size: int, layout: Mapping[str, Any],
                      reports: Iterable[RankReport], expert_index: Mapping[str, ExpertVersion],
                      extra_files: Optional[Mapping[str, FileEntry]] = None,
                      extra: Optional[Mapping[str, Any]] = None) -> Manifest:
    """Merge every rank's report into a manifest (rank 0, after all ranks succeeded).

    Args:
        tag, step, world_size, layout: as in :class:`Manifest`.
        reports: one :class:`RankReport` per rank that wrote a file.
        expert_index: from :func:`build_expert_index`.
        extra_files: further files of the checkpoint, e.g. ``{"objects.json":
            FileEntry.from_record(record, rank=0)}``.
        extra: free-form data stored in the manifest.

    Raises:
        ValueError: listing every problem: two ranks describing one tensor differently,
            a file reported twice, fragments that leave a gap or overlap, experts held
            but not indexed here. Nothing should be committed then: the plan is wrong.
    """
    check_tag(tag)
    files: Dict[str, FileEntry] = {}
    tensors: Dict[str, TensorEntry] = {}
    problems = []
    for report in reports:
        if report.file in files:
            problems.append(f"{tag}: file {report.file!r} reported by ranks "
                            f"{files[report.file].rank} and {report.rank}")
        files[report.file] = FileEntry(nbytes=report.nbytes, sha256=report.sha256,
                                       rank=report.rank)
        for spec in report.fragments:
            tkey = tensor_key(spec.name, spec.kind)
            entry = tensors.get(tkey)
            if entry is None:
                entry = tensors[tkey] = TensorEntry(shape=list(spec.shape), dtype=spec.dtype,
                                                    expert=spec.expert)
            elif (entry.shape, entry.dtype, entry.expert) != (list(spec.shape), spec.dtype,
                                                               spec.expert):
                problems.append(f"{tag}: tensor {tkey}: rank {report.rank} describes it as "
                                f"{list(spec.shape)} {spec.dtype} expert {spec.expert}, another "
                                f"rank as {entry.shape} {entry.dtype} expert {entry.expert}")
            entry.fragments.append(Fragment(file=report.file, key=spec.key,
                                            offset=spec.offset, length=spec.length))
    for name, entry in (extra_files or {}).items():
        if name in files:
            problems.append(f"{tag}: file {name!r} listed twice")
        files[name] = entry
    for entry in tensors.values():
        entry.fragments.sort(key=lambda f: f.offset)
    manifest = Manifest(tag=tag, step=step, world_size=world_size, layout=dict(layout),
                        files=files, tensors=tensors, expert_index=dict(expert_index),
                        extra=dict(extra or {}))
    problems.extend(manifest.validate())
    if problems:
        raise ValueError("cannot assemble the manifest:\n  " + "\n  ".join(problems))
    return manifest


def build_expert_index(previous: Optional[Manifest], saved_experts: Iterable[Tuple[int, int]],
                       step: int, tag: str, num_moe_layers: int,
                       num_experts: int, scope: str = "wo") -> Dict[str, ExpertVersion]:
    """The expert index of a new checkpoint (rank 0, before :func:`assemble_manifest`).

    Args:
        previous: manifest of the checkpoint this run's state descends from (the newest
            one saved by this run, or the one it resumed from); None for the first.
        saved_experts: ``(moe_layer, expert)`` pairs PEC selected: this checkpoint holds
            all their tensors.
        step, tag: of the new checkpoint.
        num_moe_layers, num_experts: the model's MoE layers and experts per layer.
        scope: the PEC variant (``--moc-pec-scope``); with ``w`` this checkpoint also
            holds every expert's optimizer state, with ``o`` every expert's weights.

    Returns:
        ``previous``'s index with the saved experts, and the parts saved for every
        expert, now pointing at ``(step, tag)``.

    Raises:
        ValueError: an expert out of range, ``previous`` newer than ``step`` or with
            experts beyond the model (a different model), or an expert that no
            checkpoint holds (the first checkpoint must save every expert; otherwise
            a restart would have no weights for it).
    """
    check_tag(tag)
    index: Dict[str, ExpertVersion] = {}
    if previous is not None:
        if previous.step > step:
            raise ValueError(f"previous checkpoint {previous.tag} is at step {previous.step}, "
                             f"after the new step {step}")
        index = {k: ExpertVersion(v.step, v.tag, v.optim_step, v.optim_tag)
                 for k, v in previous.expert_index.items()}
    valid = {expert_key(l, e) for l in range(num_moe_layers) for e in range(num_experts)}
    outside = sorted(set(index) - valid)
    if outside:
        raise ValueError(f"previous checkpoint {previous.tag} indexes experts {outside[:5]} "
                         f"outside {num_moe_layers} MoE layers x {num_experts} experts; "
                         f"it belongs to a different model")
    saved = set()
    for layer, expert in saved_experts:
        key = expert_key(layer, expert)
        if key not in valid:
            raise ValueError(f"saved expert {key} is outside {num_moe_layers} MoE layers x "
                             f"{num_experts} experts")
        saved.add(key)
        index[key] = ExpertVersion(step=step, tag=tag)
    _index_whole_part(index, saved, scope, (step, tag))
    missing = sorted(valid - set(index), key=parse_expert_key)
    if missing:
        raise ValueError(f"experts {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                         f"({len(missing)} in all) are saved in no checkpoint; the first "
                         f"checkpoint must hold every expert")
    return dict(sorted(index.items(), key=lambda kv: parse_expert_key(kv[0])))


def _index_whole_part(index: Dict[str, ExpertVersion], saved: Set[str], scope: str,
                      here: Tuple[int, str]) -> None:
    """Under a one-part PEC scope, point the part saved for every expert at ``here``.

    An expert never saved before stays absent: its other part exists nowhere, and the
    caller reports it as missing.
    """
    from deepspeed_ext.pec import check_scope
    if check_scope(scope) == "wo":
        return
    for key, old in index.items():
        if key in saved:
            continue
        if scope == "w":  # weights partial: the optimizer state is always saved
            index[key] = ExpertVersion.of_parts(old.part("w"), here)
        else:             # optimizer state partial: the weights are always saved
            index[key] = ExpertVersion.of_parts(here, old.part("o"))


# ------------------------------------------------------------------ manifest on disk

def write_manifest(ckpt_dir: str, manifest: Manifest) -> None:
    """Write ``<ckpt_dir>/manifest.json`` atomically: the commit point of a save.

    Rank 0 calls it only after every rank's file (and objects.json) is published and
    fsynced; from then on the checkpoint counts as complete.

    Raises:
        ValueError: the manifest is inconsistent (:meth:`Manifest.validate`) or its tag
            is not the directory's name (expert indexes find checkpoints by tag).
    """
    if fs.basename(ckpt_dir) != manifest.tag:
        raise ValueError(f"manifest tag {manifest.tag!r} does not match directory {ckpt_dir}")
    problems = manifest.validate()
    if problems:
        raise ValueError("refusing to write an invalid manifest:\n  " + "\n  ".join(problems))
    atomic_write_json(os.path.join(ckpt_dir, MANIFEST_FILE), sign_manifest(manifest.to_json()))


MANIFEST_CHECKSUM = "sha256"
"""The manifest's own checksum field: SHA-256 of its other fields as canonical JSON. The
manifest holds every other file's checksum, but a flipped digit in a fragment's offset
still parses and would load the wrong bytes; manifests written before it have none and
are read unchecked."""


def _manifest_digest(data: Mapping[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sign_manifest(data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` (a manifest's JSON) with its :data:`MANIFEST_CHECKSUM` (re)computed."""
    return dict(data, **{MANIFEST_CHECKSUM: _manifest_digest(data)})


def read_manifest(ckpt_dir: str) -> Manifest:
    """Read and type-check ``<ckpt_dir>/manifest.json``.

    Raises:
        CheckpointError: naming the file: missing (the save never finished, or the
            checkpoint was deleted), not JSON, not a MoC manifest, an unsupported
            version, or a tag that is not the directory's name.
    """
    path = os.path.join(ckpt_dir, MANIFEST_FILE)
    try:
        data = read_json(path, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete or deleted checkpoint)") from None
    try:
        manifest = Manifest.from_json(data, path)
        recorded = data.get(MANIFEST_CHECKSUM)
        damaged = recorded is not None and recorded != _manifest_digest(data)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    except (RecursionError, MemoryError, TypeError, KeyError, AttributeError) as err:
        # Whatever the type checks above missed must still skip this checkpoint, not
        # stop the load (or `moc-ckpt verify`) with a stray error.
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    dirname = fs.basename(ckpt_dir)
    if manifest.tag != dirname:
        raise CheckpointError(f"{path}: records tag {manifest.tag!r} but lies in {dirname!r} "
                              f"(renamed checkpoint directories break expert indexes)")
    if damaged:
        raise CheckpointError(f"{path}: checksum mismatch (the manifest is damaged; its "
                              f"{MANIFEST_CHECKSUM} does not match its contents)")
    return manifest


def read_expert_versions(ckpt_dir: str) -> Tuple[int, Dict[Tuple[int, int], int]]:
    """``(step, {(layer, expert): step of its newest whole version})`` of one checkpoint
    (the older part's step when weights and optimizer state differ), from
    its manifest without the full type check of :func:`read_manifest` (which takes tens
    of milliseconds on large manifests). For deciding where to read from, not for
    loading: a load through :class:`deepspeed_ext.reader.CheckpointReader` checks all.

    Raises:
        CheckpointError: the manifest is missing, unreadable, or lacks these fields.
    """
    path = os.path.join(ckpt_dir, MANIFEST_FILE)
    try:
        data = read_json(path, MANIFEST_MAX_BYTES)
        return _int(data["step"]), {parse_expert_key(k): min(_int(v["step"]), _int(
                                        (v.get("optim") or v)["step"]))
                                    for k, v in data.get("expert_index", {}).items()}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete or deleted checkpoint)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            MemoryError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


def _int(value: Any) -> int:
    """A step read from JSON: ``int("7")`` and ``int(7.9)`` would pass a damaged one."""
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value


def update_latest(save_dir: str, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (rank 0, after write_manifest).

    Raises:
        ValueError: ``tag`` has no manifest yet; ``latest`` must only name complete
            checkpoints, or a crash right after would resume from a partial save.
    """
    check_tag(tag)
    if not fs.isfile(os.path.join(save_dir, tag, MANIFEST_FILE)):
        raise ValueError(f"{os.path.join(save_dir, tag)} has no {MANIFEST_FILE}; write it "
                         f"before pointing {LATEST_FILE} at it")
    atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)


def advance_latest(save_dir: str, tag: str, attempt_started: Optional[float],
                   step: Optional[int] = None) -> Optional[str]:
    """The committer's :func:`update_latest`: never over later work.

    A committer can outlive its job: a keeper waiting for a dead node's reports finishes
    after the restarted job has loaded, or committed newer work. Each manifest records
    when its job attempt started (``extra["attempt_started"]``, rank 0's clock), and a
    restarted attempt records its start in :data:`ATTEMPT_FILE` before it loads.
    ``latest`` is left alone when a later attempt has started (moving it then could
    make that attempt's restart load another timeline, and the retention that follows
    delete the checkpoint it resumed from), when it names a checkpoint committed by a
    later attempt, or by this attempt at a later step (a commit that finished late: the
    training side moves on once a manifest exists, while its committer still writes
    ``latest``); it is moved otherwise (a new attempt may legitimately move it back: it
    resumed from an older checkpoint, or writes into a directory of an earlier run).
    The reads and the write are one step under :func:`locked_dir`, so two committers
    (the same keeper's threads), or a committer and a starting attempt, cannot
    interleave.

    Args:
        attempt_started: when this committer's attempt started; None (an older
            caller): always move.
        step: the step of ``tag``; None: compared by attempt only.

    Returns:
        None when ``latest`` now names ``tag``; else why it was left alone.
    """
    with locked_dir(save_dir):
        current = None
        try:
            current = read_latest(save_dir)
        except CheckpointError:
            pass  # damaged: this commit repairs it
        if attempt_started is not None and later_attempt_started(save_dir, attempt_started):
            return (f"latest stays at {current}: a later attempt of the job started "
                    f"({ATTEMPT_FILE}) and resumes from it")
        if attempt_started is not None and current is not None and current != tag:
            try:
                theirs = read_manifest(os.path.join(save_dir, current))
            except CheckpointError:
                theirs = None  # names nothing loadable: replace it
            if theirs is not None and _committed_later(theirs, attempt_started, step):
                return (f"latest stays at {current}, committed by a later attempt of the job "
                        f"or later in the same attempt")
        update_latest(save_dir, tag)
        return None


def record_attempt(save_dir: str, attempt_started: float) -> None:
    """Rank 0 of a job attempt, before it reads ``latest`` to load: write
    :data:`ATTEMPT_FILE`, so that committers of earlier attempts still running leave
    ``latest`` and retention alone (see :func:`advance_latest`). Under
    :func:`locked_dir`: a committer either moved ``latest`` before (and this attempt
    loads what it committed) or sees the record."""
    ensure_dir(save_dir)
    with locked_dir(save_dir):
        atomic_write_json(os.path.join(save_dir, ATTEMPT_FILE),
                          {"attempt_started": attempt_started})
        _roll_latest_forward(save_dir)


def _roll_latest_forward(save_dir: str) -> Optional[str]:
    """Under :func:`locked_dir`, before a new attempt reads ``latest``: point it at the
    newest complete checkpoint of the attempt that committed its current target, when
    that attempt committed later steps it never named (it died between a manifest and
    ``latest``, or moving ``latest`` failed). Left alone, the restart resumed from the
    older checkpoint and its first save set the newer one aside as an abandoned
    timeline. Returns the tag it now names, or None when unchanged."""
    try:
        current = read_latest(save_dir)
        theirs = read_manifest(os.path.join(save_dir, current)) if current else None
    except CheckpointError:
        return None  # the loader's fallback handles a damaged or dangling latest
    started = theirs.extra.get("attempt_started") if theirs is not None else None
    if not isinstance(started, (int, float)):
        return None
    later = []
    for step, tag in scan_checkpoints(save_dir).complete:
        if step > theirs.step:
            try:
                if read_manifest(os.path.join(save_dir, tag)).extra.get("attempt_started") == started:
                    later.append((step, tag))
            except CheckpointError:
                continue
    if not later:
        return None
    update_latest(save_dir, later[-1][1])
    return later[-1][1]


def later_attempt_started(save_dir: str, attempt_started: Optional[float]) -> bool:
    """Whether :data:`ATTEMPT_FILE` names an attempt that started after
    ``attempt_started`` (False for None, or without a readable record: an unreadable
    one is not a reason to stop committing)."""
    if attempt_started is None:
        return False
    try:
        theirs = read_json(os.path.join(save_dir, ATTEMPT_FILE),
                           ATTEMPT_MAX_BYTES)["attempt_started"]
    except (OSError, CheckpointError, KeyError, TypeError):
        return False
    return type(theirs) in (int, float) and theirs > attempt_started


def _committed_later(current: Manifest, attempt_started: float, step: Optional[int]) -> bool:
    theirs = current.extra.get("attempt_started")
    if not isinstance(theirs, (int, float)):
        return False
    if theirs > attempt_started:
        return True
    return theirs == attempt_started and step is not None and current.step > step


LOCK_FILE = ".moc-lock"
"""The file :func:`locked_dir` locks in a local directory (hidden: never a checkpoint)."""


@contextlib.contextmanager
def locked_dir(path: str):
    """An exclusive lock on the directory ``path`` for the ``with`` block: within this
    process always (the keeper's commit threads), across processes by a POSIX lock on
    ``<path>/.moc-lock`` for a local directory (none for URLs). A regular file opened
    for writing, not the directory: NFS emulates ``flock`` with POSIX locks, which need
    a writable descriptor, and refused the directory's, so the committers and a
    restarting job went unserialised without a word. Where no lock can be had, this
    says so once per directory and goes on unlocked."""
    with _process_lock(path):
        fd = None
        if not fs.is_url(path):
            try:
                fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.lockf(fd, fcntl.LOCK_EX)
            except OSError as e:
                if fd is not None:
                    os.close(fd)
                fd = None
                _warn_unlocked(path, e)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # closing releases the lock


_UNLOCKED_WARNED: Set[str] = set()


def _warn_unlocked(path: str, error: OSError) -> None:
    key = os.path.realpath(path)
    if key not in _UNLOCKED_WARNED:
        _UNLOCKED_WARNED.add(key)
        print(f"[moc] WARNING: cannot lock {os.path.join(path, LOCK_FILE)} ({error}); "
              f"commits into {path} are not serialised with other processes", flush=True)


_PROCESS_LOCKS: Dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(path: str) -> threading.Lock:
    # Two commit threads of one keeper writing into a URL (no flock there) interleaved
    # their read of ``latest`` and their write of it; the same writer's temporary name
    # (``latest.tmp.<pid>``) was then shared by both.
    key = fs.identity(path) if fs.is_url(path) else os.path.realpath(path)
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(key, threading.Lock())


def read_latest(save_dir: str) -> Optional[str]:
    """The tag in ``<save_dir>/latest``, or None when there is no (or an empty) file.

    Raises:
        CheckpointError: naming the file, when it holds something that is not a tag, or
            more than :data:`LATEST_MAX_BYTES`.
    """
    path = os.path.join(save_dir, LATEST_FILE)
    try:
        text = fs.read_text(path, limit=LATEST_MAX_BYTES).strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    if not text:
        return None
    try:
        return check_tag(text)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None


@dataclass
class Scan:
    """The checkpoint directories of a save_dir, by state."""

    complete: List[Tuple[int, str]]
    """``(step, tag)`` with a readable manifest, oldest first."""
    corrupt: List[Tuple[str, str]]
    """``(tag, error)`` whose manifest exists but cannot be read."""
    incomplete: List[str]
    """Tags without a manifest (saves in progress or interrupted, deletions interrupted)."""


def scan_checkpoints(save_dir: str) -> Scan:
    """Classify every directory in ``save_dir`` (hidden ones, e.g. trash, excluded)."""
    complete, corrupt, incomplete = [], [], []
    for name in fs.subdirs(save_dir):
        if name.startswith("."):
            continue
        try:
            check_tag(name)
        except ValueError:
            continue
        tag_dir = os.path.join(save_dir, name)
        if not fs.exists(os.path.join(tag_dir, MANIFEST_FILE)):
            incomplete.append(name)
            continue
        try:
            complete.append((read_manifest(tag_dir).step, name))
        except CheckpointError as err:
            corrupt.append((name, str(err)))
    complete.sort()
    return Scan(complete, corrupt, incomplete)


def list_checkpoints(save_dir: str) -> List[Tuple[int, str]]:
    """``(step, tag)`` of every complete checkpoint (manifest present and readable),
    oldest first."""
    return scan_checkpoints(save_dir).complete


# ---------------------------------------------------------------------- resolution

@dataclass
class ResolvedTensor:
    """A tensor of a checkpoint as a load sees it: which checkpoint's bytes to read."""

    name: str
    kind: str
    entry: TensorEntry
    tag: str
    """Checkpoint holding it: the loaded one, or for an expert not saved there the one
    its expert index names."""
    step: int
    """Step of that checkpoint."""


@dataclass
class Resolution:
    """Everything needed to load one tag (see :func:`resolve_checkpoint`)."""

    manifest: Manifest
    """The loaded tag's manifest."""
    manifests: Dict[str, Manifest]
    """Every manifest involved (the tag and those its expert index names), by tag."""
    tensors: Dict[str, ResolvedTensor]
    """``"name|kind"`` -> where to read it."""
    problems: List[str]
    """Why loading would fail or be wrong; empty if fine (files not checked here)."""


def resolve_checkpoint(save_dir: str, tag: str,
                       cache: Optional[Dict[str, Manifest]] = None) -> Resolution:
    """Find, for every tensor of checkpoint ``tag``, the checkpoint holding its newest
    version, reading only manifests.

    Args:
        save_dir: the checkpoint root.
        tag: the checkpoint to load.
        cache: optional tag -> manifest cache shared across calls.

    Raises:
        CheckpointError: ``tag``'s own manifest is missing or unreadable. Problems in
            what it references are returned in :attr:`Resolution.problems`.
    """
    check_tag(tag)
    cache = {} if cache is None else cache

    def load(t: str) -> Manifest:
        if t not in cache:
            cache[t] = read_manifest(os.path.join(save_dir, t))
        return cache[t]

    manifest = load(tag)
    problems = manifest.validate()
    manifests = {tag: manifest}
    tensors = {}
    for tkey, entry in manifest.tensors.items():
        name, kind = _split_or_raw(tkey)
        tensors[tkey] = ResolvedTensor(name, kind, entry, tag, manifest.step)
    for ekey, version in sorted(manifest.expert_index.items()):
        for (old_step, old_tag), parts in _locations(version).items():
            if old_tag == tag:
                continue  # held here: validate() checked it
            problems.extend(_resolve_expert(ekey, parts, old_step, old_tag, tag, load,
                                            manifests, tensors))
    return Resolution(manifest, manifests, tensors, problems)


def _locations(version: ExpertVersion) -> Dict[Tuple[int, str], Tuple[str, ...]]:
    """``(step, tag)`` -> the parts of the expert stored there (both parts: one entry)."""
    out: Dict[Tuple[int, str], Tuple[str, ...]] = {}
    for part in ("w", "o"):
        out[version.part(part)] = out.get(version.part(part), ()) + (part,)
    return out


def _resolve_expert(ekey, parts, old_step, old_tag, tag, load, manifests, tensors) -> List[str]:
    """Add the tensors of ``parts`` of expert ``ekey`` held by ``old_tag`` to ``tensors``."""
    from deepspeed_ext.pec import part_of_kind
    problems: List[str] = []
    expert = _safe_expert(ekey)
    label = f"{tag}: expert_index[{ekey!r}] points to {old_tag!r}"
    try:
        check_tag(old_tag)
        old = load(old_tag)
    except (ValueError, CheckpointError) as err:
        return [f"{label}, which is missing or incomplete ({err})"]
    manifests[old_tag] = old
    if old.step != old_step:
        problems.append(f"{label} at step {old_step}, but that checkpoint is at step "
                        f"{old.step}")
    held = {k: e for k, e in old.tensors.items()
            if e.expert == expert and part_of_kind(_split_or_raw(k)[1]) in parts}
    if not held:
        what = " and ".join(_PART_NAMES[p] for p in parts)
        problems.append(f"{label}, which holds no tensor of expert {ekey} ({what})")
    for tkey, entry in sorted(held.items()):
        problems.extend(tensor_problems(old_tag, tkey, entry, old.files))
        if tkey in tensors:
            problems.append(f"{tag}: tensor {tkey} is both in {tensors[tkey].tag} and, "
                            f"for expert {ekey}, in {old_tag}")
            continue
        name, kind = _split_or_raw(tkey)
        tensors[tkey] = ResolvedTensor(name, kind, entry, old_tag, old.step)
    return problems


def _split_or_raw(tkey: str) -> Tuple[str, str]:
    try:
        return split_tensor_key(tkey)
    except ValueError:  # reported by tensor_problems; keep the entry visible
        return tkey, ""


def verify_checkpoint(save_dir: str, tag: str, checksums: bool = True,
                      cache: Optional[Dict[str, Manifest]] = None) -> List[str]:
    """Everything that would make loading ``tag`` fail or load wrong data.

    Checks: the manifest (present, readable, consistent); every file of ``tag`` and
    every file of an older checkpoint that holds an expert ``tag`` needs (present, size,
    and with ``checksums`` the SHA-256); that each needed fragment is in its file with
    the recorded length and dtype; that each tensor's fragments cover it exactly once;
    the expert index (complete for the layout; entries point to complete checkpoints of
    the recorded step that hold the expert); objects.json's tensors.

    Args:
        save_dir: the checkpoint root.
        tag: the checkpoint.
        checksums: also hash every needed file (reads all their bytes once).
        cache: tag -> manifest, shared with other calls (:func:`resolve_checkpoint`).

    Returns:
        One line per problem, each naming the file, tensor or index entry; empty when
        ``tag`` loads correctly.
    """
    try:
        res = resolve_checkpoint(save_dir, tag, cache)
    except (CheckpointError, ValueError) as err:
        return [str(err)]
    return verify_resolution(save_dir, res, checksums)


def verify_resolution(save_dir: str, res: Resolution, checksums: bool = True) -> List[str]:
    """:func:`verify_checkpoint` for an already resolved checkpoint (saves re-reading
    the manifests when the caller needs the :class:`Resolution` anyway)."""
    tag = res.manifest.tag
    problems = list(res.problems)

    needed: Dict[Tuple[str, str], FileEntry] = {
        (tag, rel): fe for rel, fe in res.manifest.files.items() if _plain_file_name(rel)}
    by_file: Dict[Tuple[str, str], List[Tuple[str, TensorEntry, Fragment]]] = {}
    for tkey, rt in res.tensors.items():
        files = res.manifests[rt.tag].files
        for frag in rt.entry.fragments:
            if frag.file in files and _plain_file_name(frag.file):
                needed[(rt.tag, frag.file)] = files[frag.file]
                by_file.setdefault((rt.tag, frag.file), []).append((tkey, rt.entry, frag))
    bad = set()
    for (t, rel), fe in sorted(needed.items()):
        problem = check_file(os.path.join(save_dir, t, rel), fe.nbytes,
                             fe.sha256 if checksums else None)
        if problem is not None:
            problems.append(problem)
            bad.add((t, rel))
    for (t, rel), items in sorted(by_file.items()):
        if (t, rel) in bad:
            continue
        path = os.path.join(save_dir, t, rel)
        try:
            with FragmentReader(path) as reader:
                for tkey, entry, frag in items:
                    if frag.key not in reader:
                        problems.append(f"{path}: lacks fragment {frag.key!r} of tensor {tkey}")
                        continue
                    shape, dtype = reader.shape(frag.key), reader.dtype(frag.key)
                    if shape != [frag.length] or str(dtype).rsplit(".", 1)[-1] != entry.dtype:
                        problems.append(f"{path}: fragment {frag.key!r} is {dtype} {shape}, "
                                        f"manifest records {entry.dtype} [{frag.length}]")
        except CheckpointError as err:
            problems.append(str(err))
    if OBJECTS_FILE in res.manifest.files and (tag, OBJECTS_FILE) not in bad:
        problems.extend(_objects_problems(save_dir, tag, res.manifest, bad))
    return problems


def _objects_problems(save_dir: str, tag: str, manifest: Manifest, bad: Set) -> List[str]:
    tag_dir = os.path.join(save_dir, tag)
    try:
        objects = read_objects_file(tag_dir)
    except CheckpointError as err:
        return [str(err)]
    keys = tensor_keys(objects.tree)
    if not keys:
        return []
    if objects.tensor_file not in manifest.files:
        return [f"{os.path.join(tag_dir, OBJECTS_FILE)}: its tensors are in "
                f"{objects.tensor_file!r}, which is not among the checkpoint's files"]
    if (tag, objects.tensor_file) in bad:
        return []
    path = os.path.join(tag_dir, objects.tensor_file)
    try:
        with FragmentReader(path) as reader:
            return [f"{path}: lacks tensor {k!r} of {OBJECTS_FILE}" for k in keys
                    if k not in reader]
    except CheckpointError as err:
        return [str(err)]


# ------------------------------------------------------------------------ retention

def referenced_tags(save_dir: str, tag: str) -> Set[str]:
    """``tag`` plus every checkpoint its expert index points to: what loading it reads.

    Not transitive: an index already names each expert's newest version directly.

    Raises:
        CheckpointError: ``tag``'s manifest is missing or unreadable.
    """
    manifest = read_manifest(os.path.join(save_dir, check_tag(tag)))
    return {tag}.union(*(v.tags() for v in manifest.expert_index.values()))


def remove_checkpoint(save_dir: str, tag: str) -> None:
    """Delete a checkpoint directory so that a crash at any point is harmless.

    Order: remove ``manifest.json`` first (fsynced), so a half-deleted directory counts
    as incomplete and is never loaded; then rename the directory to a hidden
    ``.moc-trash.<tag>.<pid>`` name (fsynced), then delete it. A crash leaves an
    incomplete tag directory or a trash directory, both of which
    :func:`apply_retention` removes later. (A URL has no rename: its objects are deleted
    in place once the manifest is gone.)
    """
    check_tag(tag)
    tag_dir = os.path.join(save_dir, tag)
    try:
        fs.remove(os.path.join(tag_dir, MANIFEST_FILE))
        fsync_dir(tag_dir)
    except FileNotFoundError:
        pass
    _trash(save_dir, tag)


def _trash(save_dir: str, tag: str) -> None:
    # pid and time make the name unique: a rename onto a leftover trash directory of
    # the same tag (an earlier rmtree that failed) would fail.
    if fs.is_url(save_dir):  # no rename; the tag counts as incomplete until all is gone
        fs.rmtree(os.path.join(save_dir, tag))
        return
    trash = os.path.join(save_dir, f"{TRASH_PREFIX}{tag}.{os.getpid()}.{time.time_ns()}")
    os.rename(os.path.join(save_dir, tag), trash)
    fsync_dir(save_dir)
    fs.rmtree(trash)


def _looks_like_ours(tag_dir: str) -> bool:
    try:
        names = fs.listdir(tag_dir)
    except OSError:
        return False
    return all(_TAG_DIR_ENTRY.match(n) for n in names)


def _last_write(tag_dir: str) -> Optional[float]:
    """Newest mtime among the directory's files; the directory's own when empty; None
    when the store does not tell (then the directory is left alone).

    Files, not the directory, because removing a manifest (an interrupted deletion)
    touches the directory's mtime but not the files'.
    """
    times = []
    for name in fs.listdir(tag_dir):
        try:
            times.append(fs.mtime(os.path.join(tag_dir, name)))
        except OSError:
            pass
    if times:
        return None if None in times else max(times)
    try:
        return fs.mtime(tag_dir)
    except OSError:
        return None


READERS_FILE = ".moc-readers"
"""The file whose byte ranges pin checkpoints against retention (:func:`reading`), one
range per tag; apart from :data:`LOCK_FILE`, because closing any descriptor of a file
drops every POSIX lock the process holds on it (retention's probe would release
:func:`locked_dir`'s lock)."""
_READING: Dict[Tuple[str, str], int] = {}
"""Pins held by this process (POSIX locks do not exclude the process holding them)."""
_READING_GUARD = threading.Lock()


def _reader_range(tag: str) -> int:
    """The byte of :data:`READERS_FILE` that stands for ``tag`` (a hash: two tags sharing
    one only keep each other a little longer)."""
    return 1 + int.from_bytes(hashlib.sha256(tag.encode("utf-8")).digest()[:5], "big")


def _reading_key(save_dir: str, tag: str) -> Tuple[str, str]:
    return (fs.identity(save_dir) if fs.is_url(save_dir) else os.path.realpath(save_dir), tag)


@contextlib.contextmanager
def reading(save_dir: str, tag: str):
    """Pin checkpoint ``tag`` against retention for the ``with`` block: a reader
    (``moc-ckpt verify``) takes it before it reads the tag's manifest and files.

    A shared lock on the tag's byte of ``<save_dir>/.moc-readers`` for a local directory
    (retention, :func:`apply_retention`, skips a tag whose byte it cannot lock
    exclusively), and this process's own count. The failure it prevents: retention run by
    a committer (a keeper finishing a dead job's persist) deleted a checkpoint while
    verify read it, and verify reported a healthy checkpoint directory as damaged.
    Retention that held the byte first finishes its deletion before the pin is granted:
    the reader must look for the manifest after entering (a pinned tag without one was
    deleted). Without write access to ``save_dir`` the pin is this process's only.
    """
    key = _reading_key(save_dir, tag)
    with _READING_GUARD:
        _READING[key] = _READING.get(key, 0) + 1
    fd = None
    try:
        if not fs.is_url(save_dir):
            try:
                fd = _pin(save_dir, tag)
            except OSError:  # read-only storage: nothing for other processes to see
                fd = None
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the pin
        with _READING_GUARD:
            _READING[key] -= 1
            if not _READING[key]:
                del _READING[key]


def _pin(save_dir: str, tag: str) -> int:
    """:func:`reading`'s shared lock; returns the descriptor holding it."""
    path = os.path.join(save_dir, READERS_FILE)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        # Created under the directory's lock, which retention holds from its look for
        # the file to its last deletion: a file made in between went unseen.
        with locked_dir(save_dir):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            return _lock_shared(fd, tag)
    return _lock_shared(fd, tag)


def _lock_shared(fd: int, tag: str) -> int:
    try:
        _lock_byte(fd, _reader_range(tag), exclusive=False, wait=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_byte(fd: int, offset: int, exclusive: bool, wait: bool) -> None:
    """Lock one byte of ``fd``'s file; raises OSError (EAGAIN/EACCES) when ``wait`` is
    False and another holder conflicts.

    Linux: an open-file-description lock, held by ``fd`` alone. The failure it prevents:
    a POSIX ``lockf`` lock belongs to the process and is dropped when the process closes
    *any* descriptor of the file, so one pin ending (or retention's probe closing its
    descriptor) silently unpinned a checkpoint another reader of the same process was
    still loading. Elsewhere: ``lockf`` (that gap remains there)."""
    command = getattr(fcntl, "F_OFD_SETLKW" if wait else "F_OFD_SETLK", None)
    if command is None:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        fcntl.lockf(fd, mode, 1, offset)
        return
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: required for OFD locks)
    fcntl.fcntl(fd, command, struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))


class _RetentionProbe:
    """Retention's side of :func:`reading`: :meth:`claim` locks a tag's byte exclusively
    (held until :meth:`close`, so that a reader arriving during the deletion waits and
    then finds the manifest gone), or says that a reader holds it. Made under
    :func:`locked_dir` (as :func:`retain_unless_superseded` does)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.fd = None
        if not fs.is_url(save_dir):
            try:  # none: no reader ever pinned here (see _pin)
                self.fd = os.open(os.path.join(save_dir, READERS_FILE), os.O_RDWR)
            except OSError:
                self.fd = None

    def claim(self, tag: str) -> bool:
        """False while a reader pins ``tag`` (in this process, or another one)."""
        with _READING_GUARD:
            if _READING.get(_reading_key(self.save_dir, tag)):
                return False
        if self.fd is None:
            return True
        try:
            _lock_byte(self.fd, _reader_range(tag), exclusive=True, wait=False)
        except OSError:  # EAGAIN/EACCES: a reader holds it
            return False
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def apply_retention(save_dir: str, keep: int, protect: Iterable[str] = ()) -> List[str]:
    """Delete old checkpoints and leftovers of crashed saves (rank 0, after a save).

    Keeps the newest ``keep`` complete checkpoints, the one ``latest`` names, the tags in
    ``protect`` (the committer's: the checkpoint it just committed), and every
    checkpoint their expert indexes reference (an old checkpoint may hold the newest
    version of an expert not saved since), and every checkpoint a reader pins
    (:func:`reading`). Deletes the other complete checkpoints,
    oldest first, with :func:`remove_checkpoint`. Also deletes manifest-less tag
    directories whose files are all older than the newest complete checkpoint's
    manifest and that hold only MoC's own files (partial saves of crashed runs,
    interrupted deletions; a save still in progress writes newer files and is spared),
    and leftover ``.moc-trash.*`` directories. Directories with unreadable manifests are
    left for a human.

    Args:
        save_dir: the checkpoint root.
        keep: number of newest complete checkpoints to keep (>= 1).
        protect: tags never deleted, with the checkpoints their expert indexes name.

    Returns:
        Tags deleted, in deletion order.

    Raises:
        ValueError: ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    scan = scan_checkpoints(save_dir)
    deleted: List[str] = []
    for name in fs.listdir(save_dir) if fs.isdir(save_dir) else []:
        if name.startswith(TRASH_PREFIX):
            fs.rmtree(os.path.join(save_dir, name))
    if not scan.complete:
        return deleted
    tags = [t for _, t in scan.complete]
    kept = set(tags[-keep:])
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    if latest in tags:
        kept.add(latest)
    # The tag just committed, when `latest` was left elsewhere (a late commit of an
    # older step, a `latest` that could not be moved): deleted right after its commit,
    # the trainer's wait found its directory gone and failed a save that had succeeded.
    kept |= set(protect) & set(tags)
    protected = set()
    for tag in kept:
        protected |= referenced_tags(save_dir, tag)
    commits = [fs.mtime(os.path.join(save_dir, t, MANIFEST_FILE)) for t in tags]
    newest_commit = None if None in commits else max(commits)
    probe = _RetentionProbe(save_dir)
    try:
        candidates = [t for t in tags if t not in protected]
        # A checkpoint a reader pins (moc-ckpt verify) stays until a later retention, and
        # so do the older ones its expert index makes it read.
        for tag in [t for t in candidates if not probe.claim(t)]:
            protected |= referenced_tags(save_dir, tag)
        for tag in candidates:
            if tag not in protected:
                remove_checkpoint(save_dir, tag)
                deleted.append(tag)
    finally:
        probe.close()
    for tag in scan.incomplete:
        tag_dir = os.path.join(save_dir, tag)
        last = _last_write(tag_dir) if newest_commit is not None else None
        if _looks_like_ours(tag_dir) and last is not None and last < newest_commit:
            _trash(save_dir, tag)
            deleted.append(tag)
    return deleted


def retain_unless_superseded(save_dir: str, keep: int, attempt_started: Optional[float],
                             protect: Iterable[str] = ()) -> Optional[List[str]]:
    """The committer's :func:`apply_retention`: skipped when a later attempt of the job
    has started (:func:`later_attempt_started`), which may have resumed from a
    checkpoint this retention would delete; its own commits run retention.

    The check and the deletion are one step under :func:`locked_dir`, the lock
    :func:`record_attempt` takes: checked unlocked, a restart could record its start
    and read ``latest`` between the check and the deletion, and then lose the
    checkpoint it resumes from. Under the same lock as :func:`advance_latest`, so the
    ``latest`` retention keeps is the one on storage until it is done.

    Args:
        protect: passed to :func:`apply_retention` (the tag just committed).

    Returns:
        The tags deleted, or None when retention was left to the later attempt.
    """
    with locked_dir(save_dir):
        if later_attempt_started(save_dir, attempt_started):
            return None
        return apply_retention(save_dir, keep, protect)


def _earlier_attempt(save_dir: str, tag: str, attempt_started: float) -> bool:
    """Whether complete checkpoint ``tag`` was committed by an attempt that started before
    ``attempt_started`` (or by a MoC that did not record attempts)."""
    theirs = read_manifest(os.path.join(save_dir, tag)).extra.get("attempt_started")
    return not isinstance(theirs, (int, float)) or theirs < attempt_started


def _set_aside(save_dir: str, tag: str) -> None:
    """Move complete checkpoint ``tag`` out of MoC's sight: renamed to a hidden
    ``.moc-set-aside.<tag>.<ns>`` on a local directory (for a human to inspect or delete;
    MoC never reads or removes it), deleted behind a URL (no rename there)."""
    if fs.is_url(save_dir):
        remove_checkpoint(save_dir, tag)
        return
    os.rename(os.path.join(save_dir, tag),
              os.path.join(save_dir, f"{SET_ASIDE_PREFIX}{tag}.{time.time_ns()}"))
    fsync_dir(save_dir)


def set_aside_checkpoints_after(save_dir: str, step: int, attempt_started: float,
                                keep: Optional[str] = None) -> List[str]:
    """Rank 0, before this attempt's first save (of ``step``) into ``save_dir``: set aside
    (see :func:`_set_aside`) every complete checkpoint of ``step`` or later that an
    earlier attempt committed, newest first.

    They belong to an abandoned timeline: the run resumed from an older checkpoint
    (:func:`deepspeed_ext.reader.find_loadable` skipped a damaged newer one, or
    ``latest`` named an older one). Left alone, this run's save of the same step would
    collide with them, retention would count them as the newest and delete this run's
    checkpoints first, and a restart could pick them. Safe for the kept ones: an expert
    index only names checkpoints of its own step or older. ``latest`` naming one of them
    is pointed at the newest remaining checkpoint first.

    Args:
        keep: a tag never set aside (the checkpoint this run resumed from).

    Returns:
        Tags set aside.
    """
    if not fs.isdir(save_dir):
        return []  # nothing to set aside (and no directory to hold the lock file)
    # Under the directory's lock, like retention: the checks and the moves are one step
    # against a committer of an earlier attempt moving ``latest`` in between.
    with locked_dir(save_dir):
        return _set_aside_after(save_dir, step, attempt_started, keep)


def _set_aside_after(save_dir: str, step: int, attempt_started: float,
                     keep: Optional[str]) -> List[str]:
    complete = scan_checkpoints(save_dir).complete
    doomed = [tag for ckpt_step, tag in reversed(complete)
              if ckpt_step >= step and tag != keep and _earlier_attempt(save_dir, tag, attempt_started)]
    _move_latest_off(save_dir, doomed, keep, complete, fill_missing=True)
    for tag in doomed:
        _set_aside(save_dir, tag)
    return doomed


def _move_latest_off(save_dir: str, doomed: Sequence[str], keep: Optional[str],
                     complete: List[Tuple[int, str]], fill_missing: bool = False) -> None:
    """Under :func:`locked_dir`, before checkpoints ``doomed`` lose their manifests (set
    aside, overwritten): when ``latest`` names one of them, point it at ``keep`` (the
    checkpoint this run resumed from) if that stays, else at the newest complete
    checkpoint that stays, else remove it. Moved first, atomically: a kill between the
    two steps leaves ``latest`` on a checkpoint that still exists; the other order left
    it naming a tag without a manifest (and a restart loading an older one, or nothing).

    Args:
        complete: :func:`scan_checkpoints`'s ``complete`` of ``save_dir``.
        fill_missing: also write ``latest`` when there is none (or it is damaged).
    """
    remaining = [tag for _, tag in complete if tag not in doomed]
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    if remaining and (latest in doomed or (fill_missing and latest is None)):
        update_latest(save_dir, keep if keep in remaining else remaining[-1])
    elif latest in doomed:
        # Nothing remains (a new run writing into another run's directory): a restart
        # before this run's first commit would otherwise find `latest` naming a
        # checkpoint that is gone, and load nothing at all.
        fs.remove(os.path.join(save_dir, LATEST_FILE))
        fsync_dir(save_dir)


def prepare_checkpoint_dir(save_dir: str, tag: str, overwrite: bool = False,
                           attempt_started: Optional[float] = None,
                           keep: Optional[str] = None, log=None) -> str:
    """Create ``<save_dir>/<tag>`` for a new save and return its path (rank 0, then a
    barrier before any rank writes).

    A manifest-less directory of that name is a crashed save's leftover: it is emptied,
    or its stale rank files (say from a run with more ranks) would linger beside the
    new ones. A complete checkpoint of that name (a run resumed from an older step now
    saving the same step again) is replaced only with ``overwrite``: other checkpoints'
    expert indexes may point to it; or, given this run's ``attempt_started``, set aside
    when an earlier attempt committed it and it is not ``keep`` (the checkpoint this run
    resumed from), as :func:`set_aside_checkpoints_after` does (and said through ``log``).
    Either way, ``latest`` naming it is first moved off it (:func:`_move_latest_off`).

    The new directory is claimed for this save (:func:`deepspeed_ext.commit.claim_dir`):
    a committer of an earlier attempt still waiting on this tag then stands down.

    Raises:
        FileExistsError: a complete checkpoint ``tag`` exists and not ``overwrite``.
    """
    check_tag(tag)
    tag_dir = os.path.join(save_dir, tag)
    ensure_dir(save_dir)
    # All of it under the directory's lock: an earlier attempt's committer checks its
    # claim and writes its manifest under the same lock. Between a check here that saw no
    # manifest and the claim, it could write one (recreating a directory just emptied),
    # and this save would look committed before any of its files existed.
    with locked_dir(save_dir):
        _make_room(save_dir, tag, tag_dir, overwrite, attempt_started, keep, log)
        ensure_dir(tag_dir)
        from deepspeed_ext.commit import claim_dir
        claim_dir(tag_dir)  # an earlier attempt's committer still waiting here stands down
    return tag_dir


def _make_room(save_dir: str, tag: str, tag_dir: str, overwrite: bool,
               attempt_started: Optional[float], keep: Optional[str], log) -> None:
    """:func:`prepare_checkpoint_dir`'s treatment of what already holds the name."""
    if fs.exists(os.path.join(tag_dir, MANIFEST_FILE)):
        if overwrite:
            _move_latest_off(save_dir, [tag], keep, scan_checkpoints(save_dir).complete)
            remove_checkpoint(save_dir, tag)
        elif (attempt_started is not None and tag != keep
              and _earlier_attempt(save_dir, tag, attempt_started)):
            # Say an earlier attempt's committer finished late and moved `latest` to it:
            # set aside under `latest`, the tag had no manifest until this save committed.
            _move_latest_off(save_dir, [tag], keep, scan_checkpoints(save_dir).complete)
            _set_aside(save_dir, tag)  # an abandoned timeline's (say, committed late)
            if log is not None:
                log(f"WARNING: set aside checkpoint {tag_dir}, saved by an earlier attempt, "
                    f"to save this run's {tag}")
        else:
            raise FileExistsError(f"{tag_dir} is a complete checkpoint; refusing to overwrite "
                                  f"it (other checkpoints may reference its experts)")
    elif fs.isdir(tag_dir):
        if not _looks_like_ours(tag_dir):
            raise FileExistsError(f"{tag_dir} exists and holds files MoC did not write; "
                                  f"refusing to delete it")
        _trash(save_dir, tag)
