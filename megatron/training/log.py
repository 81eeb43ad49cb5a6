"""Megatron-style console lines, a JSON-lines metrics file, optional TensorBoard and W&B."""

import json
import logging
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.training.tb_tags import Scalar


def rank() -> int:
    """This process's global rank (0 before the process group exists)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only, flushed, so launcher logs interleave sensibly."""
    if rank() == 0:
        print(message, flush=True)


def show_model_lines(global_rank: int) -> None:
    """Put the model's log lines (``megatron.model``'s loggers: the MoE capacity padding,
    say) on this rank's console, as bare messages: INFO on rank 0, warnings elsewhere
    (every rank builds the same model, so one copy of a line is enough). Every rank calls
    it once at start-up. Without it a rank, which configures no logging, showed only
    warnings, and only in ``logging``'s last-resort format. Nothing is added where the
    program gave the root or ``megatron`` logger a handler of its own."""
    model = logging.getLogger("megatron.model")
    if logging.getLogger().handlers or logging.getLogger("megatron").handlers or model.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    model.addHandler(handler)
    model.setLevel(logging.INFO if global_rank == 0 else logging.WARNING)


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def training_log_line(it: int, train_iters: int, stats: Dict) -> str:
    """One line in Megatron's layout for the stats averaged over a log interval.

    The fields Megatron-DeepSpeed's line also has keep its wording and order (``consumed
    tokens`` after ``consumed samples``; ``loss scale`` before ``grad norm``; ``actual
    seqlen``, the skipped and NaN counts, ``samples per second`` and ``tokens per gpu per
    second (tgs)`` at the end); ``tokens per second`` and ``moe aux loss`` are ours.
    ``loss scale`` is printed only when ``stats['loss_scale']`` is not None (an optimizer
    without one), as Megatron-DeepSpeed does; its TFLOPs estimate is not printed (a
    formula, not a measurement).
    """
    line = (f" iteration {it:8d}/{train_iters:8d} |"
            f" consumed samples: {stats['consumed_samples']:12d} |"
            f" consumed tokens: {stats['consumed_tokens']:12d} |"
            f" elapsed time per iteration (ms): {stats['elapsed_ms']:.1f} |"
            f" tokens per second: {stats['tokens_per_s']:.1f} |"
            f" learning rate: {stats['lr']:.3E} |"
            f" global batch size: {stats['global_batch_size']:5d} |"
            f" lm loss: {stats['lm_loss']:.6E} |"
            f" moe aux loss: {stats['moe_aux_loss']:.6E} |")
    if stats.get("loss_scale") is not None:
        line += f" loss scale: {stats['loss_scale']:.1f} |"
    return line + (f" grad norm: {stats['grad_norm']:.3f} |"
                   f" actual seqlen: {stats['seq_length']:5d} |"
                   f" number of skipped iterations: {stats['skipped']:3d} |"
                   f" number of nan iterations: {stats['nan']:3d} |"
                   f" samples per second: {stats['samples_per_s']:.3f} |"
                   f" tokens per gpu per second (tgs): {stats['tgs']:.3f} |")


def throughput(iterations: int, elapsed_s: float, global_batch_size: int, seq_length: int,
               world_size: int) -> Dict[str, float]:
    """Samples and tokens per second over ``iterations`` that took ``elapsed_s`` (rank 0).

    ``tgs`` is tokens per second divided by the number of ranks (Megatron-DeepSpeed's
    "tokens per gpu per second"; one rank per GPU).
    """
    elapsed_s = max(elapsed_s, 1e-9)
    samples = global_batch_size * iterations / elapsed_s
    tokens = samples * seq_length
    return {"samples_per_s": samples, "tokens_per_s": tokens, "tgs": tokens / world_size}


def is_nan_iteration(skipped: bool, *losses: float) -> bool:
    """Megatron-DeepSpeed's "nan iteration": a skipped step whose loss is inf or NaN."""
    return bool(skipped) and not all(math.isfinite(x) for x in losses)


def eval_log_line(label: str, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return f" {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


class MetricsWriter:
    """Rank 0's JSON-lines file, TensorBoard writer and W&B run; a no-op on other ranks.

    The TensorBoard writer is ``torch.utils.tensorboard.SummaryWriter``, imported when
    ``tensorboard_dir`` is set (tests put a fake ``torch.utils.tensorboard`` module in
    ``sys.modules``); ``wandb`` is a :class:`megatron.training.wandb_log.WandbWriter` or None.
    """

    def __init__(self, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 queue_size: Optional[int] = None, wandb=None):
        self._file = None
        self._tb = None
        self._wandb = wandb if rank() == 0 else None
        if rank() != 0:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard-dir needs the tensorboard package "
                                  "(pip install tensorboard)") from None
            # queue_size: --tensorboard-queue-size, events held before a write.
            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size or 100)

    @property
    def scalars_enabled(self) -> bool:
        """TensorBoard or W&B is on (rank 0): worth building :mod:`tb_tags` scalars."""
        return self._tb is not None or self._wandb is not None

    def write(self, kind: str, iteration: int, values: Dict,
              scalars: Optional[List[Scalar]] = None) -> None:
        """Record ``values`` (floats and ints) of ``kind`` (``train``/``valid``/``moc``) at
        ``iteration`` in the metrics file, and ``scalars`` in TensorBoard and W&B; without
        ``scalars``, each number of ``values`` as ``{kind}/{key}`` (MoC's own, ``moc/...``)."""
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "iteration": iteration, **values}) + "\n")
            self._file.flush()
        if scalars is None:
            scalars = [Scalar(f"{kind}/{key}", value, iteration) for key, value in values.items()
                       if isinstance(value, (int, float))]
        self.add_scalars(scalars)

    def add_scalars(self, scalars: List[Scalar]) -> None:
        """Send ``scalars`` to TensorBoard (all but the W&B-only ones) and W&B."""
        for scalar in scalars:
            if self._tb is not None and not scalar.wandb_only:
                self._tb.add_scalar(scalar.tag, scalar.value, scalar.step)
            if self._wandb is not None:
                self._wandb.add_scalar(scalar)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
