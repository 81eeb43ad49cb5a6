"""``moc-ckpt export``: a MoC checkpoint written in another format.

- ``--format megatron-deepspeed``: Megatron-DeepSpeed's layout (DeepSpeed's format, ZeRO
  stage 1, a chosen expert-parallel and data-parallel size), so that a run can go back to
  upstream's code; weights, Adam's state, the schedule, the counters and RNG states.
- ``--format hf``: a Hugging Face ``transformers`` Mixtral (``config.json`` and
  safetensors shards) of a Mixtral-shaped model; the weights only."""

import argparse
import os

from deepspeed_ext.cli.common import UsageError, check_dir, check_tag_dir, size_text
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.interop.moc_read import read_moc
from deepspeed_ext.interop.upstream_write import write_upstream_checkpoint

FORMATS = ("megatron-deepspeed", "hf")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 1 << 10,
              "MIB": 1 << 20, "GIB": 1 << 30}


def add_export_parser(sub) -> None:
    """The ``export`` subcommand's flags (called by :func:`deepspeed_ext.cli.main.build_parser`)."""
    p = sub.add_parser("export", help="write a MoC checkpoint in Megatron-DeepSpeed's layout "
                                      "or as a Hugging Face model")
    p.add_argument("dir", help="MoC checkpoint save directory")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="megatron-deepspeed: DeepSpeed's files as upstream's pretrain_gpt.py "
                        "saves them (ZeRO stage 1); hf: a transformers Mixtral directory")
    p.add_argument("--out", required=True, help="new directory (upstream's --load, or the "
                                                "model directory)")
    p.add_argument("--tag", default=None, help="checkpoint to export (default: the newest "
                                               "that verifies)")
    p.add_argument("--expert-parallel-size", type=int, default=None, metavar="E",
                   help="upstream's --moe-expert-parallel-size (default: the saving run's)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="W",
                   help="upstream's data-parallel ranks, one ZeRO file each (default: the "
                        "saving run's world size)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="hf: the tensors' type (default float32)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="hf: largest safetensors shard (5GB, 500MB, 2GiB; default 5GB)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``moc-ckpt export DIR --format megatron-deepspeed --out OUT`` (run by
    :func:`deepspeed_ext.cli.main.main`); returns the exit status."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    if fs.is_url(args.out):
        raise UsageError(f"--out {args.out}: export into a local directory, then copy it")
    if any(os.path.exists(os.path.join(args.out, n)) for n in ("latest", "config.json")):
        raise UsageError(f"--out {args.out} already holds a checkpoint or a model; export "
                         f"into a new directory")
    if args.format == "hf":
        return _export_hf(args)
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


def _export_hf(args: argparse.Namespace) -> int:
    from deepspeed_ext.interop.hf_write import write_hf_mixtral
    tag, shape, plan = write_hf_mixtral(args.dir, args.tag, args.out, args.dtype,
                                        parse_size(args.max_shard_size))
    files = plan.file_names()
    nbytes = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"exported {tag} as a Hugging Face Mixtral to {args.out}: {len(plan.sources)} tensors "
          f"({shape.num_layers} layers x {shape.num_experts} experts, top-{shape.topk}), "
          f"{args.dtype}, {len(files)} file(s), {size_text(nbytes)}")
    print(f"load it with transformers: MixtralForCausalLM.from_pretrained({args.out!r})")
    return 0


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count.

    Raises:
        UsageError: naming ``--max-shard-size``.
    """
    value = text.strip().upper()
    digits = value.rstrip("KMGIB")
    unit = value[len(digits):]
    try:
        size = int(float(digits) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise UsageError(f"--max-shard-size {text}: give a size such as 5GB, 500MB or 2GiB") from None
    if size < 1:
        raise UsageError(f"--max-shard-size {text}: give a positive size")
    return size
