"""One rank's failure made every rank's: the outcome collectives of saves and loads.

A rank that raised alone would leave the others waiting in the next collective of the
training loop. Every rank therefore reaches the same outcome collective whether its own
part worked or not, and every rank raises :class:`MoCCheckpointError` when any failed.
Both collectives run on the metadata group (:func:`deepspeed_ext.runtime.groups.metadata_group`,
gloo), never on the training's device group.

Order, on every rank: :func:`all_outcomes` (one ``all_gather_object``) then
:func:`raise_if_failed` on its result; or :func:`broadcast_outcome` (one
``broadcast_object_list`` from rank 0) around an action only rank 0 runs.
"""

import traceback
from typing import Any, Callable, List, Sequence, Tuple

import torch.distributed as dist

from deepspeed_ext.runtime.groups import metadata_group


class MoCCheckpointError(RuntimeError):
    """A save or load failed on some rank; raised on every rank."""


def all_outcomes(ok: bool, payload) -> List[Tuple[bool, object]]:
    """Every rank's (ok, payload); the collective that makes one rank's error everyone's."""
    gathered: List = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ok, payload), group=metadata_group())
    return gathered


def broadcast_outcome(action: Callable[[], Any], what: str):
    """Run ``action`` on rank 0 and make its failure every rank's (one broadcast);
    returns what ``action`` returned (picklable), on every rank.

    Raises:
        MoCCheckpointError: on every rank, naming ``what``, when ``action`` raised.
    """
    status = [None]
    if dist.get_rank() == 0:
        try:
            status[0] = (True, action())
        except Exception as e:
            traceback.print_exc()
            status[0] = (False, f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(status, src=0, group=metadata_group())
    if not status[0][0]:
        raise MoCCheckpointError(f"{what} failed on rank 0: {status[0][1]}")
    return status[0][1]


def raise_if_failed(outcomes: Sequence[Tuple[bool, object]], what: str) -> None:
    """Raise, on the rank that calls it, when any entry of ``outcomes`` (as
    :func:`all_outcomes` returns them: one per rank) is not ok.

    Raises:
        MoCCheckpointError: naming ``what`` and every failed rank with its payload.
    """
    failed = [(r, p) for r, (ok, p) in enumerate(outcomes) if not ok]
    if failed:
        details = "; ".join(f"rank {r}: {p}" for r, p in failed)
        raise MoCCheckpointError(f"{what} failed on {len(failed)} rank(s): {details}")
