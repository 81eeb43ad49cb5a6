"""Megatron-style console lines, a JSON-lines metrics file, and optional TensorBoard."""

import json
import math
import os
import sys
import time
from typing import Dict, Optional

import torch.distributed as dist

from megatron.training.errors import ConfigError


def rank() -> int:
    """This process's global rank (0 before the process group exists)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only, flushed, so launcher logs interleave sensibly."""
    if rank() == 0:
        print(message, flush=True)


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def training_log_line(it: int, train_iters: int, stats: Dict) -> str:
    """One line in Megatron's layout for the stats averaged over a log interval."""
    return (f" iteration {it:8d}/{train_iters:8d} |"
            f" consumed samples: {stats['consumed_samples']:12d} |"
            f" elapsed time per iteration (ms): {stats['elapsed_ms']:.1f} |"
            f" tokens per second: {stats['tokens_per_s']:.1f} |"
            f" learning rate: {stats['lr']:.3E} |"
            f" global batch size: {stats['global_batch_size']:5d} |"
            f" lm loss: {stats['lm_loss']:.6E} |"
            f" moe aux loss: {stats['moe_aux_loss']:.6E} |"
            f" grad norm: {stats['grad_norm']:.3f} |"
            f" number of skipped iterations: {stats['skipped']:3d} |")


def eval_log_line(label: str, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return f" {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


class MetricsWriter:
    """Rank 0's JSON-lines file and TensorBoard writer; a no-op on other ranks."""

    def __init__(self, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 queue_size: Optional[int] = None):
        self._file = None
        self._tb = None
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

    def write(self, kind: str, iteration: int, values: Dict) -> None:
        """Record ``values`` (floats and ints) of ``kind`` (``train``/``valid``) at ``iteration``."""
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "iteration": iteration, **values}) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, iteration)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def fatal(message: str) -> None:
    """Print an error line on stderr (every rank)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
