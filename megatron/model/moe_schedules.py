"""Parm's MoE schedules (``--moe-schedule``) for MoE layers whose experts are split over
the tensor-parallel ranks (MP + EP + ESP), in place of DeepSpeed 0.19's ``MOELayer``
dispatch and combine. DeepSpeed's gate, its experts' parameters and their names are kept
(checkpoints do not change); only the order of the collectives and who computes what in
between differ. ``docs/moe-schedules.md`` derives each schedule and its costs.

* ``deepspeed``: DeepSpeed's own forward.
* ``parm-s1``: one all-to-all over the combined expert x tensor-parallel group replaces
  the all-to-all over the expert-parallel group plus the all-gather over the
  tensor-parallel group (dispatch); the experts' shards return their partial sums
  without the all-reduce inside the row-parallel layer, and one all-to-all over the
  combined group sums them at the ranks that need them (combine). The tensor-parallel
  ranks of an expert act as extra ranks of the expert dimension inside the layer.
* ``parm-s2``: DeepSpeed's collectives, with the all-to-all done as pairwise exchanges
  whose received chunks are all-gathered over the tensor-parallel group while the next
  exchange runs (dispatch and combine).

Every rank calls :func:`install_schedules` after ``deepspeed.initialize`` (it creates
the combined groups: a collective), with the same schedule per layer.
"""

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.model.moe_collectives import (GatherPartials, MoEGroups, OverlappedExchange,
                                            SpreadSlots)

logger = logging.getLogger(__name__)

SCHEDULES = ("deepspeed", "parm-s1", "parm-s2")
"""The schedules :func:`install_schedules` installs (``auto`` picks among them)."""


def route_slots(indices: torch.Tensor, locations: torch.Tensor, experts: int,
                capacity: int) -> torch.Tensor:
    """``[k, S]`` flat slot ``expert * capacity + location`` of every (route, token); a
    route the gate dropped (expert index < 0) points at the scratch slot
    ``experts * capacity``."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, experts * capacity))


def encode(tokens: torch.Tensor, slots: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` expert slots (empty slots zero)."""
    count, width = tokens.shape
    source = torch.full((experts * capacity + 1,), count, dtype=torch.long, device=tokens.device)
    source.scatter_(0, slots.reshape(-1),
                    torch.arange(count, device=tokens.device).expand_as(slots).reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, width)])
    return padded.index_select(0, source[:-1]).view(experts, capacity, width)


def decode(slots_out: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
           count: int) -> torch.Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: each token's routes weighted by their
    gate values (summed in fp32, as DeepSpeed does)."""
    width = slots_out.shape[-1]
    padded = torch.cat([slots_out.reshape(-1, width), slots_out.new_zeros(1, width)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], count, width)
    return (routed * gates.unsqueeze(-1)).sum(0).to(slots_out.dtype)


class _AddOnFirstShard(torch.autograd.Function):
    """``partial + bias`` on tensor-parallel rank 0 only (the sum over the shards then
    holds the bias once); the bias's gradient is the whole gradient's sum on every rank,
    as DeepSpeed's row-parallel layer computes it after its all-reduce (the shards' copies
    of the bias must stay equal)."""

    @staticmethod
    def forward(ctx, partial, bias, first):
        ctx.dims = tuple(range(partial.dim() - 1))
        return partial + bias if first else partial.view_as(partial)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.sum(dim=ctx.dims), None


def _expert_partials(experts, slots_in: torch.Tensor, first_shard: bool) -> torch.Tensor:
    """``[P, E_l, C, M]`` -> this rank's shards' partial outputs, without the row-parallel
    all-reduce and without its input-gradient all-reduce (S1's collectives do both)."""
    outs = []
    for i, mlp in enumerate(experts.deepspeed_experts):
        hidden = mlp.activation(F.linear(slots_in[:, i], mlp.dense_h_to_4h.weight,
                                         mlp.dense_h_to_4h.bias))
        partial = F.linear(hidden, mlp.dense_4h_to_h.weight)
        outs.append(_AddOnFirstShard.apply(partial, mlp.dense_4h_to_h.bias, first_shard))
    return torch.stack(outs, dim=1)


class ScheduledMoE:
    """The forward of one DeepSpeed ``MOELayer`` under a Parm schedule; installed as the
    layer's ``forward``. Returns what DeepSpeed's does and sets ``l_aux`` and
    ``exp_counts`` on the layer the same way."""

    def __init__(self, layer, schedule: str, groups: MoEGroups):
        from deepspeed.moe.mappings import drop_tokens, gather_tokens
        if schedule not in SCHEDULES[1:]:
            raise ValueError(f"unknown MoE schedule {schedule!r}")
        self.layer = layer
        self.schedule = schedule
        self.groups = groups
        self._drop, self._gather = drop_tokens, gather_tokens  # resolved once, not per pass

    def __call__(self, *inputs: torch.Tensor, **kwargs) -> torch.Tensor:
        drop_tokens, gather_tokens = self._drop, self._gather
        layer, g = self.layer, self.groups
        width = inputs[0].shape[-1]
        tokens = inputs[0].reshape(-1, width)
        layer.l_aux, capacity, experts, indices, locations, gates, layer.exp_counts = layer.gate(
            tokens, inputs[1], True, False)
        capacity = int(capacity)
        slots = route_slots(indices, locations, experts, capacity)
        dispatched = encode(tokens, slots, experts, capacity)
        shape = (g.ep_size, layer.num_local_experts, capacity, width)
        if self.schedule == "parm-s1":
            partial = _expert_partials(layer.experts, SpreadSlots.apply(dispatched, g), g.tp_rank == 0)
            expert_out = gather_tokens(GatherPartials.apply(partial, g), dim=1)
        else:
            received = OverlappedExchange.apply(drop_tokens(dispatched, dim=1), g)
            out = layer.experts(received.reshape(shape)).reshape(experts, capacity, width)
            expert_out = OverlappedExchange.apply(drop_tokens(out, dim=1), g)
        return decode(expert_out, slots, gates, tokens.shape[0]).reshape(inputs[0].shape)


def why_not_scheduled(moe) -> Optional[str]:
    """Why a Parm schedule cannot replace ``moe``'s (a ``deepspeed.moe.layer.MoE``)
    dispatch and combine; None when it can."""
    from deepspeed.utils import groups
    if groups.mpu is None or groups.mpu.get_tensor_model_parallel_world_size() == 1:
        return "no tensor parallelism (the schedules rearrange its collectives)"
    if not moe.enable_expert_tensor_parallelism:
        return "experts are not split over the tensor-parallel ranks (--enable-expert-tensor-parallelism)"
    if moe.deepspeed_moe.use_tutel:
        return "Tutel's dispatcher is in use"
    mlp = moe.deepspeed_moe.experts.deepspeed_experts[0]
    if not all(hasattr(mlp, a) for a in ("dense_h_to_4h", "dense_4h_to_h", "activation")):
        return "the experts are not this model's MLP"
    if mlp.dense_4h_to_h.bias is None:
        return "the experts have no biases (--disable-bias-linear): not supported by the schedules yet"
    return None


def combined_groups(moes: Sequence) -> Dict[Tuple[int, ...], object]:
    """Every rank: the combined expert x tensor-parallel group of every expert-parallel
    group, created in the same order everywhere (``new_group`` is collective)."""
    from deepspeed.utils import groups
    from deepspeed_ext.runtime.groups import metadata_group, new_training_group
    tp_ranks = dist.get_process_group_ranks(groups.mpu.get_tensor_model_parallel_group())
    all_tp: List = [None] * dist.get_world_size()
    dist.all_gather_object(all_tp, sorted(tp_ranks), group=metadata_group())
    wanted = set()
    for moe in moes:
        ep_ranks = dist.get_process_group_ranks(moe.deepspeed_moe.ep_group)
        mine = sorted({r for m in ep_ranks for r in all_tp[m]})
        every: List = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=metadata_group())
        wanted.update(tuple(ranks) for ranks in every)
    return {ranks: new_training_group(ranks) for ranks in sorted(wanted)}


def moe_groups(moe, combined: Dict[Tuple[int, ...], object]) -> MoEGroups:
    """The :class:`MoEGroups` of one MoE layer on this rank."""
    from deepspeed.utils import groups
    ep_group = moe.deepspeed_moe.ep_group
    ep_ranks = tuple(dist.get_process_group_ranks(ep_group))
    tp_group = groups.mpu.get_tensor_model_parallel_group()
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    # The tensor-parallel groups are consecutive ranks: member m's is [m - t, m - t + T).
    ranks = tuple(sorted(m - tp_rank + i for m in ep_ranks for i in range(tp_size)))
    g = MoEGroups(ep_group=ep_group, ep_ranks=ep_ranks, tp_group=tp_group,
                  combined_group=combined[ranks], ep_rank=dist.get_rank(ep_group),
                  tp_rank=tp_rank, ep_size=len(ep_ranks), tp_size=tp_size)
    # The collectives index the combined group as q * T + t.
    where = dist.get_rank(g.combined_group)
    if where != g.ep_rank * g.tp_size + g.tp_rank:
        raise RuntimeError(f"combined group rank {where} is not ep_rank {g.ep_rank} x T "
                           f"{g.tp_size} + tp_rank {g.tp_rank}: an unexpected rank layout")
    return g


def install_schedules(model: torch.nn.Module, choose) -> List[Tuple[str, str]]:
    """Install a schedule on every ``deepspeed.moe.layer.MoE`` of ``model``; every rank
    calls it, after ``deepspeed.initialize``, with the same ``choose``.

    Args:
        model: the module holding the MoE layers.
        choose: ``choose(index, groups) -> schedule`` (one of :data:`SCHEDULES`) for each
            MoE layer a Parm schedule can run on, with its :class:`MoEGroups`; the same on
            every rank (it may run collectives over the groups: every rank calls it for
            the same layers in the same order).

    Returns:
        ``(layer path, what it runs)`` per MoE layer, for the log: the schedule, or
        ``deepspeed (why)`` where a Parm schedule cannot run.
    """
    from deepspeed.moe.layer import MoE
    moes = [(path, m) for path, m in model.named_modules() if isinstance(m, MoE)]
    eligible = [m for _, m in moes if why_not_scheduled(m) is None]
    combined = combined_groups(eligible) if eligible else {}
    report = []
    for index, (path, moe) in enumerate(moes):
        moe.deepspeed_moe.__dict__.pop("forward", None)  # DeepSpeed's own, unless replaced
        why = why_not_scheduled(moe)
        if why is not None:
            report.append((path, f"deepspeed ({why})"))
            continue
        groups = moe_groups(moe, combined)
        schedule = choose(index, groups)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown MoE schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
        if schedule != "deepspeed":
            moe.deepspeed_moe.forward = ScheduledMoE(moe.deepspeed_moe, schedule, groups)
        report.append((path, schedule))
    return report
