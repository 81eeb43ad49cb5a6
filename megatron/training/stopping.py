"""When training stops early: ``--train-tokens`` and ``--exit-duration-in-mins``.

``--train-iters`` and ``--exit-interval`` are counted by the loop itself; these two are
Megatron-DeepSpeed's other stop conditions:

* ``--train-tokens N``: the loop stops once the consumed tokens (global batch x sequence
  length per iteration) reach N, checked before each iteration, as well as at
  ``--train-iters``. Every rank counts the same tokens, so no collective is needed.
* ``--exit-duration-in-mins M``: after each iteration every rank says whether M minutes
  have passed since it started, and one all-reduce (MAX) of that flag decides for all:
  a rank whose clock is a little behind would otherwise go on into the next
  iteration's collectives alone and hang there. The loop then saves a checkpoint
  (with ``--save``) and exits cleanly.
"""

import argparse
import time
from typing import Optional

import torch
import torch.distributed as dist


def train_tokens_reached(args: argparse.Namespace, consumed_samples: int) -> bool:
    """Whether ``--train-tokens`` (if given) is reached after ``consumed_samples``
    samples of ``--seq-length`` tokens. Every rank, no collective."""
    limit = getattr(args, "train_tokens", None)
    return limit is not None and consumed_samples * args.seq_length >= limit


class DurationLimit:
    """``--exit-duration-in-mins``: a clock started when the job starts, and the
    collective decision that it has run out.

    Every rank creates one at the start of :func:`~megatron.training.training.pretrain`
    and calls :meth:`expired` after every iteration, in the same order on every rank (it
    is one all-reduce when the flag is given, nothing otherwise).

    Args:
        minutes: the limit; None or 0: no limit (and no collective).
        started: ``time.time()`` the clock counts from; default: now.
    """

    def __init__(self, minutes: Optional[float], started: Optional[float] = None):
        self.minutes = minutes or None
        self.started = time.time() if started is None else started

    def elapsed_minutes(self) -> float:
        """Minutes since the clock started, on this rank."""
        return (time.time() - self.started) / 60.0

    def expired(self) -> bool:
        """Every rank, once per iteration, in the same order: True on every rank once any
        rank's clock passed the limit.

        The flag is host data, so it is reduced on the CPU metadata group
        (``deepspeed_ext.runtime.groups``): on NCCL the default group has no CPU backend,
        and a device tensor would add a device sync to every iteration.
        """
        if self.minutes is None:
            return False
        flag = torch.tensor([int(self.elapsed_minutes() > self.minutes)], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            from deepspeed_ext.runtime.groups import metadata_group
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=metadata_group())
        return bool(flag.item())
