"""MoC's Mixtral-shaped GPT-MoE as a Hugging Face ``transformers`` Mixtral: the
configuration and the name of every tensor. Pure (no ``transformers`` import: the files
are plain JSON and safetensors).

The model is Mixtral's when every layer is an MoE layer of SwiGLU experts with a top-2
router (Mixtral renormalises the chosen experts' gate values; DeepSpeed's top-2 gate
does the same), RMSNorm, no biases, and upstream's rotary embedding (each head's halves
rotated, as Hugging Face's ``rotate_half``); the output layer may be untied or tied.

| MoC | Hugging Face (Mixtral) |
|---|---|
| ``word_embeddings.weight`` | ``model.embed_tokens.weight`` |
| ``layers.N.input_layernorm.weight`` | ``model.layers.N.input_layernorm.weight`` |
| ``layers.N.self_attention.query_key_value.weight`` | ``model.layers.N.self_attn.{q,k,v}_proj.weight`` (rows split) |
| ``layers.N.self_attention.dense.weight`` | ``model.layers.N.self_attn.o_proj.weight`` |
| ``layers.N.post_attention_layernorm.weight`` | ``model.layers.N.post_attention_layernorm.weight`` |
| ``layers.N.mlp.deepspeed_moe.gate.wg.weight`` | ``model.layers.N.block_sparse_moe.gate.weight`` |
| ``...deepspeed_experts.E.dense_h_to_4h.weight`` (gate rows, then up rows) | ``...block_sparse_moe.experts.E.w1.weight``, ``...w3.weight`` |
| ``...deepspeed_experts.E.dense_4h_to_h.weight`` | ``...block_sparse_moe.experts.E.w2.weight`` |
| ``final_layernorm.weight`` | ``model.norm.weight`` |
| ``output_layer.weight`` (or the word embedding, tied) | ``lm_head.weight`` |
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

import torch

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(dense_h_to_4h|dense_4h_to_h)\.weight$")
_PLAIN = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "post_attention_layernorm.weight",
          "self_attention.dense.weight": "self_attn.o_proj.weight",
          "mlp.deepspeed_moe.gate.wg.weight": "block_sparse_moe.gate.weight"}


@dataclass(frozen=True)
class MixtralShape:
    """What the export needs of the model (from the checkpoint's trainer arguments)."""

    num_layers: int
    """Layers (each an MoE layer)."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """An expert's inner width."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key and value heads."""
    num_experts: int
    """Experts per layer."""
    topk: int
    """Experts per token."""
    padded_vocab_size: int
    """Rows of the embedding and the output layer."""
    max_position_embeddings: int
    """Longest sequence."""
    rope_theta: float
    """The rotary embedding's base."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    tied: bool
    """The output layer is the word embedding."""
    aux_loss_coeff: float
    """The router's load-balancing loss weight."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "MixtralShape":
        """From MoC's trainer arguments (a checkpoint's ``client_state.args``).

        Raises:
            ValueError: naming each flag that makes the model not Mixtral's.
        """
        wrong = []
        for flag, ok in (("--swiglu", args.get("swiglu")),
                         ("--normalization rmsnorm", args.get("normalization") == "rmsnorm"),
                         ("--disable-bias-linear", args.get("add_bias_linear") is False),
                         ("--use-rotary-position-embeddings",
                          args.get("use_rotary_position_embeddings")),
                         ("--expert-interval 1", int(args.get("expert_interval", 2)) == 1),
                         ("--topk 2", int(args.get("topk", 1)) == 2),
                         ("--num-experts > 1", int(args.get("num_experts", 1)) > 1)):
            if not ok:
                wrong.append(flag)
        if wrong:
            raise ValueError(f"not a Mixtral-shaped model: it was trained without "
                             f"{', '.join(wrong)} (Hugging Face's Mixtral has every one)")
        hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
        return cls(num_layers=int(args["num_layers"]), hidden_size=hidden,
                   ffn_hidden_size=int(args.get("ffn_hidden_size") or 4 * hidden),
                   num_attention_heads=heads,
                   num_key_value_heads=int(args.get("num_key_value_heads") or heads),
                   num_experts=int(args["num_experts"]), topk=int(args["topk"]),
                   padded_vocab_size=int(args["padded_vocab_size"]),
                   max_position_embeddings=int(args.get("max_position_embeddings")
                                               or args["seq_length"]),
                   rope_theta=float(args.get("rope_theta", 10000.0)),
                   rms_norm_eps=float(args.get("layernorm_epsilon", 1e-5)),
                   tied=not args.get("untie_embeddings_and_output_weights", False),
                   aux_loss_coeff=float(args.get("moe_loss_coeff", 0.01)))

    def config_json(self, dtype: str) -> Dict[str, Any]:
        """``config.json`` of the ``transformers`` model."""
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "vocab_size": self.padded_vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.ffn_hidden_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "sliding_window": None, "attention_dropout": 0.0,
                "num_local_experts": self.num_experts, "num_experts_per_tok": self.topk,
                "router_aux_loss_coef": self.aux_loss_coeff, "router_jitter_noise": 0.0,
                "output_router_logits": False, "tie_word_embeddings": self.tied,
                "use_cache": True, "torch_dtype": dtype}


def hf_tensors(name: str, tensor: torch.Tensor, shape: MixtralShape) -> List[Tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of MoC's tensor ``name`` (whole, fp32): one, or a fused
    one's parts.

    Raises:
        ValueError: a tensor Mixtral has no place for (a bias, a position table, ...).
    """
    if name == "word_embeddings.weight":
        out = [("model.embed_tokens.weight", tensor)]
        return out + ([("lm_head.weight", tensor)] if shape.tied else [])
    if name == "output_layer.weight":
        return [("lm_head.weight", tensor)]
    if name == "final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _LAYER.match(name)
    if match is not None:
        layer, rest = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _PLAIN:
            return [(prefix + _PLAIN[rest], tensor)]
        if rest == "self_attention.query_key_value.weight":
            return [(prefix + f"self_attn.{p}_proj.weight", t)
                    for p, t in zip("qkv", split_qkv(tensor, shape))]
        expert = _EXPERT.match(rest)
        if expert is not None:
            base = f"{prefix}block_sparse_moe.experts.{expert.group(1)}."
            if expert.group(2) == "dense_4h_to_h":
                return [(base + "w2.weight", tensor)]
            gate, up = tensor.chunk(2, dim=0)
            return [(base + "w1.weight", gate.contiguous()), (base + "w3.weight", up.contiguous())]
    raise ValueError(f"tensor {name!r} has no place in Hugging Face's Mixtral")


def split_qkv(tensor: torch.Tensor, shape: MixtralShape) -> Tuple[torch.Tensor, ...]:
    """MoC's fused QKV rows as Mixtral's ``q_proj``, ``k_proj`` and ``v_proj`` weights:
    ``[3, heads, d]`` rows when every head has its own keys, else ``[kv, heads / kv + 2,
    d]`` groups (query head ``h`` in group ``h // (heads / kv)``, as Hugging Face's
    ``repeat_kv`` pairs them)."""
    heads, kv, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    cols = tensor.shape[1]
    if kv == heads:
        q, k, v = tensor.view(3, heads * d, cols).unbind(0)
        return q.contiguous(), k.contiguous(), v.contiguous()
    per = heads // kv
    groups = tensor.view(kv, per + 2, d, cols)
    q = groups[:, :per].reshape(heads * d, cols)
    k = groups[:, per].reshape(kv * d, cols)
    v = groups[:, per + 1].reshape(kv * d, cols)
    return q.contiguous(), k.contiguous(), v.contiguous()
