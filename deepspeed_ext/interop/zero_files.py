"""Upstream's ZeRO-1/2 optimizer files put back together, per parameter. Pure (the
caller loads the files).

Each data-parallel rank ``r`` wrote ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: per
optimizer group one flat fp32 partition (``single_partition_of_fp32_groups``), Adam's
``exp_avg`` and ``exp_avg_sq`` of the same elements (``base_optimizer_state``), and
``param_slice_mappings``: for each parameter, the slice (``numel`` from ``start``) of
this rank's partition that holds its next elements. A parameter split over ranks is
their slices in rank order.

Dense groups are partitioned over every data-parallel rank. An expert group (``moe``
in its param group) is partitioned over the expert-data-parallel ranks only, the ranks
with the same expert-parallel rank ``r % ep_size`` (DeepSpeed numbers expert-parallel
groups by consecutive ranks), and names the experts by *local* index:
local ``j`` on expert-parallel rank ``e`` is global expert ``e * local_experts + j``.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
"""What each partition holds: master weights and Adam's two moments."""
_EXPERT = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


@dataclass
class ZeroState:
    """The optimizer state of upstream's ZeRO files, whole per parameter."""

    tensors: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)
    """``(upstream name with global expert ids, kind)`` -> the flat tensor (fp32)."""
    steps: List[float] = field(default_factory=list)
    """Adam's step count per optimizer group, in upstream's group order."""
    group_names: List[str] = field(default_factory=list)
    """Upstream's group names (``wd_no_scale_lr``, ``ep_size_2``, ...)."""
    expert_groups: List[bool] = field(default_factory=list)
    """Per group: whether it holds experts."""
    l2_weight_decay: bool = False
    """Whether the optimizer added weight decay to the gradient (``torch.optim.Adam``,
    its groups' ``decoupled_weight_decay`` False: Megatron-DeepSpeed on a CPU) rather
    than decoupling it (AdamW, apex's FusedAdam, whose groups do not say)."""


def global_expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """``name`` with its local expert index on expert-parallel rank ``ep_rank`` replaced
    by the global one; other names unchanged."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}"
                                 f"{m.group(3)}", name, count=1)


def assemble_zero(states: Sequence[Mapping], ep_size: int, local_experts: int,
                  shapes: Mapping[str, Sequence[int]]) -> ZeroState:
    """Every parameter's fp32 weights and moments from the data-parallel ranks'
    ``optimizer_state_dict``s (``states[r]`` of rank ``r``).

    Args:
        states: one per data-parallel rank, in rank order.
        ep_size: the run's expert-parallel size.
        local_experts: experts per MoE layer on one expert-parallel rank.
        shapes: upstream name (global expert ids) -> shape, to check every parameter is
            whole.

    Raises:
        ValueError: ranks that disagree on the groups, a slice outside its partition, a
            parameter whose slices do not add up to its shape, or one without a shape.
    """
    if not states or len(states) % ep_size:
        raise ValueError(f"{len(states)} ZeRO files for expert-parallel size {ep_size}")
    groups = len(states[0]["single_partition_of_fp32_groups"])
    result = ZeroState()
    pieces: Dict[Tuple[str, str], List[torch.Tensor]] = {}
    for g in range(groups):
        meta = states[0]["base_optimizer_state"]["param_groups"][g]
        is_expert = bool(meta.get("moe", False))
        result.group_names.append(str(meta.get("name", f"group {g}")))
        result.expert_groups.append(is_expert)
        if meta.get("decoupled_weight_decay") is False and meta.get("weight_decay", 0) > 0:
            result.l2_weight_decay = True
        result.steps.append(_group_step(states[0], g))
        for rank, state in enumerate(states):
            if len(state["single_partition_of_fp32_groups"]) != groups:
                raise ValueError(f"ZeRO file of rank {rank} has "
                                 f"{len(state['single_partition_of_fp32_groups'])} groups, "
                                 f"rank 0's {groups}")
            _add_slices(pieces, state, g, rank, ep_rank=rank % ep_size if is_expert else None,
                        local_experts=local_experts)
    for key, parts in pieces.items():
        name = key[0]
        if name not in shapes:
            raise ValueError(f"ZeRO files hold {name!r}, which the model file's "
                             f"param_shapes do not name")
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        numel = int(torch.Size(shapes[name]).numel())
        if flat.numel() != numel:
            raise ValueError(f"{name} ({key[1]}): the ZeRO slices hold {flat.numel()} "
                             f"elements, its shape {tuple(shapes[name])} {numel}")
        result.tensors[key] = flat.reshape(tuple(shapes[name]))
    return result


def _group_step(state: Mapping, group: int) -> float:
    step = state["base_optimizer_state"]["state"].get(group, {}).get("step", 0)
    return float(step.item() if isinstance(step, torch.Tensor) else step)


def _add_slices(pieces: Dict, state: Mapping, group: int, rank: int, ep_rank, local_experts: int
                ) -> None:
    """Append rank ``rank``'s slices of group ``group`` to ``pieces`` (rank order)."""
    flat = {"fp32": state["single_partition_of_fp32_groups"][group]}
    moments = state["base_optimizer_state"]["state"].get(group, {})
    for kind in KINDS[1:]:
        if kind in moments:
            flat[kind] = moments[kind]
    for name, address in state["param_slice_mappings"][group].items():
        start, numel = int(address.start), int(address.numel)
        if start < 0 or numel < 0 or start + numel > flat["fp32"].numel():
            raise ValueError(f"ZeRO file of rank {rank}: {name} slice [{start}, "
                             f"{start + numel}) outside its partition of "
                             f"{flat['fp32'].numel()}")
        if ep_rank is not None:
            name = global_expert_name(name, ep_rank, local_experts)
        for kind, tensor in flat.items():
            pieces.setdefault((name, kind), []).append(tensor[start:start + numel].float())
