"""Retention: deleting old checkpoints, crashed saves' leftovers and trash, crash-safely,
never one that ``latest`` names, a kept one references, or a reader pins."""

import os
import re
import time
from typing import Iterable, List, Optional, Set

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE
from deepspeed_ext.format.naming import check_tag
from deepspeed_ext.format.fs import fsync_dir
from deepspeed_ext.store.catalog import referenced_tags, scan_checkpoints
from deepspeed_ext.store.latest import later_attempt_started, read_latest
from deepspeed_ext.store.locking import locked_dir
from deepspeed_ext.store.pins import RetentionProbe

TRASH_PREFIX = ".moc-trash."

_TAG_DIR_ENTRY = re.compile(
    r"^(rank\d{5,}\.safetensors|rank\d{5,}\.report\.json|commit\.failed\.json|commit\.claim|"
    r"objects\.json|objects\.safetensors|manifest\.json)(\.tmp\.\d+)?$")
"""Names MoC writes into a tag directory. A manifest-less directory is deleted by
retention only if it holds nothing else, so a user's unrelated directory inside
save_dir (tensorboard/, a copied dataset) is never removed."""



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
    discard_dir(save_dir, tag)


def discard_dir(save_dir: str, tag: str) -> None:
    # pid and time make the name unique: a rename onto a leftover trash directory of
    # the same tag (an earlier rmtree that failed) would fail.
    if fs.is_url(save_dir):  # no rename; the tag counts as incomplete until all is gone
        fs.rmtree(os.path.join(save_dir, tag))
        return
    trash = os.path.join(save_dir, f"{TRASH_PREFIX}{tag}.{os.getpid()}.{time.time_ns()}")
    os.rename(os.path.join(save_dir, tag), trash)
    fsync_dir(save_dir)
    fs.rmtree(trash)


def holds_only_moc_files(tag_dir: str) -> bool:
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



def apply_retention(save_dir: str, keep: int, protect: Iterable[str] = ()) -> List[str]:
    """Delete old checkpoints and leftovers of crashed saves (rank 0, after a save).

    Keeps the newest ``keep`` complete checkpoints, the one ``latest`` names, the tags in
    ``protect`` (the committer's: the checkpoint it just committed), and every
    checkpoint their expert indexes reference (an old checkpoint may hold the newest
    version of an expert not saved since), and every checkpoint a reader pins
    (:func:`~deepspeed_ext.store.pins.reading`). Deletes the other complete checkpoints,
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
    protected = _protected(save_dir, tags, keep, protect)
    commits = [fs.mtime(os.path.join(save_dir, t, MANIFEST_FILE)) for t in tags]
    newest_commit = None if None in commits else max(commits)
    probe = RetentionProbe(save_dir)
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
        if holds_only_moc_files(tag_dir) and last is not None and last < newest_commit:
            discard_dir(save_dir, tag)
            deleted.append(tag)
    return deleted


def _protected(save_dir: str, tags: List[str], keep: int, protect: Iterable[str]) -> Set[str]:
    """:func:`apply_retention`'s keepers among complete ``tags`` (oldest first): the newest
    ``keep``, ``latest``'s target, ``protect``, and every tag their expert indexes name."""
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
    protected: Set[str] = set()
    for tag in kept:
        protected |= referenced_tags(save_dir, tag)
    return protected


def retain_unless_superseded(save_dir: str, keep: int, attempt_started: Optional[float],
                             protect: Iterable[str] = ()) -> Optional[List[str]]:
    """The committer's :func:`apply_retention`: skipped when a later attempt of the job
    has started (:func:`~deepspeed_ext.store.latest.later_attempt_started`), which may have resumed from a
    checkpoint this retention would delete; its own commits run retention.

    The check and the deletion are one step under :func:`~deepspeed_ext.store.locking.locked_dir`, the lock
    :func:`~deepspeed_ext.store.latest.record_attempt` takes: checked unlocked, a restart could record its start
    and read ``latest`` between the check and the deletion, and then lose the
    checkpoint it resumes from. Under the same lock as :func:`~deepspeed_ext.store.latest.advance_latest`, so the
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

