"""Typed records of the jobs a training process hands to its node's keeper.

A job crosses a process boundary as JSON over the keeper's socket
(:func:`deepspeed_ext.keeper.hand_over`): the training side builds a record and sends
its :meth:`to_json`; the keeper parses the request with :func:`job_from_json` (type and
bounds of every field; the paths are checked against the keeper's directories by
:func:`deepspeed_ext.keeper.job_checks.check_job`) and runs the typed record.

* :class:`PersistJob`: one rank's share of a two-level snapshot to write to storage
  (built by :class:`deepspeed_ext.two_level.TwoLevel`); rank 0's carries a
  :class:`CommitSpec`, what the keeper needs to commit the checkpoint.
* :class:`FrameJob`: one exact-recovery frame to copy (built by
  :mod:`deepspeed_ext.exact`).

Wire format: :meth:`to_json` gives exactly the keys and value shapes these jobs had as
plain dicts, because keepers outlive restarts: a keeper of older code must run a job of
this code, and this code must run an older trainer's job (``objects_in_file`` of old
jobs is still read). Unknown keys are ignored (dropped), so that a newer trainer adding
an optional field still talks to this keeper, as today's keeper ignored them; a missing
required key or a wrong value is refused with :class:`JobRefused` naming the field.

Pure data: no I/O and no heavy imports here (a frame job must not wait for torch).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from deepspeed_ext.format.image_entry import ImageEntry


class JobRefused(ValueError):
    """A job the keeper will not run (the message names the field)."""


_REQUIRED = object()


def _field(data: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED) -> Any:
    if key not in data:
        if default is _REQUIRED:
            raise JobRefused(f"{where}: missing required key {key!r}")
        return default
    return data[key]


def _int(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JobRefused(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _str(value: Any, name: str, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or "\0" in value:
        raise JobRefused(f"{name} must be a non-empty string{' or null' if optional else ''}, "
                         f"got {value!r}")
    return value


def _number(value: Any, name: str, optional: bool = False,
            positive: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise JobRefused(f"{name} must be a finite{' positive' if positive else ''} number"
                         f"{' or null' if optional else ''}, got {value!r}")
    return value


def _object(value: Any, name: str, optional: bool = False) -> Optional[Dict[str, Any]]:
    if value is None and optional:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise JobRefused(f"{name} must be a JSON object{' or null' if optional else ''}, "
                         f"got {type(value).__name__}")
    return value


def _strings(value: Any, name: str) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise JobRefused(f"{name} must be a list of strings, got {value!r}")
    return tuple(value)


def image_entry_from_json(data: Any, where: str = "entry") -> ImageEntry:
    """Parse one tensor's :class:`~deepspeed_ext.format.image_entry.ImageEntry` from a
    job (:meth:`ImageEntry.to_json`'s keys); :class:`JobRefused` names the offending field.

    Called by :meth:`PersistJob.from_json` in the keeper (or in a rank that persists
    itself) for each entry of a job, and by the training side when it builds a
    :class:`PersistJob` from a snapshot's recorded layout.
    """
    _object(data, where)
    shape = _field(data, "shape", where)
    if not isinstance(shape, (list, tuple)):
        raise JobRefused(f"{where}.shape must be a list of integers, got {shape!r}")
    return ImageEntry(key=_str(_field(data, "key", where), f"{where}.key"),
                      dtype=_str(_field(data, "dtype", where), f"{where}.dtype"),
                      shape=tuple(_int(d, f"{where}.shape") for d in shape),
                      start=_int(_field(data, "start", where), f"{where}.start"),
                      nbytes=_int(_field(data, "nbytes", where), f"{where}.nbytes"))


LAYOUT_KEYS = ("world_size", "ep_size", "zero_stage", "num_moe_layers", "num_experts")
"""The keys of the manifest's layout record (the checkpointer's, as rank 0 sends it)."""


@dataclass(frozen=True)
class CommitSpec:
    """What rank 0's keeper needs to commit a checkpoint once every report is in: the
    arguments of :func:`deepspeed_ext.store.commit.commit_checkpoint` beyond the directory,
    plus how long to wait for the reports."""

    step: int
    layout: Mapping[str, int]
    """``world_size`` (>= 1), ``ep_size``, ``zero_stage``, ``num_moe_layers``, ``num_experts``."""
    previous_tag: Optional[str]
    selected: Optional[Tuple[Tuple[int, int], ...]]
    """``(layer, expert)`` pairs the checkpoint holds; None without MoE."""
    pec_k: Optional[int]
    save_latest: bool
    keep: int
    timeout_s: float
    attempt_started: Optional[float] = None

    @property
    def world_size(self) -> int:
        return self.layout["world_size"]

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "layout": dict(self.layout),
                "previous_tag": self.previous_tag,
                "selected": [list(p) for p in self.selected] if self.selected is not None
                else None,
                "pec_k": self.pec_k, "save_latest": self.save_latest, "keep": self.keep,
                "timeout_s": self.timeout_s, "attempt_started": self.attempt_started}

    @classmethod
    def from_json(cls, data: Any, where: str = "commit") -> "CommitSpec":
        _object(data, where)
        layout = _object(_field(data, "layout", where), f"{where}.layout")
        for key in LAYOUT_KEYS:
            _int(_field(layout, key, f"{where}.layout"), f"{where}.layout.{key}",
                 1 if key == "world_size" else 0)
        selected = _field(data, "selected", where)
        if selected is not None:
            if not isinstance(selected, (list, tuple)) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 for p in selected):
                raise JobRefused(f"{where}.selected must be null or a list of [layer, expert], "
                                 f"got {selected!r}")
            selected = tuple((_int(p[0], f"{where}.selected"), _int(p[1], f"{where}.selected"))
                             for p in selected)
        pec_k = _field(data, "pec_k", where)
        save_latest = _field(data, "save_latest", where)
        if not isinstance(save_latest, bool):
            raise JobRefused(f"{where}.save_latest must be true or false, got {save_latest!r}")
        return cls(step=_int(_field(data, "step", where), f"{where}.step"),
                   layout={k: layout[k] for k in LAYOUT_KEYS},
                   previous_tag=_str(_field(data, "previous_tag", where), f"{where}.previous_tag",
                                     optional=True),
                   selected=selected,
                   pec_k=_int(pec_k, f"{where}.pec_k") if pec_k is not None else None,
                   save_latest=save_latest,
                   keep=_int(_field(data, "keep", where), f"{where}.keep"),
                   timeout_s=_number(_field(data, "timeout_s", where), f"{where}.timeout_s",
                                     positive=True),
                   attempt_started=_number(data.get("attempt_started"),
                                           f"{where}.attempt_started", optional=True))


@dataclass(frozen=True)
class PersistJob:
    """One rank's share of a snapshot, for the keeper to write to storage
    (:func:`deepspeed_ext.keeper.run_persist_job`).

    Built on every rank by ``TwoLevel`` when a snapshot is due for storage; the copy
    thread adds ``checksum`` and ``done_marker`` and the hand-over thread ``id``
    (:func:`dataclasses.replace`: the record is frozen)."""

    image: str
    """The slot image file in memory."""
    entries: Tuple[ImageEntry, ...]
    keys: Optional[Tuple[str, ...]]
    """The tensors to persist; None: all."""
    specs: Tuple[Mapping[str, Any], ...]
    """Their manifest fragment specs (``FragmentSpec.to_json``; parsed by the keeper)."""
    save_dir: str
    tag: str
    step: int
    rank: int
    objects_tree: Optional[Mapping[str, Any]] = None
    """Rank 0: the objects to write as ``objects.json``; else None."""
    object_keys: Tuple[str, ...] = ()
    """Rank 0: the image's tensors of the objects (``objects.safetensors``)."""
    claim: Optional[str] = None
    """Rank 0's claim on the tag directory (None: unchecked)."""
    run_id: Optional[str] = None
    checksum: Optional[str] = None
    """The image's memory checksum (:mod:`deepspeed_ext.format.memsum`)."""
    commit: Optional[CommitSpec] = None
    """Rank 0: commit the checkpoint once every report is in."""
    done_marker: Optional[str] = None
    """A file deleted once the slot has been read (the slot may be reused)."""
    id: Optional[str] = None
    """Retries of one hand-over carry the same id (:func:`deepspeed_ext.keeper.job_id`)."""
    objects_record: Optional[Mapping[str, Any]] = None
    """Rank 0, when it wrote the objects itself: their ``objects.json`` record."""
    extra_files: Optional[Mapping[str, Any]] = None
    """With ``objects_record``: other files rank 0 wrote (name -> record)."""
    objects_in_file: bool = False
    """Jobs of older versions: the objects' tensors are in the rank file."""

    def to_json(self) -> Dict[str, Any]:
        """The job as today's keepers read it (optional keys only when set)."""
        data = {"image": self.image, "entries": [e.to_json() for e in self.entries],
                "keys": list(self.keys) if self.keys is not None else None,
                "specs": [dict(s) for s in self.specs], "save_dir": self.save_dir,
                "tag": self.tag, "step": self.step, "rank": self.rank,
                "objects_tree": self.objects_tree, "object_keys": list(self.object_keys),
                "claim": self.claim, "run_id": self.run_id, "checksum": self.checksum}
        if self.commit is not None:
            data["commit"] = self.commit.to_json()
        if self.objects_record is not None or self.extra_files:
            data["objects_record"] = self.objects_record
            data["extra_files"] = dict(self.extra_files or {})
        if self.objects_in_file:
            data["objects_in_file"] = True
        for key in ("done_marker", "id"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data

    @classmethod
    def from_json(cls, data: Any) -> "PersistJob":
        """Parse a job from the socket; :class:`JobRefused` names the offending field."""
        where = "job"
        _object(data, where)
        entries = _field(data, "entries", where)
        if not isinstance(entries, list):
            raise JobRefused(f"entries must be a list, got {type(entries).__name__}")
        keys = _field(data, "keys", where)
        specs = _field(data, "specs", where)
        if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
            raise JobRefused(f"specs must be a list of JSON objects, got {specs!r}")
        commit = data.get("commit")
        extra = _object(data.get("extra_files"), "extra_files", optional=True)
        objects_in_file = data.get("objects_in_file", False)
        if not isinstance(objects_in_file, bool):
            raise JobRefused(f"objects_in_file must be true or false, got {objects_in_file!r}")
        return cls(
            image=_str(_field(data, "image", where), "image"),
            entries=tuple(image_entry_from_json(e, f"entries[{i}]") for i, e in enumerate(entries)),
            keys=_strings(keys, "keys") if keys is not None else None,
            specs=tuple(specs),
            save_dir=_str(_field(data, "save_dir", where), "save_dir"),
            tag=_str(_field(data, "tag", where), "tag"),
            step=_int(_field(data, "step", where), "step"),
            rank=_int(_field(data, "rank", where), "rank"),
            objects_tree=_object(data.get("objects_tree"), "objects_tree", optional=True),
            object_keys=_strings(data.get("object_keys") or [], "object_keys"),
            claim=_str(data.get("claim"), "claim", optional=True),
            run_id=_str(data.get("run_id"), "run_id", optional=True),
            checksum=_str(data.get("checksum"), "checksum", optional=True),
            commit=CommitSpec.from_json(commit) if commit is not None else None,
            done_marker=_str(data.get("done_marker"), "done_marker", optional=True),
            id=_str(data.get("id"), "id", optional=True),
            objects_record=_object(data.get("objects_record"), "objects_record", optional=True),
            extra_files=extra,
            objects_in_file=objects_in_file)


FRAME = "frame"
"""The ``kind`` of a frame job (a persist job has none)."""


@dataclass(frozen=True)
class FrameJob:
    """Copy one exact-recovery frame of one rank from memory to storage
    (:func:`deepspeed_ext.keeper.persist_frame`); built by ``ExactSnapshots``."""

    data: str
    marker: str
    """The frame's files in memory."""
    dst_data: str
    dst_marker: str
    """Their paths on storage."""
    save_dir: str
    run_id: Optional[str] = None
    id: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        data = {"kind": FRAME, "data": self.data, "marker": self.marker,
                "dst_data": self.dst_data, "dst_marker": self.dst_marker,
                "save_dir": self.save_dir, "run_id": self.run_id}
        if self.id is not None:
            data["id"] = self.id
        return data

    @classmethod
    def from_json(cls, data: Any) -> "FrameJob":
        """Parse a frame job; :class:`JobRefused` names the offending field."""
        where = "frame job"
        _object(data, where)
        if data.get("kind") != FRAME:
            raise JobRefused(f"kind must be {FRAME!r}, got {data.get('kind')!r}")
        return cls(**{f.name: _str(_field(data, f.name, where), f.name,
                                   optional=f.default is None)
                      for f in dataclasses.fields(cls)
                      if f.default is not None or f.name in data})


Job = Union[PersistJob, FrameJob]


def job_from_json(data: Any) -> Job:
    """The job of a ``persist`` request: a :class:`FrameJob` when its ``kind`` is
    ``"frame"``, else a :class:`PersistJob` (``kind`` absent, or ``"snapshot"``)."""
    if not isinstance(data, dict):
        raise JobRefused("a job must be a JSON object")
    kind = data.get("kind")
    if kind == FRAME:
        return FrameJob.from_json(data)
    if kind not in (None, "snapshot"):
        raise JobRefused(f"unknown job kind {kind!r}")
    return PersistJob.from_json(data)
