"""Preparing a save's directory: making room for the tag (emptying a crashed save,
replacing or setting aside a complete checkpoint), setting aside an abandoned timeline,
and claiming the directory."""

import os
import time
from typing import List, Optional, Sequence, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE, read_manifest
from deepspeed_ext.format.naming import ITERATION_FILE, LATEST_FILE, check_tag
from deepspeed_ext.format.fs import fsync_dir
from deepspeed_ext.format.storage import ensure_dir
from deepspeed_ext.store.catalog import scan_checkpoints
from deepspeed_ext.store.claims import claim_dir
from deepspeed_ext.store.latest import read_latest, update_latest
from deepspeed_ext.store.locking import locked_dir
from deepspeed_ext.store.retention import discard_dir, holds_only_moc_files, remove_checkpoint

SET_ASIDE_PREFIX = ".moc-set-aside."
"""Directories being deleted are renamed to this prefix first (see :func:`~deepspeed_ext.store.retention.remove_checkpoint`)."""


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
    (:func:`deepspeed_ext.store.reader.find_loadable` skipped a damaged newer one, or
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
    """Under :func:`~deepspeed_ext.store.locking.locked_dir`, before checkpoints ``doomed`` lose their manifests (set
    aside, overwritten): when ``latest`` names one of them, point it at ``keep`` (the
    checkpoint this run resumed from) if that stays, else at the newest complete
    checkpoint that stays, else remove it. Moved first, atomically: a kill between the
    two steps leaves ``latest`` on a checkpoint that still exists; the other order left
    it naming a tag without a manifest (and a restart loading an older one, or nothing).

    Args:
        complete: :func:`~deepspeed_ext.store.catalog.scan_checkpoints`'s ``complete`` of ``save_dir``.
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
        if fs.exists(os.path.join(save_dir, ITERATION_FILE)):
            fs.remove(os.path.join(save_dir, ITERATION_FILE))  # it named the same step
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

    The new directory is claimed for this save (:func:`deepspeed_ext.store.claims.claim_dir`):
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
        if not holds_only_moc_files(tag_dir):
            raise FileExistsError(f"{tag_dir} exists and holds files MoC did not write; "
                                  f"refusing to delete it")
        discard_dir(save_dir, tag)
