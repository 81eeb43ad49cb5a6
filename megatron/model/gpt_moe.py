"""GPT decoder whose MLP is a ``deepspeed.moe.layer.MoE`` every ``expert_interval`` layers.

The model is built identically on every rank except for the experts: each
expert-parallel rank holds ``num_experts / ep_size`` experts of every MoE layer.
Weights are initialised per tensor from a seed derived from the tensor's *global*
name (experts named by their global index), so the same seed gives the same model
under every expert-parallel layout.
"""

import math
import zlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megatron.model import tensor_parallel as tp
from megatron.model.config import GPTMoEConfig
from megatron.model.moe_capacity import pad_capacity

EXPERTS_KEY = "deepspeed_moe.experts.deepspeed_experts."


def layer_norm(config: GPTMoEConfig) -> nn.Module:
    """The config's norm: an RMSNorm (weight only) with ``--normalization rmsnorm``, else a
    LayerNorm: apex's fused kernel on CUDA when apex is installed, torch's otherwise."""
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    if torch.cuda.is_available():
        try:
            from apex.normalization import FusedLayerNorm  # optional `gpu` extra
            return FusedLayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        except ImportError:
            pass
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to queries and keys: dimension pair ``i`` turns by
    ``position / base ** (2 i / head_dim)``. ``interleaved``: the pairs are adjacent
    dimensions (``2i, 2i + 1``); else dimension ``i`` pairs with ``i + head_dim / 2``
    (upstream's and Hugging Face's layout)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0,
                 interleaved: bool = True):
        super().__init__()
        self.interleaved = interleaved
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Not parameters: recomputed from the config, so never checkpointed.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [batch, heads, seq, head_dim] by the angles of ``position_ids`` [batch, seq]."""
        cos = self.cos[position_ids].unsqueeze(1).to(x.dtype)
        sin = self.sin[position_ids].unsqueeze(1).to(x.dtype)
        if not self.interleaved:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    """Causal self-attention (fused QKV projection, SDPA kernel), multi-head or grouped-query
    (``num_key_value_heads`` below the head count: query head ``h`` attends with key-value
    head ``h // (heads / kv_heads)``)."""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        size = config.tensor_model_parallel_size
        self.num_heads = config.num_attention_heads // size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // size
        self.grouped = config.grouped_query
        self.head_dim = config.head_dim
        self.dropout = config.attention_dropout
        bias = config.add_bias_linear
        self.query_key_value = tp.linear(config.hidden_size, config.qkv_rows, size, "column", bias)
        self.dense = tp.linear(config.hidden_size, config.hidden_size, size, "row", bias)
        self.rotary = (RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                       config.rope_theta, config.rotary_interleaved)
                       if config.position_embedding_type == "rope" else None)

    def _split(self, qkv: torch.Tensor):
        """``[batch, seq, rows]`` -> q ``[batch, heads, seq, d]``, k and v ``[batch, kv, seq, d]``."""
        batch, seq, _ = qkv.shape
        if not self.grouped:
            q, k, v = qkv.view(batch, seq, 3, self.num_heads, self.head_dim).permute(
                2, 0, 3, 1, 4).unbind(0)
            return q, k, v
        per = self.num_heads // self.num_kv_heads
        groups = qkv.view(batch, seq, self.num_kv_heads, per + 2, self.head_dim)
        q = groups[:, :, :, :per].reshape(batch, seq, self.num_heads, self.head_dim)
        k, v = groups[:, :, :, per], groups[:, :, :, per + 1]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self._split(self.query_key_value(x))
        if self.rotary is not None:
            q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        if self.num_kv_heads != self.num_heads:
            per = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times the second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """The dense feed-forward block; also the module each expert is a copy of (split over
    ``tp_size`` ranks: the dense MLP's tensor-parallel size, an expert's with expert
    tensor parallelism, else 1). With SwiGLU ``dense_h_to_4h`` gives the gate's rows then
    the up projection's (each tensor-parallel rank its slice of both)."""

    def __init__(self, config: GPTMoEConfig, tp_size: int = 1):
        super().__init__()
        rows = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        bias = config.add_bias_linear
        self.activation = swiglu if config.swiglu else F.gelu
        """Between the two linears; Parm's S1 runs the expert shards with it too
        (``megatron.model.moe_schedules``)."""
        self.dense_h_to_4h = tp.linear(config.hidden_size, rows, tp_size, "column", bias)
        self.dense_4h_to_h = tp.linear(config.ffn_hidden_size, config.hidden_size, tp_size, "row", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm decoder layer; its MLP is an MoE layer when ``is_moe``."""

    def __init__(self, config: GPTMoEConfig, is_moe: bool):
        super().__init__()
        self.is_moe = is_moe
        self.input_layernorm = layer_norm(config)
        self.self_attention = CausalSelfAttention(config)
        self.post_attention_layernorm = layer_norm(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        if is_moe:
            from deepspeed.moe.layer import MoE
            self.mlp = MoE(
                hidden_size=config.hidden_size,
                expert=MLP(config, config.tensor_model_parallel_size
                           if config.enable_expert_tensor_parallelism else 1),
                num_experts=config.num_experts,
                ep_size=config.moe_expert_parallel_size,
                k=config.topk,
                capacity_factor=config.moe_train_capacity_factor,
                eval_capacity_factor=config.moe_eval_capacity_factor,
                min_capacity=config.moe_min_capacity,
                drop_tokens=config.moe_token_dropping,
                use_rts=False,  # random token selection would make the gate depend on RNG draws
                enable_expert_tensor_parallelism=config.enable_expert_tensor_parallelism,
                top2_2nd_expert_sampling=config.moe_top2_2nd_expert_sampling,
            )
            # The layer splits each expert's capacity slots over the tensor-parallel
            # ranks and stopped on a capacity T does not divide (an odd largest expert
            # count without token dropping): padded here (megatron.model.moe_capacity).
            pad_capacity(self.mlp.deepspeed_moe.gate, config.tensor_model_parallel_size)
        else:
            self.mlp = MLP(config, config.tensor_model_parallel_size)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        """Returns ``(hidden, aux_loss or None, expert_counts or None)``."""
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), position_ids))
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, aux_loss, counts = self.mlp(h)
            return x + self.hidden_dropout(out), aux_loss, counts
        return x + self.hidden_dropout(self.mlp(h)), None, None


class GPTMoEModel(nn.Module):
    """GPT language model with tied input/output embeddings and MoE MLPs.

    ``forward(tokens, position_ids, labels, loss_mask)`` returns
    ``(lm_loss, aux_loss, expert_counts)`` where ``expert_counts`` is an int64 tensor
    ``[num_moe_layers, num_experts]`` with the number of token-to-expert assignments
    the gates made on this rank's micro batch (before capacity dropping), the figure
    lost-token accounting needs. Without labels it returns the logits.
    """

    def __init__(self, config: GPTMoEConfig, ep_rank: int = 0):
        super().__init__()
        self.config = config
        self.ep_rank = ep_rank
        self.tp_rank, tp_size = tp.tp_rank_and_size() if config.tensor_model_parallel_size > 1 else (0, 1)
        if tp_size != config.tensor_model_parallel_size:
            raise ValueError(f"tensor_model_parallel_size {config.tensor_model_parallel_size}, but "
                             f"megatron-core's parallel_state has {tp_size}: initialise it first")
        if tp_size > 1 and config.num_experts > 1:
            tp.allow_flat_gathers_on_gloo()  # DeepSpeed's MoE token gathers over the TP group
        self.word_embeddings = tp.embedding(config.vocab_size, config.hidden_size, tp_size)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                    if config.position_embedding_type == "learned_absolute" else None)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        moe_layers = set(config.moe_layer_indices)
        self.layers = nn.ModuleList(TransformerLayer(config, i in moe_layers)
                                    for i in range(config.num_layers))
        self.final_layernorm = layer_norm(config)
        self.output_layer = (tp.linear(config.hidden_size, config.vocab_size, tp_size, "column",
                                       bias=False)
                             if config.untie_embeddings_and_output_weights else None)
        tp.mark_partition_views(self, tp_size, config.enable_expert_tensor_parallelism,
                                tp.Layout.of(config))
        if tp_size > 1 and not config.enable_expert_tensor_parallelism:
            tp.mark_replicated_experts(self)
        self.init_weights()

    def global_name(self, name: str) -> str:
        """The layout-independent name of parameter ``name``: local expert index -> global."""
        return expert_global_name(name, self.ep_rank, self.config.num_local_experts)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every tensor from ``seed`` and its global name (layout-independent):
        a tensor-parallel rank draws the whole tensor and keeps its slice, so every
        tensor-parallel size starts from the same model."""
        for name, param in self.named_parameters():
            init_parameter(self.config, self.global_name(name), param, self.tp_rank)


    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None):
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = self.embedding_dropout(x)
        aux_losses: List[torch.Tensor] = []
        counts: List[torch.Tensor] = []
        recompute = self.config.checkpoint_activations and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                # Keeps only the layer's input; the backward pass runs the layer again
                # with the RNG state of the first run (the same dropout masks and gate
                # noise), so the gradients are those of the plain forward. An MoE layer's
                # all-to-alls run again in the recompute, on every rank alike.
                x, aux, cnt = torch.utils.checkpoint.checkpoint(
                    layer, x, position_ids, use_reentrant=False, preserve_rng_state=True)
            else:
                x, aux, cnt = layer(x, position_ids)
            if aux is not None:
                aux_losses.append(aux)
                counts.append(cnt.to(torch.int64))
        x = self.final_layernorm(x)
        output = (self.output_layer.weight if self.output_layer is not None
                  else self.word_embeddings.weight)  # tied: the input embedding
        if self.config.tensor_model_parallel_size > 1:  # this rank's slice of the vocabulary
            logits = tp.parallel_logits(x, output)
        else:
            logits = F.linear(x, output)
        if labels is None:
            return logits
        return self._losses(logits, labels, loss_mask, aux_losses, counts)

    def _losses(self, logits, labels, loss_mask, aux_losses, counts
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.config.tensor_model_parallel_size > 1:
            losses = tp.parallel_cross_entropy(logits.float(), labels).reshape(-1)
        else:
            losses = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1),
                                     reduction="none")
        mask = (loss_mask if loss_mask is not None else torch.ones_like(labels)).reshape(-1).float()
        lm_loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
        aux = torch.stack([a.float() for a in aux_losses]).sum() if aux_losses else lm_loss.new_zeros(())
        expert_counts = (torch.stack(counts) if counts
                         else torch.zeros(0, self.config.num_experts, dtype=torch.int64,
                                          device=logits.device))
        return lm_loss, aux, expert_counts


def expert_global_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """``name`` with its local expert index (on expert-parallel rank ``ep_rank``) replaced
    by the global one; other names unchanged."""
    if EXPERTS_KEY not in name:
        return name
    head, tail = name.split(EXPERTS_KEY, 1)
    local, rest = tail.split(".", 1)
    return f"{head}{EXPERTS_KEY}{ep_rank * num_local_experts + int(local)}.{rest}"


@torch.no_grad()
def init_parameter(config: GPTMoEConfig, global_name: str, param: torch.nn.Parameter,
                   tp_rank: int = 0) -> None:
    """Initialise ``param`` from ``config.seed`` and its global name (the name it has in
    the whole :class:`GPTMoEModel`, experts by global index): every layout that names it
    alike (any expert-parallel, tensor-parallel or pipeline split) gets the same values."""
    size = config.tensor_model_parallel_size
    gen = torch.Generator().manual_seed(
        (config.seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2 ** 62))
    if param.dim() == 1:
        param.fill_(1.0 if "layernorm" in global_name and global_name.endswith("weight") else 0.0)
        return
    split = tp.split_of(global_name, tuple(param.shape), size, config.enable_expert_tensor_parallelism,
                        tp.Layout.of(config))
    out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    std = out_std if global_name.endswith(("dense.weight", "dense_4h_to_h.weight")) \
        else config.init_method_std
    full = torch.randn(split.global_shape if split else param.shape, generator=gen,
                       dtype=torch.float32) * std
    param.copy_(split.slice(full, tp_rank, size) if split else full)


def count_parameters(config: GPTMoEConfig) -> dict:
    """Global parameter counts (all experts, a tied embedding counted once) by kind."""
    h, f, bias = config.hidden_size, config.ffn_hidden_size, int(config.add_bias_linear)
    rows = 2 * f if config.swiglu else f
    mlp = h * rows + f * h + bias * (rows + h)
    qkv = config.qkv_rows
    attn = qkv * h + h * h + bias * (qkv + h)
    ln = h if config.normalization == "rmsnorm" else 2 * h
    n_moe = len(config.moe_layer_indices)
    dense_layers = config.num_layers - n_moe
    non_expert = (config.vocab_size * h * (2 if config.untie_embeddings_and_output_weights else 1)
                  + (config.max_position_embeddings * h if config.position_embedding_type == "learned_absolute" else 0)
                  + config.num_layers * (attn + 2 * ln) + dense_layers * mlp
                  + n_moe * h * config.num_experts  # gate
                  + ln)
    expert = n_moe * config.num_experts * mlp
    return {"non_expert": non_expert, "expert": expert, "total": non_expert + expert}
