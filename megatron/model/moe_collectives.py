"""The collectives of Parm's MoE schedules (``megatron/model/moe_schedules.py``), as
autograd functions over an MoE layer's groups. ``docs/moe-schedules.md`` derives them.

Notation: ``P`` expert-parallel ranks, ``T`` tensor-parallel ranks (experts split over
them: expert sharding), ``E_l`` local experts, ``C`` capacity slots per expert, ``M``
hidden size. Rank ``(q, t)`` is expert-parallel rank ``q``, tensor-parallel rank ``t``.
The *combined group* holds the ``P x T`` ranks of one expert-parallel group and their
tensor-parallel peers, ordered ``q * T + t``. Every rank keeps the slots
``[t * C / T, (t + 1) * C / T)`` of each expert (its *slot range*, DeepSpeed's
``drop_tokens``).

* :class:`SpreadSlots` (S1's dispatch): each rank sends its slot range of the experts
  of ``q'`` to all ``T`` ranks ``(q', *)`` in one all-to-all over the combined group;
  each rank receives every slot of its experts from every source. Backward: each rank
  sums the ``T`` partial gradients of its slot range (one all-to-all), then the slot
  ranges are all-gathered over the tensor-parallel group.
* :class:`GatherPartials` (S1's combine): the adjoint all-to-all: a rank holding partial
  sums (one tensor-parallel shard's) of every slot of its experts sends each source its
  slot range; the receiver sums the ``T`` partials.
* :class:`OverlappedExchange` (S2): DeepSpeed's all-to-all over the expert-parallel group
  followed by the all-gather of slot ranges over the tensor-parallel group, done as
  ``P - 1`` pairwise exchanges whose received chunk is all-gathered (asynchronously) while
  the next exchange runs. The result is the same tensor, to the bit.

Every rank of a combined group calls these in the same order (they are collectives).
"""

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MoEGroups:
    """The process groups of one MoE layer, and this rank's place in them."""

    ep_group: object
    """Expert-parallel group (``P`` ranks, the same tensor-parallel rank)."""
    ep_ranks: Tuple[int, ...]
    """Its global ranks, in group order (position = expert-parallel rank)."""
    tp_group: object
    """Tensor-parallel group (``T`` ranks)."""
    combined_group: object
    """The ``P x T`` ranks of the expert-parallel group and their tensor-parallel peers,
    ordered ``q * T + t``."""
    ep_rank: int
    tp_rank: int
    ep_size: int
    tp_size: int


def _all_to_all(inp: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of equal blocks along ``inp``'s leading dimensions (flattened: one block
    per group member, in group order); returns a new tensor of ``inp``'s shape."""
    inp = inp.contiguous()
    output = torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)
    dist.all_to_all_single(output.view(-1), inp.view(-1), group=group)
    return output


def spread_forward(own: torch.Tensor, g: MoEGroups) -> torch.Tensor:
    """``own`` ``[P*E_l, C/T, M]`` (this rank's slot range of every expert) -> ``[P, E_l,
    C, M]``: every slot of this rank's experts, from every source."""
    p, t = g.ep_size, g.tp_size
    e_l = own.shape[0] // p
    chunks = own.reshape(p, 1, e_l, *own.shape[1:]).expand(p, t, e_l, *own.shape[1:])
    received = _all_to_all(chunks, g.combined_group)
    # received[q, t_src]: source (q, t_src)'s slot range t_src of this rank's experts
    return received.permute(0, 2, 1, 3, 4).reshape(p, e_l, t * own.shape[1], own.shape[2])


def gather_forward(partial: torch.Tensor, g: MoEGroups) -> torch.Tensor:
    """``partial`` ``[P, E_l, C, M]`` (partial sums over the tensor-parallel shards, for
    every source) -> ``[P*E_l, C/T, M]``: this rank's slot range of every expert, summed
    over the ``T`` shards."""
    p, t = g.ep_size, g.tp_size
    _, e_l, c, m = partial.shape
    # send[q', t']: slot range t' of source q''s experts, to rank (q', t')
    send = partial.reshape(p, e_l, t, c // t, m).permute(0, 2, 1, 3, 4)
    received = _all_to_all(send, g.combined_group)
    # received[q, t_shard]: shard t_shard's partial for this rank's slot range of the
    # experts of q
    return received.sum(dim=1).reshape(p * e_l, c // t, m)


def gather_slot_ranges(own: torch.Tensor, g: MoEGroups) -> torch.Tensor:
    """``[E, C/T, M]`` slot ranges -> ``[E, C, M]``, all-gathered over the tensor-parallel
    group (forward of DeepSpeed's ``gather_tokens`` along the slots)."""
    t = g.tp_size
    out = torch.empty((t,) + tuple(own.shape), dtype=own.dtype, device=own.device)
    dist.all_gather_into_tensor(out.view(-1), own.contiguous().view(-1), group=g.tp_group)
    return out.permute(1, 0, 2, 3).reshape(own.shape[0], t * own.shape[1], own.shape[2])


def own_slot_range(full: torch.Tensor, g: MoEGroups) -> torch.Tensor:
    """This rank's slot range of ``[E, C, M]`` (DeepSpeed's ``drop_tokens`` along dim 1)."""
    width = full.shape[1] // g.tp_size
    return full.narrow(1, g.tp_rank * width, width)


class SpreadSlots(torch.autograd.Function):
    """S1's dispatch: ``[E, C, M]`` (every rank of a tensor-parallel group holds the same)
    -> ``[P, E_l, C, M]`` (every slot of this rank's experts). Backward: the partial input
    gradients of the ``T`` expert shards are summed (one all-to-all) and the full gradient
    is all-gathered, so every rank of the group gets the same, as it does in DeepSpeed."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, groups: MoEGroups) -> torch.Tensor:
        ctx.groups = groups
        return spread_forward(own_slot_range(full, groups), groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.groups
        return gather_slot_ranges(gather_forward(grad.contiguous(), g), g), None


class GatherPartials(torch.autograd.Function):
    """S1's combine: ``[P, E_l, C, M]`` partial sums -> ``[E, C/T, M]`` this rank's slot
    range, summed over the expert shards. Backward: the gradient of a sum reaches every
    term: each rank's slot-range gradient goes to all ``T`` shards (:func:`spread_forward`)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, groups: MoEGroups) -> torch.Tensor:
        ctx.groups = groups
        return gather_forward(partial.contiguous(), groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return spread_forward(grad.contiguous(), ctx.groups), None


def overlapped_exchange(own: torch.Tensor, g: MoEGroups) -> torch.Tensor:
    """``own`` ``[P*E_l, C/T, M]`` -> ``[P*E_l, C, M]``: the all-to-all over the
    expert-parallel group, then the all-gather of slot ranges over the tensor-parallel
    group, with the all-gather of each received chunk started while the next pairwise
    exchange runs."""
    p, t = g.ep_size, g.tp_size
    e_l = own.shape[0] // p
    chunks = own.reshape(p, e_l, *own.shape[1:])
    received = torch.empty_like(chunks)
    gathered = torch.empty((p, t) + tuple(chunks.shape[1:]), dtype=own.dtype, device=own.device)
    pending = []
    for step in range(p):
        dst, src = (g.ep_rank + step) % p, (g.ep_rank - step) % p
        if step == 0:
            received[src].copy_(chunks[dst])
        else:
            requests = [dist.isend(chunks[dst].contiguous(), g.ep_ranks[dst], group=g.ep_group),
                        dist.irecv(received[src], g.ep_ranks[src], group=g.ep_group)]
            for req in requests:
                req.wait()
        pending.append(dist.all_gather_into_tensor(gathered[src].view(-1), received[src].view(-1),
                                                   group=g.tp_group, async_op=True))
    for work in pending:
        work.wait()
    # gathered[q, t_src]: slot range t_src of the experts of this rank, from source q
    return gathered.permute(0, 2, 1, 3, 4).reshape(p * e_l, t * own.shape[1], own.shape[2])


class OverlappedExchange(torch.autograd.Function):
    """S2: :func:`overlapped_exchange` forward. Backward as DeepSpeed's ``gather_tokens``
    then ``_AllToAll``: this rank's slot range of the gradient, sent back by one
    all-to-all over the expert-parallel group."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, groups: MoEGroups) -> torch.Tensor:
        ctx.groups = groups
        return overlapped_exchange(own.contiguous(), groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.groups
        mine = own_slot_range(grad, g).contiguous()
        return _all_to_all(mine, g.ep_group), None
