"""Upstream logging (MoEtion): what a pipeline stage sends across its boundaries, kept in
host memory so that a failed neighbour can replay without the others recomputing.

On every training step a stage sends, per micro-batch, its output activations to the next
stage and the gradients of its inputs to the previous one. :class:`UpstreamLog` keeps a
host copy of each, on the sender, keyed by ``(iteration, micro-batch, direction)``. The
micro-batch is counted per step and direction (DeepSpeed's schedules send both in
micro-batch order); the pipeline's buffer id is not a key, since the engine reuses its
buffers when micro-batches outnumber them. Evaluation's sends are not kept.

A stage that restores its exact-mode window replays its iterations from these logs: the
previous stage's activations are its inputs, the next stage's gradients its outputs'
gradients. The log therefore keeps the iterations of at least two windows
(``retain_iterations``) and frees older ones after every step.

Every rank of a pipeline engine creates one and calls :meth:`UpstreamLog.attach`; the log
then runs inside ``engine.train_batch``, on the training's thread, without collectives.
On a GPU the copies go to pinned host memory on a side stream, and :meth:`UpstreamLog.get`
waits for them.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

ACTIVATION = "activation"
"""Direction of a log entry: output activations sent to the next stage."""
GRADIENT = "gradient"
"""Direction of a log entry: input gradients sent to the previous stage."""


@dataclass(frozen=True)
class LogKey:
    """Where one logged send belongs."""

    iteration: int
    """The training step (1-based, as the trainer counts) whose schedule sent it."""
    micro_batch: int
    """The micro-batch's index in that step (0-based, in the order sent)."""
    direction: str
    """:data:`ACTIVATION` or :data:`GRADIENT`."""


def log_bytes_per_iteration(activation_bytes: int, gradient_bytes: int, micro_batches: int,
                            stage: int, stages: int) -> int:
    """Host bytes one step adds to a stage's log: the activations of every micro-batch
    (all stages but the last) and the input gradients (all stages but the first)."""
    per_micro = (activation_bytes if stage < stages - 1 else 0) + (gradient_bytes if stage > 0 else 0)
    return per_micro * micro_batches


def log_capacity_bytes(per_iteration: int, retain_iterations: int) -> int:
    """The most host memory a stage's log holds: ``retain_iterations`` steps, plus the
    one being logged before the oldest is freed."""
    return per_iteration * (retain_iterations + 1)


class UpstreamLog:
    """A rank's log of its sends across pipeline-stage boundaries.

    Args:
        engine: a DeepSpeed ``PipelineEngine``.
        retain_iterations: steps kept (at least two exact-mode windows).
    """

    def __init__(self, engine, retain_iterations: int):
        if retain_iterations < 1:
            raise ValueError(f"retain_iterations must be >= 1, got {retain_iterations}")
        self.engine = engine
        self.retain_iterations = retain_iterations
        self.entries: Dict[LogKey, Tuple[torch.Tensor, ...]] = {}
        """The logged tensors (host copies; on a GPU, valid after :meth:`sync`)."""
        self.bytes = 0
        """Host bytes held now."""
        self.peak_bytes = 0
        """Most host bytes held at once."""
        self._iteration: Optional[int] = None  # the step being logged (None: not training)
        self._counts = {ACTIVATION: 0, GRADIENT: 0}
        self._stream = None

    # -- hooks ---------------------------------------------------------------------------

    def attach(self) -> None:
        """Every rank, once, after ``deepspeed.initialize``: log the engine's sends from
        its next ``train_batch`` on. DeepSpeed runs each pipeline instruction through the
        class's instruction map, so the two sends are replaced in a per-engine copy of it."""
        from deepspeed.runtime.pipe import schedule
        engine = self.engine
        if "_INSTRUCTION_MAP" not in vars(engine):  # another log may have made one already
            engine._INSTRUCTION_MAP = dict(type(engine)._INSTRUCTION_MAP)
        table = engine._INSTRUCTION_MAP
        send_activations = table[schedule.SendActivation]
        send_grads = table[schedule.SendGrad]
        log = self

        def logged_send_activations(eng, buffer_id):
            log.record_send(eng, ACTIVATION, buffer_id)
            send_activations(eng, buffer_id)

        def logged_send_grads(eng, buffer_id):
            log.record_send(eng, GRADIENT, buffer_id)  # before the send frees the inputs
            send_grads(eng, buffer_id)

        table[schedule.SendActivation] = logged_send_activations  # this engine's table
        table[schedule.SendGrad] = logged_send_grads  # only: the class's stays DeepSpeed's
        run_schedule = engine._exec_schedule

        def logged_schedule(pipe_schedule):
            training = isinstance(pipe_schedule, schedule.TrainSchedule)
            log.begin(engine.global_steps + 1 if training else None)
            try:
                return run_schedule(pipe_schedule)
            finally:
                log.end()

        engine._exec_schedule = logged_schedule

    def begin(self, iteration: Optional[int]) -> None:
        """Start logging step ``iteration`` (None: a schedule that trains nothing)."""
        self._iteration = iteration
        self._counts = {ACTIVATION: 0, GRADIENT: 0}

    def end(self) -> None:
        """After a step's schedule: free the steps older than the retained ones."""
        if self._iteration is not None:
            self.free_before(self._iteration - self.retain_iterations + 1)
        self._iteration = None

    def record_send(self, engine, direction: str, buffer_id: int) -> None:
        """Keep what ``engine``'s ``SendActivation`` (its outputs) or ``SendGrad`` (its
        inputs' gradients) of pipeline buffer ``buffer_id`` sends, before it is sent."""
        if direction == ACTIVATION:
            self.record(ACTIVATION, engine.pipe_buffers["outputs"][buffer_id])
            return
        inputs = engine.pipe_buffers["inputs"][buffer_id]
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.record(GRADIENT, tuple(t.grad for t in inputs
                                    if torch.is_tensor(t) and t.grad is not None))

    def record(self, direction: str, tensors) -> None:
        """Keep a host copy of one send (called by the hooks, in send order)."""
        if self._iteration is None:
            return
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        key = LogKey(self._iteration, self._counts[direction], direction)
        self._counts[direction] += 1
        copies = tuple(self._host_copy(t) for t in tensors)
        old = self.entries.pop(key, None)  # a step logged again (a replay) replaces it
        if old is not None:
            self.bytes -= _nbytes(old)
        self.entries[key] = copies
        self.bytes += _nbytes(copies)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        # GPU: the copy runs beside the next compute, so the tensor must not be written in
        # place before it ends. DeepSpeed's sends are fresh tensors each micro-batch (a
        # forward's outputs, the .grad of a cloned input), freed rather than reused:
        # record_stream keeps the allocator from handing their memory out early.
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        # The copy waits for the compute that made the tensor, and runs beside the next.
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # not reused by the allocator before the copy
        return host

    # -- reading and freeing -------------------------------------------------------------

    def sync(self) -> None:
        """Wait for the copies in flight (GPU); a no-op on CPU."""
        if self._stream is not None:
            self._stream.synchronize()

    def get(self, iteration: int, micro_batch: int, direction: str) -> Tuple[torch.Tensor, ...]:
        """The tensors sent in ``direction`` for micro-batch ``micro_batch`` of step
        ``iteration``.

        Raises:
            KeyError: naming the entry, when it was never logged or is freed.
        """
        key = LogKey(iteration, micro_batch, direction)
        if key not in self.entries:
            held = self.iterations()
            raise KeyError(f"upstream log has no {direction} of micro-batch {micro_batch} of "
                           f"iteration {iteration} (it holds iterations "
                           f"{held[0] if held else '-'}..{held[-1] if held else '-'})")
        self.sync()
        return self.entries[key]

    def iterations(self) -> List[int]:
        """The steps held, oldest first."""
        return sorted({k.iteration for k in self.entries})

    def clear(self) -> None:
        """Drop every entry (the log is lost with its rank's state)."""
        self.entries.clear()
        self.bytes = 0

    def adopt(self, entries: Dict[LogKey, Tuple[torch.Tensor, ...]], retain_iterations: int) -> None:
        """Take a failed run's entries (host copies) as this log's, in the same process
        (``--moc-restart in-job``: the engine is new, the steps it sent are not), with
        their retention (0: this log's)."""
        self.clear()
        if retain_iterations:
            self.retain_iterations = retain_iterations
        self.entries.update(entries)
        self.bytes = sum(_nbytes(v) for v in entries.values())
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def free_before(self, iteration: int) -> None:
        """Drop every step before ``iteration``."""
        for key in [k for k in self.entries if k.iteration < iteration]:
            self.bytes -= _nbytes(self.entries.pop(key))


def _nbytes(tensors: Tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
