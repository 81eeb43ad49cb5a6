"""Flags of the training run (batch, optimizer, precision, learning rate, checkpoints,
DeepSpeed) and their checks, and the batch sizes derived from them and the world size.

The checks run on every rank in :func:`megatron.training.arguments.validate_args`, in the
order that function lists, each raising :class:`~megatron.errors.ConfigError` naming the
flag to fix.
"""

import argparse
import os

from megatron.errors import ConfigError
from megatron.training.args.checks import MAX_TIMEOUT_S, check_at_least, check_float
from megatron.training.parallel_layout import build_layout


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The ``training`` group: batch, length of the run, optimizer, precision, ZeRO."""
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="Samples per rank per forward (required).")
    g.add_argument("--global-batch-size", type=int,
                   help="Samples per optimizer step; default: micro batch x data-parallel size.")
    g.add_argument("--train-iters", type=int, help="Optimizer steps to train for (required).")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Also stop once this many tokens (global batch x sequence length per "
                        "iteration) are consumed, if that comes before --train-iters.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="After this many minutes since the start, save (with --save) and exit "
                        "cleanly; every rank agrees through one all-reduce per iteration.")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Recompute each transformer layer's activations in the backward pass "
                        "instead of keeping them (torch.utils.checkpoint): less memory, about "
                        "one more forward pass of compute.")
    g.add_argument("--seed", type=int, default=1234, help="Seed of init, dropout and data order.")
    g.add_argument("--deterministic", action="store_true",
                   help="Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS "
                        "workspace, math attention): bitwise-repeatable runs on CUDA too. "
                        "Implied by --moc-mode exact on CUDA.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip; 0: off.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    g.add_argument("--l2-weight-decay", action="store_true",
                   help="Adam with weight decay added to the gradient (torch.optim.Adam), as "
                        "Megatron-DeepSpeed trains on a CPU without --torch-adam; default: "
                        "decoupled weight decay (AdamW, as apex's FusedAdam on GPUs).")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute with fp32 master weights.")
    g.add_argument("--fp16", action="store_true", help="float16 compute with dynamic loss scaling.")
    g.add_argument("--loss-scale", type=float, default=0.0, help="fp16 static loss scale; 0: dynamic.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16 dynamic loss scaling: overflows tolerated before the scale drops "
                        "(DeepSpeed's fp16.hysteresis).")
    g.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2], help="DeepSpeed ZeRO stage.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="A collective that waits longer fails instead of hanging.")
    g.add_argument("--num-threads", type=int, default=0,
                   help="CPU threads per rank; 0: cores / local ranks (unless OMP_NUM_THREADS is set).")


def add_lr_args(p: argparse.ArgumentParser) -> None:
    """The ``learning rate`` group: peak, warmup and decay, by iterations or tokens."""
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, help="Peak learning rate (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="Decay shape.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    g.add_argument("--lr-decay-iters", type=int, help="Decay steps; default: --train-iters.")
    g.add_argument("--lr-warmup-tokens", type=int, default=None,
                   help="Linear warmup over this many consumed tokens (instead of "
                        "--lr-warmup-iters).")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="Decay until this many consumed tokens (instead of --lr-decay-iters).")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="On --load, take the schedule's settings (rates, warmup, decay) from "
                        "the flags instead of the checkpoint.")


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The ``checkpointing`` group: where to save and load, how often, what to restore."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="Directory to save checkpoints to.")
    g.add_argument("--load", help="Directory to resume from; empty or missing: start from scratch.")
    g.add_argument("--save-interval", type=int, default=0, help="Save every N iterations; 0: only at the end.")
    g.add_argument("--exit-interval", type=int, default=0,
                   help="Save (with --save) and exit once the iteration is a multiple of N; "
                        "the schedule still follows --train-iters.")
    g.add_argument("--no-load-optim", action="store_true", help="Load weights only, not optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore RNG states.")


def add_deepspeed_args(p: argparse.ArgumentParser) -> None:
    """The ``deepspeed`` group: DeepSpeed's own flags, and its launcher's."""
    g = p.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", action="store_true", help="Accepted for compatibility; always on.")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON config; default: built from the flags.")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="Set by the launcher.")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Same as --checkpoint-activations (the recompute is torch's).")


def check_distributed_timeout(args: argparse.Namespace) -> None:
    """A collective's timeout is a finite number of minutes Python can wait for."""
    check_float("--distributed-timeout-minutes", args.distributed_timeout_minutes, "minutes",
                maximum=MAX_TIMEOUT_S / 60)


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """The data-parallel size of the layout the flags ask for on ``world_size`` ranks.

    Raises:
        ConfigError: the pipeline stages do not split the world, or the layout's ranks
            do not split into the tensor- and expert-parallel sizes (naming the flag).
    """
    tp = getattr(args, "tensor_model_parallel_size", 1)
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if stages > 1 and world_size % stages:
        raise ConfigError(f"world size ({world_size}) must be divisible by "
                          f"--pipeline-model-parallel-size ({stages})")
    try:
        # a pipeline stage's ranks (world / P) are laid out as the whole world is without one
        return build_layout(world_size // max(stages, 1), tp, args.moe_expert_parallel_size,
                            bool(getattr(args, "enable_expert_tensor_parallelism", False))).dp
    except ValueError as e:  # the message names the flag
        raise ConfigError(str(e)) from None


def fill_batch_sizes(args: argparse.Namespace, dp: int) -> None:
    """Set ``data_parallel_size``, the default ``--global-batch-size`` (one micro-batch per
    data-parallel rank) and ``gradient_accumulation_steps``.

    Raises:
        ConfigError: the global batch is no multiple of micro batch x data-parallel size.
    """
    args.data_parallel_size = dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size ({args.global_batch_size}) must be divisible by "
                          f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x "
                          f"{dp} = {per_step})")
    args.gradient_accumulation_steps = args.global_batch_size // per_step


def fill_lr_decay_iters(args: argparse.Namespace) -> None:
    """``--lr-decay-iters`` defaults to ``--train-iters``."""
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters


def check_training(args: argparse.Namespace) -> None:
    """One precision, a learning-rate schedule that decays, counts that are not negative,
    and a ``--deepspeed_config`` file that agrees with the flags (its values taken for the
    flags not given, so the later checks see what DeepSpeed will run)."""
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr ({args.min_lr}) must be between 0 and --lr ({args.lr})")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                          f"--lr-decay-iters ({args.lr_decay_iters})")
    for name in ("save_interval", "exit_interval", "eval_iters", "num_workers", "num_threads"):
        check_at_least(args, name, 0)
    if args.deepspeed_config and not os.path.isfile(args.deepspeed_config):
        raise ConfigError(f"--deepspeed_config: file not found: {args.deepspeed_config}")
    if args.deepspeed_config:
        from megatron.training.ds_config import reconcile_with_file
        reconcile_with_file(args)
    if args.hysteresis < 1:
        raise ConfigError(f"--hysteresis must be >= 1, got {args.hysteresis}")
