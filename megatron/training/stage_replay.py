"""One pipeline stage replaying its steps alone from its neighbours' upstream logs, as
the trainer runs it: the window restored, the data and learning rate positioned, the
steps replayed (:class:`~deepspeed_ext.exact.local_replay.StageReplay`) or run through
the whole pipeline when the replay is global.

Used by the two localized recoveries: a stage that lost its state in place
(:mod:`megatron.training.stage_loss`) and a stage whose rank crashed under an in-job
restart (:mod:`megatron.training.local_restart`). Every rank builds one
:class:`StageReplayer` and calls, in order: :meth:`StageReplayer.inputs` (every rank:
the survivors hand over their logs, or every rank learns why they cannot),
:meth:`StageReplayer.load_agreed` (every rank: the replaying ranks load their frames),
then :meth:`StageReplayer.replay` on the replaying ranks only.
"""

import argparse
from typing import Callable, List, Tuple

import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state, set_rng_state


class StageReplayer:
    """The replay of a window's steps on this rank's stage.

    Args:
        engine: the ``PipelineEngine`` (``engine.moc_upstream`` and ``engine.moc_cross``
            with ``--moc-upstream-logging``).
        exact: the run's :class:`~deepspeed_ext.exact.ExactSnapshots`.
        batches_from: ``consumed samples -> iterator`` of the pipeline's batches from
            there (the first and last stages read their replayed steps' data from it).
        scheduler: the trainer's learning-rate scheduler (set to each replayed step's).
    """

    def __init__(self, engine, exact, batches_from: Callable[[int], object], scheduler,
                 args: argparse.Namespace):
        self.engine, self.exact, self.scheduler, self.args = engine, exact, scheduler, args
        self.batches_from = batches_from

    def inputs(self, failed: List[int], steps: List[int]) -> Tuple[object, str]:
        """Every rank: the survivors hand ``failed``'s ranks the logs of ``steps``
        (:func:`~deepspeed_ext.exact.local_replay.gather_replay_inputs`). Returns this
        rank's inputs (None off the failed stage) and why the replay must be global
        instead ('' when it need not; the same on every rank)."""
        from deepspeed_ext.exact.local_replay import gather_replay_inputs
        from deepspeed_ext.runtime.groups import metadata_group
        engine, upstream = self.engine, getattr(self.engine, "moc_upstream", None)
        why = ""
        if upstream is None:
            why = "no upstream logs: --moc-upstream-logging is off"
        elif len(failed) > 1:
            why = f"stages {failed} failed together: a stage's neighbour has no log to give"
        if why:
            return None, why
        inputs = None
        try:
            inputs = gather_replay_inputs(engine, failed[0], steps, upstream, engine.moc_cross)
        except KeyError as e:
            why = f"a neighbour's upstream log is incomplete ({e.args[0]})"
        every: List = [None] * dist.get_world_size()
        dist.all_gather_object(every, why, group=metadata_group())
        return inputs, next((w for w in every if w), "")  # one decision for every rank

    def load_agreed(self, found, replaying: bool, what: str = "in-place recovery"):
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
            raise RuntimeError(f"{what} cannot restore the window of frames at "
                               f"{found.start}: {'; '.join(errors)}")
        return frames

    def replay(self, found, frames, steps: List[int], inputs, end_rng) -> None:
        """The replaying ranks, together: restore ``found``'s first frame and run
        ``steps`` again, from the logs (``inputs``) or, when None, through the whole
        pipeline (every stage replays). The window's later frames are applied after their
        steps; the replayed steps' losses and gate counts are dropped (counted the first
        time); last, the random generators are set to ``end_rng``, their state after the
        last step's iteration. A replay draws what its steps drew, but not what the
        evaluations between them did (top-2 gating samples its second expert in
        evaluation too): continued from the replay's, the next steps' dropout masks and
        gate noise differed from the uninterrupted run's (measured)."""
        from deepspeed_ext.exact.local_replay import StageReplay
        engine = self.engine
        replay, objects = self._restore(found, frames)
        consumed = int(objects["client_state"]["consumed_train_samples"])
        rng = get_rng_state()
        data = self.batches_from(consumed)
        # after the loader: building one draws from the global generator (measured:
        # with dropout the replayed steps' masks differed)
        set_rng_state(rng)
        stage_replay = (None if inputs is None
                        else StageReplay(engine, engine.moc_upstream, engine.moc_cross, inputs))
        for step in steps:
            if stage_replay is not None:
                stage_replay.step(data)
            else:
                engine.train_batch(data)
            self._after_replayed_step(step, replay)
        self._drop_replayed_outputs()
        set_rng_state(end_rng)

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

