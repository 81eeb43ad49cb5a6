"""A pipeline stage losing its training state in place, and the in-process recovery
(``--moc-fault lose-stage@N:rank=R``, exact mode, ``--pipeline-model-parallel-size`` > 1).

At the top of iteration ``N`` the stage of rank ``R`` loses its weights, optimizer state
and logs (set to NaN and emptied: a GPU's memory gone); its processes, the process group
and the other stages live on. Every rank knows it (the fault is in every rank's flags),
so every rank enters :meth:`StageLoss.recover` at once:

* **localized** (``--moc-upstream-logging``): only the failed stage's ranks restore the
  newest complete window of exact-mode frames and replay the steps since its start from
  their neighbours' upstream logs (:mod:`deepspeed_ext.exact.local_replay`); the other
  stages wait in a barrier.
* **global** (no upstream logs, two adjacent stages lost, or a neighbour's log lacking a
  step): every stage restores the window and replays the steps through the pipeline.
  The log line says why.

Either way the state after recovery is the one before the fault, to the bit, and the loop
continues with iteration ``N``. The fault fires once per process.
"""

import argparse
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state
from megatron.errors import ConfigError
from megatron.training.stage_replay import StageReplayer

KIND = "lose-stage"


@dataclass
class Recovered:
    """What one in-process recovery did (rank 0 logs it; the benchmark reads it)."""

    iteration: int
    """The iteration the fault fired at (the loop runs it next)."""
    stages: List[int]
    """The stages that lost their state."""
    localized: bool
    """Whether only those stages replayed."""
    window_start: int
    """The frame the replay started from."""
    seconds: float
    """Wall time of the recovery, fault to the end of the replay (every rank waited)."""
    why: str
    """Why the recovery was global ('' when localized)."""


def check_stage_loss(args: argparse.Namespace, specs) -> None:
    """With the other flag checks, on every rank: ``lose-stage`` needs a pipeline and exact
    mode's frames.

    Raises:
        ConfigError: naming the flags.
    """
    if any(s.kind == KIND for s in specs) and (
            getattr(args, "pipeline_model_parallel_size", 1) < 2 or args.moc_mode != "exact"):
        raise ConfigError("--moc-fault lose-stage needs --pipeline-model-parallel-size > 1 and "
                          "--moc-mode exact (the stage restores its window of frames)")


class StageLoss:
    """The ``lose-stage`` faults of a job and their recovery. Every rank creates one with
    the same faults and calls :meth:`before_iteration` at the top of every iteration.

    Args:
        engine: the ``PipelineEngine`` (with ``engine.moc_upstream`` and
            ``engine.moc_cross`` when ``--moc-upstream-logging``).
        exact: the job's :class:`~deepspeed_ext.exact.ExactSnapshots`.
        specs: every fault of the job (other kinds are ignored).
        stage_of: global rank -> its pipeline stage.
        batches_from: ``consumed samples -> iterator`` of the pipeline's batches from
            there (the first and last stages read their replayed steps' data from it).
        scheduler: the trainer's learning-rate scheduler (set to each replayed step's).
        log: rank 0's lines.
    """

    def __init__(self, engine, exact, specs, stage_of: Callable[[int], int],
                 batches_from: Callable[[int], object], scheduler, args: argparse.Namespace,
                 log: Callable[[str], None]):
        self.engine, self.exact, self.args, self.log = engine, exact, args, log
        self.replayer = StageReplayer(engine, exact, batches_from, scheduler, args)
        self.pending = sorted({(s.iteration, stage_of(s.rank)) for s in specs if s.kind == KIND})
        self.recoveries: List[Recovered] = []

    def before_iteration(self, iteration: int) -> Optional[Recovered]:
        """Every rank, at the top of the loop: fire the losses due at ``iteration`` and
        recover from them (None: nothing due)."""
        due = [stage for it, stage in self.pending if it <= iteration]
        if not due:
            return None
        self.pending = [(it, s) for it, s in self.pending if it > iteration]
        began = time.perf_counter()
        failed = sorted(set(due))
        # The last frame's copy runs beside the next step, and this loss comes at the top
        # of one: wiped under the copy, the frame would hold NaN (measured: the global
        # replay after a localized one diverged).
        self.exact.writer.wait_for_previous()
        if self.engine.stage_id in failed:
            self._lose_state()
        self.log(f"[fault] stage(s) {failed} lost their training state at iteration {iteration} "
                 f"(--moc-fault lose-stage): recovering in place")
        done = self._recover(iteration, failed, began)
        self.recoveries.append(done)
        how = (f"localized: stage(s) {failed} replayed iterations {done.window_start + 1}.."
               f"{iteration - 1} from their neighbours' upstream logs while the others waited"
               if done.localized else f"global: every stage replayed iterations "
               f"{done.window_start + 1}..{iteration - 1} ({done.why})")
        self.log(f"[moc] recovered in {done.seconds:.2f} s, {how}")
        self._record(done)
        return done

    def _record(self, done: Recovered) -> None:
        """Rank 0: a ``recovery`` event in ``--moc-event-file`` (the ETTR line counts them)."""
        path = getattr(self.args, "moc_event_file", None)
        if not path or dist.get_rank() != 0:
            return
        from megatron.training.events import EventLog
        EventLog(path).append({
            "kind": "recovery", "iteration": done.window_start,
            "source": "localized in place" if done.localized else "global in place",
            "load_s": done.seconds, "plt": 0.0, "iterations_lost": done.iteration - 1 - done.window_start,
            "stages": done.stages, "why": done.why, "failure": f"lose-stage at {done.iteration}"})

    def _lose_state(self) -> None:
        """This rank's weights, fp32 masters, moments and logs are gone."""
        from deepspeed_ext.state import describe_local_state
        engine = self.engine
        with torch.no_grad():
            for frag in describe_local_state(engine, self.exact.naming):
                frag.tensor.fill_(float("nan"))
            for param in engine.module.parameters():
                param.fill_(float("nan"))
        for log in (getattr(engine, "moc_upstream", None), getattr(engine, "moc_cross", None)):
            if log is not None:
                log.clear()

    def _recover(self, iteration: int, failed: List[int], began: float) -> Recovered:
        from deepspeed_ext.exact.local_replay import newest_window
        from deepspeed_ext.runtime.groups import metadata_group
        found = newest_window(self.exact)
        if found is None:
            raise RuntimeError(f"stage(s) {failed} lost their state at iteration {iteration} "
                               "and no complete window of exact-mode frames exists yet")
        steps = list(range(found.start + 1, iteration))
        inputs, why = self.replayer.inputs(failed, steps)
        replaying = bool(why) or self.engine.stage_id in failed
        frames = self.replayer.load_agreed(found, replaying)
        if replaying:
            # this process's generators survive the loss: the state they end at
            self.replayer.replay(found, frames, steps, None if why else inputs, get_rng_state())
        dist.barrier(group=metadata_group())  # the other stages wait here
        return Recovered(iteration, failed, not why, found.start, time.perf_counter() - began, why)
