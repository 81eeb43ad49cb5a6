"""The cost model: what each checkpoint policy costs a given model, layout and hardware.

Pure functions over plain dataclasses. Units: bytes, seconds, iterations. Formulas (the
MoC paper's overhead model, Eq. 3-16, and MoEtion's ETTR):

* State per parameter: ``STATE_BYTES`` (fp32 master weights plus Adam's two moments, what
  MoC saves); compute weights ``WEIGHT_BYTES`` (bf16). Under ZeRO-2 with expert
  parallelism every rank holds ``1/gpus`` of the non-expert and of the expert state, so a
  full checkpoint is ``(P_ne + P_e) * STATE_BYTES / gpus`` per rank and PEC with K of N
  experts ``(P_ne + K/N * P_e) * STATE_BYTES / gpus`` (MoC Eq. 8, fully sharded).
* Stall per checkpoint (MoC Eq. 10): ``max(0, T_copy - T_fwd_bwd)`` for asynchronous
  copies; a synchronous save blocks for its copy and its write.
* Lost work per failure: half a checkpoint interval on average, plus the time until the
  newest checkpoint is durable (its copy or persist lag), in iterations; exact recovery
  replays from the start of the last complete window: ``1.5 W`` on average.
* Lost tokens (PLT) per failure under PEC: with sequential rotation an expert's newest
  version is on average ``I (N/K - 1) / 2`` iterations older than the checkpoint, so a
  failure loses that many iterations of its updates; over a run with ``lambda = T_iter /
  MTBF`` failures per iteration the accumulated PLT is ``lambda * I (N/K - 1) / 2``.
* Two-level recovery from memory: each rank keeps ``snapshot.SLOTS`` (three) snapshots
  of ``Ks`` experts per layer, so memory holds ``min(N, 3 Ks)`` experts (ages 0, I, 2I);
  the others come from storage, as old as its rotation (``I_p (N/K_p - 1) / 2``) plus the
  distance from the resumed snapshot back to the newest durable persist, and are read
  from storage during the recovery.
* Host memory (two-level): what the trainer reserves per rank, ``snapshot.SLOTS`` full
  images (whatever ``Ks``) plus what it keeps of its peers' snapshots; budgets are GiB
  (2**30 bytes), as the trainer's ``--moc-host-memory-gb``. Bandwidths are decimal GB/s.
* ETTR (MoEtion): ``1 / (1 + overhead/T_iter) * 1 / (1 + E[R] / MTBF)``, ``E[R]`` the
  expected downtime plus redone work of a failure, mixed over failure kinds (software:
  the processes die, host memory survives; node: a node's memory is lost too).
* In-job restart (:mod:`deepspeed_ext.planning.restart`): a failure recovered in place
  costs the in-job phases before the load instead of ``restart_s`` (and no
  ``node_replace_s``), the load being the policy's own; the share of failures that find
  too few spares (:func:`~deepspeed_ext.planning.restart.blocked`) costs a relaunch.
"""

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from deepspeed_ext.planning.inputs import (GB, GIB, PEER_STEPS_KEPT, POLICIES, REDUNDANCY,
                                           SNAPSHOT_SLOTS_KEPT, STATE_BYTES, WEIGHT_BYTES,
                                           Hardware, Layout, ModelShape, Policy)
from deepspeed_ext.planning.restart import RestartPlan, blocked, in_job_hardware
from deepspeed_ext.policy import redundancy as rd

__all__ = ["GB", "GIB", "PEER_STEPS_KEPT", "POLICIES", "REDUNDANCY", "SNAPSHOT_SLOTS_KEPT",
           "STATE_BYTES", "WEIGHT_BYTES", "FailureRecovery", "Hardware", "Infeasible",
           "Layout", "ModelShape", "Policy", "PolicyCosts", "Prediction", "dynamic_k",
           "full_state_bytes", "in_job_costs", "policy_costs", "predict",
           "two_level_host_bytes"]
"""The inputs (:mod:`deepspeed_ext.planning.inputs`) are re-exported: callers import the
whole model from here."""


class Infeasible(ValueError):
    """A policy setting that cannot run on this hardware (its writes never catch up)."""


@dataclass(frozen=True)
class FailureRecovery:
    """What one failure of a kind costs."""

    downtime_s: float
    """Restart plus load."""
    lost_iterations: float
    """Expected iterations redone (replayed or re-trained)."""
    plt: float
    """Expected lost expert updates per failure, in iterations of the whole model's
    expert assignments (divide by the run's iterations for its PLT share)."""
    source: str
    """Where the state comes from: storage, memory, peers, memory+storage."""


@dataclass(frozen=True)
class PolicyCosts:
    """A policy's predicted costs for one model, layout and hardware."""

    policy: Policy
    k_effective: int
    """Experts per layer actually saved (pec-dynamic: the steady-state K)."""
    save_bytes_per_rank: float
    """Bytes one rank copies per checkpoint (snapshot or frame)."""
    persist_bytes_per_rank: float
    """Bytes one rank writes to storage per persisted checkpoint."""
    copy_s: float
    """Device-to-host copy of one checkpoint."""
    persist_s: float
    """Writing one persisted checkpoint to storage (one rank's share, all writing)."""
    stall_s: float
    """Training-loop stall per checkpoint."""
    overhead_per_iteration_s: float
    """Average stall per iteration."""
    protect_s: float
    """Redundancy: seconds until a snapshot is in the peers' memory (0: none)."""
    host_bytes_per_rank: float
    """Host memory per rank: two-level, what the trainer reserves (every slot a full
    image, plus the peers' redundancy); exact, two windows of frames; async saves, one
    checkpoint's buffer."""
    software: FailureRecovery
    node: FailureRecovery
    storage_every: int = 0
    """Iterations between checkpoints that reach storage (after any capping)."""
    memory_every: int = 0
    """Iterations between in-memory snapshots (two-level) or windows (exact); 0: none."""
    notes: Tuple[str, ...] = ()
    """Why a setting is capped or degraded (persist slower than its interval, ...)."""

    def expected_recovery(self, node_fraction: float) -> Tuple[float, float, float]:
        """(downtime s, lost iterations, PLT per failure) mixed over failure kinds."""
        s, n = self.software, self.node
        mix = lambda a, b: (1 - node_fraction) * a + node_fraction * b  # noqa: E731
        return (mix(s.downtime_s, n.downtime_s), mix(s.lost_iterations, n.lost_iterations),
                mix(s.plt, n.plt))


def _background(hw: Hardware, nbytes_per_iteration: float) -> float:
    """Seconds per iteration the background copies and writes take from training."""
    return hw.background_s_per_gb * nbytes_per_iteration / GB


def _rank_state(model: ModelShape, layout: Layout, k: int) -> float:
    """Bytes of fp32 state one rank saves with ``k`` experts per layer (0: all)."""
    k = k or model.num_experts
    return (model.params_non_expert + model.params_expert * k / model.num_experts) \
        * STATE_BYTES / layout.gpus


def full_state_bytes(model: ModelShape, layout: Layout) -> float:
    """Bytes of one rank's whole fp32 state and Adam moments (a full snapshot)."""
    return _rank_state(model, layout, 0)


def _staleness(interval: float, n: int, k: int) -> float:
    """Mean iterations an expert's newest saved version lags the checkpoint (rotation)."""
    k = k or n
    return interval * (n / k - 1) / 2


def _lost_share(model: ModelShape, layout: Layout) -> float:
    """Share of each MoE layer's experts held by one node's ranks."""
    ep = layout.expert_parallel(model)
    return min(1.0, layout.gpus_per_node / ep) if layout.gpus > layout.gpus_per_node else 1.0


def dynamic_k(model: ModelShape, hw: Hardware, interval: int, k0: int,
              threshold: float, mtbf_s: float) -> int:
    """The K the paper's dynamic K settles at: doubled from ``k0`` while the accumulated
    PLT (``lambda * staleness``) exceeds ``threshold``."""
    n = model.num_experts
    k = k0 or n
    lam = hw.iteration_s / mtbf_s
    while k < n and lam * _staleness(interval, n, k) > threshold:
        k = min(n, 2 * k)
    return k


def policy_costs(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                 mtbf_s: Optional[float] = None) -> PolicyCosts:
    """The predicted costs of ``policy`` (``mtbf_s`` is needed only by pec-dynamic).

    Raises:
        ValueError: a policy that does not fit the model (K above the experts, ...), or
            a redundancy the trainer refuses on this layout.
    """
    n = model.num_experts
    for name in ("k", "k_snapshot"):
        if getattr(policy, name) > n:
            raise ValueError(f"{name}={getattr(policy, name)} exceeds the {n} experts")
    _check_redundancy_layout(policy, layout)
    fb = hw.fwd_bwd_fraction * hw.iteration_s
    wbps, rbps = hw.write_bps(layout), hw.read_bps(layout)
    d2h, h2d = hw.d2h_gbps * GB, hw.h2d_gbps * GB
    full = _rank_state(model, layout, 0)
    notes: List[str] = []
    k_eff = policy.k or n
    kind = policy.kind
    if kind == "pec-dynamic":
        if mtbf_s is None:
            raise ValueError("pec-dynamic needs the MTBF")
        k_eff = dynamic_k(model, hw, policy.interval, policy.k, policy.plt_threshold, mtbf_s)
    if kind == "full-sync":
        return _full_sync(policy, model, hw, full, wbps, rbps, d2h)
    if kind in ("full-async", "pec", "pec-dynamic"):
        k = n if kind == "full-async" else k_eff
        return _async(policy, model, layout, hw, k, full, fb, wbps, rbps, d2h, notes)
    if kind == "two-level":
        return _two_level(policy, model, layout, hw, full, fb, wbps, rbps, d2h, h2d, notes)
    return _exact(policy, model, layout, hw, full, fb, wbps, rbps, d2h, h2d, notes)


def _full_sync(policy, model, hw, full, wbps, rbps, d2h) -> PolicyCosts:
    """A synchronous full save: the loop blocks for its copy and its write."""
    n = model.num_experts
    size = full
    copy = size / d2h
    persist = size / wbps
    stall = copy + persist + hw.save_call_s
    interval = policy.interval
    lost = interval / 2
    load = size / rbps
    rec = FailureRecovery(hw.restart_s + hw.warmup_s + load, lost, 0.0, "storage")
    return PolicyCosts(policy, n, size, size, copy, persist, stall, stall / interval, 0.0,
                       0.0, rec, replace(rec, downtime_s=rec.downtime_s + hw.node_replace_s),
                       storage_every=interval)


def _async(policy, model, layout, hw, k, full, fb, wbps, rbps, d2h, notes) -> PolicyCosts:
    """An asynchronous save of ``k`` experts per layer (full-async: all; PEC: K)."""
    n = model.num_experts
    t = hw.iteration_s
    size = _rank_state(model, layout, k)
    copy = size / d2h
    persist = size / wbps
    stall = hw.save_call_s + max(0.0, copy - fb)
    interval = policy.interval
    if persist > interval * t:
        # A save is skipped while the previous one is still being written.
        effective = math.ceil(persist / t)
        notes.append(f"storage needs {persist:.1f} s per checkpoint: one every "
                     f"{effective} iterations, not {interval}")
        interval = effective
    lost = interval / 2 + persist / t
    # Every expert is read back, each from the checkpoint holding its newest version.
    load = full / rbps
    plt = _staleness(interval, n, k)
    rec = FailureRecovery(hw.restart_s + hw.warmup_s + load, lost, plt, "storage")
    background = _background(hw, (size + size) / interval)  # the copy, then its write
    return PolicyCosts(policy, k, size, size, copy, persist, stall,
                       stall / interval + background, 0.0,
                       size, rec, replace(rec, downtime_s=rec.downtime_s + hw.node_replace_s),
                       storage_every=interval, notes=tuple(notes))


def _check_redundancy_layout(policy: Policy, layout: Layout) -> None:
    """The trainer's own check of a redundancy against the node layout.

    Raises:
        ValueError: what :func:`deepspeed_ext.policy.redundancy.check_layout` says.
    """
    if policy.redundancy == "none":
        return
    try:
        rd.check_layout(policy.redundancy_spec(),
                        rd.Topology(layout.gpus, min(layout.gpus, layout.gpus_per_node)))
    except ValueError as err:
        raise ValueError(f"the trainer refuses it on this layout: {err}") from None


def two_level_host_bytes(policy: Policy, full: float) -> float:
    """Host memory the trainer reserves per rank for two-level checkpointing
    (``TwoLevel._check_memory_budget``): every one of its ``snapshot.SLOTS`` slots is a
    full image (fp32 weights and both Adam moments of every expert it holds, whatever
    ``Ks``), plus what it keeps of its peers' snapshots (``redundancy.extra_bytes``).

    The trainer adds a fourth slot for erasure coding with ``--moc-redundancy-interval``
    above 1; the planner proposes only the default interval 1.
    """
    image = math.ceil(full)
    return SNAPSHOT_SLOTS_KEPT * image + rd.extra_bytes(policy.redundancy_spec(), image,
                                                        PEER_STEPS_KEPT)


def _redundancy(policy: Policy, layout: Layout, hw: Hardware, size: float,
                interval_s: float, notes: List[str]) -> Tuple[float, float]:
    """(protect seconds, rebuild seconds) of one rank's snapshot of ``size`` bytes (both
    modes send about one image per rank; a rebuild reads about one)."""
    if policy.redundancy == "none":
        return 0.0, 0.0
    net = hw.network_bps(layout)
    protect = size / net
    if protect > interval_s:
        notes.append(f"redundancy needs {protect:.2f} s per snapshot, more than the "
                     f"{interval_s:.2f} s between snapshots: protection lags")
    return protect, size / net


def _slot_staleness(interval: float, n: int, ks: int, slots: int,
                    storage_age: float) -> float:
    """Mean iterations an expert's newest version lags a recovery from memory.

    Args:
        interval: iterations between snapshots.
        n: experts per layer.
        ks: experts per snapshot (sequential rotation); 0: all.
        slots: snapshots held, of ages 0 .. ``slots - 1`` intervals.
        storage_age: the age of the experts in none of them (read from storage).
    """
    ks = ks or n
    covered = min(n, slots * ks)
    if covered >= n:
        return _staleness(interval, n, ks)
    return (covered * interval * (slots - 1) / 2 + (n - covered) * storage_age) / n


def _memory_recovery(model: ModelShape, layout: Layout, hw: Hardware, interval: int,
                     ks: int, slots: int, storage_age: float) -> Tuple[float, float]:
    """(PLT per failure, load seconds) of a rank restoring from ``slots`` snapshots of
    ``ks`` experts: what they hold from host memory, the other experts from storage."""
    n = model.num_experts
    in_memory = _rank_state(model, layout, min(n, slots * (ks or n)))
    from_storage = _rank_state(model, layout, 0) - in_memory
    load = in_memory / (hw.h2d_gbps * GB) + from_storage / hw.read_bps(layout)
    return _slot_staleness(interval, n, ks, slots, storage_age), load


def _persist_every(persist_s: float, every: int, persist_every: int, t: float,
                   notes: List[str]) -> int:
    """Iterations between persists: a persist due while the previous one is still being
    written is skipped (the snapshot stays in memory only)."""
    if persist_s <= persist_every * t:
        return persist_every
    effective = math.ceil(persist_s / (every * t)) * every
    notes.append(f"storage needs {persist_s:.1f} s per persist: one every {effective} "
                 f"iterations, not {persist_every}")
    return effective


def _two_level(policy, model, layout, hw, full, fb, wbps, rbps, d2h, h2d, notes):
    n = model.num_experts
    t = hw.iteration_s
    ks = policy.k_snapshot or n
    kp = policy.k or n  # the trainer's pec_k 0 persists every expert, whatever Ks
    snap = _rank_state(model, layout, ks)
    persisted = _rank_state(model, layout, kp)
    # A persisted snapshot also holds the experts being persisted (more than Ks only
    # when every expert is persisted).
    persisted_snap = _rank_state(model, layout, max(ks, kp))
    copy = snap / d2h
    stall = hw.snapshot_call_s + max(0.0, copy - fb)
    stall_persisted = hw.snapshot_call_s + max(0.0, persisted_snap / d2h - fb)
    every = policy.interval
    persist = persisted / wbps
    persist_every = _persist_every(persist, every, every * policy.persist_interval, t, notes)
    protect, rebuild = _redundancy(policy, layout, hw, snap, every * t, notes)
    start = hw.restart_s + hw.warmup_s
    # Software failure: back to the newest complete snapshot (complete one copy after
    # it); experts in none of the slots come from the newest durable persist, which is
    # that much older (on average) than the snapshot, plus its own rotation's age.
    mem_lost = every / 2 + copy / t
    stored_lost = persist_every / 2 + persist / t
    rotation = _staleness(persist_every, n, kp)
    storage_age = rotation + max(0.0, stored_lost - mem_lost)
    mem_plt, mem_load = _memory_recovery(model, layout, hw, every, ks, SNAPSHOT_SLOTS_KEPT,
                                         storage_age)
    software = FailureRecovery(start + mem_load, mem_lost, mem_plt, "memory")
    share = _lost_share(model, layout)
    if policy.redundancy != "none":
        # The lost node's ranks hold only the snapshot rebuilt from their peers.
        lost_plt, lost_load = _memory_recovery(model, layout, hw, every, ks, 1, storage_age)
        node = FailureRecovery(start + hw.node_replace_s + rebuild + max(lost_load, mem_load),
                               every / 2 + max(copy, protect) / t,
                               share * lost_plt + (1 - share) * mem_plt, "peers")
    else:
        # Two-level recovery: the lost node's ranks load from storage, the others take
        # their experts' newer snapshots from memory; everyone goes back to the persist.
        survivors, _ = _memory_recovery(model, layout, hw, every, ks, SNAPSHOT_SLOTS_KEPT,
                                        rotation)
        node = FailureRecovery(start + hw.node_replace_s + full / rbps, stored_lost,
                               share * rotation + (1 - share) * survivors, "storage+memory")
    # Memory-only snapshots run no collective; a persisted one pays for its collectives.
    overhead = stall / every + (stall_persisted - stall + hw.persist_call_s) / persist_every \
        + _background(hw, snap / every + (persisted_snap - snap + persisted) / persist_every)
    return PolicyCosts(policy, kp, snap, persisted, copy, persist, stall, overhead,
                       protect, two_level_host_bytes(policy, full), software, node,
                       storage_every=persist_every, memory_every=every, notes=tuple(notes))


def _exact(policy, model, layout, hw, full, fb, wbps, rbps, d2h, h2d, notes):
    t = hw.iteration_s
    w = policy.window
    weights = model.params_total * WEIGHT_BYTES / layout.gpus
    # A frame: one group's fp32 state and moments, plus the compute weights of the groups
    # not yet active in the window ((W-1)/2 of W on average).
    frame = full / w + weights * (w - 1) / (2 * w)
    copy = frame / d2h
    stall = max(0.0, copy - fb)
    write = frame / wbps
    if write > t:
        # Every frame goes to storage: a backlog that only grows.
        raise Infeasible(f"exact W={w}: storage needs {write:.2f} s per frame, more than an "
                         f"iteration ({t:g} s)")
    host = 2 * w * frame  # the current and the previous window
    replay = 1.5 * w  # from the start of the last complete window
    window_bytes = frame * w
    start = hw.restart_s + hw.warmup_s
    software = FailureRecovery(start + window_bytes / h2d, replay + copy / t, 0.0, "memory")
    node = FailureRecovery(start + hw.node_replace_s + window_bytes / rbps,
                           replay + max(copy, write) / t, 0.0, "storage")
    # Every frame is copied, then written to storage.
    return PolicyCosts(policy, model.num_experts, frame, frame, copy, write, stall,
                       stall + _background(hw, 2 * frame), 0.0, host, software, node,
                       storage_every=w, memory_every=w, notes=tuple(notes))


@dataclass(frozen=True)
class Prediction:
    """A policy's analytic outcome at one MTBF."""

    costs: PolicyCosts
    mtbf_s: float
    node_fraction: float
    ettr: float
    plt: float
    """Accumulated PLT (share of expert assignments whose updates are lost)."""
    expected_downtime_s: float
    expected_lost_iterations: float
    restart: RestartPlan = RestartPlan()
    in_place: float = 0.0
    """Share of failures recovered in place (in-job restart with a spare free)."""


def in_job_costs(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                 plan: RestartPlan, mtbf_s: Optional[float] = None) -> PolicyCosts:
    """The costs of ``policy`` when a failure is recovered in place (its downtimes: the
    in-job phases before the load, then the policy's own load)."""
    return policy_costs(policy, model, layout, in_job_hardware(hw, plan.phases, layout.gpus),
                        mtbf_s)


def _restart_mix(costs: PolicyCosts, policy: Policy, model: ModelShape, layout: Layout,
                 hw: Hardware, mtbf_s: float, node_fraction: float,
                 plan: RestartPlan) -> Tuple[float, float]:
    """(expected downtime per failure, share recovered in place) under ``plan``: each
    kind's in-job downtime while spares are free, its relaunch downtime when not."""
    if not plan.in_job:
        return costs.expected_recovery(node_fraction)[0], 0.0
    in_job = in_job_costs(policy, model, layout, hw, plan, mtbf_s)
    soft, node = blocked(plan, mtbf_s, node_fraction, min(layout.gpus, layout.gpus_per_node))
    software = soft * costs.software.downtime_s + (1 - soft) * in_job.software.downtime_s
    lost_node = node * costs.node.downtime_s + (1 - node) * in_job.node.downtime_s
    downtime = (1 - node_fraction) * software + node_fraction * lost_node
    return downtime, (1 - node_fraction) * (1 - soft) + node_fraction * (1 - node)


def predict(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware, mtbf_s: float,
            node_fraction: float = 0.0, restart: RestartPlan = RestartPlan()) -> Prediction:
    """The analytic ETTR and PLT of ``policy`` (MoEtion's formula, failure kinds mixed;
    with an in-job ``restart``, in-place and relaunched recoveries mixed as well).

    Raises:
        ValueError: MTBF <= 0, or ``node_fraction`` outside [0, 1].
    """
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"the MTBF must be > 0 seconds and finite, got {mtbf_s}")
    if not 0 <= node_fraction <= 1:
        raise ValueError(f"the node-failure fraction must be in [0, 1], got {node_fraction}")
    costs = policy_costs(policy, model, layout, hw, mtbf_s)
    t = hw.iteration_s
    _, lost, plt = costs.expected_recovery(node_fraction)
    downtime, in_place = _restart_mix(costs, policy, model, layout, hw, mtbf_s,
                                      node_fraction, restart)
    step = t + costs.overhead_per_iteration_s
    recovery = downtime + lost * step
    ettr = 1 / (1 + costs.overhead_per_iteration_s / t) / (1 + recovery / mtbf_s)
    failures_per_iteration = step / mtbf_s
    return Prediction(costs, mtbf_s, node_fraction, ettr, failures_per_iteration * plt,
                      downtime, lost, restart, in_place)
