"""``<save_dir>/latest`` and the job-attempt record: which checkpoint a restart loads,
and how committers that outlive their attempt are kept from moving it over later work."""

import logging
import os
from typing import Optional, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE, Manifest, read_manifest
from deepspeed_ext.format.naming import ITERATION_FILE, LATEST_FILE, check_tag
from deepspeed_ext.format.storage import (SMALL_RECORD_MAX_BYTES, atomic_write_json,
                                          atomic_write_text, ensure_dir, read_json)
from deepspeed_ext.store.catalog import scan_checkpoints
from deepspeed_ext.store.locking import locked_dir

logger = logging.getLogger(__name__)

LATEST_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest ``latest`` read (it holds one tag): one linked to /dev/zero was read forever."""
ATTEMPT_FILE = "moc-attempt.json"
"""``{"attempt_started": t}`` of the newest job attempt training into a save directory
(rank 0 writes it before reading ``latest`` to load): an earlier attempt's committer that
finishes later leaves ``latest`` and retention to it (:func:`later_attempt_started`)."""
ATTEMPT_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest :data:`ATTEMPT_FILE` read (it holds one number)."""


def update_latest(save_dir: str, tag: str, step: Optional[int] = None) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (rank 0, after write_manifest),
    then write its step into :data:`~deepspeed_ext.format.naming.ITERATION_FILE`.

    Args:
        step: the step of ``tag``; None: read from its manifest.

    Raises:
        ValueError: ``tag`` has no manifest yet; ``latest`` must only name complete
            checkpoints, or a crash right after would resume from a partial save.
    """
    check_tag(tag)
    if not fs.isfile(os.path.join(save_dir, tag, MANIFEST_FILE)):
        raise ValueError(f"{os.path.join(save_dir, tag)} has no {MANIFEST_FILE}; write it "
                         f"before pointing {LATEST_FILE} at it")
    atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)
    write_iteration_file(save_dir, tag, step)


def write_iteration_file(save_dir: str, tag: str, step: Optional[int] = None) -> None:
    """Rank 0 (or a committer), right after ``latest`` named ``tag``: write its step into
    :data:`~deepspeed_ext.format.naming.ITERATION_FILE` atomically, as Megatron-DeepSpeed
    does. Only ever after ``latest``, so it never names a step without a manifest.

    A failure is a warning: the file is for other tools, ``latest`` already counts, and
    failing the commit for it would stop a run whose checkpoint is whole.
    """
    path = os.path.join(save_dir, ITERATION_FILE)
    try:
        if step is None:
            step = read_manifest(os.path.join(save_dir, tag)).step
        atomic_write_text(path, f"{int(step)}")
    except (OSError, CheckpointError) as err:
        logger.warning("cannot write %s (%s: %s); %s names %s", path, type(err).__name__,
                       err, LATEST_FILE, tag)


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
    The reads and the write are one step under :func:`~deepspeed_ext.store.locking.locked_dir`, so two committers
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
        update_latest(save_dir, tag, step)
        return None


def record_attempt(save_dir: str, attempt_started: float) -> None:
    """Rank 0 of a job attempt, before it reads ``latest`` to load: write
    :data:`ATTEMPT_FILE`, so that committers of earlier attempts still running leave
    ``latest`` and retention alone (see :func:`advance_latest`). Under
    :func:`~deepspeed_ext.store.locking.locked_dir`: a committer either moved ``latest`` before (and this attempt
    loads what it committed) or sees the record."""
    ensure_dir(save_dir)
    with locked_dir(save_dir):
        atomic_write_json(os.path.join(save_dir, ATTEMPT_FILE),
                          {"attempt_started": attempt_started})
        _roll_latest_forward(save_dir)


def _roll_latest_forward(save_dir: str) -> Optional[str]:
    """Under :func:`~deepspeed_ext.store.locking.locked_dir`, before a new attempt reads ``latest``: point it at the
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
    step, tag = later[-1]
    update_latest(save_dir, tag, step)
    return tag


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


def extended_tag(previous: Optional[Tuple[str, str]], save_dir: str) -> Optional[str]:
    """The tag a new checkpoint in ``save_dir`` extends (its expert index starts from
    that one's): ``previous`` (``(directory, tag)`` of the last checkpoint saved or
    loaded) when it lies in ``save_dir``, however the two directories are spelled."""
    if previous is None or not fs.same_location(previous[0], save_dir):
        return None
    return previous[1]
