"""Load a MoC checkpoint: assemble each tensor from its fragments, taking every expert
from the checkpoint that holds its newest version.

Multi-rank call order (the orchestration owns the collectives)::

    rank 0:    tag, skipped = find_loadable(save_dir, checksums=False, cache=manifests)
               res = resolve_checkpoint(save_dir, tag, manifests)  # structure checked
               warn about `skipped`; broadcast (tag, res) (tag None = fresh start)
    each rank: with CheckpointReader(save_dir, tag, check_structure=False,
                                     resolution=res) as ckpt:
                   for name, kind in what this rank owns under the NEW layout:
                       ckpt.read(name, kind, start, length, out=flat_buffer[...])
                   state = ckpt.objects()                 # iteration, RNG, scheduler
               (each file is checksummed by the rank that reads it, before its first
               read; a mismatch raises CheckpointError: gather the outcomes, and when
               any rank failed so, rank 0 chooses again with that tag excluded)

Each rank reads only the element ranges it needs, whatever layout (world size, ZeRO
partitioning, expert parallel size) the checkpoint was written with.
"""

import bisect
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.format.dtypes import dtype_from_name
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.fragment_reader import FragmentReader
from deepspeed_ext.format.manifest import Manifest
from deepspeed_ext.format.naming import tensor_key
from deepspeed_ext.format.splits import TensorSplit, convert, same_order
from deepspeed_ext.format.vocab import PaddedVocab, RowPlan, fit_rows, plan_rows
from deepspeed_ext.format.objects import OBJECTS_FILE, decode, read_objects_file, tensor_keys
from deepspeed_ext.format.storage import FileRecord, verify_file
from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.store.catalog import (Resolution, ResolvedTensor, resolve_checkpoint,
                                         scan_checkpoints)
from deepspeed_ext.store.latest import read_latest
from deepspeed_ext.store.pins import reading
from deepspeed_ext.store.verify import verify_checkpoint, verify_resolution

__all__ = ["CheckpointError", "CheckpointReader", "TensorInfo", "find_loadable"]


@dataclass(frozen=True)
class TensorInfo:
    """Global facts of one tensor of a checkpoint."""

    name: str
    kind: str
    shape: Tuple[int, ...]
    """Global shape."""
    dtype: torch.dtype
    expert: Optional[Tuple[int, int]]
    """``(moe_layer, expert)`` or None."""
    tag: str
    """Checkpoint its bytes come from (older than the loaded one for an expert not
    saved there)."""
    step: int
    """Step of that version: ``reader.step - info.step`` steps of its updates are lost."""
    split: Optional[TensorSplit] = None
    """The tensor-parallel split it was saved with (None: saved whole, row-major)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def find_loadable(save_dir: str, checksums: bool = True,
                  exclude: Optional[Dict[str, str]] = None,
                  cache: Optional[Dict[str, Manifest]] = None) -> Tuple[Optional[str], List[str]]:
    """The checkpoint a restart should load, skipping broken ones.

    Tries the tag in ``latest`` first, then every complete checkpoint from the newest
    step down, and returns the first that :func:`~deepspeed_ext.store.verify.verify_checkpoint`
    passes. Call it on one rank (with ``checksums`` it reads every needed byte once) and
    broadcast the result. Each candidate is verified under
    :func:`~deepspeed_ext.store.pins.reading`: a committer's retention in another process
    (a keeper finishing a persist) deleting it meanwhile made a healthy checkpoint look
    damaged, and the restart fell back to an older one.

    Args:
        save_dir: the checkpoint root.
        checksums: verify SHA-256 of every needed file.
        exclude: tags already found unusable (tag -> why), passed over with that reason
            (a load whose ranks found a bad checksum while reading tries the next one).
        cache: tag -> manifest, filled with the manifests read (a caller that resolves
            the chosen tag next reads none of them again).

    Returns:
        ``(tag, skipped)``: ``skipped`` has one line per checkpoint passed over (newer
        than ``tag``, or named by ``latest``) with its problems, for a warning.
        ``(None, [])`` when ``save_dir`` holds no checkpoint at all (a fresh start).

    Raises:
        CheckpointError: checkpoints exist but none loads. Starting from scratch then
            would silently throw the run away, so this is left to the user.
    """
    skipped: List[str] = []
    candidates: List[str] = []
    try:
        latest = read_latest(save_dir)
    except CheckpointError as err:
        skipped.append(str(err))
        latest = None
    if latest is not None:
        candidates.append(latest)
    scan = scan_checkpoints(save_dir)
    for _, tag in reversed(scan.complete):
        if tag not in candidates:
            candidates.append(tag)
    for tag, err in scan.corrupt:
        if tag != latest:
            skipped.append(f"skipped checkpoint {tag}: {err}")
    for tag in candidates:
        if exclude and tag in exclude:
            skipped.append(f"skipped checkpoint {tag}: {exclude[tag]}")
            continue
        with reading(save_dir, tag):
            problems = verify_checkpoint(save_dir, tag, checksums=checksums, cache=cache)
        if not problems:
            return tag, skipped
        skipped.append(f"skipped checkpoint {tag}: " + "; ".join(problems))
    if not skipped:
        return None, []
    raise CheckpointError(f"no loadable checkpoint in {save_dir}:\n  " + "\n  ".join(skipped))


class CheckpointReader:
    """Random access to the tensors and objects of one checkpoint.

    Opening reads the manifests (this tag's and those its expert index names), checks
    files exist with their recorded sizes, each fragment is in its file, and every
    tensor is covered exactly once; it raises :class:`~deepspeed_ext.format.errors.CheckpointError` listing the
    problems otherwise. It reads no tensor data.

    Args:
        save_dir: the checkpoint root.
        tag: the checkpoint; None = the one ``latest`` names (no fallback; use
            :func:`find_loadable` for that).
        verify_checksums: hash each file once, right before its first use, and raise
            :class:`~deepspeed_ext.format.errors.CheckpointError` naming it on a mismatch (and on a wrong size).
            That reads each file this reader uses once, whole: every rank checks what
            it reads itself, in parallel.
        check_structure: check every file of the checkpoint (sizes, the fragments in
            each, coverage) when opening. With many ranks let one rank do it (as
            :func:`find_loadable` does without checksums) and pass False elsewhere:
            otherwise every rank opens every rank's files.
        resolution: ``tag``'s :func:`~deepspeed_ext.store.catalog.resolve_checkpoint`, when
            one rank read the manifests and sent it (else every rank reads every
            manifest the checkpoint's expert index names).

    The checkpoint is pinned against retention (:func:`~deepspeed_ext.store.pins.reading`,
    which also keeps the older checkpoints its expert index names) from before its
    manifest is read until :meth:`close`: retention run by a committer in another process
    (a keeper still persisting) deleted files under a loading job, whose ranks then
    failed to read what the manifest promised.

    File handles are cached until :meth:`close` (or the ``with`` block ends). Not
    thread-safe.
    """

    def __init__(self, save_dir: str, tag: Optional[str] = None,
                 verify_checksums: bool = True, check_structure: bool = True,
                 resolution: Optional[Resolution] = None):
        self.save_dir = save_dir
        self._readers: Dict[Tuple[str, str], FragmentReader] = {}
        self._pin = contextlib.ExitStack()
        if tag is None:
            tag = read_latest(save_dir)
            if tag is None:
                raise CheckpointError(f"{os.path.join(save_dir, 'latest')}: missing or empty; "
                                      f"no complete checkpoint is recorded in {save_dir}")
        try:
            self._open(save_dir, tag, check_structure, resolution)
        except BaseException:
            self._pin.close()
            raise
        self.verify_checksums = verify_checksums
        self._verified: set = set()
        self._offsets: Dict[str, List[int]] = {}
        self._reordered: Optional[Tuple[Tuple, torch.Tensor]] = None

    def _open(self, save_dir: str, tag: str, check_structure: bool,
              resolution: Optional[Resolution]) -> None:
        """Pin ``tag``, then read (or take) its resolution and check its structure."""
        # Before the manifest is read: a retention that held the tag first finishes its
        # deletion, and the resolution below then finds no manifest.
        self._pin.enter_context(reading(save_dir, tag))
        if resolution is not None and resolution.manifest.tag == tag:
            self._res = resolution
        else:
            try:
                self._res = resolve_checkpoint(save_dir, tag)
            except ValueError as err:  # a malformed tag
                raise CheckpointError(str(err)) from None
        problems = verify_resolution(save_dir, self._res, checksums=False) \
            if check_structure else []
        if problems:
            raise CheckpointError(f"checkpoint {tag} in {save_dir} cannot be loaded:\n  "
                                  + "\n  ".join(problems))

    # ------------------------------------------------------------------ properties
    @property
    def manifest(self) -> Manifest:
        """The loaded checkpoint's manifest."""
        return self._res.manifest

    @property
    def tag(self) -> str:
        return self._res.manifest.tag

    @property
    def step(self) -> int:
        return self._res.manifest.step

    def expert_versions(self) -> Dict[Tuple[int, int], Tuple[int, str]]:
        """``(moe_layer, expert)`` -> ``(step, tag)`` of the version this load uses; when
        its weights and optimizer state come from different checkpoints, the older one
        (the expert is whole only up to that step)."""
        return {k: min(v.part("w"), v.part("o"))
                for k, v in self.manifest.expert_versions().items()}

    def keys(self) -> List[Tuple[str, str]]:
        """Every ``(name, kind)``, sorted."""
        return sorted((rt.name, rt.kind) for rt in self._res.tensors.values())

    def tensor_names(self, kind: Optional[str] = None) -> List[str]:
        """Sorted global tensor names (of one ``kind`` if given)."""
        return sorted({rt.name for rt in self._res.tensors.values()
                       if kind is None or rt.kind == kind})

    def kinds(self, name: Optional[str] = None) -> List[str]:
        """Sorted kinds (``fp32``, ``exp_avg``, ...), of one tensor if ``name`` is given."""
        return sorted({rt.kind for rt in self._res.tensors.values()
                       if name is None or rt.name == name})

    def info(self, name: str, kind: str) -> TensorInfo:
        """Shape, dtype, expert and source checkpoint of a tensor (KeyError if absent)."""
        rt = self._resolved(name, kind)
        return TensorInfo(name=name, kind=kind, shape=tuple(rt.entry.shape),
                          dtype=dtype_from_name(rt.entry.dtype), expert=rt.entry.expert,
                          tag=rt.tag, step=rt.step, split=rt.entry.split)

    # ---------------------------------------------------------------------- reads
    def read(self, name: str, kind: str, start: int = 0, length: Optional[int] = None,
             out: Optional[torch.Tensor] = None, split: Optional[TensorSplit] = None,
             rows: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened global tensor, in the
        order of ``split`` (None: row-major); with ``rows``, of the tensor with its first
        dimension trimmed or extended with zero rows to ``rows``
        (:func:`deepspeed_ext.format.vocab.fit_rows`: a padded vocabulary loaded under
        another padding).

        When the checkpoint stored the tensor in that order (saved by the same
        tensor-parallel split, or whole and read whole), reads only the byte ranges of
        the fragments that overlap the range. Otherwise (a load under another
        tensor-parallel size, or other ``rows``) it reads the whole tensor once, re-orders
        it (:func:`deepspeed_ext.format.splits.convert`), fits its rows, and keeps it for
        the next range of the same tensor, order and rows. Either way from the checkpoint
        that holds the tensor's newest version.

        Args:
            name, kind: the tensor.
            start: first element of the flattened tensor.
            length: number of elements; None = to the end.
            out: optional 1-D tensor of ``length`` elements and the stored dtype to fill
                (e.g. a slice of the rank's flat ZeRO partition); returned.
            split: the order to read in: a tensor-parallel rank's split, whose part ``p``
                is elements ``[p * part_numel, (p + 1) * part_numel)``.
            rows: the first dimension to read the tensor with (None: as saved).

        Raises:
            KeyError: no such tensor.
            IndexError: the range is outside the tensor.
            ValueError: ``out`` does not fit, or ``split`` is not one of this tensor.
            CheckpointError: a file fails its checksum (with ``verify_checksums``) or
                cannot be read.
        """
        rt = self._resolved(name, kind)
        shape = tuple(rt.entry.shape)
        if rows is not None and (not shape or type(rows) is not int or rows < 1):
            raise ValueError(f"{name}|{kind}: cannot read a tensor of shape {list(shape)} "
                             f"with {rows!r} rows")
        rows = None if rows is None or rows == shape[0] else rows
        numel = rt.entry.numel if rows is None else rt.entry.numel // shape[0] * rows
        if length is None:
            length = numel - start
        if start < 0 or length < 0 or start + length > numel:
            raise IndexError(f"{name}|{kind}: range [{start}, {start + length}) outside its "
                             f"{numel} elements")
        dtype = dtype_from_name(rt.entry.dtype)
        if out is None:
            out = torch.empty(length, dtype=dtype)
        elif out.dim() != 1 or out.numel() != length or out.dtype != dtype:
            raise ValueError(f"{name}|{kind}: out must be 1-D {dtype} with {length} elements, "
                             f"got {tuple(out.shape)} {out.dtype}")
        if rows is None and same_order(rt.entry.split, split):
            return self._read_stored(rt, name, kind, start, length, out)
        return out.copy_(self._whole(rt, name, kind, split, rows).narrow(0, start, length))

    def _whole(self, rt: ResolvedTensor, name: str, kind: str, split: Optional[TensorSplit],
               rows: Optional[int]) -> torch.Tensor:
        """The whole tensor in ``split``'s order with ``rows`` rows (None: as saved), kept
        for the next range of it (one whole tensor at a time)."""
        key = (rt.tag, name, kind, split, rows)
        if self._reordered is None or self._reordered[0] != key:
            self._reordered = None
            numel = rt.entry.numel
            stored = self._read_stored(rt, name, kind, 0, numel,
                                       torch.empty(numel, dtype=dtype_from_name(rt.entry.dtype)))
            if rows is None:
                whole = convert(stored, rt.entry.split, split)
            else:
                fitted = fit_rows(convert(stored, rt.entry.split, None).view(rt.entry.shape), rows)
                whole = convert(fitted.view(-1), None, split)
            self._reordered = (key, whole)
        return self._reordered[1]

    def _read_stored(self, rt: ResolvedTensor, name: str, kind: str, start: int, length: int,
                     out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + length)`` in the stored order, into ``out``."""
        frags = rt.entry.fragments
        offsets = self._offsets.get(tensor_key(name, kind))
        if offsets is None:
            offsets = self._offsets[tensor_key(name, kind)] = [f.offset for f in frags]
        end = start + length
        pos = start
        i = bisect.bisect_right(offsets, start) - 1
        while pos < end:
            frag = frags[i]
            stop = min(frag.offset + frag.length, end)
            self._fragment_file(rt.tag, frag.file).read(
                frag.key, pos - frag.offset, stop - pos, out=out[pos - start:stop - start])
            pos = stop
            i += 1
        return out

    def read_full(self, name: str, kind: str, rows: Optional[int] = None) -> torch.Tensor:
        """The whole tensor in its global shape (a split one re-assembled), with ``rows``
        rows if given (see :meth:`read`)."""
        shape = tuple(self._resolved(name, kind).entry.shape)
        if rows is not None:
            shape = (rows,) + shape[1:]
        return self.read(name, kind, rows=rows).view(shape)

    def objects(self) -> Any:
        """The decoded ``objects.json`` of this checkpoint; None when it has none."""
        if OBJECTS_FILE not in self.manifest.files:
            return None
        self._check_once(self.tag, OBJECTS_FILE)
        objects = read_objects_file(os.path.join(self.save_dir, self.tag))
        keys = tensor_keys(objects.tree)
        tensors = {}
        if keys:
            reader = self._fragment_file(self.tag, objects.tensor_file)
            tensors = {k: reader.read_tensor(k) for k in keys}
        try:
            return decode(objects.tree, tensors)
        except ValueError as err:
            raise CheckpointError(f"{os.path.join(self.save_dir, self.tag, OBJECTS_FILE)}: "
                                  f"{err}") from None

    # -------------------------------------------------------------------- internals
    def _resolved(self, name: str, kind: str) -> ResolvedTensor:
        rt = self._res.tensors.get(f"{name}|{kind}")
        if rt is None:
            raise KeyError(f"checkpoint {self.tag} has no tensor {name!r} of kind {kind!r}")
        return rt

    def _check_once(self, tag: str, rel: str) -> None:
        if not self.verify_checksums or (tag, rel) in self._verified:
            return
        entry = self._res.manifests[tag].files[rel]
        verify_file(os.path.join(self.save_dir, tag, rel),
                    FileRecord(nbytes=entry.nbytes, sha256=entry.sha256))
        self._verified.add((tag, rel))

    def _fragment_file(self, tag: str, rel: str) -> FragmentReader:
        reader = self._readers.get((tag, rel))
        if reader is None:
            self._check_once(tag, rel)
            reader = FragmentReader(os.path.join(self.save_dir, tag, rel))
            self._readers[(tag, rel)] = reader
        return reader

    def close(self) -> None:
        """Close every cached file and release the pin (reads afterwards reopen the
        files, unpinned: retention may delete them then)."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._reordered = None
        self._pin.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_saved_shape(reader: CheckpointReader, frag, load_dir: str, tag: str,
                      plan: Optional[RowPlan] = None) -> Optional[int]:
    """Refuse a tensor saved with another shape: reads go by flat element ranges, so a
    smaller model (say, another --ffn-hidden-size) would load the first elements of each
    saved tensor, laid out wrongly, without an error (the trainer's check of the saved
    arguments is skipped when it falls back past a damaged newest checkpoint). A tensor
    of ``plan`` (:func:`deepspeed_ext.format.vocab.plan_rows`) must have the plan's saved
    rows and the model's other dimensions.

    ``frag`` is the rank's fragment (:class:`deepspeed_ext.state.LocalFragment`: its
    ``name``, ``kind`` and ``shape`` are read).

    Returns:
        The ``rows`` to :meth:`CheckpointReader.read` the fragment with (None: as saved).

    Raises:
        MoCCheckpointError: naming the tensor and both shapes.
    """
    saved = tuple(reader.info(frag.name, frag.kind).shape)
    fitted = plan is not None and frag.name in plan.names
    if fitted and (tuple(frag.shape[:1]) != (plan.rows,) or saved != plan.saved_shape(frag.shape)):
        raise MoCCheckpointError(
            f"{os.path.join(load_dir, tag)}: {frag.name} ({frag.kind}) was saved with shape "
            f"{list(saved)}, this model's is {list(frag.shape)}: only its vocabulary rows "
            f"may differ ({plan.saved_rows} saved, {plan.rows} described by the model)")
    if fitted:
        return plan.rows
    if saved != tuple(frag.shape):
        raise MoCCheckpointError(
            f"{os.path.join(load_dir, tag)}: {frag.name} ({frag.kind}) was saved with shape "
            f"{list(saved)}, this model's is {list(frag.shape)}: the checkpoint belongs to "
            f"another model configuration (compare the model flags with the run that saved it)")


def vocab_plan(reader: CheckpointReader, model: Optional[PaddedVocab],
               saved_record: Any) -> Optional[RowPlan]:
    """What loading ``reader``'s checkpoint into the model ``model`` describes does with
    the padded-vocabulary rows (:func:`deepspeed_ext.format.vocab.plan_rows`); None:
    nothing to fit. ``saved_record``: the checkpoint objects'
    :data:`~deepspeed_ext.format.vocab.OBJECTS_KEY` entry (None when absent).

    Every loading rank calls it with the same checkpoint (no collective), and
    ``moc-ckpt consolidate --padded-vocab-size``.

    Raises:
        VocabMismatch: see :func:`~deepspeed_ext.format.vocab.plan_rows`.
        ValueError: a malformed record.
    """
    if model is None:
        return None
    saved_rows: Dict[str, int] = {}
    for name, kind in reader.keys():  # one kind's rows; check_saved_shape checks each
        if name in model.names and name not in saved_rows:
            shape = reader.info(name, kind).shape
            saved_rows[name] = shape[0] if shape else 0
    return plan_rows(model, PaddedVocab.from_record(saved_record), saved_rows)
