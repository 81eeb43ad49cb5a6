"""MoEtion's localized recovery: one pipeline stage replays its steps alone, from its
neighbours' logs, while the other stages wait.

A stage whose state was lost restores the state of an earlier step (its exact-mode
window's start) and runs its steps again through DeepSpeed's own pipeline schedule, so
that the arithmetic is the original's, with four instructions replaced:

* receiving activations: the previous stage's :class:`~deepspeed_ext.exact.upstream.UpstreamLog`
  entry of that step and micro-batch (the first stage reads its data, as before);
* receiving gradients: the next stage's log entry (the last stage computes its loss);
* sending either: nothing is sent; the stage's own upstream log records it again;
* the tied-gradient reduction and the optimizer step run as they are, their all-reduces
  across stages answered from the results the other stages kept
  (:class:`~deepspeed_ext.exact.cross_stage.CrossStageLog`).

The collectives inside the stage (data- and expert-parallel reductions, the experts'
all-to-alls, ZeRO's all-gathers) run for real: every data-parallel rank of the failed
stage replays together.

Who calls what, in order: every rank calls :func:`newest_window` and
:func:`gather_replay_inputs` (one ``all_gather_object`` each on the metadata group: the
window every rank holds, and the survivors' logs); the failed stage's ranks restore their
window's first frame (:func:`restore_window`) and call :meth:`StageReplay.step` once per
step to replay, in order, applying the window's later frames after their steps
(``Replay.apply``); every rank then meets in a barrier (the survivors wait there).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_ext.exact.cross_stage import CrossStageLog, GroupKey
from deepspeed_ext.exact.upstream import ACTIVATION, GRADIENT, UpstreamLog


@dataclass
class ReplayInputs:
    """What a replaying rank receives from the survivors, for the steps it replays."""

    activations: Dict[Tuple[int, int], Tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """(step, micro-batch) -> the previous stage's sent activations (empty on stage 0)."""
    gradients: Dict[Tuple[int, int], Tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """(step, micro-batch) -> the next stage's sent input gradients (empty on the last)."""
    collectives: Dict[Tuple[int, GroupKey], List[torch.Tensor]] = field(default_factory=dict)
    """(step, group) -> the all-reduce results over a group reaching other stages."""


def newest_window(exact):
    """Every rank (one ``all_gather_object`` on the metadata group): the newest window of
    exact-mode frames every rank holds, in its node's memory or in storage
    (:class:`~deepspeed_ext.exact.frames.WindowOnDisk`; None: none). Waits for this
    rank's frame copy in flight first."""
    import torch.distributed as dist
    from deepspeed_ext.exact.frames import agree_window
    from deepspeed_ext.runtime.groups import metadata_group
    exact.writer.wait_for_previous()
    mine = exact.recovery.available_frames(exact.save_dir)
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, {f: rec for f, (rec, _) in mine.items()}, group=metadata_group())
    return agree_window(every)


def restore_window(exact, found):
    """This rank (the ranks of a stage together: ZeRO's all-gather of the weights): load
    and check its frames of window ``found``, restore the engine to the window's first
    frame (counters, optimizer scalars, the first group's fp32 state, every compute
    weight). Returns the :class:`~deepspeed_ext.exact.replay.Replay` that applies the
    later frames, and the first frame's objects (``client_state``, ``rng``).

    Raises:
        RuntimeError: a frame is missing or fails its checks.
    """
    from deepspeed_ext.exact.replay import Replay, check_window, load_frame, restore_objects
    from deepspeed_ext.policy import window as win
    roots = exact.recovery.available_frames(exact.save_dir)
    frames = {}
    for f in range(found.start, found.start + found.window):
        if f not in roots:
            raise RuntimeError(f"rank {exact.rank} holds no frame {f} of the window at {found.start}")
        frames[f] = load_frame(roots[f][1], f, exact.rank)
    schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
    check_window(exact.index, found.start, schedule, {f: t for f, (t, _) in frames.items()})
    replay = Replay(found.start, schedule, {f: t for f, (t, _) in frames.items()})
    objects = frames[found.start][1]
    restore_objects(exact.engine, objects)
    exact.index.forget_fragments()  # moments may have just been created
    replay.apply(found.start, exact.index, exact.engine)
    return replay, objects


def _neighbour(engine, stage: int) -> int:
    """The global rank of ``stage`` with this rank's data-parallel coordinate (the rank
    DeepSpeed's pipeline exchanges with)."""
    return engine.grid.stage_to_global(stage_id=stage)


def gather_replay_inputs(engine, failed_stage: int, iterations: Sequence[int],
                         upstream: UpstreamLog, cross: CrossStageLog) -> Optional[ReplayInputs]:
    """Every rank: the survivors hand the failed stage's ranks their logs of
    ``iterations`` (one ``all_gather_object`` on the metadata group); returns this rank's
    :class:`ReplayInputs` on the failed stage, None elsewhere.

    Raises:
        KeyError: a neighbour lacks a step or micro-batch (its log was freed or lost); the
            same on every rank of the failed stage, which must then replay globally.
    """
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    stage = engine.stage_id
    steps = set(iterations)
    offer = None
    if stage != failed_stage:
        upstream.sync()
        logs = {(k.iteration, k.micro_batch, k.direction): v for k, v in upstream.entries.items()
                if k.iteration in steps}
        offer = (stage, logs, {slot: v for slot, v in cross.entries.items() if slot[0] in steps})
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, offer, group=metadata_group())
    if stage != failed_stage:
        return None
    rank, out = dist.get_rank(), ReplayInputs()
    for source, item in enumerate(every):
        if item is None:
            continue
        their_stage, logs, results = item
        if their_stage == failed_stage - 1 and source == _neighbour(engine, their_stage):
            out.activations = {(i, m): v for (i, m, d), v in logs.items() if d == ACTIVATION}
        if their_stage == failed_stage + 1 and source == _neighbour(engine, their_stage):
            out.gradients = {(i, m): v for (i, m, d), v in logs.items() if d == GRADIENT}
        for slot, values in results.items():
            if rank in slot[1]:
                out.collectives.setdefault(slot, values)  # every member kept the same
    micro = engine.micro_batches
    needs = ([("activations", failed_stage - 1)] if failed_stage > 0 else []) + \
        ([("gradients", failed_stage + 1)] if failed_stage < engine.num_stages - 1 else [])
    for what, neighbour in needs:
        held = getattr(out, what)
        missing = [(i, m) for i in sorted(steps) for m in range(micro) if (i, m) not in held]
        if missing:
            raise KeyError(f"stage {neighbour}'s upstream log lacks the {what} of "
                           f"(step, micro-batch) {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return out


class StageReplay:
    """Replays this rank's stage's steps from :class:`ReplayInputs` (every rank of the
    failed stage, together, one step at a time, after restoring the state of the step
    before the first).

    Args:
        engine: the stage's ``PipelineEngine`` (with ``upstream`` and ``cross`` attached).
        inputs: from :func:`gather_replay_inputs`.
    """

    def __init__(self, engine, upstream: UpstreamLog, cross: CrossStageLog, inputs: ReplayInputs):
        self.engine, self.upstream, self.cross, self.inputs = engine, upstream, cross, inputs
        self._counts = {ACTIVATION: 0, GRADIENT: 0}

    def step(self, data_iter=None) -> int:
        """Replay step ``engine.global_steps + 1``; ``data_iter`` gives the first and last
        stages their micro-batches of it, as the original step's did. Returns the step."""
        from deepspeed.runtime.pipe import schedule
        engine = self.engine
        iteration = engine.global_steps + 1
        table = engine._INSTRUCTION_MAP
        replaced = {schedule.RecvActivation: self._recv_activations,
                    schedule.RecvGrad: self._recv_grads,
                    schedule.SendActivation: self._send_activations,
                    schedule.SendGrad: self._send_grads}
        saved = {k: table[k] for k in replaced}
        table.update(replaced)
        self._counts = {ACTIVATION: 0, GRADIENT: 0}
        if data_iter is not None:
            engine.set_dataiterator(data_iter)
        engine.module.train()
        engine.total_loss = None
        engine.total_additional_losses = None
        engine._compute_loss = True
        try:
            with self.cross.replaying(self.inputs.collectives, iteration):
                engine._exec_schedule(engine._train_schedule())
        finally:
            table.update(saved)
        self.cross.end_step()
        return iteration

    def _next(self, direction: str) -> Tuple[int, int]:
        key = (self.engine.global_steps + 1, self._counts[direction])
        self._counts[direction] += 1
        return key

    def _recv_activations(self, eng, buffer_id):
        # as DeepSpeed's receive leaves them: detached copies, floats requiring grad
        sent = self.inputs.activations[self._next(ACTIVATION)]
        recvd = tuple(t.to(eng.device).clone().detach() for t in sent)
        for buffer in recvd:
            buffer.requires_grad = buffer.is_floating_point()
        eng.pipe_buffers["inputs"][buffer_id] = recvd

    def _recv_grads(self, eng, buffer_id):
        sent = self.inputs.gradients[self._next(GRADIENT)]
        layer = eng.grad_layer
        if layer is not None and len(layer) == len(sent) and all(
                b.shape == t.shape and b.dtype == t.dtype for b, t in zip(layer, sent)):
            for buffer, value in zip(layer, sent):
                buffer.copy_(value.to(buffer.device))
        else:
            eng.grad_layer = [t.to(eng.device).clone() for t in sent]

    def _send_activations(self, eng, buffer_id):
        self.upstream.record(ACTIVATION, eng.pipe_buffers["outputs"][buffer_id])

    def _send_grads(self, eng, buffer_id):
        inputs = eng.pipe_buffers["inputs"][buffer_id]
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.upstream.record(GRADIENT, tuple(t.grad for t in inputs
                                             if torch.is_tensor(t) and t.grad is not None))
        eng.pipe_buffers["inputs"][buffer_id] = None  # as the real send frees it
