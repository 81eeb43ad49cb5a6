"""Localized against global recovery of a pipeline stage (MoEtion): what each costs a
failure, and the ETTR it gives. Pure functions over a plain dataclass.

A pipeline of ``P`` stages, one device each, runs a step of ``M`` micro-batches in the
1F1B schedule in ``(M + P - 1)`` slots of one stage's forward and backward of one
micro-batch (``M`` slots of work, ``P - 1`` of bubble), so one slot is
``T_iter / (M + P - 1)``. Exact mode replays, after a failure, the steps since the start
of the newest complete window: ``1.5 W`` on average (``W`` frames per window).

* **Global**: every stage restores its window and replays through the pipeline:
  ``restore + 1.5 W * T_iter``.
* **Localized**: the failed stage replays alone, from its neighbours' upstream logs, with
  no bubble and nothing to wait for: ``restore + 1.5 W * M * T_iter / (M + P - 1)``. The
  other stages wait; nobody recomputes their work.
* **ETTR** (MoEtion's, as :func:`deepspeed_ext.planning.costs.predict`):
  ``1 / (1 + overhead / T_iter) / (1 + (downtime + replay) / MTBF)``, the overhead being
  what the logs' copies add to a step.

The speedup of localized over global replay is therefore ``(M + P - 1) / M`` per step:
small with many micro-batches, larger with many stages. On a shared CPU (the tests and
benchmarks here) a stage replaying alone also gets the cores the waiting stages leave,
which this model, one device per stage, does not count.
"""

from dataclasses import dataclass
from typing import Dict

REPLAYED_WINDOWS = 1.5
"""Steps replayed per failure, in windows: from the start of the newest complete window."""


@dataclass(frozen=True)
class PipelineRecovery:
    """A pipeline job's figures for the recovery model."""

    stages: int
    """Pipeline stages P."""
    micro_batches: int
    """Micro-batches per step M."""
    window: int
    """Exact mode's frames per window W."""
    iteration_s: float
    """Seconds per step."""
    restore_s: float = 0.0
    """Seconds to restore a window of frames (from host memory)."""
    downtime_s: float = 0.0
    """Seconds before the replay can start (detection, replacing the failed device)."""
    log_overhead_s: float = 0.0
    """Seconds the upstream logs' copies add to a step (hidden behind compute: 0)."""

    def __post_init__(self):
        if self.stages < 2 or self.micro_batches < 1 or self.window < 1:
            raise ValueError(f"need stages >= 2, micro_batches >= 1 and window >= 1, got "
                             f"{self.stages}, {self.micro_batches} and {self.window}")
        if not self.iteration_s > 0 or min(self.restore_s, self.downtime_s,
                                           self.log_overhead_s) < 0:
            raise ValueError("iteration_s must be > 0 and the other times >= 0")


def replay_step_s(p: PipelineRecovery, localized: bool) -> float:
    """Seconds to replay one step: the whole pipeline's step, or one stage's ``M`` slots."""
    if not localized:
        return p.iteration_s
    return p.iteration_s * p.micro_batches / (p.micro_batches + p.stages - 1)


def recovery_s(p: PipelineRecovery, localized: bool, steps: float = 0.0) -> float:
    """Seconds from the failure to training again: downtime, restore and the replay of
    ``steps`` steps (0: the average, ``1.5 W``)."""
    steps = steps or REPLAYED_WINDOWS * p.window
    return p.downtime_s + p.restore_s + steps * replay_step_s(p, localized)


def ettr(p: PipelineRecovery, mtbf_s: float, localized: bool) -> float:
    """MoEtion's ETTR at mean time between failures ``mtbf_s`` (the logs' overhead counts
    only when localized: without them the job pays no copies)."""
    if not mtbf_s > 0:
        raise ValueError(f"the MTBF must be > 0 seconds, got {mtbf_s}")
    overhead = p.log_overhead_s if localized else 0.0
    return 1 / (1 + overhead / p.iteration_s) / (1 + recovery_s(p, localized) / mtbf_s)


def compare(p: PipelineRecovery, mtbf_s: float) -> Dict[str, float]:
    """Both recoveries side by side: seconds per failure, speedup, ETTR each."""
    loc, glo = recovery_s(p, True), recovery_s(p, False)
    return {"localized_s": loc, "global_s": glo, "speedup": glo / loc,
            "replay_speedup": replay_step_s(p, False) / replay_step_s(p, True),
            "ettr_localized": ettr(p, mtbf_s, True), "ettr_global": ettr(p, mtbf_s, False)}
