"""The training and validation batches of a run, positioned where its state says.

Every rank calls :func:`build_loaders` after the checkpoint load (the state it returns
says how many samples were consumed), and again for a stage-loss recovery's replay.
"""

import argparse

from megatron.training import checkpointing
from megatron.training.engine_setup import rank_place


def build_loaders(args: argparse.Namespace, datasets, state: checkpointing.ResumeState):
    """Train and valid iterators positioned after what ``state`` says was consumed."""
    from megatron.data import build_pretraining_data_loader
    train_ds, valid_ds, _ = datasets
    # The data-parallel rank reads its shard; the ranks of a tensor-parallel group read
    # the same one.
    place = rank_place(args)
    rank, world = place.dp_rank, args.data_parallel_size
    train = build_pretraining_data_loader(train_ds, state.consumed_train_samples,
                                          args.micro_batch_size, rank, world, args.num_workers)
    valid_consumed = (state.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    valid = (build_pretraining_data_loader(valid_ds, valid_consumed, args.micro_batch_size, rank,
                                           world, args.num_workers)
             if args.eval_iters > 0 and valid_ds is not None else None)
    train, valid = iter(train), (iter(valid) if valid is not None else None)
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:  # the engine pulls its batches
        from deepspeed.accelerator import get_accelerator
        from megatron.training.pipeline import pipe_batches
        device = get_accelerator().current_device_name()
        train = pipe_batches(train, device)
        valid = pipe_batches(valid, device) if valid is not None else None
    return train, valid
