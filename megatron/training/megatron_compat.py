"""Megatron-DeepSpeed's flags that restate what this trainer does, and the checks that
they say nothing else.

Megatron-DeepSpeed's MoE example scripts (``examples_deepspeed/MoE/ds_pretrain_gpt_*``)
pass flags for features this trainer has in one form only: no sequence parallelism,
memory-mapped indexed datasets, separate MoE parameter groups. They are
accepted with that value, and any other value is refused here (on every rank, before any
collective) with a message naming the flag and what is supported. docs/megatron-deepspeed.md
maps each of their flags to ours.

Their scripts also pass switches that have nothing to switch here (fused kernels this
model does not have, the communication backend DeepSpeed picks): those are accepted, and
rank 0 prints one line per flag saying so (:func:`ignored_flag_notes`). The architecture
options (SwiGLU, RMSNorm, grouped-query attention, upstream's rotary embedding, untied or
bias-free layers) are the model's own flags (``megatron.training.args.model``); a
rotary embedding over part of each head and Megatron-LM's ``--group-query-attention``
are refused.
"""

import argparse
from typing import Iterable, List, Optional, Sequence

from megatron.errors import ConfigError

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


def add_upstream_switch_args(p: argparse.ArgumentParser) -> None:
    """Megatron-DeepSpeed switches that change nothing in this trainer (rank 0 prints one
    line each at the start saying why: :func:`ignored_flag_notes`)."""
    g = p.add_argument_group("Megatron-DeepSpeed switches with nothing to switch here "
                             "(accepted; rank 0 prints one line each saying why)")
    g.add_argument("--distributed-backend", choices=DISTRIBUTED_BACKENDS, default=None,
                   help="Ignored, as Megatron-DeepSpeed ignores it: the backend is DeepSpeed's "
                        "accelerator's (nccl on CUDA; gloo on CPU, ccl with oneCCL's bindings).")
    for flags, dest in FLASH_ATTENTION_SWITCHES:
        g.add_argument(*flags, dest=dest, action="store_true",
                       help="Ignored: attention always runs in torch's "
                            "scaled_dot_product_attention, which picks a flash kernel where the "
                            "device, dtype and head size allow.")
    for flag, what in FUSION_SWITCHES:
        g.add_argument(flag, action="store_true", help=f"Ignored: {what}.")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="Ignored: weights are always initialized on the CPU (DeepSpeed then "
                        "moves the model to the device).")


def add_unsupported_args(p: argparse.ArgumentParser) -> None:
    """Megatron-DeepSpeed's options for what this trainer does not have (yet), accepted
    only where they describe what it does (refused by :func:`check_unsupported_options`)."""
    g = p.add_argument_group("Megatron-DeepSpeed options this trainer does not have (refused "
                             "unless they describe what it does)")
    g.add_argument("--rampup-batch-size", nargs="*", default=None, metavar="N",
                   help="Refused: the global batch size is fixed for the run.")
    g.add_argument("--mlp-type", choices=("standard", "residual"), default="standard",
                   help="standard only; residual (PR-MoE's Residual MoE) is refused.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="1.0 only (--position-embedding-type rope rotates whole heads).")
    for flag, _ in UNSUPPORTED_MODEL_SWITCHES:
        g.add_argument(flag, action="store_true", help="Refused: not supported yet.")


DISTRIBUTED_BACKENDS = ("nccl", "gloo", "ccl", "hccl")
"""``--distributed-backend`` values: Megatron-DeepSpeed's choices."""

FLASH_ATTENTION_SWITCHES = ((("--use-flash-attn", "--use-flash-attn-v1"), "use_flash_attn_v1"),
                            (("--use-flash-attn-v2",), "use_flash_attn_v2"))
"""Megatron-DeepSpeed's FlashAttention switches (option strings, ``dest``)."""

FUSION_SWITCHES = (
    ("--no-gradient-accumulation-fusion",
     "gradient accumulation is never fused into the weight-gradient GEMMs here (no APEX "
     "kernel; megatron-core's layers run with the fusion off)"),
    ("--no-masked-softmax-fusion",
     "nothing to switch off here: attention is torch's scaled_dot_product_attention, not "
     "Megatron's fused scale-mask-softmax kernel"),
    ("--no-bias-gelu-fusion",
     "nothing to switch off here (no fused kernel): the MLP's bias and GeLU are separate "
     "torch ops"),
    ("--no-bias-dropout-fusion",
     "nothing to switch off here (no fused kernel): bias, dropout and the residual add are "
     "separate torch ops"),
)
"""Megatron-DeepSpeed's ``--no-*-fusion`` switches and why each changes nothing here."""

UNSUPPORTED_MODEL_SWITCHES = (
    ("--group-query-attention",
     "not supported: this is Megatron-LM's switch; grouped-query attention is "
     "--num-key-value-heads N (Megatron-DeepSpeed's), with N dividing --num-attention-heads"),
)
"""Architecture switches the model does not have, and the message refusing each."""


def check_unsupported_options(args: argparse.Namespace) -> None:
    """Refuse Megatron-DeepSpeed's options that describe another model or a batch-size
    ramp-up (every rank, before any collective).

    Raises:
        ConfigError: naming the flag, saying it is not supported yet and what to do.
    """
    for flag, why in UNSUPPORTED_MODEL_SWITCHES:
        if getattr(args, _dest(flag), False):
            raise ConfigError(f"{flag}: {why}")
    if getattr(args, "mlp_type", "standard") == "residual":
        raise ConfigError("--mlp-type residual: Residual MoE (PR-MoE's dense MLP beside each "
                          "MoE layer's experts) is not supported; drop the flag or pass "
                          "--mlp-type standard")
    percent = getattr(args, "rotary_percent", 1.0)
    if percent != 1.0:
        raise ConfigError(f"--rotary-percent {percent:g}: not supported yet: a rotary "
                          "embedding over part of each head; --position-embedding-type rope "
                          "rotates whole heads (--rotary-percent 1.0)")
    ramp = getattr(args, "rampup_batch_size", None)
    if ramp is not None:
        raise ConfigError(f"--rampup-batch-size {' '.join(ramp)}: batch-size ramp-up is not "
                          "supported: the global batch size is fixed for the run (DeepSpeed's "
                          "train_batch_size), and the run length is --train-iters (Megatron-"
                          "DeepSpeed accepts the ramp-up only with --train-samples); drop the "
                          "flag to train at --global-batch-size from the start")


def ignored_flag_notes(args: argparse.Namespace) -> List[str]:
    """One line per given Megatron-DeepSpeed switch that changes nothing here, saying why
    (pure; the trainer prints them on rank 0 once the process group exists)."""
    notes = []
    backend = getattr(args, "distributed_backend", None)
    if backend is not None:
        notes.append(f"--distributed-backend {backend}: the backend is DeepSpeed's "
                     "accelerator's (nccl on CUDA; gloo on CPU, ccl with oneCCL's bindings), "
                     "as in Megatron-DeepSpeed, which does not read this flag either; ignored")
    for flags, dest in FLASH_ATTENTION_SWITCHES:
        if getattr(args, dest, False):
            notes.append(_flash_attention_note(flags[0], args))
    for flag, what in FUSION_SWITCHES:
        if getattr(args, _dest(flag), False):
            notes.append(f"{flag}: {what}; ignored")
    if getattr(args, "train_data_path", None) and was_given(args, "split"):
        notes.append(f"--split {args.split}: --train-data-path (--valid-data-path, "
                     "--test-data-path) each name a dataset used whole, as in Megatron-DeepSpeed, "
                     "which ignores --split with them too; ignored")
    if getattr(args, "use_cpu_initialization", False):
        notes.append("--use-cpu-initialization: weights are always initialized on the CPU here "
                     "(DeepSpeed then moves the model to the device); ignored")
    return notes


def _flash_attention_note(flag: str, args: argparse.Namespace) -> str:
    note = (f"{flag}: nothing to switch on here: attention always runs in torch's "
            "scaled_dot_product_attention, which uses FlashAttention-2 on CUDA for fp16/bf16 "
            "where the head size allows (else its memory-efficient or math kernel) and its "
            "flash kernel on CPU")
    if getattr(args, "deterministic", False) or getattr(args, "moc_mode", "pec") == "exact":
        note += ("; on CUDA, --deterministic (implied there by --moc-mode exact) restricts it "
                 "to the math kernel")
    return note + "; ignored"


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def check_megatron_compat(args: argparse.Namespace) -> None:
    """Refuse the values of the compatibility flags this trainer does not support.

    Raises:
        ConfigError: naming the flag, its value and the supported one.
    """
    _check_pipeline(args)
    _check_tensor_parallel(args)
    check_unsupported_options(args)
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
