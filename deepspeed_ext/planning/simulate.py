"""Failure simulator: replays a failure process over a long run, per policy.

A run is simulated segment by segment: training resumes at some iteration and advances
at one iteration per ``T_iter + overhead`` seconds until the next failure; then the
policy's newest durable state decides where it resumes (a checkpoint becomes durable a
copy, persist or protection lag after its iteration), the failure costs the policy's
downtime (restart and load; a failure during the downtime starts the recovery over),
and the iterations between the resumed point and the failure are done again. Failures
come from an exponential process with mean ``mtbf_s`` (seeded) or from a trace of
``(time_s, kind)``; a failure is a node failure with probability ``node_fraction``
(traces say so per failure). ``pec-dynamic`` doubles K whenever the accumulated PLT
exceeds its threshold, as the trainer does; its costs change with it.

Results: ETTR (useful iteration time over wall time), goodput (tokens per second),
accumulated PLT, failures; :func:`simulate_many` repeats over seeds and gives 95 %
confidence intervals. Pure and deterministic for a seed.
"""

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from deepspeed_ext.planning.costs import Hardware, Layout, ModelShape, Policy, policy_costs

KINDS = ("software", "node")


@dataclass(frozen=True)
class Failure:
    time_s: float
    kind: str = "software"

    def __post_init__(self):
        if self.time_s < 0:
            raise ValueError(f"a failure time must be >= 0, got {self.time_s}")
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


def exponential_failures(mtbf_s: float, horizon_s: float, node_fraction: float,
                         seed: int) -> List[Failure]:
    """Failure times of a Poisson process of mean gap ``mtbf_s`` up to ``horizon_s``."""
    if not mtbf_s > 0:
        raise ValueError(f"the MTBF must be > 0 seconds, got {mtbf_s}")
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return out
        out.append(Failure(t, "node" if rng.random() < node_fraction else "software"))


def parse_trace(text: str) -> List[Failure]:
    """A trace file: one failure per line, ``SECONDS [software|node]``; ``#`` comments.

    Raises:
        ValueError: naming the line.
    """
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            out.append(Failure(float(parts[0]), parts[1] if len(parts) > 1 else "software"))
        except (ValueError, IndexError) as err:
            raise ValueError(f"trace line {number}: {line!r}: {err}") from None
    return sorted(out, key=lambda f: f.time_s)


def _durable(progress: float, interval: float, lag_iterations: float) -> float:
    """Iterations since the resume point covered by the newest durable checkpoint, taken
    every ``interval`` iterations and durable ``lag_iterations`` after it."""
    if progress < lag_iterations:
        return 0.0
    return math.floor((progress - lag_iterations) / interval) * interval


def simulate_run(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                 iterations: int, failures: Sequence[Failure], mtbf_s: float,
                 downtime_failures: bool = True, uptime_clock: bool = False) -> RunResult:
    """Simulate ``iterations`` useful iterations under ``failures`` (sorted by time).

    ``mtbf_s`` is used only for pec-dynamic's starting costs (its K then follows the
    simulated PLT, not the formula). ``downtime_failures=False``: failures that fall
    due while the job is down are skipped (as this repository's fault injector does: its
    clock only fires inside the training loop) instead of restarting the recovery.
    ``uptime_clock``: failure times count seconds of training (downtime excluded), so a
    trace measured on a real run keeps each failure at the same point of its training
    segment even when the simulated downtimes differ from the real ones.
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    k = policy.k or model.num_experts
    dynamic = policy.kind == "pec-dynamic"
    current = replace(policy, kind="pec", k=k) if dynamic else policy
    costs = policy_costs(current, model, layout, hw, mtbf_s)
    t_iter = hw.iteration_s
    wall = hw.warmup_s  # the first start's slower first iterations
    done = 0.0  # iterations completed and durable-or-not, of the useful run
    redone = 0.0
    lost_expert = 0.0  # iterations' worth of lost expert updates (PLT numerator)
    count = 0
    queue = list(failures)
    index = 0
    uptime = 0.0  # seconds spent training so far (the uptime clock)
    while True:
        step = t_iter + costs.overhead_per_iteration_s
        start_iteration = done
        if index >= len(queue):
            next_failure = math.inf
        elif uptime_clock:
            next_failure = wall + max(0.0, queue[index].time_s - uptime)
        else:
            next_failure = queue[index].time_s
        finish = wall + (iterations - done) * step
        if finish <= next_failure:
            wall = finish
            done = iterations
            break
        failure = queue[index]
        index += 1
        progress = (next_failure - wall) / step
        uptime += next_failure - wall
        wall = next_failure
        count += 1
        rec = costs.node if failure.kind == "node" else costs.software
        interval, lag = _checkpoint_grid(costs, failure.kind, t_iter)
        kept = _durable(progress, interval, lag)
        done = start_iteration + kept
        redone += progress - kept
        if rec.plt:
            lost_expert += rec.plt
        # Downtime; failures inside it start the recovery over.
        end = wall + rec.downtime_s
        while not uptime_clock and index < len(queue) and queue[index].time_s < end:
            if downtime_failures:
                count += 1
                wall = queue[index].time_s
                end = wall + rec.downtime_s
            index += 1
        wall = end
        if dynamic and done > 0 and lost_expert / max(done, 1.0) > policy.plt_threshold \
                and k < model.num_experts:
            k = min(model.num_experts, 2 * k)
            current = replace(current, k=k)
            costs = policy_costs(current, model, layout, hw, mtbf_s)
    useful = iterations * t_iter
    return RunResult(ettr=useful / wall if wall else 1.0,
                     goodput_tokens_s=iterations * model.tokens_per_iteration / wall if wall else 0.0,
                     plt=lost_expert / iterations, failures=count, wall_s=wall,
                     useful_iterations=iterations, redone_iterations=redone, final_k=k)


def _checkpoint_grid(costs, kind: str, t_iter: float) -> Tuple[float, float]:
    """(interval, durability lag) in iterations of the state a failure of ``kind`` resumes
    from, counted from the resume point."""
    p = costs.policy
    source = (costs.node if kind == "node" else costs.software).source
    if p.kind == "exact":
        # The last complete window: complete one copy after its last frame (its replay
        # then covers the rest, counted as redone iterations).
        return float(p.window), p.window + costs.copy_s / t_iter
    if source == "memory":
        return float(costs.memory_every), costs.copy_s / t_iter
    if source == "peers":
        return float(costs.memory_every), max(costs.copy_s, costs.protect_s) / t_iter
    lag = 0.0 if p.kind == "full-sync" else costs.persist_s / t_iter
    return float(costs.storage_every), lag


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


def _ci(values: List[float]) -> float:
    if len(values) < 2:
        return 0.0
    return 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def simulate_many(policy: Policy, model: ModelShape, layout: Layout, hw: Hardware,
                  mtbf_s: float, iterations: int, seeds: Sequence[int],
                  node_fraction: float = 0.0,
                  trace: Optional[List[Failure]] = None,
                  downtime_failures: bool = True) -> Summary:
    """:func:`simulate_run` for each seed (one failure schedule per seed, the same for
    every policy given the same seeds), summarised. With ``trace``, the trace is replayed
    (the seeds are ignored but for their count)."""
    if not seeds:
        raise ValueError("at least one seed")
    results: List[RunResult] = []
    # A horizon long enough for the slowest policy: failures beyond it never matter.
    horizon = iterations * hw.iteration_s * 50 + 10 * mtbf_s
    for seed in seeds:
        failures = trace if trace is not None else exponential_failures(
            mtbf_s, horizon, node_fraction, seed)
        results.append(simulate_run(policy, model, layout, hw, iterations, failures, mtbf_s,
                                    downtime_failures))
        if trace is not None:
            break
    ettr = [r.ettr for r in results]
    plt = [r.plt for r in results]
    return Summary(policy, mtbf_s, len(results), statistics.mean(ettr), _ci(ettr),
                   statistics.mean(r.goodput_tokens_s for r in results), statistics.mean(plt),
                   _ci(plt), statistics.mean(r.failures for r in results),
                   statistics.mean(r.final_k for r in results))
