"""One training step and one evaluation, on every rank.

:func:`train_step` runs ``gradient_accumulation_steps`` forward/backward passes, one
optimizer step and one small all-reduce of the losses; :func:`evaluate` runs
``--eval-iters`` global batches without gradients and one all-reduce.
"""

import argparse
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist


@dataclass
class StepStats:
    """What one training iteration produced on this rank."""

    lm_loss: float
    """LM loss averaged over the data-parallel ranks and micro batches."""
    moe_aux_loss: float
    """Load-balancing loss, averaged like ``lm_loss`` (before ``--moe-loss-coeff``)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    skipped: bool
    """The optimizer skipped the step (fp16 overflow)."""
    expert_counts: torch.Tensor
    """Token-to-expert assignments of this rank's micro batches, int64 ``[moe_layers, experts]``,
    on the engine's device."""
    loss_scale: Optional[float] = None
    """The optimizer's loss scale after the step; None where it has none (see
    :func:`optimizer_loss_scale`)."""


def batch_to_device(batch: Dict, device) -> Dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}


def optimizer_loss_scale(optimizer) -> Optional[float]:
    """The DeepSpeed optimizer's current loss scale, or None where it has none.

    Megatron-DeepSpeed logs ``optimizer.cur_scale`` when the attribute exists: ZeRO 1/2's
    optimizer has it (1.0 without fp16); DeepSpeed's fp16 optimizer of ZeRO stage 0 names
    it ``loss_scale`` (None without grad scaling); a plain torch optimizer (fp32, stage 0)
    has neither, and then the log line leaves the field out, as upstream's does.
    """
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if torch.is_tensor(value) and value.numel() == 1:
            return float(value.item())
    return None


def train_step(engine, data_iterator: Iterator, args: argparse.Namespace) -> StepStats:
    """One optimizer step over ``gradient_accumulation_steps`` micro batches (all ranks).

    Losses and gate counts stay on the device until the one all-reduce at the end: a
    ``.item()`` per micro batch would make a GPU wait for every micro batch.
    """
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        from megatron.training.pipeline import pipe_train_step
        lm, aux, counts = pipe_train_step(engine, data_iterator, args.num_experts)
        return _step_stats(engine, lm, aux, counts)
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    counts = None
    for _ in range(args.gradient_accumulation_steps):
        batch = batch_to_device(next(data_iterator), engine.device)
        lm_loss, aux_loss, expert_counts = engine(batch["tokens"], batch["position_ids"],
                                                  batch["labels"], batch["loss_mask"])
        engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
        engine.step()
        sums += torch.stack((lm_loss.detach().double(), aux_loss.detach().double()))
        counts = expert_counts if counts is None else counts + expert_counts
    sums /= args.gradient_accumulation_steps * dist.get_world_size()
    dist.all_reduce(sums)  # on the device: NCCL cannot reduce CPU tensors
    # On NCCL the host waits here, for the all-reduce and the compute queued before it;
    # the monitor's clock counts only the all-reduce's stream time as collective time
    # (CUDA events), so a slow device still shows as this rank's own time.
    lm, aux = sums.tolist()
    return _step_stats(engine, lm, aux, counts)


def _step_stats(engine, lm: float, aux: float, counts: torch.Tensor) -> StepStats:
    """The step's record, with what the engine knows after its optimizer step."""
    grad_norm = engine.get_global_grad_norm()
    return StepStats(lm_loss=lm, moe_aux_loss=aux,
                     grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
                     skipped=bool(getattr(engine.optimizer, "overflow", False)),
                     expert_counts=counts, loss_scale=optimizer_loss_scale(engine.optimizer))


@torch.no_grad()
def evaluate(engine, data_iterator: Iterator, args: argparse.Namespace,
             on_step: Optional[Callable[[], None]] = None) -> float:
    """Mean LM loss over ``--eval-iters`` global batches of validation data (all ranks).

    Args:
        on_step: called after each micro batch (the monitor's progress touch).
    """
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        from megatron.training.pipeline import pipe_evaluate
        return pipe_evaluate(engine, data_iterator, args, on_step)
    engine.eval()
    total = torch.zeros(1, dtype=torch.float64, device=engine.device)
    steps = args.eval_iters * args.gradient_accumulation_steps
    for _ in range(steps):
        batch = batch_to_device(next(data_iterator), engine.device)
        lm_loss, _, _ = engine(batch["tokens"], batch["position_ids"], batch["labels"],
                               batch["loss_mask"])
        total += lm_loss.detach().double()
        if on_step is not None:
            on_step()
    engine.train()
    total /= steps * dist.get_world_size()
    dist.all_reduce(total)
    return total.item()
