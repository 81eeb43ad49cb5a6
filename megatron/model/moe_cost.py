"""The alpha-beta cost model of the MoE schedules (``megatron/model/moe_schedules.py``):
the communication time of one MoE layer's forward and backward pass under each
schedule, and the choice of ``--moe-schedule auto``. Pure: no I/O, no collectives.
``docs/moe-schedules.md`` derives every term.

A collective over ``n`` ranks on a link of latency ``alpha`` (seconds per step) and
inverse bandwidth ``beta`` (seconds per byte), with ``B`` bytes per rank:

* all-to-all (pairwise exchange): ``alpha (n - 1) + beta B (n - 1) / n``
* all-gather (ring, ``B`` the gathered bytes): ``alpha (n - 1) + beta B (n - 1) / n``
* all-reduce (ring): ``2 alpha (n - 1) + 2 beta B (n - 1) / n``

``V = E * C * M * bytes`` is the dispatched tensor of one rank (every expert's capacity
slots, every tensor-parallel rank holding the same); ``P`` expert-parallel, ``T``
tensor-parallel ranks.
"""

import math
import struct
from dataclasses import dataclass
from typing import Dict, Mapping


@dataclass(frozen=True)
class Link:
    """Latency and inverse bandwidth of collectives over one process group."""

    alpha: float
    """Seconds per step of a collective (per peer exchanged with)."""
    beta: float
    """Seconds per byte a rank sends."""

    def all_to_all(self, ranks: int, nbytes: float) -> float:
        return 0.0 if ranks == 1 else self.alpha * (ranks - 1) + self.beta * nbytes * (ranks - 1) / ranks

    all_gather = all_to_all  # the same terms for a ring all-gather of nbytes gathered

    def all_reduce(self, ranks: int, nbytes: float) -> float:
        return 2 * self.all_to_all(ranks, nbytes)


@dataclass(frozen=True)
class GroupLinks:
    """The links of one MoE layer's groups (measured by the trainer's calibration, or
    read from ``--moe-schedule-costs``)."""

    ep: Link
    """The expert-parallel group (``P`` ranks; across nodes at scale)."""
    tp: Link
    """The tensor-parallel group (``T`` ranks; within a node)."""
    combined: Link
    """The ``P x T`` ranks of both (S1's all-to-alls)."""

    def to_record(self) -> Dict[str, Dict[str, float]]:
        return {name: {"alpha": link.alpha, "beta": link.beta}
                for name, link in (("ep", self.ep), ("tp", self.tp), ("combined", self.combined))}

    @staticmethod
    def from_record(record: Mapping) -> "GroupLinks":
        """Inverse of :meth:`to_record`; ValueError naming the field for anything else."""
        links = {}
        for name in ("ep", "tp", "combined"):
            entry = record.get(name) if isinstance(record, Mapping) else None
            if not isinstance(entry, Mapping):
                raise ValueError(f"{name}: expected {{alpha, beta}}, got {entry!r}")
            values = []
            for key in ("alpha", "beta"):
                value = entry.get(key)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 \
                        or not math.isfinite(value):
                    raise ValueError(f"{name}.{key}: expected a non-negative number, got {value!r}")
                values.append(float(value))
            links[name] = Link(*values)
        return GroupLinks(**links)


@dataclass(frozen=True)
class LayerShape:
    """What one MoE layer moves on one rank."""

    experts: int
    """Experts of the layer (E)."""
    capacity: int
    """Slots per expert (C)."""
    hidden: int
    """Model width (M)."""
    ep: int
    """Expert-parallel size (P)."""
    tp: int
    """Tensor-parallel size (T)."""
    bytes_per_element: int = 4
    """Activation element size (fp32: 4, bf16/fp16: 2)."""

    @property
    def volume(self) -> float:
        """V: bytes of the dispatched ``[E, C, M]`` tensor."""
        return self.experts * self.capacity * self.hidden * self.bytes_per_element


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def capacity_of(tokens: int, experts: int, topk: int, capacity_factor: float,
                min_capacity: int, drop_tokens: bool, tensor_parallel: int = 1) -> int:
    """Slots per expert as DeepSpeed 0.19's gate sizes them, rounded up to a multiple of
    ``tensor_parallel`` as the model pads them (``megatron.model.moe_capacity``). With
    token dropping the gate computes ``ceil(tokens / experts * capacity_factor * topk)``
    in float32 (float64 differs: 25 tokens, 2 experts, factor 1.2 give 15 in float64, 16
    in DeepSpeed); without, it takes the largest expert count, estimated here as the mean
    ``tokens * topk / experts``."""
    if not drop_tokens:
        capacity = max(1, math.ceil(tokens * topk / experts))
    else:
        product = _float32(_float32(tokens / experts) * _float32(capacity_factor * topk))
        capacity = max(math.ceil(product), min_capacity)
    return -(-capacity // tensor_parallel) * tensor_parallel


def predict(schedule: str, shape: LayerShape, links: GroupLinks) -> float:
    """Seconds of communication of one forward and backward pass of the layer."""
    p, t, v = shape.ep, shape.tp, shape.volume
    a2a_ep = links.ep.all_to_all(p, v / t)            # one slot range of every expert
    gather = links.tp.all_gather(t, v)               # slot ranges -> every slot
    reduce = links.tp.all_reduce(t, v)               # the row-parallel layer's
    if schedule == "deepspeed":
        # forward: a2a, gather, reduce, a2a, gather; backward: a2a, the column layer's
        # input-gradient reduce, a2a, and the two drops' gathers
        return 4 * a2a_ep + 4 * gather + 2 * reduce
    if schedule == "parm-s1":
        # forward: spread (combined a2a), partial sums (combined a2a), gather; backward:
        # the same two a2a's and the gather after the first
        return 4 * links.combined.all_to_all(p * t, v) + 2 * gather
    if schedule == "parm-s2":
        # DeepSpeed's, with each forward a2a + gather pipelined over the P - 1 exchanges:
        # the chunk gathers hide behind the exchanges, but the last chunk's does not
        overlapped = max(a2a_ep, gather * (p - 1) / p) + gather / p
        return 2 * overlapped + 2 * a2a_ep + 2 * gather + 2 * reduce
    raise ValueError(f"unknown MoE schedule {schedule!r}")


def choose(shape: LayerShape, links: GroupLinks, schedules=("deepspeed", "parm-s1", "parm-s2")):
    """``(fastest predicted schedule, {schedule: seconds})``; ties go to the earlier one
    (DeepSpeed's first)."""
    times = {s: predict(s, shape, links) for s in schedules}
    return min(schedules, key=lambda s: times[s]), times
