"""The catalog of a save directory: which checkpoints it holds (complete, corrupt,
incomplete), and for a tag, which checkpoint holds each tensor it needs."""

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import (MANIFEST_FILE, PART_NAMES, ExpertVersion, Manifest,
                                           TensorEntry, read_manifest, tensor_problems)
from deepspeed_ext.format.naming import check_tag, split_or_raw, try_parse_expert_key
from deepspeed_ext.policy.pec import part_of_kind


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



def referenced_tags(save_dir: str, tag: str) -> Set[str]:
    """``tag`` plus every checkpoint its expert index points to: what loading it reads.

    Not transitive: an index already names each expert's newest version directly.

    Raises:
        CheckpointError: ``tag``'s manifest is missing or unreadable.
    """
    manifest = read_manifest(os.path.join(save_dir, check_tag(tag)))
    return {tag}.union(*(v.tags() for v in manifest.expert_index.values()))


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
        name, kind = split_or_raw(tkey)
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
    problems: List[str] = []
    expert = try_parse_expert_key(ekey)
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
            if e.expert == expert and part_of_kind(split_or_raw(k)[1]) in parts}
    if not held:
        what = " and ".join(PART_NAMES[p] for p in parts)
        problems.append(f"{label}, which holds no tensor of expert {ekey} ({what})")
    for tkey, entry in sorted(held.items()):
        problems.extend(tensor_problems(old_tag, tkey, entry, old.files))
        if tkey in tensors:
            problems.append(f"{tag}: tensor {tkey} is both in {tensors[tkey].tag} and, "
                            f"for expert {ekey}, in {old_tag}")
            continue
        name, kind = split_or_raw(tkey)
        tensors[tkey] = ResolvedTensor(name, kind, entry, old_tag, old.step)
    return problems

