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

from deepspeed_ext.engine.rng import get_rng_state, set_rng_state
from megatron.errors import ConfigError

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
        self.engine, self.exact, self.scheduler, self.args = engine, exact, scheduler, args
        self.batches_from, self.log = batches_from, log
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
        from deepspeed_ext.exact.local_replay import (StageReplay, gather_replay_inputs,
                                                      newest_window)
        from deepspeed_ext.runtime.groups import metadata_group
        found = newest_window(self.exact)
        if found is None:
            raise RuntimeError(f"stage(s) {failed} lost their state at iteration {iteration} "
                               "and no complete window of exact-mode frames exists yet")
        steps = list(range(found.start + 1, iteration))
        engine, upstream = self.engine, getattr(self.engine, "moc_upstream", None)
        why = ""
        if upstream is None:
            why = "no upstream logs: --moc-upstream-logging is off"
        elif len(failed) > 1:
            why = f"stages {failed} failed together: a stage's neighbour has no log to give"
        inputs = None
        if not why:
            try:
                inputs = gather_replay_inputs(engine, failed[0], steps, upstream, engine.moc_cross)
            except KeyError as e:
                why = f"a neighbour's upstream log is incomplete ({e.args[0]})"
            every: List = [None] * dist.get_world_size()
            dist.all_gather_object(every, why, group=metadata_group())
            why = next((w for w in every if w), "")  # one decision for every rank
        replaying = bool(why) or engine.stage_id in failed
        frames = self._load_agreed(found, replaying)
        if replaying:
            replay, objects = self._restore(found, frames)
            consumed = int(objects["client_state"]["consumed_train_samples"])
            rng = get_rng_state()
            data = self.batches_from(consumed)
            # after the loader: building one draws from the global generator (measured:
            # with dropout the replayed steps' masks differed)
            set_rng_state(rng)
            stage_replay = None if why else StageReplay(engine, upstream, engine.moc_cross, inputs)
            for step in steps:
                if stage_replay is not None:
                    stage_replay.step(data)
                else:
                    engine.train_batch(data)
                self._after_replayed_step(step, replay)
            self._drop_replayed_outputs()
        dist.barrier(group=metadata_group())  # the other stages wait here
        return Recovered(iteration, failed, not why, found.start, time.perf_counter() - began, why)

    def _load_agreed(self, found, replaying: bool):
        """Every rank: the replaying ranks load and check their frames of ``found`` (no
        collectives), and every rank learns whether all could before anything collective:
        a rank failing alone would leave the others waiting in ZeRO's all-gather or the
        barrier. Returns this rank's frames (None when it does not replay).

        Raises:
            RuntimeError: on every rank, naming each rank's problem.
        """
        from deepspeed_ext.exact.local_replay import load_window
        from deepspeed_ext.runtime.groups import metadata_group
        frames, error = None, None
        if replaying:
            try:
                frames = load_window(self.exact, found)
            except Exception as e:  # reported on every rank below
                error = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
        every: List = [None] * dist.get_world_size()
        dist.all_gather_object(every, error, group=metadata_group())
        errors = [e for e in every if e]
        if errors:
            raise RuntimeError(f"in-place recovery cannot restore the window of frames at "
                               f"{found.start}: {'; '.join(errors)}")
        return frames

    def _restore(self, found, frames):
        """The window's first frame into this rank's engine, and the trainer's scheduler
        to that frame's step."""
        replay, objects = self.exact.recovery.start_replay(found, frames)
        # megatron.core's scheduler loads by stepping from where it is: from 0 here, or it
        # would land at the loss's step plus the frame's
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(objects["client_state"]["opt_param_scheduler"])
        set_rng_state(objects["rng"])  # dropout and gate noise draw as the first time
        return replay, objects

    def _after_replayed_step(self, step: int, replay) -> None:
        """As the loop does after a step: the scheduler's next rate; the window's frame."""
        args = self.args
        self.scheduler.step(1, token_num=step * args.global_batch_size * args.seq_length)
        if step < replay.end:
            replay.apply(step, self.exact.index, self.engine)

    def _drop_replayed_outputs(self) -> None:
        """The replayed steps' losses and gate counts were counted the first time."""
        from megatron.model.gpt_moe_pipe import take_gate_counts
        engine = self.engine
        engine.module.loss_fn.take(engine.device)
        take_gate_counts(engine.module, self.args.num_experts, engine.device)
