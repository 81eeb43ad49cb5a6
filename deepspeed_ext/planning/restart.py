"""The in-job restart and its hot spares, as the planner models them (pure).

A *relaunch* (``--moc-restart relaunch``) starts every process of the job again: the
planner's ``restart_s`` (process start, imports, process groups, engine) plus the
policy's load and the first iterations' extra time (``warmup_s``); a node failure adds
``node_replace_s``. An *in-job restart* (``--moc-restart in-job``, docs/failures.md
"In-job restart: the supervisor") keeps the survivors' processes and memory, and a hot
spare, started and imported beforehand, takes the failed rank. Its phases, in the order
they run (:data:`PHASES`):

1. detection: the supervisor notices the death;
2. leave: the survivors leave the failed step (their collectives with the dead rank
   fail) and see the new round;
3. teardown: they destroy their process groups and DeepSpeed's cached ones;
4. rendezvous: every process of the new round, the spare included, joins it in the store;
5. groups: the round's process groups are formed, ``groups_s + groups_per_rank_s x
   ranks`` (below);
6. engine: DeepSpeed's engine is built again in the same process;
7. state: the state comes back, from host memory: snapshot bytes per rank over the
   host-memory bandwidth (in the cost model, the policy's own load: what it keeps in
   memory from there, the rest from storage);
8. first step: the first step's extra seconds over a steady one.

**Forming the groups grows linearly with the ranks**, ``a + b x ranks``, not with
``log2(ranks)``: NCCL's communicator initialisation bootstraps through one root and a
ring that carries every rank's address to every rank (N - 1 hops), and then lays its
rings and trees over all N ranks' topology; torch's store-based rendezvous has one
store server answer every rank. A logarithmic cost needs a tree-shaped bootstrap (a
split of a parent communicator, several bootstrap roots), which a group formed again
after a failure does not have (its parent was aborted). Linear is also the cautious
choice: it overestimates rather than hides the cost at scale.

**Spares** (:class:`RestartPlan`): ``spares`` spare GPUs wait per job, as whole spare
nodes (the supervisor's ``--spare-nodes``: ``spares / gpus_per_node`` of them). A
failure is recovered in place while a spare node is free, and takes it whole, software
failure or node failure alike: a lost node's ranks go to a spare node, and so do a
crashed process's node's (the supervisor moves a node with no spare process of its own
whole, so that a node's ranks never straddle two machines; the node it leaves is
displaced). The spares a failure takes come back ``repair_s`` after it (the failed node
repaired or replaced; a software failure's node is healthy, but it left the job and
waits as long: a cautious simplification). A failure that finds no free spare node
costs a relaunch and takes none. Spare processes inside the training nodes (the
supervisor's ``--spares``) are not modelled. The analytic model (:func:`blocked`) treats the pool as a loss system (failures
arrive as a Poisson process, each holds its spares for ``repair_s``; Kaufman-Roberts);
the simulator (:func:`take`) follows the pool failure by failure.
"""

import math
from dataclasses import dataclass, fields, replace
from typing import List, Tuple

from deepspeed_ext.planning.inputs import GB, Hardware
from deepspeed_ext.supervisor.children import POLL_S as SUPERVISOR_POLL_S

RESTART_MODES = ("relaunch", "in-job")
"""The trainer's ``--moc-restart`` choices."""
PHASES = ("detection", "leave", "teardown", "rendezvous", "groups", "engine", "state",
          "first step")
"""An in-job restart's phases, in the order they run."""
IN_JOB_POLL_S = 0.1
"""How often a process waiting for a round reads the store
(``megatron/training/in_job.py``'s ``POLL_S``; not imported: the library does not import
the trainer)."""
REPAIR_S = 3600.0
"""Default seconds until a failure's spares are back (an assumption: a node taken out,
repaired or replaced from the cluster's pool, and health-checked)."""


@dataclass(frozen=True)
class InJobPhases:
    """What each phase of an in-job restart costs, seconds (flags ``--in-job-<name>``,
    underscores as dashes; or the ``in_job`` object of a ``--hardware`` file that
    ``moc-plan calibrate --from-json`` wrote from ``benchmarks/restart_bench.py``).

    The defaults are what is known on CPU (gloo, 2-4 ranks; issue 37 and the
    supervisor's code), each field's source below.

    Raises (on construction):
        ValueError: a value that is not a finite number >= 0, naming its flag.
    """

    detection_s: float = SUPERVISOR_POLL_S
    """The supervisor notices a death: it looks for exits every ``POLL_S`` (0.1 s,
    ``deepspeed_ext/supervisor/children.py``); the whole poll, not half, to be cautious.
    A lost node or a hang is assumed noticed as fast (as the relaunch's ``restart_s``
    assumes): raise it for a heartbeat timeout."""
    leave_s: float = IN_JOB_POLL_S
    """The survivors leave the failed step and see the new round: on gloo the dead
    peer's closed socket fails their collective at once (the ``in-job-round`` event's
    ``left_s`` is negative), then they read the round within one poll of the store
    (0.1 s, ``megatron/training/in_job.py``)."""
    teardown_s: float = 0.0
    """Destroying the process groups and DeepSpeed's cached ones: counted in
    ``groups_s``, whose 70 ms measurement destroyed the old group too;
    ``benchmarks/restart_bench.py`` times it apart."""
    rendezvous_s: float = 0.0
    """Every process joins the new round (one read of the round's record; the spare
    polls for it while the survivors leave): counted in ``groups_s``'s 70 ms."""
    groups_s: float = 0.07
    """The fixed part ``a`` of forming the round's groups: survivors re-formed a gloo
    group in about 70 ms on plain torch.distributed with the store in a launcher
    process (issue 37, 3 ranks: the per-rank part is negligible there)."""
    groups_per_rank_s: float = 0.0005
    """The part ``b`` per rank of the job (module docstring: why linear). An assumption,
    not measured here: 0.5 ms per rank gives 2 s at 4,096 ranks and 48 s at 96K, the
    order of the tens of seconds NVIDIA/nccl pull request 1789 reports for NCCL's
    initialisation at 48K-96K ranks before its fix."""
    engine_s: float = 2.5
    """Rebuilding the engine in the same process: resetting DeepSpeed's process groups
    (``deepspeed.comm``'s backend, ``deepspeed.utils.groups``' expert and expert-data
    groups) and running ``deepspeed.initialize`` again took 1.5-3.5 s on CPU (issue 37,
    DeepSpeed ZeRO-2 + MoE): the middle of that range."""
    first_step_s: float = 0.0
    """The first step's extra seconds over a steady one (lazy connections of the new
    groups, caches): not measured yet, 0 as the relaunch's ``--warmup-s`` default."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{phase_flag(f.name)} must be a finite number of seconds "
                                 f">= 0, got {value!r}")

    def groups(self, ranks: int) -> float:
        """Seconds to form the groups of a job of ``ranks`` ranks: ``a + b x ranks``."""
        return self.groups_s + self.groups_per_rank_s * ranks

    def before_state(self, ranks: int) -> float:
        """Seconds from the death to the state restore's start (detection to engine)."""
        return (self.detection_s + self.leave_s + self.teardown_s + self.rendezvous_s
                + self.groups(ranks) + self.engine_s)


def phase_flag(name: str) -> str:
    """The command-line flag of an :class:`InJobPhases` field: ``--in-job-engine-s``."""
    return "--in-job-" + name.replace("_", "-")


@dataclass(frozen=True)
class PhaseTimes:
    """One in-job restart's phases, seconds (:func:`in_job_phases`)."""

    detection: float
    leave: float
    teardown: float
    rendezvous: float
    groups: float
    engine: float
    state: float
    first_step: float

    def items(self) -> List[Tuple[str, float]]:
        """``(phase, seconds)`` in :data:`PHASES` order."""
        return list(zip(PHASES, (getattr(self, f.name) for f in fields(self))))

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds in self.items())

    def largest(self) -> Tuple[str, float]:
        """The phase that dominates (the first of equals, in phase order)."""
        return max(self.items(), key=lambda item: item[1])


def in_job_phases(phases: InJobPhases, ranks: int, state_bytes: float,
                  host_gbps: float) -> PhaseTimes:
    """The phases of one in-job restart of a job of ``ranks`` ranks that restores
    ``state_bytes`` per rank from host memory at ``host_gbps`` GB/s (1e9 bytes/s).

    Raises:
        ValueError: ranks < 1, negative bytes or a bandwidth that is not > 0.
    """
    if ranks < 1 or state_bytes < 0 or not host_gbps > 0:
        raise ValueError(f"ranks must be >= 1, state bytes >= 0 and the bandwidth > 0, got "
                         f"{ranks}, {state_bytes}, {host_gbps}")
    return PhaseTimes(phases.detection_s, phases.leave_s, phases.teardown_s,
                      phases.rendezvous_s, phases.groups(ranks), phases.engine_s,
                      state_bytes / (host_gbps * GB), phases.first_step_s)


def in_job_hardware(hw: Hardware, phases: InJobPhases, ranks: int) -> Hardware:
    """``hw`` as an in-job restart with a spare sees it: the restart before loading is
    detection to engine, the first step's extra time replaces the relaunch's warm-up,
    and a lost node costs no replacement wait (a spare node is already there). The
    policy's load (the state phase) is the cost model's own."""
    return replace(hw, restart_s=phases.before_state(ranks), warmup_s=phases.first_step_s,
                   node_replace_s=0.0)


@dataclass(frozen=True)
class RestartPlan:
    """How failures come back: a relaunch, or in place while spares last.

    Raises (on construction):
        ValueError: an unknown mode, negative spares, spares without an in-job restart,
            or a repair time that is not a finite number >= 0, naming the flag.
    """

    mode: str = "relaunch"
    """One of :data:`RESTART_MODES` (``--restart``)."""
    spares: int = 0
    """Spare processes (GPUs) of the job (``--spares``)."""
    repair_s: float = REPAIR_S
    """Seconds until a failure's spares are back (``--repair-s``)."""
    phases: InJobPhases = InJobPhases()

    def __post_init__(self):
        if self.mode not in RESTART_MODES:
            raise ValueError(f"--restart must be one of {', '.join(RESTART_MODES)}, got "
                             f"{self.mode!r}")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) \
                or self.spares < 0:
            raise ValueError(f"--spares must be an integer >= 0, got {self.spares!r}")
        if self.spares and self.mode != "in-job":
            raise ValueError("--spares needs --restart in-job (a relaunch starts every "
                             "process again and has no use for spares)")
        if isinstance(self.repair_s, bool) or not isinstance(self.repair_s, (int, float)) \
                or not (math.isfinite(self.repair_s) and self.repair_s >= 0):
            raise ValueError(f"--repair-s must be a finite number of seconds >= 0, got "
                             f"{self.repair_s!r}")

    @property
    def in_job(self) -> bool:
        return self.mode == "in-job"

    def label(self, node_size: int) -> str:
        """``relaunch``, ``in-job, 16 spares (2 nodes)``."""
        if not self.in_job:
            return "relaunch"
        nodes = self.spares / node_size
        whole = f"{nodes:g} node{'s' if nodes != 1 else ''}"
        return f"in-job, {self.spares} spare{'s' if self.spares != 1 else ''} ({whole})"


def spares_needed(kind: str, node_size: int) -> int:
    """Spare GPUs a failure of ``kind`` (software or node) needs to be recovered in
    place: a spare node's, ``node_size``, either way (module docstring)."""
    if kind not in ("software", "node"):
        raise ValueError(f"a failure kind is software or node, got {kind!r}")
    return node_size


@dataclass(frozen=True)
class SparePool:
    """The spares of a running job: how many are free, and when the taken ones return."""

    free: int
    returns: Tuple[Tuple[float, int], ...] = ()
    """``(time_s, count)``: ``count`` spares come back at ``time_s``, earliest first."""


def refill(pool: SparePool, now_s: float) -> SparePool:
    """``pool`` at ``now_s``: every spare due back by then is free again."""
    due = sum(count for at, count in pool.returns if at <= now_s)
    if not due:
        return pool
    return SparePool(pool.free + due, tuple(r for r in pool.returns if r[0] > now_s))


def take(pool: SparePool, now_s: float, count: int,
         repair_s: float) -> Tuple[bool, SparePool]:
    """A failure at ``now_s`` that needs ``count`` spares: (recovered in place, the pool
    after it). In place: ``count`` spares are taken until ``now_s + repair_s``; else the
    failure costs a relaunch and the pool is only refilled."""
    pool = refill(pool, now_s)
    if count < 1 or pool.free < count:
        return False, pool
    back = tuple(sorted(pool.returns + ((now_s + repair_s, count),)))
    return True, SparePool(pool.free - count, back)


def blocked(plan: RestartPlan, mtbf_s: float, node_fraction: float,
            node_size: int) -> Tuple[float, float]:
    """(share of software failures, share of node failures) that find too few free
    spares and cost a relaunch, in the long run (1, 1 for a relaunch plan).

    The pool is a loss system with ``plan.spares`` places: software failures arrive at
    ``(1 - f) / MTBF``, node failures at ``f / MTBF``, each holds ``node_size`` places
    (:func:`spares_needed`) for ``repair_s``. Kaufman-Roberts: ``q(0) = 1``,
    ``j q(j) = sum_k a_k b_k q(j - b_k)`` (``a_k`` a class's arrivals x ``repair_s``,
    ``b_k`` its places), normalised; a class of ``b`` places is refused in the states
    ``j > spares - b``.
    """
    if not plan.in_job:
        return 1.0, 1.0
    c = plan.spares
    classes = ((spares_needed("software", node_size), (1 - node_fraction) / mtbf_s * plan.repair_s),
               (spares_needed("node", node_size), node_fraction / mtbf_s * plan.repair_s))
    q = [1.0] + [0.0] * c
    for j in range(1, c + 1):
        q[j] = sum(load * size * q[j - size] for size, load in classes if size <= j) / j
        if q[j] > 1e200:  # a long repair: rescale before the floats overflow to inf
            q = [x / q[j] for x in q]
    total = sum(q)
    refused = [sum(q[max(0, c - size + 1):]) / total if size <= c else 1.0
               for size, _ in classes]
    return refused[0], refused[1]
