"""Verification of a checkpoint: everything that would make loading it fail or load
wrong data, from the manifests down to every needed file's bytes."""

import os
from typing import Dict, List, Optional, Set, Tuple

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.fragment_reader import FragmentReader
from deepspeed_ext.format.manifest import FileEntry, Fragment, Manifest, TensorEntry
from deepspeed_ext.format.naming import plain_file_name
from deepspeed_ext.format.objects import OBJECTS_FILE, read_objects_file, tensor_keys
from deepspeed_ext.format.storage import check_file
from deepspeed_ext.store.catalog import Resolution, resolve_checkpoint



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
        cache: tag -> manifest, shared with other calls (:func:`~deepspeed_ext.store.catalog.resolve_checkpoint`).

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
    the manifests when the caller needs the :class:`~deepspeed_ext.store.catalog.Resolution` anyway)."""
    tag = res.manifest.tag
    problems = list(res.problems)

    needed: Dict[Tuple[str, str], FileEntry] = {
        (tag, rel): fe for rel, fe in res.manifest.files.items() if plain_file_name(rel)}
    by_file: Dict[Tuple[str, str], List[Tuple[str, TensorEntry, Fragment]]] = {}
    for tkey, rt in res.tensors.items():
        files = res.manifests[rt.tag].files
        for frag in rt.entry.fragments:
            if frag.file in files and plain_file_name(frag.file):
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


