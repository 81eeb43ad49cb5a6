"""The pretraining run: a short sequence of phases, each in its own module.

Every rank runs :func:`pretrain` with the same arguments. Call order on each rank:
``validate_args`` (no collectives) -> process group (:mod:`~megatron.training.process`)
-> tokenizer and datasets -> model and ``deepspeed.initialize``
(:mod:`~megatron.training.engine_setup`) -> fault tolerance
(:mod:`~megatron.training.fault_tolerance`) -> ``load_checkpoint`` -> loaders
(:mod:`~megatron.training.loaders`) -> the loop (:mod:`~megatron.training.train_loop`),
where each iteration runs ``gradient_accumulation_steps`` forward/backward passes, one
optimizer step, and one small all-reduce of the losses.

A run can be entered again in the same process: :func:`pretrain` closes what it made
(the fault-tolerance component with MoC's keeper and threads, the heartbeat, the
metrics writer; the engine and loaders go with the last reference) and, after
:func:`~megatron.training.process.close_process_groups`, the next :func:`pretrain`
makes everything anew.
"""

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.engine.rng import set_rng_state, set_seed
from megatron.training import checkpointing
from megatron.training.arguments import padded_vocab_size, validate_args
from megatron.training.engine_setup import (print_banner, release_engine,
                                           setup_model_and_optimizer)
from megatron.training.fault_tolerance import FaultTolerance
from megatron.training.loaders import build_loaders
from megatron.training.log import MetricsWriter, print_rank_0
from megatron.training.loop_watch import startup_watch
from megatron.training.megatron_compat import ignored_flag_notes
from megatron.training.process import (close_process_groups, initialize_distributed,
                                       remove_deepspeed_shm_buffers, set_determinism,
                                       set_threads, unlink_deepspeed_shm_buffer)
from megatron.training.step import StepStats, evaluate, optimizer_loss_scale, train_step
from megatron.training.upstream_import import redirect_upstream_load
from megatron.training.stopping import DurationLimit
from megatron.training.train_loop import TrainLoop, TrainResult
from megatron.training.wandb_log import open_wandb

__all__ = ["pretrain", "TrainResult", "StepStats", "train_step", "evaluate",
           "optimizer_loss_scale", "setup_model_and_optimizer", "initialize_distributed",
           "close_process_groups", "remove_deepspeed_shm_buffers",
           "unlink_deepspeed_shm_buffer"]


@dataclass
class RunParts:
    """What the set-up phases made for one run on this rank."""

    engine: object
    scheduler: object
    ft: FaultTolerance
    state: checkpointing.ResumeState
    train_iter: object
    valid_iter: Optional[object]


def pretrain(args: argparse.Namespace, extra_setup=None) -> TrainResult:
    """Train a GPT-MoE model as the arguments say; every rank calls it.

    Args:
        args: parsed (not yet validated) arguments.
        extra_setup: optional ``callable(engine, args)`` run after the engine exists
            and before any checkpoint is loaded (extensions patch the engine here).

    Raises:
        ConfigError: bad input, raised on every rank before training starts.
    """
    limit = DurationLimit(getattr(args, "exit_duration_in_mins", None))  # counts start-up too
    validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    # Start-up and loading are watched like iterations (--moc-monitor): a phase that
    # never ends (a JIT build waiting on a dead builder's lock, a peer that never joins
    # the rendezvous, a stalled load) is reported by name instead of waiting forever.
    startup = startup_watch(args)
    try:
        parts = _set_up(args, startup, extra_setup)
    finally:
        startup.stop()  # the loop's heartbeat takes over (or start-up failed)
    writer = MetricsWriter(args.metrics_file, args.tensorboard_dir,
                           queue_size=getattr(args, "tensorboard_queue_size", None),
                           wandb=open_wandb(args, dist.get_rank()))
    try:
        return TrainLoop(args, parts.engine, parts.scheduler, parts.ft, writer,
                         parts.train_iter, parts.valid_iter, limit).run(parts.state)
    finally:
        writer.close()
        release_engine(parts.engine)


def _set_up(args: argparse.Namespace, startup, extra_setup) -> RunParts:
    """Every rank, in order: the process group, the data, the engine and the
    fault-tolerance component, the checkpoint load, the loaders."""
    set_threads(args)
    set_determinism(args)  # before any CUDA work (cuBLAS reads its workspace setting once)
    startup.phase("process group")
    initialize_distributed(args)
    validate_args(args, dist.get_world_size())
    for note in ignored_flag_notes(args):  # Megatron-DeepSpeed switches with no effect here
        print_rank_0(f"> {note}")
    set_seed(args.seed)
    startup.phase("data")
    datasets = _build_datasets(args)
    print_banner(args)
    startup.phase("model and engine")
    engine, scheduler = setup_model_and_optimizer(args)
    # Training's draws (dropout masks, top-2 gate noise) start from the seed whatever
    # building the model drew: torch's nn.Linear initialisers draw, megatron-core's
    # tensor-parallel layers do not, and a T = 2 run gated differently from T = 1.
    set_seed(args.seed)
    ft = FaultTolerance.setup(args, engine, scheduler, datasets)
    try:
        return _load_and_position(args, startup, extra_setup, engine, scheduler, ft, datasets)
    except BaseException:
        ft.abort()  # a peer lost during the load: nothing of this run keeps running
        release_engine(engine)
        raise


def _load_and_position(args, startup, extra_setup, engine, scheduler, ft,
                       datasets) -> RunParts:
    """Every rank: the extension hook, the checkpoint load, the loaders and the RNG and
    LR schedule positioned where the checkpoint says."""
    if extra_setup is not None:
        extra_setup(engine, args)
    startup.phase("checkpoint load")
    state = _load(args, engine, scheduler, ft)
    startup.phase("data loaders")
    train_iter, valid_iter = build_loaders(args, datasets, state)
    if state.rng_state is not None:
        set_rng_state(state.rng_state)
    from megatron.training.lr_schedule import uses_tokens
    if uses_tokens(args):  # a checkpoint without the token count: the samples tell it
        scheduler.step(0, token_num=state.consumed_train_samples * args.seq_length)
    return RunParts(engine, scheduler, ft, state, train_iter, valid_iter)


def _build_datasets(args: argparse.Namespace) -> Tuple:
    """Every rank: the tokenizer (the padded vocabulary size recorded in ``args``) and
    the train, valid and test datasets."""
    from megatron.data import build_tokenizer, build_train_valid_test_datasets
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size,
                                               args.make_vocab_size_divisible_by,
                                               getattr(args, "tensor_model_parallel_size", 1))
    # Saved with the arguments: which rows hold tokens when a load meets another padding.
    args.true_vocab_size = tokenizer.vocab_size
    # Data before the model: a missing or unusable --data-path stops the job before
    # the (slow) engine set-up.
    return build_train_valid_test_datasets(args, tokenizer)


def _load(args: argparse.Namespace, engine, scheduler,
          ft: FaultTolerance) -> checkpointing.ResumeState:
    """Every rank: this attempt recorded, then the newest checkpoint under ``--load``
    (a fresh state without one)."""
    state = checkpointing.ResumeState()
    checkpointing.record_attempt(engine, args)
    if args.load:
        redirect_upstream_load(args)  # a Megatron-DeepSpeed --load: imported into --save
        resumed = ft.resume_in_job()  # in-job, a pipeline: only the failed stage replays
        if resumed is not None:
            return resumed
        state = checkpointing.load_checkpoint(engine, args, scheduler, exact=ft.exact)
        ft.after_load()
    return state
