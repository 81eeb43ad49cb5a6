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
    engine.train_batch(batches)  # (evaluation's forwards count nothing: eval mode)
    cross = getattr(engine, "moc_cross", None)
    if cross is not None:
        cross.end_step()
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


def boundary_bytes(args: argparse.Namespace) -> Tuple[int, int]:
    """Bytes a stage sends per micro-batch across a stage boundary: ``(activations,
    gradients)``: the hidden states (in the compute precision), the position ids (int64)
    and the aux-loss scalar forward; the gradients of the hidden states and the aux loss
    back."""
    elem = 2 if (getattr(args, "fp16", False) or getattr(args, "bf16", False)) else 4
    hidden = args.micro_batch_size * args.seq_length * args.hidden_size * elem
    return hidden + args.micro_batch_size * args.seq_length * 8 + 4, hidden + 4


def attach_upstream_log(engine, args: argparse.Namespace):
    """Every rank, with ``--moc-upstream-logging``, after the engine exists: an
    :class:`~deepspeed_ext.exact.upstream.UpstreamLog` on the engine's sends, keeping two
    exact-mode windows (``--moc-window``; an automatic window sets it at its first frame,
    :func:`check_upstream_log`)."""
    from deepspeed_ext.exact.cross_stage import CrossStageLog
    from deepspeed_ext.exact.upstream import UpstreamLog
    retain = 2 * max(args.moc_window, 1)
    log = UpstreamLog(engine, retain_iterations=retain)
    log.attach()
    # the all-reduces across stages (tied gradients, the norm): a stage replaying alone
    # takes their results from the others (megatron/training/stage_loss.py)
    engine.moc_cross = CrossStageLog(engine, retain)
    engine.moc_cross.attach()
    return log


def check_upstream_log(log, args: argparse.Namespace, window: int) -> None:
    """Every rank, once the exact-mode window ``window`` is known (before the second
    iteration): keep two windows, and refuse a log whose host memory would exceed
    ``--moc-upstream-log-gb`` on any stage (every rank computes the same figures).

    Raises:
        ConfigError: naming the flags to change.
    """
    from deepspeed_ext.exact.upstream import log_bytes_per_iteration, log_capacity_bytes
    from megatron.errors import ConfigError
    log.retain_iterations = 2 * window
    cross = getattr(log.engine, "moc_cross", None)
    if cross is not None:
        cross.retain_iterations = 2 * window
    act, grad = boundary_bytes(args)
    stages = args.pipeline_model_parallel_size
    worst = max(log_capacity_bytes(log_bytes_per_iteration(
        act, grad, args.gradient_accumulation_steps, s, stages), 2 * window) for s in range(stages))
    budget = args.moc_upstream_log_gb * 2 ** 30
    if budget and worst > budget:
        raise ConfigError(
            f"--moc-upstream-logging: a stage's log of two windows (W = {window}) of "
            f"{args.gradient_accumulation_steps} micro-batches takes {worst / 2 ** 30:.3f} GiB of "
            f"host memory, over --moc-upstream-log-gb {args.moc_upstream_log_gb:g}; raise it, "
            f"or lower --moc-window, --micro-batch-size or the micro-batches per step")


def report_upstream_log(log, args: argparse.Namespace) -> str:
    """Every rank, at the end of training: rank 0's line on the host memory each stage's
    upstream log holds (the most of any rank of the stage; one ``all_gather_object``)."""
    from deepspeed_ext.runtime.groups import metadata_group
    stage = log.engine.stage_id
    mine = (stage, log.bytes, log.peak_bytes, log.iterations())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=metadata_group())
    parts = []
    for s in range(args.pipeline_model_parallel_size):
        held = [e for e in every if e[0] == s]
        parts.append(f"stage {s} {max(e[1] for e in held) / 2 ** 20:.2f} MiB "
                     f"(peak {max(e[2] for e in held) / 2 ** 20:.2f})")
    iters = mine[3]
    span = f"iterations {iters[0]}..{iters[-1]}" if iters else "no iteration"
    return (f"[moc] upstream logs: {', '.join(parts)} per rank; {span} kept "
            f"({log.retain_iterations} = two windows)")
