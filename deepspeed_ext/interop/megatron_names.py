"""Megatron-DeepSpeed's parameter names and fused layouts against MoC's GPT-MoE's. Pure.

Upstream nests its GPT under ``language_model``; MoC's model holds the same modules at
the top (the names below without the prefix). Experts are named by their global id in
both (upstream's expert files; MoC's checkpoints).

| upstream | MoC |
|---|---|
| ``language_model.embedding.word_embeddings.weight`` | ``word_embeddings.weight`` |
| ``language_model.embedding.position_embeddings.weight`` | ``position_embeddings.weight`` |
| ``language_model.encoder.layers.N.<rest>`` | ``layers.N.<rest>`` |
| ``language_model.encoder.final_layernorm.{weight,bias}`` | ``final_layernorm.{weight,bias}`` |
| ``language_model.output_layer.weight`` (untied) | ``output_layer.weight`` |

The fused QKV projection (``self_attention.query_key_value``) differs in its row order:
upstream groups the rows per head, ``[heads, 3, head_dim]``; MoC's rows are
``[3, heads, head_dim]`` (all queries, all keys, all values). :func:`qkv_to_moc` and
:func:`qkv_to_upstream` permute the rows of a weight, bias or their optimizer moments.
"""

import re
from typing import Dict, Mapping, Optional

import torch

UPSTREAM_PREFIX = "language_model."
QKV_SUFFIXES = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias")
EXPERT_NAME = re.compile(r"^layers\.(\d+)\.mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")
STRAY_PREFIX = "encoderlayers."
"""DeepSpeed 0.19.8 also writes rank 0's experts into the dense file's ``module`` under
``encoderlayers...`` (no dot, local ids); the expert files are the truth."""

_PLAIN = {"embedding.word_embeddings.weight": "word_embeddings.weight",
          "embedding.position_embeddings.weight": "position_embeddings.weight",
          "output_layer.weight": "output_layer.weight"}


def moc_name(upstream: str) -> Optional[str]:
    """MoC's name for upstream's parameter ``upstream`` (with or without the
    ``language_model.`` prefix); None for a name MoC does not take (the stray expert copies).

    Raises:
        ValueError: a parameter MoC's model has no place for (a name of another model),
            named.
    """
    name = upstream[len(UPSTREAM_PREFIX):] if upstream.startswith(UPSTREAM_PREFIX) else upstream
    if name.startswith(STRAY_PREFIX):
        return None
    if name in _PLAIN:
        return _PLAIN[name]
    if name.startswith("encoder.layers.") or name.startswith("encoder.final_layernorm."):
        return name[len("encoder."):]
    raise ValueError(f"upstream parameter {upstream!r} has no counterpart in MoC's GPT-MoE "
                     f"(another model's module)")


def upstream_name(moc: str) -> str:
    """Upstream's full name (``language_model.``...) of MoC's parameter ``moc``."""
    for up, ours in _PLAIN.items():
        if moc == ours:
            return UPSTREAM_PREFIX + up
    return UPSTREAM_PREFIX + "encoder." + moc


def expert_of(moc: str) -> Optional[tuple]:
    """``(transformer layer, global expert)`` of an expert's parameter (MoC name), else
    None."""
    match = EXPERT_NAME.match(moc)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_qkv(moc: str) -> bool:
    """Whether ``moc`` names a fused QKV weight or bias."""
    return moc.endswith(QKV_SUFFIXES)


def qkv_to_moc(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``[heads, 3, head_dim]`` (upstream) to ``[3, heads, head_dim]`` (MoC); a new
    contiguous tensor of the same shape."""
    rows = tensor.shape[0]
    if rows % (3 * heads):
        raise ValueError(f"fused QKV with {rows} rows is not 3 x {heads} heads")
    rest = tensor.shape[1:]
    view = tensor.reshape(heads, 3, rows // (3 * heads), *rest)
    return view.transpose(0, 1).reshape(tensor.shape).contiguous()


def qkv_to_upstream(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`qkv_to_moc`."""
    rows = tensor.shape[0]
    if rows % (3 * heads):
        raise ValueError(f"fused QKV with {rows} rows is not 3 x {heads} heads")
    rest = tensor.shape[1:]
    view = tensor.reshape(3, heads, rows // (3 * heads), *rest)
    return view.transpose(0, 1).reshape(tensor.shape).contiguous()


def flatten_module(module: Mapping, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Upstream's nested ``module`` (``{"language_model": {"embedding": {...}, "encoder":
    {flat keys}}}``) as ``{dotted name: tensor}``.

    Raises:
        ValueError: a leaf that is neither a tensor nor a mapping (named).
    """
    flat: Dict[str, torch.Tensor] = {}
    for key, value in module.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, Mapping):
            flat.update(flatten_module(value, name + "."))
        else:
            raise ValueError(f"module entry {name!r} is a {type(value).__name__}, not a tensor")
    return flat
