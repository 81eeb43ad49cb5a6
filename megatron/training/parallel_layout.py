"""Where each rank sits in a tensor x data (x expert) parallel job: a plan, pure.

The order is Megatron's and DeepSpeed's (pipeline outermost, tensor innermost; no
pipeline here): the ``T`` consecutive ranks ``[T*i, T*i + T)`` form a tensor-parallel
group; the ranks with the same tensor-parallel rank form a data-parallel group of
``world / T``; DeepSpeed splits each data-parallel group into expert-parallel groups of
``E`` consecutive members, and the members with the same place in those groups form an
expert-data-parallel group. With expert tensor parallelism (expert sharding, ESP) an
expert's shards live on the tensor-parallel group. Every rank computes the same layout.
"""

from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class RankPlace:
    """One rank's coordinates."""

    tp_rank: int
    """Rank in its tensor-parallel group."""
    dp_rank: int
    """Rank in its data-parallel group (which batch shard it reads)."""
    ep_rank: int
    """Rank in its expert-parallel group (which experts of each layer it holds)."""


@dataclass(frozen=True)
class ParallelLayout:
    """A job's tensor, data and expert parallel sizes; built by :func:`build_layout`."""

    world: int
    """Ranks in the job."""
    tp: int
    """Tensor-parallel size (``--tensor-model-parallel-size``)."""
    ep: int
    """Expert-parallel size (``--moe-expert-parallel-size``)."""

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world / tp``."""
        return self.world // self.tp

    def place(self, rank: int) -> RankPlace:
        dp_rank = rank // self.tp
        return RankPlace(tp_rank=rank % self.tp, dp_rank=dp_rank, ep_rank=dp_rank % self.ep)

    def tensor_groups(self) -> List[Tuple[int, ...]]:
        return [tuple(range(i, i + self.tp)) for i in range(0, self.world, self.tp)]

    def data_groups(self) -> List[Tuple[int, ...]]:
        return [tuple(range(t, self.world, self.tp)) for t in range(self.tp)]

    def expert_groups(self) -> List[Tuple[int, ...]]:
        """Expert-parallel groups: ``ep`` consecutive members of each data-parallel group."""
        return [group[i:i + self.ep] for group in self.data_groups()
                for i in range(0, len(group), self.ep)]

    def expert_data_groups(self) -> List[Tuple[int, ...]]:
        """Ranks holding the same experts (their gradients are averaged together)."""
        return [group[e::self.ep] for group in self.data_groups() for e in range(self.ep)]


def build_layout(world: int, tp: int, ep: int) -> ParallelLayout:
    """The layout of ``world`` ranks; raises ValueError naming the flag that does not fit."""
    if tp < 1 or world % tp:
        raise ValueError(f"world size ({world}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if ep < 1 or (world // tp) % ep:
        if tp == 1:
            raise ValueError(f"world size ({world}) must be divisible by "
                             f"--moe-expert-parallel-size ({ep})")
        raise ValueError(f"the data-parallel size ({world // tp} = world size {world} / "
                         f"--tensor-model-parallel-size {tp}) must be divisible by "
                         f"--moe-expert-parallel-size ({ep})")
    return ParallelLayout(world=world, tp=tp, ep=ep)
