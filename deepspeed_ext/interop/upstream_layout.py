"""Where each parameter of a Megatron-DeepSpeed GPT-MoE goes in upstream's files: its
model's parameter order, the four optimizer groups DeepSpeed forms, and the ZeRO-1/2
partition of each group over the data-parallel ranks. Pure.

Upstream's ``named_parameters`` order: the word and position embeddings, then per layer
``input_layernorm``, ``self_attention.query_key_value``, ``self_attention.dense``,
``post_attention_layernorm`` and the MLP (a dense layer's two linears, or an MoE layer's
gate followed by its local experts' linears), weight before bias (no bias with
``--disable-bias-linear``, an RMSNorm without one); the final norm, then an untied output
layer, last. Megatron puts every parameter that is a bias or one-dimensional in the group
without weight decay; DeepSpeed moves the experts' parameters of each group into a group
of their own (``ep_size_E``, ``moe``) after the dense ones.

ZeRO stage 1/2 flattens each group in that order, pads the whole to a multiple of
twice the partition count (DeepSpeed's start alignment of 2 elements per partition),
and gives each rank an equal, contiguous partition; the padding is at the end of the
last one. Dense groups are partitioned over all data-parallel ranks, expert groups
over the ranks sharing an expert-parallel rank (``rank % ep_size``).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from deepspeed_ext.interop.upstream_model import UpstreamModel

ALIGNMENT = 2
"""Elements of start alignment per partition (DeepSpeed's ``nccl_start_alignment_factor``)."""


@dataclass(frozen=True)
class UpstreamParam:
    """One parameter as upstream's model on one expert-parallel rank holds it."""

    name: str
    """Upstream's name, with the *local* expert index for an expert's parameter."""
    shape: Tuple[int, ...]
    """Its shape."""
    group: int
    """Optimizer group: 0 dense with weight decay, 1 dense without, 2 and 3 the experts'."""
    expert: int = -1
    """The local expert index (-1: not an expert's)."""


@dataclass
class GroupSlices:
    """One rank's partition of one optimizer group."""

    numel: int
    """Elements of the partition (padding included)."""
    padding: int
    """Padding elements at its end."""
    slices: List[Tuple[str, int, int, int]] = field(default_factory=list)
    """``(name, start in the partition, numel, offset in the flattened parameter)``."""


def _norm(name: str, h: int, model: UpstreamModel) -> List[Tuple[str, Tuple[int, ...], int]]:
    """A norm's parameters: a LayerNorm's weight and bias, an RMSNorm's weight."""
    out = [(f"{name}.weight", (h,), -1)]
    return out + ([] if model.normalization == "rmsnorm" else [(f"{name}.bias", (h,), -1)])


def _linear(name: str, rows: int, cols: int, model: UpstreamModel, expert: int = -1):
    out = [(f"{name}.weight", (rows, cols), expert)]
    return out + ([(f"{name}.bias", (rows,), expert)] if model.add_bias_linear else [])


def _layer_params(model: UpstreamModel, layer: int) -> List[Tuple[str, Tuple[int, ...], int]]:
    h, f, prefix = model.hidden_size, model.ffn_hidden_size, f"language_model.encoder.layers.{layer}."
    qkv = (model.num_attention_heads + 2 * model.kv_heads) * (h // model.num_attention_heads)
    up = 2 * f if model.swiglu else f
    out = (_norm("input_layernorm", h, model)
           + _linear("self_attention.query_key_value", qkv, h, model)
           + _linear("self_attention.dense", h, h, model)
           + _norm("post_attention_layernorm", h, model))
    if layer in model.moe_layers:
        out.append(("mlp.deepspeed_moe.gate.wg.weight", (model.num_experts, h), -1))
        for local in range(model.local_experts):
            base = f"mlp.deepspeed_moe.experts.deepspeed_experts.{local}."
            out += (_linear(base + "dense_h_to_4h", up, h, model, local)
                    + _linear(base + "dense_4h_to_h", h, f, model, local))
    else:
        out += _linear("mlp.dense_h_to_4h", up, h, model) + _linear("mlp.dense_4h_to_h", h, f, model)
    return [(prefix + n, s, e) for n, s, e in out]


def upstream_params(model: UpstreamModel) -> List[UpstreamParam]:
    """Every parameter of one expert-parallel rank's model, in upstream's order."""
    h = model.hidden_size
    raw = [("language_model.embedding.word_embeddings.weight", (model.padded_vocab_size, h), -1)]
    if not model.rotary:
        raw.append(("language_model.embedding.position_embeddings.weight",
                    (model.max_position_embeddings, h), -1))
    for layer in range(model.num_layers):
        raw += _layer_params(model, layer)
    raw += [("language_model.encoder." + n, s, e) for n, s, e in _norm("final_layernorm", h, model)]
    if model.untie:
        raw.append(("language_model.output_layer.weight", (model.padded_vocab_size, h), -1))
    out = []
    for name, shape, expert in raw:
        no_wd = name.endswith(".bias") or len(shape) == 1
        out.append(UpstreamParam(name, tuple(shape), (2 if expert >= 0 else 0) + int(no_wd),
                                 expert))
    return out


def expected_shapes(model: UpstreamModel) -> Dict[str, Tuple[int, ...]]:
    """Upstream name (experts by global id) -> shape of every parameter of the whole model."""
    out = {p.name: p.shape for p in upstream_params(model) if p.expert < 0}
    local = [p for p in upstream_params(model) if p.expert == 0]
    for layer in model.moe_layers:
        for expert in range(model.num_experts):
            for p in local:
                head = f"language_model.encoder.layers.{layer}."
                if p.name.startswith(head):
                    name = p.name.replace(".deepspeed_experts.0.", f".deepspeed_experts.{expert}.")
                    out[name] = p.shape
    return out


def partition_group(params: List[UpstreamParam], partitions: int) -> List[GroupSlices]:
    """ZeRO's equal partitions of one group flattened in order, over ``partitions``
    ranks (see the module docstring)."""
    total = sum(_numel(p.shape) for p in params)
    multiple = ALIGNMENT * partitions
    padded = -(-total // multiple) * multiple
    size = padded // partitions
    out = [GroupSlices(numel=size, padding=0) for _ in range(partitions)]
    out[-1].padding = padded - total
    position = 0
    for p in params:
        numel, done = _numel(p.shape), 0
        while done < numel:
            part, start = divmod(position, size)
            take = min(numel - done, size - start)
            out[part].slices.append((p.name, start, take, done))
            done += take
            position += take
    return out


def rank_partitions(model: UpstreamModel) -> Dict[int, Dict[int, GroupSlices]]:
    """Data-parallel rank -> optimizer group -> that rank's partition."""
    params = upstream_params(model)
    world, ep = model.dp_world_size, model.ep_size
    out: Dict[int, Dict[int, GroupSlices]] = {r: {} for r in range(world)}
    for group in range(4):
        members = [p for p in params if p.group == group]
        if group < 2:
            for rank, part in enumerate(partition_group(members, world)):
                out[rank][group] = part
            continue
        ranks_of = {e: [r for r in range(world) if r % ep == e] for e in range(ep)}
        for ranks in ranks_of.values():
            for rank, part in zip(ranks, partition_group(members, len(ranks))):
                out[rank][group] = part
    return out


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
