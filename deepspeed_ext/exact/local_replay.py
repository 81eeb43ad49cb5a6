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

Who calls what, in order: every rank calls :func:`newest_window` (one
``all_gather_object`` on the metadata group: the window every rank holds) and
:func:`gather_replay_inputs` (the survivors' logs, pairwise); the failed stage's ranks load
their frames (:func:`load_window`, no collectives), every rank agrees that they could,
the failed stage's ranks restore the window's first frame (``exact.recovery.start_replay``)
and call :meth:`StageReplay.step` once per step to replay, in order, applying the window's later frames after their steps
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


def load_window(exact, found):
    """This rank alone, no collectives: load and check its frames of window ``found``
    (memory first, then storage); for ``exact.recovery.start_replay`` once every
    replaying rank succeeded.

    Raises:
        RuntimeError: this rank holds no frame of the window; or what
            ``Recovery.load_checked`` raises for a damaged one.
    """
    roots = exact.recovery.available_frames(exact.save_dir)
    window = range(found.start, found.start + found.window)
    missing = [f for f in window if f not in roots]
    if missing:
        raise RuntimeError(f"rank {exact.rank} holds no frame {missing} of the window at {found.start}")
    return exact.recovery.load_checked(found, {f: roots[f][1] for f in window})


def _neighbour(engine, stage: int) -> int:
    """The global rank of ``stage`` with this rank's data-parallel coordinate (the rank
    DeepSpeed's pipeline exchanges with)."""
    return engine.grid.stage_to_global(stage_id=stage)


def _offers(engine, failed_stage: int, steps, upstream: UpstreamLog, cross: CrossStageLog,
            failed: Sequence[int], holders) -> List[Tuple[int, str, tuple, torch.Tensor]]:
    """What this surviving rank sends to the failed stage's ranks, in order:
    ``(destination, kind, key, tensor)`` with ``kind`` activation, gradient or collective
    (key ``(step, micro-batch, index)`` or ``(step, group, call, 0)``)."""
    import torch.distributed as dist
    stage, out = engine.stage_id, []
    direction = {failed_stage - 1: ACTIVATION, failed_stage + 1: GRADIENT}.get(stage)
    if direction is not None:
        dest = _neighbour(engine, failed_stage)
        upstream.sync()
        for key in sorted((k for k in upstream.entries if k.iteration in steps
                           and k.direction == direction),
                          key=lambda k: (k.iteration, k.micro_batch)):
            for index, tensor in enumerate(upstream.entries[key]):
                out.append((dest, direction, (key.iteration, key.micro_batch, index), tensor))
    me = dist.get_rank()
    for (step, group), values in sorted(cross.entries.items()):
        if step not in steps or me != min(holders.get(group, (me,))):
            continue  # one survivor of each group hands its results over
        for dest in (r for r in failed if r in group):
            for call, tensor in enumerate(values):
                out.append((dest, "collective", (step, group, call, 0), tensor))
    return out


def gather_replay_inputs(engine, failed_stage: int, iterations: Sequence[int],
                         upstream: UpstreamLog, cross: CrossStageLog) -> Optional[ReplayInputs]:
    """Every rank: the survivors hand the failed stage's ranks their logs of
    ``iterations``; returns this rank's :class:`ReplayInputs` on the failed stage, None
    elsewhere.

    Two phases on the metadata group: one ``all_gather_object`` of what each rank holds
    and will send (keys, shapes, dtypes: small), then the tensors themselves, pairwise
    (``isend``/``irecv``, neighbour to neighbour; every collective group's results from
    one survivor of it): a rank receives only what it replays, and no tensor is pickled.

    Raises:
        KeyError: a neighbour lacks a step or micro-batch (its log was freed or lost); the
            same on every rank of the failed stage, which must then replay globally.
    """
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    stage, steps = engine.stage_id, set(iterations)
    held = sorted({group for step, group in cross.entries if step in steps}) \
        if stage != failed_stage else []
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, (stage, held), group=metadata_group())
    failed = [r for r, (s, _) in enumerate(every) if s == failed_stage]
    holders: Dict[GroupKey, List[int]] = {}
    for r, (_, groups) in enumerate(every):
        for group in groups:
            holders.setdefault(tuple(group), []).append(r)
    offers = (_offers(engine, failed_stage, steps, upstream, cross, failed, holders)
              if stage != failed_stage else [])
    plans: List = [None] * dist.get_world_size()
    dist.all_gather_object(plans, [(d, kind, key, tuple(t.shape), str(t.dtype).split(".")[-1])
                                   for d, kind, key, t in offers], group=metadata_group())
    works = [dist.isend(t.contiguous(), d, group=metadata_group()) for d, _, _, t in offers]
    rank, received = dist.get_rank(), []
    for source, plan in enumerate(plans):
        for dest, kind, key, shape, dtype in plan:
            if dest == rank:
                buf = torch.empty(shape, dtype=getattr(torch, dtype))
                works.append(dist.irecv(buf, source, group=metadata_group()))
                received.append((kind, key, buf))
    for work in works:
        work.wait()
    if stage != failed_stage:
        return None
    return _assemble(engine, failed_stage, steps, received)


def _assemble(engine, failed_stage: int, steps, received) -> ReplayInputs:
    out = ReplayInputs()
    parts: Dict[Tuple[str, tuple], Dict[int, torch.Tensor]] = {}
    for kind, key, tensor in received:
        if kind == "collective":
            step, group, call, _ = key
            out.collectives.setdefault((step, tuple(group)), []).append(tensor)
        else:
            parts.setdefault((kind, tuple(key[:2])), {})[key[2]] = tensor
    for (kind, (step, micro)), tensors in parts.items():
        target = out.activations if kind == ACTIVATION else out.gradients
        target[(step, micro)] = tuple(tensors[i] for i in sorted(tensors))
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
        self.upstream.record_send(eng, ACTIVATION, buffer_id)

    def _send_grads(self, eng, buffer_id):
        self.upstream.record_send(eng, GRADIENT, buffer_id)
        eng.pipe_buffers["inputs"][buffer_id] = None  # as the real send frees it
