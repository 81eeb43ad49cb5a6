"""Training and evaluation steps under pipeline parallelism
(``--pipeline-model-parallel-size P``): DeepSpeed's pipeline engine runs the micro-batches
of a step itself (``train_batch`` / ``eval_batch``), pulling them from an iterator on the
first stage (tokens, positions) and the last (labels, loss mask).

Every rank calls these (the engine's schedule is a collective of the pipeline); the losses
are summed over the world from the last stage's
:class:`~megatron.model.gpt_moe_pipe.PipeLoss`.
"""

import argparse
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist


def pipe_batches(data_iterator: Iterator, device) -> Iterator:
    """The trainer's batches as the pipeline engine takes them:
    ``((tokens, position_ids), (labels, loss_mask))``, on ``device``."""
    for batch in data_iterator:
        yield ((batch["tokens"].to(device), batch["position_ids"].to(device)),
               (batch["labels"].to(device), batch["loss_mask"].to(device)))


def _loss_parts(engine) -> torch.Tensor:
    """``[lm sum, aux sum, micro-batches]`` over the world (on the device)."""
    parts = engine.module.loss_fn.take(engine.device)
    dist.all_reduce(parts)  # device tensors: the training's own group
    return parts


def pipe_train_step(engine, batches: Iterator,
                    num_experts: int) -> Tuple[float, float, torch.Tensor]:
    """One optimizer step: ``train_batch`` over ``gradient_accumulation_steps``
    micro-batches; returns the mean LM and aux losses and this rank's gate counts
    ``[num_moe_layers, num_experts]`` (its stage's rows; the trainer sums them over the
    world, as without a pipeline)."""
    from megatron.model.gpt_moe_pipe import take_gate_counts
    take_gate_counts(engine.module, num_experts, engine.device)  # drop evaluation's
    engine.train_batch(batches)
    lm, aux, count = _loss_parts(engine).tolist()
    return lm / count, aux / count, take_gate_counts(engine.module, num_experts, engine.device)


@torch.no_grad()
def pipe_evaluate(engine, batches: Iterator, args: argparse.Namespace,
                  on_step: Optional[Callable[[], None]] = None) -> float:
    """Mean LM loss over ``--eval-iters`` global batches (``eval_batch`` each)."""
    for _ in range(args.eval_iters):
        engine.eval_batch(batches)
        if on_step is not None:
            on_step()
    lm, _, count = _loss_parts(engine).tolist()
    return lm / count
