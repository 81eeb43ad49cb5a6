"""Tensor (model) parallelism for the GPT-MoE model: which tensors are split, how, and
the layers that hold the splits.

With ``tensor_model_parallel_size`` T > 1 the attention heads, the dense MLP's inner
width and the vocabulary are split over the T ranks of a tensor-parallel group with
megatron-core's layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, vocab-parallel cross entropy); LayerNorms, position
embeddings and the row-parallel layers' biases are replicated. megatron-core's
``parallel_state`` must be initialised first (every rank, before the model is built).

Every split tensor is a slice of the tensor the same model has at T = 1
(:class:`TPSplit`): the model draws each tensor whole from its seed and name, then keeps
its rank's slice, so a T = 2 run starts from exactly the T = 1 run's weights. The same
record says where a rank's piece lies in the global tensor, which is what a checkpoint
of a tensor-parallel run has to record about each fragment.

The fused QKV projection keeps the T = 1 layout ``[3, heads, head_dim]`` of its output
rows: a rank's heads are a slice along the heads dimension of the ``[3, hidden, hidden]``
view, not a contiguous block of rows (with grouped-query attention the rows are grouped
per key-value head, and a rank's are a contiguous block of groups). With SwiGLU the
MLP's ``dense_h_to_4h`` rows are ``[2, ffn]`` (gate, up), split along ``ffn`` alike.
"""

import copy
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn


@dataclass(frozen=True)
class TPSplit:
    """How one parameter of a tensor-parallel rank is a slice of the global tensor."""

    global_shape: Tuple[int, ...]
    """The tensor's shape at T = 1 (the parameter's shape, for the whole model)."""
    view: Tuple[int, ...]
    """The shape the global tensor is viewed as before slicing (``global_shape`` unless
    the split dimension is an inner one, as for the fused QKV projection)."""
    dim: int
    """The dimension of ``view`` split evenly over the T ranks."""

    def slice(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``full`` (the global tensor) among ``size`` ranks,
        contiguous, in the parameter's local shape."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"expected the global shape {self.global_shape}, got {tuple(full.shape)}")
        piece = full.reshape(self.view).chunk(size, dim=self.dim)[rank].contiguous()
        if self.view == self.global_shape:
            return piece
        # An inner dimension of the first one (QKV): the rows of the pieces, in order.
        return piece.reshape((-1,) + self.global_shape[1:])

    def offset(self, rank: int, size: int) -> int:
        """Where rank ``rank``'s piece starts along ``dim`` of ``view``."""
        return rank * self.view[self.dim] // size


@dataclass(frozen=True)
class Layout:
    """What of the model's architecture decides how its fused tensors split."""

    swiglu: bool = False
    """``dense_h_to_4h`` holds ``[2, ffn]`` rows (gate, up): each rank a slice of both."""
    grouped_qkv: bool = False
    """The fused QKV rows are ``[kv_heads, ...]`` groups (grouped-query attention): split
    in contiguous blocks of key-value heads, not along the heads of ``[3, heads, ...]``."""

    @classmethod
    def of(cls, config) -> "Layout":
        """The layout of a :class:`~megatron.model.config.GPTMoEConfig`."""
        return cls(swiglu=bool(getattr(config, "swiglu", False)),
                   grouped_qkv=bool(getattr(config, "grouped_query", False)))


def _rows(shape: Tuple[int, ...], size: int, parts: int = 1) -> TPSplit:
    """Output rows split: contiguous blocks (``parts`` 1), or along the second dimension
    of a ``[parts, rows / parts, ...]`` view."""
    rows = shape[0] * size
    whole = (rows,) + shape[1:]
    if parts == 1:
        return TPSplit(whole, whole, 0)
    return TPSplit(whole, (parts, rows // parts) + shape[1:], 1)


def split_of(name: str, shape: Tuple[int, ...], size: int,
             expert_tp: bool = False, layout: Layout = Layout()) -> Optional[TPSplit]:
    """The split of parameter ``name`` (local ``shape``) among ``size`` tensor-parallel
    ranks, or None for a replicated one; experts' MLPs are split like the dense MLP with
    ``expert_tp`` (expert tensor parallelism), the gate never. Pure: the same answer on
    every rank."""
    if size == 1 or ("deepspeed_moe" in name and not expert_tp) or ".gate." in name:
        return None
    shape = tuple(shape)
    leaf = name.rsplit(".", 2)[-2:]  # (module, "weight"|"bias")
    module, kind = leaf if len(leaf) == 2 else ("", leaf[0])
    if module in ("word_embeddings", "output_layer"):  # vocabulary rows
        return _rows(shape, size)
    if module == "query_key_value":  # [3, heads, head_dim] rows: split along heads
        return _rows(shape, size, 1 if layout.grouped_qkv else 3)
    if module == "dense_h_to_4h":  # column-parallel: output rows ([2, ffn] with SwiGLU)
        return _rows(shape, size, 2 if layout.swiglu else 1)
    if module in ("dense", "dense_4h_to_h") and kind == "weight":  # row-parallel: inputs
        return TPSplit((shape[0], shape[1] * size), (shape[0], shape[1] * size), 1)
    return None  # LayerNorms, position embeddings, row-parallel biases: replicated


def _core():
    from megatron.data.compat import quiet_core_import
    with quiet_core_import():
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
    return parallel_state, tensor_parallel, ModelParallelConfig


def tp_rank_and_size() -> Tuple[int, int]:
    """This rank's place in its tensor-parallel group: (0, 1) unless megatron-core's
    ``parallel_state`` was initialised with a larger tensor-parallel size."""
    parallel_state, _, _ = _core()
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _core_config(size: int):
    _, _, ModelParallelConfig = _core()
    # CPU-safe settings (megatron-core 0.16): weights made on the CPU and filled by the
    # model's own init; no fused CUDA kernels, no sequence parallelism.
    return ModelParallelConfig(tensor_model_parallel_size=size, use_cpu_initialization=True,
                               perform_initialization=False, gradient_accumulation_fusion=False,
                               sequence_parallel=False)


_SPLIT_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "moc_partition_view")
"""megatron-core's attributes of a split parameter (read by DeepSpeed's gradient norm), and
MoC's view of an inner split (read by its checkpoints)."""


def mark_replicated_experts(model: nn.Module) -> None:
    """Mark every expert parameter ``model_parallel`` when experts are replicated over the
    tensor-parallel ranks (no expert tensor parallelism). DeepSpeed then places other
    experts on each rank of a tensor-parallel group (parallel_layout), but its gradient
    norm counts a parameter without a model-parallel mark on tensor-parallel rank 0 only:
    measured at T = 2, the norm missed half the experts and was 1 % low, so gradient
    clipping scaled every step differently from T = 1. With the mark each rank counts its
    own experts and the norms are summed over the group. (Not ``tensor_model_parallel``:
    the weights are whole, and megatron-core and MoC checkpoints read that mark as split.)"""
    for param in model.parameters():
        if getattr(param, "allreduce", True) is False:  # DeepSpeed's mark of an expert's
            param.model_parallel = True


def mark_partition_views(model: nn.Module, size: int, expert_tp: bool,
                         layout: Layout = Layout()) -> None:
    """Mark every parameter split along an inner dimension of a view (the fused QKV
    projection's ``[3, heads, ...]``) with ``moc_partition_view = (view, dim)``, which MoC
    checkpoints read to place its parts (``deepspeed_ext.state``); megatron-core's
    ``partition_dim`` 0 alone would have them stored as contiguous row blocks, and a load
    under another tensor-parallel size would then mix queries, keys and values."""
    for name, param in model.named_parameters():
        split = split_of(name, tuple(param.shape), size, expert_tp, layout)
        if split is not None and split.view != split.global_shape:
            param.moc_partition_view = (split.view, split.dim)


@functools.lru_cache(maxsize=None)
def _layer_classes():
    """megatron-core's parallel linears returning only their output (the bias is added
    inside): drop-in for ``nn.Linear``, with the same parameter names."""
    _, tp, _ = _core()

    def shares_groups(cls):
        """DeepSpeed deep-copies the expert module once per local expert; a process group
        cannot be copied (TypeError: cannot pickle ProcessGroup), so a copy shares the
        layer's groups and copies the rest. A copied Parameter loses its Python attributes
        (torch copies data and requires_grad only), so the split marks are set again:
        unmarked expert shards were counted on tensor-parallel rank 0 only in DeepSpeed's
        gradient norm (0.02 % low with top-1, 0.2 % with top-2)."""

        def __deepcopy__(self, memo):
            for value in vars(self).values():
                if isinstance(value, torch.distributed.ProcessGroup):
                    memo[id(value)] = value
            copied = cls.__new__(cls)
            memo[id(self)] = copied
            for key, value in vars(self).items():
                copied.__dict__[key] = copy.deepcopy(value, memo)
            for name, param in self.named_parameters(recurse=False):
                twin = getattr(copied, name)
                for mark in _SPLIT_MARKS:
                    if hasattr(param, mark):
                        setattr(twin, mark, getattr(param, mark))
            return copied

        cls.__deepcopy__ = __deepcopy__
        return cls

    @shares_groups
    class ColumnLinear(tp.ColumnParallelLinear):
        """Output features split over the group; returns this rank's slice (no gather)."""

        # No ``_extra_state`` entry (megatron-core's is always None) in state dicts, so
        # that checkpoints hold the same keys at every tensor-parallel size.
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x):
            return _flat_call(super().forward, x)

    @shares_groups
    class RowLinear(tp.RowParallelLinear):
        """Input features split over the group; takes this rank's slice of the input and
        returns the full output (summed over the group)."""

        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x):
            return _flat_call(super().forward, x)

    return ColumnLinear, RowLinear


def _flat_call(forward, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)[0]`` with ``x`` as [tokens, features] when it has more than 3
    dimensions: megatron-core's backward handles at most 3 (DeepSpeed's experts get
    [ep, experts, capacity, hidden] chunks), and a linear layer treats every leading
    dimension alike."""
    if x.dim() <= 3:
        return forward(x)[0]
    out = forward(x.reshape(-1, x.shape[-1]))[0]
    return out.reshape(x.shape[:-1] + out.shape[-1:])


def linear(in_features: int, out_features: int, size: int, kind: str,
           bias: bool = True) -> nn.Module:
    """A linear layer for ``size`` tensor-parallel ranks: ``nn.Linear`` at size 1, else a
    ``kind`` (``column`` or ``row``) parallel one; ``bias`` False: none."""
    if size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    column, row = _layer_classes()
    if kind == "column":
        layer = column(in_features, out_features, config=_core_config(size),
                       init_method=lambda w: None, bias=bias, gather_output=False)
        return _mark_split(layer, 0)
    layer = row(in_features, out_features, config=_core_config(size), init_method=lambda w: None,
                bias=bias, input_is_parallel=True, skip_bias_add=False)
    return _mark_split(layer, 1)


def _mark_split(layer: nn.Module, dim: int) -> nn.Module:
    """Mark ``layer.weight`` as split along ``dim`` (``tensor_model_parallel``,
    ``partition_dim``). megatron-core marks weights only when it initialises them itself
    (``perform_initialization``), which this model does not; unmarked, DeepSpeed counted a
    split weight as replicated in the gradient norm, only on tensor-parallel rank 0, and
    clipped T = 2 runs with a norm 1.2 % below T = 1's."""
    _, tp, _ = _core()
    tp.set_tensor_model_parallel_attributes(layer.weight, is_parallel=True, dim=dim, stride=1)
    return layer


def embedding(vocab_size: int, hidden_size: int, size: int) -> nn.Module:
    """The word embedding: vocabulary rows split over the group when ``size`` > 1."""
    if size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    _, tp, _ = _core()
    return _mark_split(tp.VocabParallelEmbedding(vocab_size, hidden_size, config=_core_config(size),
                                                 init_method=lambda w: None), 0)


def parallel_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits of this rank's vocabulary slice (tied output embedding): ``x`` is
    replicated, so its gradient is summed over the group in the backward pass."""
    _, tp, _ = _core()
    return torch.nn.functional.linear(tp.copy_to_tensor_model_parallel_region(x), weight)


def parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy over the vocabulary split across the group."""
    _, tp, _ = _core()
    return tp.vocab_parallel_cross_entropy(logits, labels)


def allow_flat_gathers_on_gloo() -> None:
    """Let DeepSpeed's MoE token gathers run on gloo (every rank, before the first MoE
    forward with tensor parallelism; idempotent).

    ``deepspeed.moe.mappings`` gathers a ``[e, c, m]`` tensor into a flat buffer of
    ``T * e * c * m`` elements with ``all_gather_into_tensor``; NCCL takes any shapes of the
    same size, gloo wants the output to be the inputs stacked and fails with "invalid
    tensor size". On gloo the wrapper passes the input flattened (the same bytes in the
    same order); every other call is DeepSpeed's unchanged.
    """
    import deepspeed.comm as ds_comm
    if getattr(ds_comm.all_gather_into_tensor, "_moc_flat_gloo", False):
        return
    gather = ds_comm.all_gather_into_tensor

    @functools.wraps(gather)
    def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False):
        if (output_tensor.dim() == 1 and tensor.dim() > 1 and tensor.is_contiguous()
                and torch.distributed.get_backend(group) == "gloo"):
            tensor = tensor.view(-1)
        return gather(output_tensor, tensor, group=group, async_op=async_op)

    all_gather_into_tensor._moc_flat_gloo = True
    ds_comm.all_gather_into_tensor = all_gather_into_tensor
