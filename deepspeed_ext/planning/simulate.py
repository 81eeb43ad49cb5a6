"""Failure simulator: replays a failure process over a long run, per policy.

A run is simulated segment by segment: training resumes at some iteration and advances
at one iteration per ``T_iter + overhead`` seconds until the next failure; then the
policy's newest state that a failure of that kind leaves usable decides where it
resumes, the failure costs the policy's downtime (restart and load; a failure during
the downtime starts the recovery over, and a node failure during a software recovery
turns it into a node recovery), and the iterations between the resumed point and the
failure are done again.

The state is tracked in absolute iterations, as the trainer keeps it: the newest
checkpoint durable on storage (a checkpoint becomes durable a copy or persist lag after
its iteration) and the newest complete snapshot in host memory. A software failure
keeps host memory; a node failure loses one node's, so without redundancy it goes back
to the newest durable persist, which may lie before the point the current segment
resumed from (a memory snapshot). Two-level persists follow the trainer: the first
snapshot after every (re)start is persisted, then every ``persist_interval``-th.

Failures come from an exponential process with mean ``mtbf_s`` (a seeded generator,
drawn lazily so a run never runs out of them) or from a trace of ``(time_s, kind)``; a
failure is a node failure with probability ``node_fraction`` (traces say so per
failure). ``pec-dynamic`` doubles K whenever the accumulated PLT exceeds its threshold,
as the trainer does; its costs change with it. A run that cannot finish (failures
faster than its recoveries) stops after :data:`MAX_FAILURES` failures with the progress
made so far.

With an in-job restart (:class:`~deepspeed_ext.planning.restart.RestartPlan`), each
failure, the ones during a recovery included, takes the spares it needs from the job's
pool while enough are free (:func:`~deepspeed_ext.planning.restart.take`; they come back
``repair_s`` later) and its recovery costs the in-job downtime; a failure that finds too
few costs the relaunch's (and a recovery restarted by it, too).

Results: ETTR (useful iteration time over wall time), goodput (tokens per second),
accumulated PLT, failures, failures recovered in place; :func:`simulate_many` repeats
over seeds and gives 95 % confidence intervals (Student's t). Pure and deterministic for
a seed.
"""

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from deepspeed_ext.planning.costs import (FailureRecovery, Hardware, Layout, ModelShape,
                                          Policy, PolicyCosts, in_job_costs, policy_costs)
from deepspeed_ext.planning.restart import RestartPlan, SparePool, spares_needed, take

KINDS = ("software", "node")
MAX_FAILURES = 100_000
"""Failures after which a run that has not finished stops (its ETTR is the progress so
far over the time so far)."""
T_95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95 % quantiles of Student's t for 1 .. 30 degrees of freedom."""


@dataclass(frozen=True)
class Failure:
    time_s: float
    kind: str = "software"

    def __post_init__(self):
        if not (math.isfinite(self.time_s) and self.time_s >= 0):
            raise ValueError(f"a failure time must be a finite number of seconds >= 0, got "
                             f"{self.time_s}")
        if self.kind not in KINDS:
            raise ValueError(f"a failure kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class RunResult:
    """One simulated run."""

    ettr: float
    goodput_tokens_s: float
    plt: float
    failures: int
    wall_s: float
    useful_iterations: int
    redone_iterations: float
    final_k: int
    finished: bool = True
    """False when the run stopped after :data:`MAX_FAILURES` failures."""
    in_place: int = 0
    """Failures recovered in place (in-job restart, a spare free)."""


def failure_stream(mtbf_s: float, node_fraction: float, seed: int) -> Iterator[Failure]:
    """Failures of a Poisson process of mean gap ``mtbf_s``, without end (seeded)."""
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"the MTBF must be > 0 seconds and finite, got {mtbf_s}")
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield Failure(t, "node" if rng.random() < node_fraction else "software")


def exponential_failures(mtbf_s: float, horizon_s: float, node_fraction: float,
                         seed: int) -> List[Failure]:
    """The failures of :func:`failure_stream` up to ``horizon_s``."""
    out = []
    for failure in failure_stream(mtbf_s, node_fraction, seed):
        if failure.time_s > horizon_s:
            return out
        out.append(failure)
    return out  # never reached: the stream has no end


def parse_trace(text: str, source: str = "trace") -> List[Failure]:
    """A trace file: one failure per line, ``SECONDS [software|node]``; ``#`` comments.

    Args:
        source: what the errors call the text (the file's name).

    Raises:
        ValueError: naming ``source`` and the line.
    """
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                out.append(_trace_line(line))
            except ValueError as err:
                raise ValueError(f"{source} line {number}: {line!r}: {err}") from None
    return sorted(out, key=lambda f: f.time_s)


def _trace_line(line: str) -> Failure:
    parts = line.replace(",", " ").split()
    if len(parts) > 2:
        raise ValueError(f"expected 'SECONDS [{'|'.join(KINDS)}]', got {len(parts)} fields")
    try:
        seconds = float(parts[0])
    except ValueError:
        raise ValueError(f"{parts[0]!r} is not a number of seconds") from None
    return Failure(seconds, parts[1] if len(parts) > 1 else "software")


def load_trace(path: str) -> List[Failure]:
    """:func:`parse_trace` of a file.

    Raises:
        ValueError: naming the file (and the line, or why it cannot be read).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: {err}") from None
    return parse_trace(text, path)


def _newest(progress: float, first: float, period: float, lag: float) -> Optional[float]:
    """Offset from the resume point of the newest checkpoint usable ``progress``
    iterations after it: taken at ``first``, ``first + period``, ..., usable ``lag``
    iterations after it; None when none is yet."""
    if progress < first + lag:
        return None
    return first + math.floor((progress - lag - first) / period) * period


@dataclass(frozen=True)
class _Points:
    """Where a failure could resume from, in absolute iterations."""

    storage: float
    """The newest checkpoint durable on storage."""
    memory: Optional[float]
    """The newest complete snapshot in host memory (two-level; None: none usable)."""
    peers: Optional[float]
    """The newest snapshot protected in the peers' memory (two-level with redundancy)."""
    exact: Optional[float]
    """Exact mode: the start of the newest complete window."""


def _points(costs: PolicyCosts, t_iter: float, start: float, progress: float,
            storage: float, memory: Optional[float]) -> _Points:
    """The resume candidates of a failure ``progress`` iterations after ``start``, given
    the newest durable checkpoint and snapshot from before that segment."""
    p = costs.policy
    if p.kind == "exact":
        # The start of the last complete window: complete one copy after its last frame
        # (its replay then covers the rest, counted as redone iterations). Every frame
        # is on storage too: the resume point is durable.
        window = _newest(progress, 0.0, p.window, p.window + costs.copy_s / t_iter)
        point = start + (window if window is not None else 0.0)
        return _Points(point, point, None, point)
    if p.kind == "two-level":
        every = float(costs.memory_every)
        # The trainer persists the first snapshot after every start, then every N-th.
        stored = _newest(progress, every, costs.storage_every, costs.persist_s / t_iter)
        snap = _newest(progress, every, every, costs.copy_s / t_iter)
        protected = _newest(progress, every, every,
                            max(costs.copy_s, costs.protect_s) / t_iter)
        memory_now = start + snap if snap is not None else memory
        peers = start + protected if protected is not None else memory
        return _Points(max(storage, start + stored) if stored is not None else storage,
                       memory_now, peers if p.redundancy != "none" else None, None)
    lag = 0.0 if p.kind == "full-sync" else costs.persist_s / t_iter
    stored = _newest(progress, costs.storage_every, costs.storage_every, lag)
    return _Points(max(storage, start + stored) if stored is not None else storage,
                   None, None, None)


def _resume(kind: str, points: _Points, costs: PolicyCosts) -> Tuple[float, Optional[float]]:
    """(resume iteration, the snapshot in host memory after it) of a failure of ``kind``."""
    if points.exact is not None:
        return points.exact, points.exact
    source = (costs.node if kind == "node" else costs.software).source
    if source == "memory" and points.memory is not None:
        point = max(points.memory, points.storage)
        return point, point
    if source == "peers" and points.peers is not None:
        point = max(points.peers, points.storage)
        return point, point
    # From storage: a replaced node has no snapshot; the first one after the restart
    # is the next usable one.
    return points.storage, None


@dataclass
class _Restarts:
    """How a run's failures come back: the policy's costs relaunched and (in-job) in
    place, and the spares left."""

    plan: RestartPlan
    node_size: int
    relaunch: PolicyCosts
    in_job: Optional[PolicyCosts]
    pool: SparePool
    in_place: int = 0

    @classmethod
    def start(cls, plan: RestartPlan, policy: Policy, model: ModelShape, layout: Layout,
              hw: Hardware, mtbf_s: float) -> "_Restarts":
        out = cls(plan, min(layout.gpus, layout.gpus_per_node), None, None,
                  SparePool(plan.spares))
        out.price(policy, model, layout, hw, mtbf_s)
        return out

    def price(self, policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
              mtbf_s: float) -> PolicyCosts:
        """(Re)compute both costs of ``policy`` (pec-dynamic changes K); returns the
        relaunch's, whose resume points and overhead are also the in-job ones'."""
        self.relaunch = policy_costs(policy, model, layout, hw, mtbf_s)
        self.in_job = in_job_costs(policy, model, layout, hw, self.plan, mtbf_s) \
            if self.plan.in_job else None
        return self.relaunch

    def recovery(self, kind: str, failure_kind: str, at_s: float) -> FailureRecovery:
        """The recovery of ``kind`` after a failure of ``failure_kind`` at ``at_s``: in
        place when that failure gets its spares, else relaunched."""
        costs = self.relaunch
        if self.in_job is not None:
            ok, self.pool = take(self.pool, at_s, spares_needed(failure_kind, self.node_size),
                                 self.plan.repair_s)
            if ok:
                self.in_place += 1
                costs = self.in_job
        return costs.node if kind == "node" else costs.software


class _Failures:
    """A failure source with one failure of look-ahead (a list or an endless stream)."""

    def __init__(self, failures: Iterable[Failure]):
        self._it = iter(failures)
        self.next: Optional[Failure] = next(self._it, None)

    def pop(self) -> Failure:
        failure, self.next = self.next, next(self._it, None)
        return failure


@dataclass
class _Run:
    """The state of one simulated run: wall seconds, absolute iterations."""

    wall: float
    """Now, in seconds since the job started."""
    done: float = 0.0
    """The iteration training has reached."""
    storage: float = 0.0
    """The newest checkpoint durable on storage (0: the job's start)."""
    memory: Optional[float] = None
    """The newest complete snapshot in host memory that a recovery can use."""
    redone: float = 0.0
    lost_expert: float = 0.0
    """Iterations' worth of lost expert updates (the PLT's numerator)."""
    count: int = 0
    """Failures so far."""
    uptime: float = 0.0
    """Seconds spent training so far (the uptime clock)."""

    def next_failure_s(self, queue: _Failures, uptime_clock: bool) -> float:
        if queue.next is None:
            return math.inf
        if uptime_clock:
            return self.wall + max(0.0, queue.next.time_s - self.uptime)
        return queue.next.time_s

    def fail(self, costs: PolicyCosts, failure: Failure, at_s: float, t_iter: float) -> _Points:
        """A failure at ``at_s``: training goes back to what its kind leaves usable."""
        step = t_iter + costs.overhead_per_iteration_s
        # A failure during the first start's warm-up makes no progress (never negative).
        progress = max(0.0, (at_s - self.wall) / step)
        self.uptime += max(0.0, at_s - self.wall)
        self.wall = at_s
        self.count += 1
        points = _points(costs, t_iter, self.done, progress, self.storage, self.memory)
        self.storage = points.storage
        self.done += progress
        self._go_back(costs, failure.kind, points)
        return points

    def _go_back(self, costs: PolicyCosts, kind: str, points: _Points) -> None:
        rec = costs.node if kind == "node" else costs.software
        resumed, self.memory = _resume(kind, points, costs)
        self.redone += self.done - resumed
        self.done = resumed
        self.lost_expert += rec.plt

    def recover(self, restarts: _Restarts, kind: str, points: _Points, queue: _Failures,
                downtime_failures: bool, max_failures: int) -> None:
        """The downtime of a failure of ``kind`` (just counted): failures inside it start
        the recovery over (or are skipped), and a node failure during a software recovery
        makes it a node recovery, from the state a node failure leaves; each failure's
        spares decide whether its recovery is in place."""
        costs = restarts.relaunch
        end = self.wall + restarts.recovery(kind, kind, self.wall).downtime_s
        while queue.next is not None and queue.next.time_s < end and self.count < max_failures:
            failure = queue.pop()
            if not downtime_failures:
                continue
            self.count += 1
            self.wall = failure.time_s
            if failure.kind == "node" and kind != "node":
                self.lost_expert -= costs.software.plt
                kind = "node"
                self._go_back(costs, kind, points)
            end = self.wall + restarts.recovery(kind, failure.kind, self.wall).downtime_s
        self.wall = end


def simulate_run(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                 iterations: int, failures: Iterable[Failure], mtbf_s: float,
                 downtime_failures: bool = True, uptime_clock: bool = False,
                 max_failures: int = MAX_FAILURES,
                 restart: RestartPlan = RestartPlan()) -> RunResult:
    """Simulate ``iterations`` useful iterations under ``failures`` (sorted by time; a
    list or an endless iterator such as :func:`failure_stream`).

    ``mtbf_s`` is used only for pec-dynamic's starting costs (its K then follows the
    simulated PLT, not the formula). ``downtime_failures=False``: failures that fall
    due while the job is down are skipped (as this repository's fault injector does: its
    clock only fires inside the training loop) instead of restarting the recovery.
    ``uptime_clock``: failure times count seconds of training (downtime excluded), so a
    trace measured on a real run keeps each failure at the same point of its training
    segment even when the simulated downtimes differ from the real ones. A run still
    unfinished after ``max_failures`` failures stops there (``finished`` False).
    ``restart``: relaunch every failure (the default) or recover it in place while
    spares last (module docstring).
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    if max_failures < 1:
        raise ValueError("max_failures must be >= 1")
    k = policy.k or model.num_experts
    dynamic = policy.kind == "pec-dynamic"
    current = replace(policy, kind="pec", k=k) if dynamic else policy
    restarts = _Restarts.start(restart, current, model, layout, hw, mtbf_s)
    costs = restarts.relaunch
    run = _Run(wall=hw.warmup_s)  # the first start's slower first iterations
    queue = _Failures(failures)
    while True:
        step = hw.iteration_s + costs.overhead_per_iteration_s
        at = run.next_failure_s(queue, uptime_clock)
        finish = run.wall + (iterations - run.done) * step
        if finish <= at:
            run.wall, run.done = finish, float(iterations)
            break
        if run.count >= max_failures:
            break
        failure = queue.pop()
        points = run.fail(costs, failure, at, hw.iteration_s)
        if not uptime_clock:
            run.recover(restarts, failure.kind, points, queue, downtime_failures, max_failures)
        else:
            run.wall += restarts.recovery(failure.kind, failure.kind, run.wall).downtime_s
        if dynamic and run.done > 0 and run.lost_expert / max(run.done, 1.0) \
                > policy.plt_threshold and k < model.num_experts:
            k = min(model.num_experts, 2 * k)
            current = replace(current, k=k)
            costs = restarts.price(current, model, layout, hw, mtbf_s)
    return replace(_result(run, iterations, hw.iteration_s, model, k),
                   in_place=restarts.in_place)


def _result(run: _Run, iterations: int, t_iter: float, model: ModelShape, k: int) -> RunResult:
    useful = run.done
    return RunResult(ettr=useful * t_iter / run.wall if run.wall else 1.0,
                     goodput_tokens_s=(useful * model.tokens_per_iteration / run.wall
                                       if run.wall else 0.0),
                     plt=run.lost_expert / max(useful, 1.0), failures=run.count,
                     wall_s=run.wall, useful_iterations=int(useful),
                     redone_iterations=run.redone, final_k=k, finished=useful >= iterations)


@dataclass(frozen=True)
class Summary:
    """A policy over several seeds: means and 95 % confidence half-widths."""

    policy: Policy
    mtbf_s: float
    runs: int
    ettr: float
    ettr_ci: float
    goodput_tokens_s: float
    plt: float
    plt_ci: float
    failures: float
    final_k: float
    unfinished: int = 0
    """Runs stopped after :data:`MAX_FAILURES` failures."""
    in_place: float = 0.0
    """Share of the failures recovered in place (in-job restart, a spare free)."""


def t_quantile(dof: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``dof`` degrees of freedom (the normal
    1.96 beyond 30)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    return T_95[dof - 1] if dof <= len(T_95) else 1.96


def confidence_half_width(values: List[float]) -> float:
    """Half-width of the 95 % confidence interval of the mean of ``values`` (used by
    :func:`simulate_many` and its tests)."""
    if len(values) < 2:
        return 0.0
    return t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def simulate_many(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                  mtbf_s: float, iterations: int, seeds: Sequence[int],
                  node_fraction: float = 0.0,
                  trace: Optional[List[Failure]] = None,
                  downtime_failures: bool = True,
                  restart: RestartPlan = RestartPlan()) -> Summary:
    """:func:`simulate_run` for each seed (one failure schedule per seed, the same for
    every policy given the same seeds), summarised. With ``trace``, the trace is replayed
    (the seeds are ignored but for their count)."""
    if not seeds:
        raise ValueError("at least one seed")
    results: List[RunResult] = []
    for seed in seeds:
        failures = trace if trace is not None else failure_stream(mtbf_s, node_fraction, seed)
        results.append(simulate_run(policy, model, layout, hw, iterations, failures, mtbf_s,
                                    downtime_failures, restart=restart))
        if trace is not None:
            break
    ettr = [r.ettr for r in results]
    plt = [r.plt for r in results]
    return Summary(policy, mtbf_s, len(results), statistics.mean(ettr),
                   confidence_half_width(ettr),
                   statistics.mean(r.goodput_tokens_s for r in results), statistics.mean(plt),
                   confidence_half_width(plt), statistics.mean(r.failures for r in results),
                   statistics.mean(r.final_k for r in results),
                   sum(not r.finished for r in results),
                   sum(r.in_place for r in results) / max(1, sum(r.failures for r in results)))
