"""``moc-ckpt export --format megatron-deepspeed``: a MoC checkpoint written in
Megatron-DeepSpeed's layout (DeepSpeed's format, ZeRO stage 1, a chosen expert-parallel
and data-parallel size), so that a run can go back to upstream's code; weights, Adam's
state, the schedule, the counters and RNG states."""

import argparse
import os

from deepspeed_ext.cli.common import UsageError, check_dir, check_tag_dir, size_text
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.interop.moc_read import read_moc
from deepspeed_ext.interop.upstream_write import write_upstream_checkpoint

FORMATS = ("megatron-deepspeed",)


def add_export_parser(sub) -> None:
    """The ``export`` subcommand's flags (called by :func:`deepspeed_ext.cli.main.build_parser`)."""
    p = sub.add_parser("export", help="write a MoC checkpoint in Megatron-DeepSpeed's layout")
    p.add_argument("dir", help="MoC checkpoint save directory")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="megatron-deepspeed: DeepSpeed's files as upstream's pretrain_gpt.py "
                        "saves them (ZeRO stage 1)")
    p.add_argument("--out", required=True, help="new directory (upstream's --load)")
    p.add_argument("--tag", default=None, help="checkpoint to export (default: the newest "
                                               "that verifies)")
    p.add_argument("--expert-parallel-size", type=int, default=None, metavar="E",
                   help="upstream's --moe-expert-parallel-size (default: the saving run's)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="W",
                   help="upstream's data-parallel ranks, one ZeRO file each (default: the "
                        "saving run's world size)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``moc-ckpt export DIR --format megatron-deepspeed --out OUT`` (run by
    :func:`deepspeed_ext.cli.main.main`); returns the exit status."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    if fs.is_url(args.out):
        raise UsageError(f"--out {args.out}: export into a local directory, then copy it")
    if os.path.exists(os.path.join(args.out, "latest")):
        raise UsageError(f"--out {args.out} already holds a checkpoint; export into a new "
                         f"directory")
    for flag, value in (("--expert-parallel-size", args.expert_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: give a positive size")
    try:
        ckpt = read_moc(args.dir, args.tag, args.expert_parallel_size, args.data_parallel_size)
    except CheckpointError as err:
        if "divides neither" in str(err):
            raise UsageError(f"--expert-parallel-size/--data-parallel-size: {err}") from None
        raise
    import deepspeed
    tag_dir = write_upstream_checkpoint(args.out, ckpt, deepspeed.__version__)
    model = ckpt.model
    nbytes = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir))
    state = "weights and Adam's moments" if ckpt.moments else "weights only (no ZeRO files)"
    print(f"exported iteration {ckpt.iteration} ({len(ckpt.weights)} tensors, {state}) to "
          f"{tag_dir}: {size_text(nbytes)}, {model.dp_world_size} data-parallel ranks, "
          f"expert-parallel size {model.ep_size}")
    print(f"upstream flags: --num-layers {model.num_layers} --hidden-size {model.hidden_size} "
          f"--ffn-hidden-size {model.ffn_hidden_size} --num-attention-heads "
          f"{model.num_attention_heads} --seq-length {model.seq_length} "
          f"--max-position-embeddings {model.max_position_embeddings} --num-experts "
          f"{model.num_experts} --expert-interval {model.expert_interval} --topk {model.topk} "
          f"--moe-expert-parallel-size {model.ep_size} --zero-stage 1"
          + ("; its Adam added weight decay to the gradient (torch.optim.Adam, as upstream "
             "runs on a CPU)" if ckpt.l2_weight_decay else ""))
    return 0
