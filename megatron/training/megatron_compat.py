"""Megatron-DeepSpeed's flags that restate what this trainer does, and the checks that
they say nothing else.

Megatron-DeepSpeed's MoE example scripts (``examples_deepspeed/MoE/ds_pretrain_gpt_*``)
pass flags for features this trainer has in one form only: no sequence parallelism,
memory-mapped indexed datasets, separate MoE parameter groups. They are
accepted with that value, and any other value is refused here (on every rank, before any
collective) with a message naming the flag and what is supported. docs/megatron-deepspeed.md
maps each of their flags to ours.
"""

import argparse
from typing import Iterable, Optional, Sequence

from megatron.training.errors import ConfigError

DATA_IMPLS = ("mmap", "infer")
"""``--data-impl`` values: Megatron-DeepSpeed's choices; both read our memory-mapped
indexed datasets (``infer`` finds ``mmap``). Older Megatron's ``lazy`` and ``cached``
are refused by the parser's choices."""


class NumExpertsAction(argparse.Action):
    """``--num-experts N``; Megatron-DeepSpeed's PR-MoE list form (``--num-experts 32 32
    ... 64``, one count per MoE layer) is refused by name instead of argparse's
    "unrecognized arguments: 32 32".

    Called by argparse while parsing, on every rank.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) != 1:
            counts = " ".join(str(v) for v in values)
            raise ConfigError(f"--num-experts {counts}: PR-MoE (per-layer expert counts) is not "
                              "supported; give one expert count for every MoE layer")
        setattr(namespace, self.dest, values[0])


def add_megatron_compat_args(p: argparse.ArgumentParser) -> None:
    """The group of Megatron-DeepSpeed flags accepted with the one value we support."""
    g = p.add_argument_group("Megatron-DeepSpeed compatibility (accepted with the value "
                             "this trainer supports)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="Split attention heads, the dense MLP and the vocabulary over this many "
                        "consecutive ranks (megatron-core's layers); experts are split too with "
                        "--enable-expert-tensor-parallelism, else kept whole "
                        "(--moe-expert-parallel-size a multiple of it). MoC checkpoints load "
                        "under another size.")
    g.add_argument("--enable-expert-tensor-parallelism", action="store_true",
                   help="With --tensor-model-parallel-size > 1, split each expert's MLP over "
                        "the tensor-parallel ranks too (DeepSpeed's expert sharding).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Refused: sequence parallelism is not supported yet.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Pipeline stages (DeepSpeed's pipeline engine; ZeRO stage 0/1, every "
                        "stage must hold an MoE layer; MoC checkpoints of every kind load under "
                        "another size; with --tensor-model-parallel-size too, DeepSpeed's MoE dispatch "
                        "only).")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Accepted: the model is never pipelined.")
    g.add_argument("--data-impl", default="mmap", choices=DATA_IMPLS,
                   help="Indexed dataset implementation: memory-mapped (infer finds mmap).")
    g.add_argument("--create-moe-param-group", action="store_true",
                   help="Accepted: expert parameters always get their own optimizer groups.")


def check_megatron_compat(args: argparse.Namespace) -> None:
    """Refuse the values of the compatibility flags this trainer does not support.

    Raises:
        ConfigError: naming the flag, its value and the supported one.
    """
    _check_pipeline(args)
    _check_tensor_parallel(args)
    queue = getattr(args, "tensorboard_queue_size", None)
    if queue is not None and queue < 1:
        raise ConfigError(f"--tensorboard-queue-size must be >= 1, got {queue}")
    if getattr(args, "lr_warmup_tokens", None) is not None and args.lr_warmup_iters:
        raise ConfigError("--lr-warmup-tokens and --lr-warmup-iters both set the warm-up; "
                          "give one")
    for name in ("train_tokens", "lr_warmup_tokens", "lr_decay_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < (1 if name != "lr_warmup_tokens" else 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= "
                              f"{1 if name != 'lr_warmup_tokens' else 0}, got {value}")
    warmup, decay = getattr(args, "lr_warmup_tokens", None), getattr(args, "lr_decay_tokens", None)
    if warmup is not None and decay is not None and warmup >= decay:
        raise ConfigError(f"--lr-warmup-tokens ({warmup}) must be smaller than "
                          f"--lr-decay-tokens ({decay})")
    minutes = getattr(args, "exit_duration_in_mins", None)
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--exit-duration-in-mins must be > 0, got {minutes:g}")


def given_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> Iterable[str]:
    """The ``dest`` of every option that ``argv`` (YAML flags included) names: what the
    user set, as opposed to a default (for the checks against a ``--deepspeed_config``
    file and the tokenizer inferred from ``--vocab-file``)."""
    options = {opt: action.dest for action in parser._actions for opt in action.option_strings}
    for token in argv:
        if token.startswith("--"):
            dest = options.get(token.split("=", 1)[0])
            if dest is not None:
                yield dest


def was_given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the flag of ``dest`` was on the command line or in a ``--config`` file
    (False for a namespace not made by ``parse_args``)."""
    return dest in (getattr(args, "given_flags", None) or ())


def infer_tokenizer(args: argparse.Namespace) -> Optional[str]:
    """Megatron-DeepSpeed's scripts select GPT-2 BPE by passing ``--vocab-file`` and
    ``--merge-file`` alone: without an explicit ``--tokenizer-type`` they now mean
    GPT2BPETokenizer (the byte-level default ignored them, and the run failed much later
    on "token id >= 257"). Sets ``args.tokenizer_type``; returns what it inferred.

    Raises:
        ConfigError: an explicit ``--tokenizer-type`` that does not read those files.
    """
    files = [flag for flag, value in (("--vocab-file", args.vocab_file),
                                      ("--merge-file", args.merge_file)) if value]
    if not files:
        return None
    if was_given(args, "tokenizer_type"):
        if args.tokenizer_type == "ByteLevelTokenizer":
            raise ConfigError(f"{' and '.join(files)} given with --tokenizer-type "
                              "ByteLevelTokenizer, which reads no files: drop them, or use "
                              "--tokenizer-type GPT2BPETokenizer")
        return None
    if args.tokenizer_type != "GPT2BPETokenizer":
        args.tokenizer_type = "GPT2BPETokenizer"
        return args.tokenizer_type
    return None


def _check_pipeline(args: argparse.Namespace) -> None:
    """Refuse what pipeline parallelism does not support (yet), naming the flags."""
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if stages < 1:
        raise ConfigError(f"--pipeline-model-parallel-size must be >= 1, got {stages}")
    if stages == 1:
        return
    if getattr(args, "zero_stage", 0) >= 2:
        raise ConfigError(f"--pipeline-model-parallel-size {stages} with --zero-stage "
                          f"{args.zero_stage}: DeepSpeed's pipeline engine supports ZeRO stage 0 or "
                          "1 only; pass --zero-stage 1")
    if getattr(args, "checkpoint_activations", False):
        raise ConfigError(f"--pipeline-model-parallel-size {stages} with --checkpoint-activations: "
                          "activation checkpointing inside pipeline stages is not supported yet")
    schedule = getattr(args, "moe_schedule", "deepspeed")
    if schedule != "deepspeed":
        # Setting a schedule up is a collective per MoE layer of the whole world, and
        # stages hold different numbers of MoE layers: the stages would wait on each other.
        raise ConfigError(f"--pipeline-model-parallel-size {stages} with --moe-schedule "
                          f"{schedule}: Parm's schedules are not supported inside pipeline "
                          "stages yet; drop the flag (DeepSpeed's dispatch runs)")


def _check_tensor_parallel(args: argparse.Namespace) -> None:
    """Refuse what tensor parallelism does not support yet, naming the flags."""
    if getattr(args, "sequence_parallel", False):
        raise ConfigError("--sequence-parallel: sequence parallelism is not supported yet; "
                          "drop the flag (tensor parallelism runs without it)")
    size = getattr(args, "tensor_model_parallel_size", 1)
    if size < 1:
        raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {size}")
    if size == 1:
        if getattr(args, "enable_expert_tensor_parallelism", False):
            raise ConfigError("--enable-expert-tensor-parallelism needs "
                              "--tensor-model-parallel-size > 1")
        return
