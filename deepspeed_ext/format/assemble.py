"""What each rank reports about the fragments it wrote, and how rank 0 assembles the
manifest from the reports (see :mod:`deepspeed_ext.format.manifest` for the order)."""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from deepspeed_ext.format.manifest import (SPLIT_VERSION, VERSION, ExpertVersion, FileEntry,
                                           Fragment, Manifest, TensorEntry, get_field)
from deepspeed_ext.format.splits import TensorSplit, check_split_shape
from deepspeed_ext.format.dtypes import dtype_from_name
from deepspeed_ext.format.naming import check_key_part, check_tag, fragment_key, tensor_key
from deepspeed_ext.format.storage import FileRecord



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
    """dtype name as stored (:func:`deepspeed_ext.format.dtypes.dtype_name`)."""
    expert: Optional[Tuple[int, int]] = None
    """``(moe_layer, expert)`` for an expert's tensor."""
    split: Optional[TensorSplit] = None
    """The tensor-parallel split ``offset`` counts in (part-major order); None: row-major."""

    def __post_init__(self):
        check_key_part(self.name, "tensor name")
        check_key_part(self.kind, "tensor kind")
        dtype_from_name(self.dtype)
        if self.split is not None and check_split_shape(self.split, self.shape):
            raise ValueError(f"fragment {self.name}|{self.kind}: "
                             f"{check_split_shape(self.split, self.shape)}")
        numel = math.prod(self.shape)
        if self.offset < 0 or self.length <= 0 or self.offset + self.length > numel:
            raise ValueError(f"fragment {self.name}|{self.kind}: [{self.offset}, "
                             f"{self.offset + self.length}) is not a non-empty range of its "
                             f"{numel} elements")

    @property
    def key(self) -> str:
        return fragment_key(self.name, self.kind, self.offset)

    def to_json(self) -> Dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, "offset": self.offset,
               "length": self.length, "shape": list(self.shape), "dtype": self.dtype,
               "expert": list(self.expert) if self.expert is not None else None}
        if self.split is not None:
            out["split"] = self.split.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "fragment") -> "FragmentSpec":
        """Inverse of :meth:`to_json`; ValueError naming the field for anything else (a
        report file's payload is read back from storage: a wrong shape raised
        KeyError/TypeError out of the committer)."""
        shape = get_field(d, "shape", list, where)
        if not all(type(s) is int for s in shape):
            raise ValueError(f"{where}.shape: expected a list of ints, got {shape!r}")
        expert = d.get("expert") if isinstance(d, dict) else None
        if expert is not None and (not isinstance(expert, list) or len(expert) != 2
                                   or not all(type(x) is int for x in expert)):
            raise ValueError(f"{where}.expert: expected [layer, expert] or null, got {expert!r}")
        split = d.get("split") if isinstance(d, dict) else None
        return cls(name=get_field(d, "name", str, where), kind=get_field(d, "kind", str, where),
                   offset=get_field(d, "offset", int, where), length=get_field(d, "length", int, where),
                   shape=tuple(shape), dtype=get_field(d, "dtype", str, where),
                   expert=tuple(expert) if expert is not None else None,
                   split=TensorSplit.from_json(split, f"{where}.split") if split is not None else None)


@dataclass
class RankReport:
    """What one rank wrote, sent to rank 0 (as :meth:`to_json`, plain data) after its
    file is published."""

    rank: int
    file: str
    """File name relative to the tag directory (:func:`~deepspeed_ext.format.naming.rank_file_name`)."""
    nbytes: int
    sha256: str
    fragments: List[FragmentSpec] = field(default_factory=list)

    @classmethod
    def from_record(cls, rank: int, file: str, record: FileRecord,
                    fragments: Iterable[FragmentSpec]) -> "RankReport":
        """Report of a file :func:`~deepspeed_ext.format.storage.write_fragment_file` published."""
        return cls(rank=rank, file=file, nbytes=record.nbytes, sha256=record.sha256,
                   fragments=list(fragments))

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "nbytes": self.nbytes,
                "sha256": self.sha256, "fragments": [f.to_json() for f in self.fragments]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "report") -> "RankReport":
        """Inverse of :meth:`to_json`; ValueError naming the field for anything else."""
        return cls(rank=get_field(d, "rank", int, where), file=get_field(d, "file", str, where),
                   nbytes=get_field(d, "nbytes", int, where), sha256=get_field(d, "sha256", str, where),
                   fragments=[FragmentSpec.from_json(f, f"{where}.fragments[{i}]")
                              for i, f in enumerate(get_field(d, "fragments", list, where))])


def assemble_manifest(tag: str, step: int, world_size: int, layout: Mapping[str, Any],
                      reports: Iterable[RankReport], expert_index: Mapping[str, ExpertVersion],
                      extra_files: Optional[Mapping[str, FileEntry]] = None,
                      extra: Optional[Mapping[str, Any]] = None) -> Manifest:
    """Merge every rank's report into a manifest (rank 0, after all ranks succeeded).

    Args:
        tag, step, world_size, layout: as in :class:`~deepspeed_ext.format.manifest.Manifest`.
        reports: one :class:`RankReport` per rank that wrote a file.
        expert_index: from :func:`~deepspeed_ext.format.expert_index.build_expert_index`.
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
                                                    expert=spec.expert, split=spec.split)
            elif (entry.shape, entry.dtype, entry.expert, entry.split) != (
                    list(spec.shape), spec.dtype, spec.expert, spec.split):
                problems.append(f"{tag}: tensor {tkey}: rank {report.rank} describes it as "
                                f"{list(spec.shape)} {spec.dtype} expert {spec.expert} split "
                                f"{spec.split}, another rank as {entry.shape} {entry.dtype} "
                                f"expert {entry.expert} split {entry.split}")
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
                        extra=dict(extra or {}),
                        version=(SPLIT_VERSION if any(e.split is not None for e in tensors.values())
                                 else VERSION))
    problems.extend(manifest.validate())
    if problems:
        raise ValueError("cannot assemble the manifest:\n  " + "\n  ".join(problems))
    return manifest
