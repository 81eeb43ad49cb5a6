"""Flags of the model's shape and its mixture of experts, and their checks.

The checks run on every rank in :func:`megatron.training.arguments.validate_args`, in the
order that function lists, each raising :class:`~megatron.errors.ConfigError` naming the
flag to fix.
"""

import argparse

from megatron.errors import ConfigError
from megatron.training.megatron_compat import NumExpertsAction

# Settings that fix the shape of the model: a checkpoint saved with other values
# cannot be loaded, and the error names the first one that differs.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_experts", "expert_interval", "padded_vocab_size",
                    "max_position_embeddings", "position_embedding_type", "swiglu",
                    "normalization", "add_bias_linear", "untie_embeddings_and_output_weights",
                    "num_key_value_heads", "use_rotary_position_embeddings")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The ``model`` group: the transformer's sizes, position embedding, init and dropout."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="Transformer layers (required).")
    g.add_argument("--hidden-size", type=int, help="Model width (required).")
    g.add_argument("--ffn-hidden-size", type=int, default=0, help="MLP inner width; 0: 4 * hidden size.")
    g.add_argument("--num-attention-heads", type=int, help="Attention heads (required).")
    g.add_argument("--seq-length", type=int, help="Tokens per sample (required).")
    g.add_argument("--max-position-embeddings", type=int,
                   help="Position table size; default: --seq-length.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"],
                   help="A learned position table, or rope: a rotary embedding over whole heads "
                        "(base --rope-theta, adjacent pairs of dimensions rotated; "
                        "--use-rotary-position-embeddings rotates each head's halves).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="LayerNorm epsilon.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    add_architecture_args(g)


def add_architecture_args(g) -> None:
    """Today's MoE architectures (Mixtral, Qwen-MoE, DeepSeek style), by upstream's flags."""
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLPs and experts: SiLU of a gate projection times an up "
                        "projection (dense_h_to_4h holds both, gate first).")
    g.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm",
                   help="Every norm a LayerNorm or an RMSNorm (weight only).")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="No biases in the linear layers (attention, MLPs, experts).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="An output layer of its own instead of the word embedding.")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="Key and value heads (grouped-query attention; must divide "
                        "--num-attention-heads); default: one per attention head.")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Upstream's rotary embedding (each head's two halves rotated, as "
                        "Hugging Face's; no position table): --position-embedding-type rope "
                        "with that layout.")
    g.add_argument("--rope-theta", type=float, default=10000.0,
                   help="The rotary embedding's base.")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """The ``mixture of experts`` group: experts, their parallelism, gating and schedule."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, nargs="+", default=1, action=NumExpertsAction,
                   help="Experts per MoE layer; 1: dense model. One count only: PR-MoE's "
                        "per-layer list is refused.")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1,
                   help="Ranks the experts of a layer are spread over; must divide --num-experts "
                        "and the world size.")
    g.add_argument("--expert-interval", type=int, default=2, help="Every N-th layer is an MoE layer.")
    g.add_argument("--topk", type=int, default=1, choices=[1, 2], help="Experts per token.")
    g.add_argument("--moe-loss-coeff", type=float, default=0.01,
                   help="Weight of the load-balancing loss added to the LM loss.")
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0, help="Capacity factor in training.")
    g.add_argument("--moe-eval-capacity-factor", type=float, default=1.0, help="Capacity factor in evaluation.")
    g.add_argument("--moe-min-capacity", type=int, default=4, help="Minimum expert capacity in tokens.")
    g.add_argument("--disable-moe-token-dropping", action="store_true",
                   help="Never drop tokens over an expert's capacity.")
    g.add_argument("--disable-moe-top2-2nd-expert-sampling", dest="moe_top2_2nd_expert_sampling",
                   action="store_false",
                   help="Top-2: each token's second expert is the second-largest gate (as "
                        "Mixtral's router), not drawn with Gumbel noise (DeepSpeed's default).")
    g.add_argument("--moe-schedule", default="deepspeed",
                   choices=["deepspeed", "parm-s1", "parm-s2", "auto"],
                   help="How MoE layers with experts split over the tensor-parallel ranks "
                        "dispatch and combine tokens: DeepSpeed's own, Parm's S1 or S2, or auto "
                        "(per layer, by an alpha-beta cost model of the layer's groups, measured "
                        "at start; docs/moe-schedules.md).")
    g.add_argument("--moe-schedule-costs", default=None, metavar="FILE",
                   help="With --moe-schedule auto: the groups' alpha/beta from this JSON file "
                        "({ep, tp, combined: {alpha, beta}}) instead of measuring them.")


def fill_position_embeddings(args: argparse.Namespace) -> None:
    """``--max-position-embeddings`` defaults to ``--seq-length``;
    ``--use-rotary-position-embeddings`` means ``--position-embedding-type rope``."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if getattr(args, "use_rotary_position_embeddings", False):
        args.position_embedding_type = "rope"


def check_model(args: argparse.Namespace) -> None:
    """The sizes against each other: the sequence fits the position table, the heads
    split the width, the expert-parallel ranks split the experts."""
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
                          f"({args.max_position_embeddings})")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size ({args.hidden_size}) must be divisible by "
                          f"--num-attention-heads ({args.num_attention_heads})")
    ep = args.moe_expert_parallel_size
    if args.num_experts % ep:
        raise ConfigError(f"--num-experts ({args.num_experts}) must be divisible by "
                          f"--moe-expert-parallel-size ({ep})")
    kv = getattr(args, "num_key_value_heads", None)
    if kv is not None and (kv < 1 or args.num_attention_heads % kv):
        raise ConfigError(f"--num-key-value-heads ({kv}) must divide --num-attention-heads "
                          f"({args.num_attention_heads})")
    if args.position_embedding_type == "rope" and (args.hidden_size // args.num_attention_heads) % 2:
        raise ConfigError(f"a rotary embedding needs an even head size; --hidden-size "
                          f"{args.hidden_size} / --num-attention-heads {args.num_attention_heads} "
                          f"is odd")


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """The tensor-parallel ranks split the heads and the MLP's inner width."""
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if tp > 1:
        for flag, value in (("--num-attention-heads", args.num_attention_heads),
                            ("--num-key-value-heads", getattr(args, "num_key_value_heads", None)
                             or args.num_attention_heads),
                            ("--ffn-hidden-size", args.ffn_hidden_size or 4 * args.hidden_size)):
            if value % tp:
                raise ConfigError(f"{flag} ({value}) must be divisible by "
                                  f"--tensor-model-parallel-size ({tp})")


def check_moe_layers(args: argparse.Namespace) -> None:
    """A model with experts has an MoE layer, and routes each token to at most all of them."""
    if args.num_experts > 1 and args.expert_interval > args.num_layers:
        raise ConfigError(f"--expert-interval ({args.expert_interval}) exceeds --num-layers "
                          f"({args.num_layers}): the model would have no MoE layer")
    if args.num_experts > 1 and args.topk > args.num_experts:
        raise ConfigError(f"--topk ({args.topk}) exceeds --num-experts ({args.num_experts})")


def check_moe_schedule(args: argparse.Namespace) -> None:
    """A Parm schedule rearranges the collectives of experts split over the
    tensor-parallel ranks: refuse it where there are none (``auto`` falls back to
    DeepSpeed's, with a log line)."""
    schedule = getattr(args, "moe_schedule", "deepspeed")
    if schedule in ("parm-s1", "parm-s2") and (
            getattr(args, "tensor_model_parallel_size", 1) == 1
            or not getattr(args, "enable_expert_tensor_parallelism", False) or args.num_experts <= 1):
        raise ConfigError(f"--moe-schedule {schedule} needs MoE layers (--num-experts > 1) with "
                          "experts split over the tensor-parallel ranks "
                          "(--tensor-model-parallel-size > 1 --enable-expert-tensor-parallelism)")
    if getattr(args, "moe_schedule_costs", None) and schedule != "auto":
        raise ConfigError("--moe-schedule-costs is read by --moe-schedule auto only")


def check_dropout(args: argparse.Namespace) -> None:
    """Dropout probabilities are in [0, 1)."""
    for flag, dropout in (("--hidden-dropout", args.hidden_dropout),
                          ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {dropout}")
