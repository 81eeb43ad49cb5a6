"""Where each rank sits in a tensor x data (x expert) parallel job: a plan, pure.

The order is Megatron's and DeepSpeed's (pipeline outermost, tensor innermost; no
pipeline here): the ``T`` consecutive ranks ``[T*i, T*i + T)`` form a tensor-parallel
group; the ranks with the same tensor-parallel rank form a data-parallel group of
``world / T``; DeepSpeed splits each data-parallel group into expert-parallel groups of
``E`` consecutive members, and the members with the same place in those groups form an
expert-data-parallel group. With expert tensor parallelism (expert sharding, ESP) an
expert's shards live on the tensor-parallel group.

Without it (experts replicated over the tensor-parallel ranks), DeepSpeed 0.19 builds its
expert groups without the tensor-parallel layout (``_create_expert_and_data_parallel``
without ``mp_size``): ``E`` consecutive *world* ranks form an expert-parallel group, and the
ranks ``E`` apart an expert-data-parallel group. Each tensor-parallel rank of a group then
holds other experts, and DeepSpeed's MoE layer sends each rank's ``1/T`` share of the
capacity slots to them (its ``drop_tokens``). This is the same model only when every
expert-parallel group holds whole tensor-parallel groups (``E`` a multiple of ``T``):
then an expert receives all ``T`` shares of every data shard it serves, and its gradient
is averaged over as many ranks as there are data shards. :func:`build_layout` refuses other
sizes. Every rank computes the same layout.
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
    expert_tp: bool = True
    """Experts split over the tensor-parallel ranks (``--enable-expert-tensor-parallelism``);
    False: replicated over them (DeepSpeed's world-ordered expert groups). Moot at T = 1."""

    @property
    def _world_ordered(self) -> bool:
        return self.tp > 1 and not self.expert_tp

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world / tp``."""
        return self.world // self.tp

    def place(self, rank: int) -> RankPlace:
        dp_rank = rank // self.tp
        ep_rank = rank % self.ep if self._world_ordered else dp_rank % self.ep
        return RankPlace(tp_rank=rank % self.tp, dp_rank=dp_rank, ep_rank=ep_rank)

    def tensor_groups(self) -> List[Tuple[int, ...]]:
        return [tuple(range(i, i + self.tp)) for i in range(0, self.world, self.tp)]

    def data_groups(self) -> List[Tuple[int, ...]]:
        return [tuple(range(t, self.world, self.tp)) for t in range(self.tp)]

    def expert_groups(self) -> List[Tuple[int, ...]]:
        """Expert-parallel groups: ``ep`` consecutive members of each data-parallel group
        (without expert tensor parallelism: ``ep`` consecutive ranks)."""
        if self._world_ordered:
            return [tuple(range(i, i + self.ep)) for i in range(0, self.world, self.ep)]
        return [group[i:i + self.ep] for group in self.data_groups()
                for i in range(0, len(group), self.ep)]

    def expert_data_groups(self) -> List[Tuple[int, ...]]:
        """Ranks holding the same experts (their gradients are averaged together)."""
        if self._world_ordered:
            return [tuple(range(e, self.world, self.ep)) for e in range(self.ep)]
        return [group[e::self.ep] for group in self.data_groups() for e in range(self.ep)]


def build_layout(world: int, tp: int, ep: int, expert_tp: bool = True) -> ParallelLayout:
    """The layout of ``world`` ranks (``expert_tp``: experts split over the tensor-parallel
    ranks); raises ValueError naming the flag that does not fit."""
    if tp < 1 or world % tp:
        raise ValueError(f"world size ({world}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if tp > 1 and not expert_tp:
        if ep < 1 or ep % tp or world % ep:
            raise ValueError(
                f"experts replicated over the tensor-parallel ranks (no "
                f"--enable-expert-tensor-parallelism) need --moe-expert-parallel-size ({ep}) to "
                f"be a multiple of --tensor-model-parallel-size ({tp}) that divides the world "
                f"size ({world}): DeepSpeed groups experts over consecutive ranks, and a group "
                f"must hold whole tensor-parallel groups")
        return ParallelLayout(world=world, tp=tp, ep=ep, expert_tp=False)
    if ep < 1 or (world // tp) % ep:
        if tp == 1:
            raise ValueError(f"world size ({world}) must be divisible by "
                             f"--moe-expert-parallel-size ({ep})")
        raise ValueError(f"the data-parallel size ({world // tp} = world size {world} / "
                         f"--tensor-model-parallel-size {tp}) must be divisible by "
                         f"--moe-expert-parallel-size ({ep})")
    return ParallelLayout(world=world, tp=tp, ep=ep)
