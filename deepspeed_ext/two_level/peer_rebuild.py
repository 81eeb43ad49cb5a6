"""Rebuilding lost nodes' snapshots from the peers' copies or parities, before a memory
recovery (:mod:`deepspeed_ext.two_level`, ``--moc-redundancy``)."""

import logging
import time
import traceback
from typing import List, Optional

import torch
import torch.distributed as dist

from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import all_outcomes
from deepspeed_ext.two_level.records import RankPlace

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def rebuild_from_peers(place: RankPlace, signature: Optional[str]) -> bool:
    """Every rank, before a memory recovery: when some ranks lost their snapshots (a
    lost node), rebuild them from the copies or parities their peers hold (one
    ``all_gather_object`` of what each rank holds, then the plan's point-to-point
    transfers, then one outcome collective).

    Returns:
        True when snapshots were rebuilt (the memory recovery can then use them).
    """
    from deepspeed_ext.policy import redundancy as rd
    start = time.perf_counter()
    own = {m["step"]: (i, m) for i, m in place.slots.complete() if m["signature"] == signature}
    replicas, parities = place.redundancy.holdings_record()
    gathered: List = [None] * place.world
    dist.all_gather_object(gathered, (sorted(own), replicas, parities), group=metadata_group())
    holdings = rd.Holdings(
        own={r: frozenset(g[0]) for r, g in enumerate(gathered)},
        replicas={r: {int(src): frozenset(steps) for src, steps in g[1].items()}
                  for r, g in enumerate(gathered)},
        parities={r: frozenset(int(s) for s in g[2]) for r, g in enumerate(gathered)})
    plan = rd.plan_rebuild(holdings, place.topo, place.spec)
    if plan.step is None:
        if not any(g[0] or g[1] or g[2] for g in gathered):
            return False  # no memory anywhere (a first start): nothing to explain
        _log(f"recovery: cannot recover from memory, even with the peers' redundancy: "
             f"{plan.why}; loading from storage")
        return False
    if not plan.rebuilt:
        return False
    chunks = {r: {int(s): c for s, c in g[2].items()} for r, g in enumerate(gathered)}
    ok, result = True, None
    try:
        result = place.redundancy.rebuild(plan, chunks, _own_images(place, own), place.slots)
    except Exception as e:
        traceback.print_exc()
        ok, result = False, f"{type(e).__name__}: {e}"
    return _report(place, plan, all_outcomes(ok, result), start)


def _own_images(place: RankPlace, own):
    """``step -> this rank's own image of that step`` (a copy of the slot's bytes)."""
    from deepspeed_ext.snapshot import image_end

    def own_image(step):
        slot, meta = own[step]
        size = image_end(meta)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(place.slots.image_path(slot), shared=False, size=size,
                               dtype=torch.uint8)
    return own_image


def _report(place: RankPlace, plan, outcomes, start: float) -> bool:
    """Every rank, after the rebuild's outcome exchange: log it; True when it worked."""
    if not all(o for o, _ in outcomes):
        bad = "; ".join(f"rank {r}: {m}" for r, (o, m) in enumerate(outcomes) if not o)
        _log(f"recovery: rebuilding snapshots from peers failed ({bad})")
        return False
    received = sum(c["received"] for _, c in outcomes)
    nodes = sorted({place.topo.node_of(r) for r in plan.rebuilt})
    _log(f"recovery: rebuilt the step-{plan.step} snapshots of rank(s) "
         f"{list(plan.rebuilt)} (lost node(s) {nodes}) from the peers' memory "
         f"({place.spec.describe()}): {received / 2**20:.2f} MiB in "
         f"{time.perf_counter() - start:.2f} s"
         + (f"; {plan.why}" if plan.why else ""))
    return True
