"""The best settings of each policy family for one cluster and MTBF (pure).

Each family's candidate settings (intervals, K, windows, redundancy) are scored with
the analytic model (:func:`deepspeed_ext.planning.costs.predict`); a candidate whose
accumulated PLT exceeds the limit, or that holds more host memory per rank than allowed,
is out. The best of each family is returned, best family first.

:func:`recommend_restart` does the same for each way of coming back from a failure
(:func:`restart_plans`: a relaunch, and an in-job restart with 1 .. k whole spare nodes)
and ranks them by effective throughput: ``ETTR x training GPUs / (training + spare
GPUs)``, what the spares' GPUs would otherwise have trained; spares pay when the ETTR
they gain outweighs the GPUs they hold back.
"""

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from deepspeed_ext.planning.costs import (GIB, POLICIES, Hardware, Layout, ModelShape,
                                          Policy, Prediction, predict)
from deepspeed_ext.planning.restart import InJobPhases, RestartPlan

INTERVALS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
WINDOWS = (1, 2, 4, 8, 16, 32, 64)
PERSIST_INTERVALS = (1, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(frozen=True)
class Constraints:
    """What a recommendation must respect."""

    plt_limit: float = 0.0375
    """Accumulated PLT a policy may reach (the MoC paper's accuracy bound)."""
    host_memory_gb: float = 0.0
    """Host memory per rank for snapshots/frames/redundancy, GiB (2**30 bytes, the unit
    of the trainer's ``--moc-host-memory-gb``); 0: unlimited."""
    node_fraction: float = 0.0
    """Share of failures that lose a node's memory."""

    def __post_init__(self):
        if not 0 <= self.plt_limit <= 1:
            raise ValueError(f"--plt-limit must be in [0, 1], got {self.plt_limit}")
        if not (math.isfinite(self.host_memory_gb) and self.host_memory_gb >= 0):
            raise ValueError(f"--host-memory-gb must be a finite number >= 0 (GiB; 0: "
                             f"unlimited), got {self.host_memory_gb}")
        if not 0 <= self.node_fraction <= 1:
            raise ValueError(f"--node-failure-fraction must be in [0, 1], got {self.node_fraction}")


def k_choices(n: int) -> List[int]:
    """The K values the search tries for ``n`` experts per layer: the powers of two below
    ``n``, then ``n`` (used by :func:`candidates` and its tests)."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def candidates(kind: str, model: ModelShape, layout: Layout) -> Iterable[Policy]:
    """Every setting of ``kind`` the search tries."""
    n = model.num_experts
    # Only settings the trainer accepts: erasure groups of ec_data + 1 nodes must divide
    # the nodes (deepspeed_ext.policy.redundancy.check_layout).
    ec = [d for d in (1, 2, 3, 4, 7) if layout.nodes >= 2 and layout.nodes % (d + 1) == 0]
    redundancy = [("none", 1)] + ([("replicate", 1)] if layout.nodes >= 2 else []) \
        + [("erasure", d) for d in ec]
    if kind in ("full-sync", "full-async"):
        for i in INTERVALS:
            yield Policy(kind, interval=i)
    elif kind in ("pec", "pec-dynamic"):
        for i in INTERVALS:
            for k in k_choices(n):
                yield Policy(kind, interval=i, k=k)
    elif kind == "two-level":
        for i in (1, 2, 5, 10, 20, 50):
            for ks in k_choices(n):
                for kp in [k for k in k_choices(n) if k <= ks]:
                    for p in PERSIST_INTERVALS:
                        for r, d in redundancy:
                            yield Policy(kind, interval=i, k_snapshot=ks, k=kp,
                                         persist_interval=p, redundancy=r, ec_data=d)
    elif kind == "exact":
        for w in WINDOWS:
            yield Policy(kind, window=w)
    else:
        raise ValueError(f"unknown policy {kind!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Choice:
    """The best setting of one policy family."""

    kind: str
    best: Optional[Prediction]
    """None when no setting meets the constraints."""
    why_none: str = ""
    tried: int = 0


def best_of(kind: str, model: ModelShape, layout: Layout, hw: Hardware, mtbf_s: float,
            constraints: Constraints, restart: RestartPlan = RestartPlan()) -> Choice:
    best, tried, reasons = None, 0, set()
    for policy in candidates(kind, model, layout):
        tried += 1
        try:
            pred = predict(policy, model, layout, hw, mtbf_s, constraints.node_fraction,
                           restart)
        except ValueError as err:
            reasons.add(str(err))
            continue
        if pred.plt > constraints.plt_limit:
            reasons.add(f"PLT above {constraints.plt_limit:.2%}")
            continue
        if constraints.host_memory_gb and \
                pred.costs.host_bytes_per_rank > constraints.host_memory_gb * GIB:
            reasons.add(f"more than {constraints.host_memory_gb:g} GiB of host memory per rank")
            continue
        # Ties (common: many settings reach the same ETTR) go to the cheaper one.
        key = (round(pred.ettr, 6), -pred.costs.host_bytes_per_rank, -pred.plt)
        if best is None or key > (round(best.ettr, 6), -best.costs.host_bytes_per_rank,
                                  -best.plt):
            best = pred
    return Choice(kind, best, "; ".join(sorted(reasons)) if best is None else "", tried)


def recommend(model: ModelShape, layout: Layout, hw: Hardware, mtbf_s: float,
              constraints: Constraints, kinds: Sequence[str] = POLICIES,
              restart: RestartPlan = RestartPlan()) -> List[Choice]:
    """The best setting of each family in ``kinds``, best ETTR first (families with no
    admissible setting last), under ``restart``.

    Raises:
        ValueError: MTBF <= 0 or an unknown family.
    """
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"--mtbf must be > 0 seconds and finite, got {mtbf_s}")
    choices = [best_of(k, model, layout, hw, mtbf_s, constraints, restart) for k in kinds]
    return sorted(choices, key=lambda c: -(c.best.ettr if c.best else -1.0))


def restart_plans(layout: Layout, max_spare_nodes: int, phases: InJobPhases,
                  repair_s: float) -> List[RestartPlan]:
    """A relaunch, then an in-job restart with 1 .. ``max_spare_nodes`` whole spare nodes
    (0 spare nodes would relaunch every failure: the relaunch itself)."""
    if max_spare_nodes < 0:
        raise ValueError(f"--max-spare-nodes must be >= 0, got {max_spare_nodes}")
    node = min(layout.gpus, layout.gpus_per_node)
    return [RestartPlan()] + [RestartPlan("in-job", n * node, repair_s, phases)
                              for n in range(1, max_spare_nodes + 1)]


@dataclass(frozen=True)
class RestartChoice:
    """The best policies under one restart plan, and what the plan's spares cost."""

    plan: RestartPlan
    choices: Tuple[Choice, ...]
    """Best ETTR first, as :func:`recommend` gives them."""
    gpus: int
    """The job's training GPUs."""

    @property
    def best(self) -> Optional[Prediction]:
        return next((c.best for c in self.choices if c.best is not None), None)

    @property
    def effective(self) -> float:
        """``ETTR x training GPUs / (training + spare GPUs)``; 0 with no admissible policy."""
        best = self.best
        return best.ettr * self.gpus / (self.gpus + self.plan.spares) if best else 0.0


def recommend_restart(model: ModelShape, layout: Layout, hw: Hardware, mtbf_s: float,
                      constraints: Constraints, kinds: Sequence[str],
                      plans: Sequence[RestartPlan]) -> List[RestartChoice]:
    """:func:`recommend` under each plan, best effective throughput first (ties: fewer
    spares).

    Raises:
        ValueError: MTBF <= 0 or an unknown family.
    """
    out = [RestartChoice(plan, tuple(recommend(model, layout, hw, mtbf_s, constraints, kinds,
                                               plan)), layout.gpus)
           for plan in plans]
    return sorted(out, key=lambda c: (-round(c.effective, 9), c.plan.spares))
