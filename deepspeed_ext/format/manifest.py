"""``manifest.json``: what a MoC checkpoint holds (the data model), how it is parsed,
validated, signed, written and read.

On disk::

    <save_dir>/latest                        tag of the newest complete checkpoint
    <save_dir>/<tag>/rank00003.safetensors   fragments rank 3 wrote (key "name|kind|offset")
    <save_dir>/<tag>/objects.json            non-tensor state (deepspeed_ext.format.objects), rank 0
    <save_dir>/<tag>/manifest.json           written LAST by rank 0; presence = complete

A fragment is elements ``[offset, offset + length)`` of the *flattened* global tensor
``name`` of kind ``kind`` (``fp32`` master weights, ``exp_avg``, ``exp_avg_sq``, ...).
A checkpoint holds every non-expert tensor and the tensors of the experts it saved
(Partial Experts Checkpointing); its ``expert_index`` says, for every expert of every
MoE layer, which checkpoint holds that expert's newest version, so loading a tag needs
that tag plus the older tags its index names
(:func:`deepspeed_ext.store.catalog.referenced_tags`). With the paper's
one-part PEC variants (``--moc-pec-scope w`` or ``o``) an expert's weights and its
optimizer state can have different newest versions; the index then names both.

"layer" in an expert index is the MoE layer's ordinal (0 .. num_moe_layers-1), not the
transformer layer number; "expert" is the global expert index within that layer.

Save, multi-rank call order (the orchestration owns the collectives; ``store.*`` are
:mod:`deepspeed_ext.store` modules, the rest :mod:`deepspeed_ext.format`)::

    rank 0:     tag_dir = store.prepare.prepare_checkpoint_dir(save_dir, tag)  # claims it
    all:        barrier
    each rank:  specs = [assemble.FragmentSpec(...), ...]           # from the save plan
                tensors = {spec.key: cpu_snapshot_view, ...}
                rank 0 also: tree, obj = objects.encode(state); tensors.update(obj)
                record = storage.write_fragment_file(
                    os.path.join(tag_dir, rank_file_name(rank)), tensors)  # once fsynced
                report = assemble.RankReport.from_record(rank, rank_file_name(rank), record,
                                                         specs)
    all:        gather report.to_json() (or the rank's error) to rank 0
    rank 0:     if any rank failed: stop (no manifest = incomplete; retention cleans it)
                obj_record = objects.write_objects_file(tag_dir, tree, rank_file_name(0))
                index = expert_index.build_expert_index(previous_manifest, saved_experts,
                                                        step, tag, num_moe_layers, num_experts)
                manifest = assemble.assemble_manifest(
                    tag, step, world_size, layout,
                    [assemble.RankReport.from_json(r) for r in gathered],
                    index, extra_files={OBJECTS_FILE: FileEntry.from_record(obj_record, 0)})
                write_manifest(tag_dir, manifest)                   # the commit point
                store.latest.advance_latest(save_dir, tag, attempt_started, step)
                store.retention.retain_unless_superseded(save_dir, keep, attempt_started)
    all:        broadcast rank 0's outcome

Load: :func:`deepspeed_ext.store.reader.find_loadable` on one rank, broadcast the tag, then
:class:`deepspeed_ext.store.reader.CheckpointReader` on every rank.
"""

import hashlib
import json
import math
import os
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.format.dtypes import dtype_from_name
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.splits import TensorSplit, check_split_shape
from deepspeed_ext.format.naming import (check_tag, expert_key, fragment_key, parse_expert_key,
                                         plain_file_name, split_or_raw, split_tensor_key,
                                         try_parse_expert_key)
from deepspeed_ext.format.storage import FileRecord, atomic_write_json, check_depth, read_json
from deepspeed_ext.policy.pec import part_of_kind

FORMAT = "moc-ckpt"
VERSION = 2
"""Version 2 added per-part expert versions (``expert_index[...].optim``)."""
SPLIT_VERSION = 3
"""Version 3 added tensor-parallel splits (``tensors[...].split``): written only by a
checkpoint that holds a split tensor, so that an older MoC, which would read a split
tensor's part-major order as row-major, refuses it instead."""
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_FILE = "manifest.json"
MANIFEST_MAX_BYTES = 256 << 20
"""Largest manifest read: a manifest of a trillion-parameter model's fragments stays far
below it; a bigger file is damage (or not ours), and reading it whole, then parsing it
(several times its size in memory), could take the node's memory with it."""


MANIFEST_CHECKSUM = "sha256"
"""The manifest's own checksum field: SHA-256 of its other fields as canonical JSON. The
manifest holds every other file's checksum, but a flipped digit in a fragment's offset
still parses and would load the wrong bytes; manifests written before it have none and
are read unchecked."""


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
        """From what :func:`~deepspeed_ext.format.storage.write_fragment_file` or
        :func:`~deepspeed_ext.format.objects.write_objects_file` returned."""
        return cls(nbytes=record.nbytes, sha256=record.sha256, rank=rank)

    def to_json(self) -> Dict[str, Any]:
        return {"sha256": self.sha256, "nbytes": self.nbytes, "rank": self.rank}


@dataclass
class Fragment:
    """Elements ``[offset, offset + length)`` of a flattened tensor, stored in ``file``."""

    file: str
    """File name relative to the checkpoint directory (``rank00001.safetensors``)."""
    key: str
    """safetensors key (:func:`~deepspeed_ext.format.naming.fragment_key`)."""
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
    """dtype name (``float32``, ``bfloat16``; see :func:`deepspeed_ext.format.dtypes.dtype_name`)."""
    expert: Optional[Tuple[int, int]]
    """``(moe_layer, expert)`` for an expert's tensor, None for non-expert state."""
    fragments: List[Fragment] = field(default_factory=list)
    """Where its elements are, sorted by offset; together exactly ``[0, numel)``."""
    split: Optional[TensorSplit] = None
    """How the tensor-parallel ranks that saved it split it: offsets are then in its
    part-major order (:mod:`deepspeed_ext.format.splits`); None: row-major."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> Dict[str, Any]:
        out = {"shape": list(self.shape), "dtype": self.dtype,
               "expert": list(self.expert) if self.expert is not None else None,
               "fragments": [f.to_json() for f in self.fragments]}
        if self.split is not None:
            out["split"] = self.split.to_json()
        return out


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
        return {(e.expert, part_of_kind(split_or_raw(k)[1]))
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
            if not plain_file_name(name):
                problems.append(f"{where}: file name {name!r} is not a plain file name")
        for tkey, entry in self.tensors.items():
            problems.extend(tensor_problems(where, tkey, entry, self.files))
            if entry.split is not None and self.version < SPLIT_VERSION:
                problems.append(f"{where}: tensor {tkey} is split, which version "
                                f"{self.version} manifests cannot say")
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
                                f"({PART_NAMES[part]}) but its expert_index entry is "
                                f"{version and version.to_json()}")
        held_parts = self.held_parts()
        # A checkpoint saved before the first optimizer step holds no moments at all.
        has_optim = any(part == "o" for _, part in held_parts)
        for ekey, version in self.expert_index.items():
            if self.tag in version.tags() and try_parse_expert_key(ekey) not in held:
                problems.append(f"{where}: expert_index[{ekey!r}] points to this checkpoint, "
                                f"which holds no tensor of that expert")
                continue
            for part in ("w", "o") if has_optim else ("w",):
                if (version.part(part)[1] == self.tag
                        and (try_parse_expert_key(ekey), part) not in held_parts):
                    problems.append(f"{where}: expert_index[{ekey!r}] puts its "
                                    f"{PART_NAMES[part]} in this checkpoint, which holds none")
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
            expert = try_parse_expert_key(ekey)
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


PART_NAMES = {"w": "weights", "o": "optimizer state"}
"""Display names of the expert parts (``"w"``, ``"o"``)."""



def _is_count(value: Any) -> bool:
    """A non-negative int read from JSON (``true`` is no count)."""
    return type(value) is int and value >= 0



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
    if entry.split is not None and check_split_shape(entry.split, entry.shape):
        return [f"{label}: {check_split_shape(entry.split, entry.shape)}"]
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


def get_field(data: Mapping[str, Any], key: str, types: Any, where: str) -> Any:
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
    for name, f in get_field(data, "files", dict, source).items():
        w = f"{source}: files[{name!r}]"
        files[name] = FileEntry(nbytes=get_field(f, "nbytes", int, w), sha256=get_field(f, "sha256", str, w),
                                rank=get_field(f, "rank", int, w))
    tensors = {}
    for tkey, t in get_field(data, "tensors", dict, source).items():
        w = f"{source}: tensors[{tkey!r}]"
        expert = get_field(t, "expert", (list, type(None)), w)
        if expert is not None:
            if len(expert) != 2 or not all(type(x) is int for x in expert):
                raise ValueError(f"{w}.expert: expected [layer, expert] or null, got {expert}")
            expert = (expert[0], expert[1])
        shape = get_field(t, "shape", list, w)
        if not all(type(s) is int for s in shape):
            raise ValueError(f"{w}.shape: expected a list of ints, got {shape}")
        frags = []
        for i, fr in enumerate(get_field(t, "fragments", list, w)):
            fw = f"{w}.fragments[{i}]"
            frags.append(Fragment(file=get_field(fr, "file", str, fw), key=get_field(fr, "key", str, fw),
                                  offset=get_field(fr, "offset", int, fw),
                                  length=get_field(fr, "length", int, fw)))
        split = t.get("split")
        tensors[tkey] = TensorEntry(shape=shape, dtype=get_field(t, "dtype", str, w), expert=expert,
                                    fragments=sorted(frags, key=lambda f: f.offset),
                                    split=(TensorSplit.from_json(split, f"{w}.split")
                                           if split is not None else None))
    index = {}
    for ekey, v in get_field(data, "expert_index", dict, source).items():
        w = f"{source}: expert_index[{ekey!r}]"
        optim = v.get("optim") if isinstance(v, dict) else None
        if optim is not None and not isinstance(optim, dict):
            raise ValueError(f"{w}.optim: expected an object, got {type(optim).__name__}")
        index[ekey] = ExpertVersion(
            step=get_field(v, "step", int, w), tag=get_field(v, "tag", str, w),
            optim_step=get_field(optim, "step", int, w + ".optim") if optim is not None else None,
            optim_tag=get_field(optim, "tag", str, w + ".optim") if optim is not None else None)
    layout, extra = get_field(data, "layout", dict, source), get_field(data, "extra", dict, source)
    for name, free in (("layout", layout), ("extra", extra)):
        try:
            # Free-form: nesting that parsed raised RecursionError later, deeper in a
            # load's stack (the checksum's json.dumps, `moc-ckpt inspect`).
            check_depth(free)
        except ValueError as err:
            raise ValueError(f"{source}: {name} is {err}") from None
    return Manifest(tag=get_field(data, "tag", str, source), step=get_field(data, "step", int, source),
                    world_size=get_field(data, "world_size", int, source),
                    layout=layout, files=files, tensors=tensors,
                    expert_index=index, extra=extra, format=fmt, version=version)


# ------------------------------------------------------------------ building (save)

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


def _manifest_digest(data: Mapping[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sign_manifest(data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` (a manifest's JSON) with its :data:`MANIFEST_CHECKSUM` (re)computed."""
    return dict(data, **{MANIFEST_CHECKSUM: _manifest_digest(data)})


def read_manifest_json(ckpt_dir: str) -> Any:
    """The parsed, unchecked JSON of ``<ckpt_dir>/manifest.json``, at most
    :data:`MANIFEST_MAX_BYTES` of it (:func:`read_manifest` checks it; the expert index's
    quick look, :func:`deepspeed_ext.format.expert_index.read_expert_versions`, does not).

    Raises:
        CheckpointError: naming the file: missing (the save never finished, or the
            checkpoint was deleted), too large, not JSON, or nested too deeply.
        OSError: the file exists but cannot be read.
    """
    path = os.path.join(ckpt_dir, MANIFEST_FILE)
    try:
        return read_json(path, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete or deleted checkpoint)") from None


def read_manifest(ckpt_dir: str) -> Manifest:
    """Read and type-check ``<ckpt_dir>/manifest.json``.

    Raises:
        CheckpointError: naming the file: missing (the save never finished, or the
            checkpoint was deleted), not JSON, not a MoC manifest, an unsupported
            version, or a tag that is not the directory's name.
    """
    path = os.path.join(ckpt_dir, MANIFEST_FILE)
    data = read_manifest_json(ckpt_dir)
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

