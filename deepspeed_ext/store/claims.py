"""A save's claim on its tag directory: a committer (or writer) of an earlier attempt
that finds another claim there stands down (see :mod:`deepspeed_ext.store.commit`)."""

import os
import uuid
from typing import Optional

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import SMALL_RECORD_MAX_BYTES, atomic_write_json, read_json

CLAIM_NAME = "commit.claim"
CLAIM_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest claim read (it holds one random id)."""


class CommitError(RuntimeError):
    """A checkpoint could not be committed: a writer failed, or reports did not arrive."""


class Superseded(CommitError):
    """The tag directory is no longer this committer's: another save claimed it (a later
    attempt saving the same tag) or it was deleted. The committer must write nothing."""


def claim_dir(tag_dir: str) -> str:
    """Rank 0, right after creating a save's directory: write a fresh claim (atomic) that
    the committer of this save will hold; returns it."""
    claim = uuid.uuid4().hex
    # Not fsynced: it is written inside a snapshot's save call, and a claim lost in a
    # machine crash does not matter (the committers holding it died with the machine).
    atomic_write_json(os.path.join(tag_dir, CLAIM_NAME), {"claim": claim}, durable=False)
    return claim


def read_claim(tag_dir: str) -> Optional[str]:
    """The claim of the save that last claimed ``tag_dir``; None when there is none (a
    directory deleted, committed and cleaned, or made before claims existed)."""
    path = os.path.join(tag_dir, CLAIM_NAME)
    try:
        claim = read_json(path, CLAIM_MAX_BYTES)["claim"]
    except FileNotFoundError:
        return None
    except CheckpointError as err:  # too large, not JSON, nested too deeply: it names the file
        raise CommitError(str(err)) from None
    except (OSError, KeyError, TypeError) as err:
        raise CommitError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(claim, str):  # a claim that compares unequal to every id forever
        raise CommitError(f"{path}: unreadable (the claim is a {type(claim).__name__})")
    return claim


def check_claim(tag_dir: str, claim: Optional[str]) -> None:
    """Raise :class:`Superseded` when ``tag_dir`` no longer holds ``claim`` (None: no check,
    for a directory claimed before claims existed)."""
    if claim is None:
        return
    now = read_claim(tag_dir)
    if now is None:
        raise Superseded(f"{tag_dir} was deleted (or committed) while this commit waited")
    if now != claim:
        raise Superseded(f"{tag_dir} was claimed by another save while this commit waited "
                         f"(a restarted job saving the same tag); leaving it to that save")

