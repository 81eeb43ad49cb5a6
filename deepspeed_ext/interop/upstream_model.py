"""The shape and layout of a Megatron-DeepSpeed run, from the ``args`` its checkpoint
stores, and what MoC cannot train of it yet. Pure."""

import argparse
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

REFUSED = (
    # (upstream argument, value MoC needs, the flag to name)
    ("apply_residual_connection_post_layernorm", False,
     "--apply-residual-connection-post-layernorm"),
    ("mlp_type", "standard", "--mlp-type"),
    ("enable_expert_tensor_parallelism", False, "--enable-expert-tensor-parallelism"),
    ("tensor_model_parallel_size", 1, "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", 1, "--pipeline-model-parallel-size"),
)
"""Upstream settings the import refuses until MoC's model has them (issue 38's
architectures); a missing argument counts as the needed value."""


@dataclass(frozen=True)
class AdamSettings:
    """The optimizer settings a checkpoint's files record (upstream's ZeRO files, DeepSpeed
    config)."""

    betas: Tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """Weight decay of the decaying groups."""
    clip_grad: float = 1.0
    """Gradient clipping norm (0: none)."""

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "AdamSettings":
        """From stored arguments (upstream's Namespace as a dict, or MoC's trainer's)."""
        return cls(betas=(float(values.get("adam_beta1", 0.9)),
                          float(values.get("adam_beta2", 0.999))),
                   eps=float(values.get("adam_eps", 1e-8)),
                   weight_decay=float(values.get("weight_decay", 0.0)),
                   clip_grad=float(values.get("clip_grad", 1.0) or 0.0))


@dataclass
class UpstreamModel:
    """What an import needs to know of upstream's model and run."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP (and expert) inner width."""
    num_attention_heads: int
    """Attention heads (the fused QKV's row groups)."""
    seq_length: int
    """Training sequence length."""
    max_position_embeddings: int
    """Rows of the learned position embedding."""
    padded_vocab_size: int
    """Rows of the word embedding."""
    true_vocab_size: int
    """Tokens of the tokenizer (the rest of the rows are padding)."""
    make_vocab_size_divisible_by: int
    """Upstream's padding multiple."""
    num_experts: int
    """Experts per MoE layer."""
    expert_interval: int
    """Every how many layers an MoE layer comes."""
    topk: int
    """Experts per token."""
    ep_size: int
    """Expert-parallel size of the saving run."""
    dp_world_size: int
    """Data-parallel ranks of the saving run (its ZeRO files)."""
    global_batch_size: int
    """Samples per iteration (upstream's scheduler counts samples)."""
    micro_batch_size: int
    """Samples per rank and micro-step."""
    tokenizer_type: str
    """Upstream's tokenizer."""
    swiglu: bool = False
    """SwiGLU MLPs and experts (``dense_h_to_4h``: gate rows, then up rows)."""
    normalization: str = "layernorm"
    """``layernorm`` or ``rmsnorm`` (weight only)."""
    add_bias_linear: bool = True
    """Biases in the linear layers."""
    untie: bool = False
    """An output layer of its own (``output_layer.weight``)."""
    num_key_value_heads: int = 0
    """Key-value heads (0: one per head); fewer: the QKV rows are grouped per key-value head."""
    rotary: bool = False
    """Upstream's rotary embedding (halves rotated) instead of a learned position table."""
    rope_theta: float = 10000.0
    """The rotary embedding's base."""
    layernorm_epsilon: float = 1e-5
    """The norms' epsilon."""

    @property
    def kv_heads(self) -> int:
        """Key-value heads (the head count without grouped-query attention)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def grouped(self) -> bool:
        """Grouped-query attention: QKV rows already in MoC's (and upstream's) grouped order."""
        return self.kv_heads < self.num_attention_heads

    @property
    def moe_layers(self) -> List[int]:
        """0-based MoE layers (layers 1, 3, ... for interval 2), as MoC places them."""
        return [i for i in range(self.num_layers) if (i + 1) % self.expert_interval == 0]

    @property
    def local_experts(self) -> int:
        """Experts per MoE layer on one expert-parallel rank."""
        return self.num_experts // self.ep_size

    @classmethod
    def from_args(cls, args: Any, info: Optional[Mapping] = None) -> "UpstreamModel":
        """From upstream's stored ``args`` (a Namespace) and ``universal_checkpoint_info``.

        Raises:
            ValueError: no arguments, an architecture MoC cannot train yet (naming
                upstream's flag), per-layer expert counts that differ (PR-MoE), or an
                expert count the expert-parallel size does not divide.
        """
        if not isinstance(args, argparse.Namespace):
            raise ValueError("the model file stores no argument Namespace ('args'): not "
                             "written by Megatron-DeepSpeed's pretrain_gpt.py")
        values = vars(args)
        _refuse(values)
        experts = values.get("num_experts") or [1]
        experts = list(experts) if isinstance(experts, (list, tuple)) else [experts]
        if len(set(experts)) != 1 or experts[0] < 2:
            raise ValueError(f"--num-experts {' '.join(map(str, experts))}: MoC imports one "
                             f"expert count (of at least 2) for every MoE layer")
        info = info or {}
        model = cls(
            num_layers=int(values["num_layers"]), hidden_size=int(values["hidden_size"]),
            ffn_hidden_size=int(values.get("ffn_hidden_size") or 4 * values["hidden_size"]),
            num_attention_heads=int(values["num_attention_heads"]),
            seq_length=int(values["seq_length"]),
            max_position_embeddings=int(values["max_position_embeddings"]),
            padded_vocab_size=int(values["padded_vocab_size"]),
            true_vocab_size=int(info.get("original_vocab_size") or values["padded_vocab_size"]),
            make_vocab_size_divisible_by=int(values.get("make_vocab_size_divisible_by", 128)),
            num_experts=int(experts[0]), expert_interval=int(values.get("expert_interval", 2)),
            topk=int(values.get("topk", 1)),
            ep_size=int(values.get("moe_expert_parallel_size") or 1),
            dp_world_size=int(values.get("data_parallel_size") or values.get("world_size") or 1),
            global_batch_size=int(values["global_batch_size"]),
            micro_batch_size=int(values["micro_batch_size"]),
            tokenizer_type=str(values.get("tokenizer_type")), **_architecture(values))
        if model.num_experts % model.ep_size or model.dp_world_size % model.ep_size:
            raise ValueError(f"--moe-expert-parallel-size {model.ep_size} divides neither "
                             f"{model.num_experts} experts nor {model.dp_world_size} ranks")
        return model

    @classmethod
    def from_moc_args(cls, args: Mapping[str, Any], ep_size: int,
                      dp_world_size: int) -> "UpstreamModel":
        """From the arguments MoC's trainer records in its checkpoints (a dict), for an
        upstream run of ``dp_world_size`` ranks and expert-parallel size ``ep_size``.

        Raises:
            ValueError: a model upstream's GPT does not have (rotary embeddings in MoC's
                layout), no experts, or a layout the experts do not fit.
        """
        if args.get("position_embedding_type", "learned_absolute") != "learned_absolute" \
                and not args.get("use_rotary_position_embeddings"):
            raise ValueError(f"--position-embedding-type {args['position_embedding_type']}: "
                             f"this rotary embedding (adjacent pairs rotated) is not "
                             f"Megatron-DeepSpeed's (--use-rotary-position-embeddings rotates "
                             f"halves); it is not exported")
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                               "padded_vocab_size", "num_experts", "global_batch_size")
                   if args.get(k) is None]
        if missing:
            raise ValueError(f"the checkpoint's arguments lack {', '.join(missing)}")
        hidden = int(args["hidden_size"])
        model = cls(
            num_layers=int(args["num_layers"]), hidden_size=hidden,
            ffn_hidden_size=int(args.get("ffn_hidden_size") or 4 * hidden),
            num_attention_heads=int(args["num_attention_heads"]),
            seq_length=int(args["seq_length"]),
            max_position_embeddings=int(args.get("max_position_embeddings") or args["seq_length"]),
            padded_vocab_size=int(args["padded_vocab_size"]),
            true_vocab_size=int(args.get("true_vocab_size") or args["padded_vocab_size"]),
            make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by", 128)),
            num_experts=int(args["num_experts"]), expert_interval=int(args.get("expert_interval", 2)),
            topk=int(args.get("topk", 1)), ep_size=ep_size, dp_world_size=dp_world_size,
            global_batch_size=int(args["global_batch_size"]),
            micro_batch_size=int(args.get("micro_batch_size") or 1),
            tokenizer_type=str(args.get("tokenizer_type")),
            swiglu=bool(args.get("swiglu", False)),
            normalization=str(args.get("normalization", "layernorm")),
            add_bias_linear=bool(args.get("add_bias_linear", True)),
            untie=bool(args.get("untie_embeddings_and_output_weights", False)),
            num_key_value_heads=int(args.get("num_key_value_heads") or 0),
            rotary=bool(args.get("use_rotary_position_embeddings", False)),
            rope_theta=float(args.get("rope_theta", 10000.0)),
            layernorm_epsilon=float(args.get("layernorm_epsilon", 1e-5)))
        if model.num_experts < 2:
            raise ValueError("the checkpoint's model has no experts (--num-experts 1)")
        if model.num_experts % ep_size or dp_world_size % ep_size:
            raise ValueError(f"expert-parallel size {ep_size} divides neither "
                             f"{model.num_experts} experts nor {dp_world_size} ranks")
        return model

    def check_moe_layers(self, gate_layers: List[int]) -> None:
        """Raise ValueError unless the layers with a gate are MoC's MoE layers."""
        if gate_layers != self.moe_layers:
            raise ValueError(f"the checkpoint's MoE layers are {gate_layers}; MoC places them "
                             f"at {self.moe_layers} for --expert-interval "
                             f"{self.expert_interval} and {self.num_layers} layers")

    def moc_args(self) -> Dict[str, Any]:
        """The arguments a MoC checkpoint records (what the trainer checks against its
        flags on ``--load``), under Megatron's names."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "seq_length": self.seq_length,
                "max_position_embeddings": self.max_position_embeddings,
                "position_embedding_type": "rope" if self.rotary else "learned_absolute",
                "padded_vocab_size": self.padded_vocab_size,
                "true_vocab_size": self.true_vocab_size,
                "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by,
                "num_experts": self.num_experts, "expert_interval": self.expert_interval,
                "topk": self.topk, "moe_expert_parallel_size": self.ep_size,
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "tokenizer_type": self.tokenizer_type, "imported_from": "megatron-deepspeed",
                "swiglu": self.swiglu, "normalization": self.normalization,
                "add_bias_linear": self.add_bias_linear,
                "untie_embeddings_and_output_weights": self.untie,
                "num_key_value_heads": self.num_key_value_heads or None,
                "use_rotary_position_embeddings": self.rotary, "rope_theta": self.rope_theta,
                "layernorm_epsilon": self.layernorm_epsilon}


def _refuse(values: Mapping[str, Any]) -> None:
    for name, needed, flag in REFUSED:
        value = values.get(name, needed)
        if value != needed:
            raise ValueError(f"the checkpoint was trained with {flag} ({name} = {value!r}); "
                             f"MoC's GPT-MoE cannot train it yet, so it is not imported")
    rotary = bool(values.get("use_rotary_position_embeddings", False))
    learned = bool(values.get("add_position_embedding", not rotary))
    if rotary == learned:
        raise ValueError("the checkpoint was trained with " + (
            "both a learned position table and --use-rotary-position-embeddings"
            if rotary else "no position embedding at all (--no-position-embedding)")
            + "; MoC's GPT-MoE has one or the other")
    if float(values.get("rotary_percent", 1.0) or 1.0) != 1.0:
        raise ValueError(f"the checkpoint was trained with --rotary-percent "
                         f"{values['rotary_percent']}; MoC rotates whole heads")


def _architecture(values: Mapping[str, Any]) -> Dict[str, Any]:
    """The architecture fields of :meth:`UpstreamModel.from_args`."""
    heads = int(values["num_attention_heads"])
    kv = int(values.get("num_key_value_heads") or heads)
    if heads % kv:
        raise ValueError(f"--num-key-value-heads {kv} does not divide {heads} heads")
    return {"swiglu": bool(values.get("swiglu", False)),
            "normalization": str(values.get("normalization") or "layernorm"),
            "add_bias_linear": bool(values.get("add_bias_linear", True)),
            "untie": bool(values.get("untie_embeddings_and_output_weights", False)),
            "num_key_value_heads": kv if kv != heads else 0,
            "rotary": bool(values.get("use_rotary_position_embeddings", False)),
            "rope_theta": float(values.get("rope_theta", 10000.0) or 10000.0),
            "layernorm_epsilon": float(values.get("layernorm_epsilon", 1e-5))}


SAMPLE_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
"""Upstream's scheduler fields counted in samples (it steps by the global batch size);
MoC's trainer counts them in iterations."""
KEPT = ("max_lr", "min_lr", "lr_decay_style", "start_wd", "end_wd", "wd_incr_style")


def scheduler_in_iterations(saved: Mapping[str, Any], global_batch_size: int) -> Dict[str, Any]:
    """Upstream's LR scheduler state in the form MoC's trainer loads: the sample counts
    divided by the global batch size (rounded up: a warm-up that ended mid-iteration
    upstream ends at that iteration), the token-based fields kept only for a
    token-based schedule (``lr_decay_tokens`` set).

    Raises:
        ValueError: a field MoC's scheduler needs is missing (named).
    """
    missing = [k for k in SAMPLE_COUNTS + KEPT if k not in saved]
    if missing:
        raise ValueError(f"the checkpoint's lr_scheduler lacks {', '.join(missing)}")
    out = {k: saved[k] for k in KEPT}
    for key in SAMPLE_COUNTS:
        value = int(saved[key] or 0)
        out[key] = -(-value // global_batch_size)
    if saved.get("lr_decay_tokens") is not None:
        for key in ("num_tokens", "lr_warmup_tokens", "lr_decay_tokens"):
            if saved.get(key) is not None:
                out[key] = int(saved[key])
    return out


def scheduler_in_samples(saved: Mapping[str, Any], global_batch_size: int,
                         tokens: int) -> Dict[str, Any]:
    """The inverse of :func:`scheduler_in_iterations`: MoC's trainer's scheduler state
    (steps in iterations) as upstream's (steps in samples); ``tokens`` stands for
    ``num_tokens`` when the schedule counts none (an iteration-based one).

    Raises:
        ValueError: a field upstream's scheduler needs is missing (named).
    """
    missing = [k for k in SAMPLE_COUNTS + KEPT if k not in saved]
    if missing:
        raise ValueError(f"the checkpoint's opt_param_scheduler lacks {', '.join(missing)}")
    out: Dict[str, Any] = {k: saved[k] for k in KEPT}
    for key in SAMPLE_COUNTS:
        out[key] = int(saved[key] or 0) * global_batch_size
    for key in ("lr_warmup_tokens", "lr_decay_tokens"):
        out[key] = int(saved[key]) if saved.get(key) is not None else None
    out["num_tokens"] = int(saved["num_tokens"]) if saved.get("num_tokens") is not None else tokens
    return out
