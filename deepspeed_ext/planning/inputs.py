"""The cost model's inputs: a model's shape, the job's layout, the hardware's figures and
a checkpoint policy (plain frozen dataclasses, checked on construction), and the
model's constants. :mod:`deepspeed_ext.planning.costs` turns them into costs; its
docstring gives the formulas and units.
"""

import math
from dataclasses import dataclass, fields

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.peers import KEEP
from deepspeed_ext.policy import plt as trainer_plt
from deepspeed_ext.policy import redundancy as rd
from deepspeed_ext.snapshot import SLOTS

STATE_BYTES = 12
"""fp32 master weight and Adam's two moments, per parameter."""
WEIGHT_BYTES = 2
"""bf16 compute weights, per parameter."""
SNAPSHOT_SLOTS_KEPT = SLOTS
"""Two-level snapshots held per rank (triple buffering; the trainer's ``snapshot.SLOTS``)."""
PEER_STEPS_KEPT = KEEP
"""Protected steps a rank keeps of its peers' snapshots (the trainer's ``peers.KEEP``)."""
GB = 1e9
"""Bandwidths are decimal: 1 GB/s = 1e9 bytes per second."""
GIB = 2**30
"""Host-memory budgets are binary, as the trainer's ``--moc-host-memory-gb``."""

POLICIES = ("full-sync", "full-async", "pec", "pec-dynamic", "two-level", "exact")
REDUNDANCY = ("none", "replicate", "erasure")



@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model."""

    name: str
    """A label (the config file's name)."""
    params_non_expert: int
    """Parameters outside the experts (embeddings, attention, dense MLPs, gates)."""
    params_expert: int
    """Parameters of all experts of all MoE layers."""
    num_experts: int
    """Experts per MoE layer (N)."""
    num_moe_layers: int
    """MoE layers."""
    tokens_per_iteration: int
    """Global batch size x sequence length."""

    def __post_init__(self):
        if self.params_non_expert < 0 or self.params_expert < 0:
            raise ValueError("parameter counts must be >= 0")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if self.tokens_per_iteration < 1:
            raise ValueError("tokens_per_iteration must be >= 1")

    @property
    def params_total(self) -> int:
        return self.params_non_expert + self.params_expert


@dataclass(frozen=True)
class Layout:
    """How the job is spread: data parallel over every GPU (ZeRO-2), experts over ``ep``."""

    gpus: int
    """Ranks (GPUs) of the job."""
    gpus_per_node: int = 8
    """Ranks per node: the failure domain of host memory."""
    ep: int = 0
    """Expert-parallel size; 0: min(gpus, experts)."""

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus ({self.gpus}) and --gpus-per-node "
                             f"({self.gpus_per_node}) must be >= 1")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not a whole number of nodes of "
                             f"--gpus-per-node {self.gpus_per_node}")
        if self.ep < 0 or (self.ep and self.gpus % self.ep):
            raise ValueError(f"--ep {self.ep} must divide --gpus {self.gpus}")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def expert_parallel(self, model: ModelShape) -> int:
        ep = self.ep or math.gcd(self.gpus, model.num_experts)
        if model.num_experts % ep:
            raise ValueError(f"--ep {ep} does not divide the {model.num_experts} experts")
        return ep


@dataclass(frozen=True)
class Hardware:
    """Measured or assumed figures (``moc-plan calibrate`` measures them)."""

    iteration_s: float
    """Seconds of one training iteration without checkpointing."""
    d2h_gbps: float = 20.0
    """Device-to-host copy bandwidth per rank, GB/s (the snapshot copy)."""
    h2d_gbps: float = 20.0
    """Host-to-device (and host memory) bandwidth per rank, GB/s (a restore from memory)."""
    storage_write_gbps: float = 2.0
    """Write bandwidth to checkpoint storage per node, GB/s."""
    storage_read_gbps: float = 4.0
    """Read bandwidth from checkpoint storage per node, GB/s."""
    storage_total_gbps: float = 200.0
    """The storage system's aggregate bandwidth, GB/s (a large parallel filesystem); 0: no
    limit beyond the nodes' own."""
    network_gbps: float = 25.0
    """Bandwidth between nodes per node, GB/s (snapshot redundancy and its rebuild)."""
    fwd_bwd_fraction: float = 0.9
    """Share of an iteration the snapshot copy can hide behind (forward and backward)."""
    restart_s: float = 60.0
    """Seconds from a failure to training again, before loading (detection, restart,
    initialisation, rendezvous)."""
    node_replace_s: float = 0.0
    """Extra seconds a node failure costs (a replacement node joining)."""
    warmup_s: float = 0.0
    """Extra seconds the first iterations of a (re)started job take (allocations, caches)."""
    background_s_per_gb: float = 0.0
    """Seconds the training loop loses per GB a rank copies or writes in the background:
    0 where copies are DMA and writes run on otherwise idle host cores; on CPU training
    the copy and write threads share the cores with compute (``moc-plan calibrate
    --from-json`` derives it from a benchmark's clean two-level run)."""
    snapshot_call_s: float = 0.0
    """The training loop's cost of a memory-only two-level snapshot call (picking the
    slot and experts, handing the copy to its thread)."""
    persist_call_s: float = 0.0
    """The extra cost of a two-level snapshot that is due for storage (its one small
    collective and the checkpoint directory's)."""
    save_call_s: float = 0.0
    """The training loop's fixed cost of a save that goes to storage, besides its copy:
    the write plan, the checkpoint directory's collective, handing off to the writer
    (``moc-plan calibrate --from-json`` reads it from a benchmark; 20 ms was measured for
    configs/small.yaml on 2 CPU ranks)."""

    POSITIVE = ("iteration_s", "d2h_gbps", "h2d_gbps", "storage_write_gbps",
                "storage_read_gbps", "network_gbps", "fwd_bwd_fraction")
    """Fields that must be > 0 (the others >= 0); every field must be finite."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--iteration-time" if f.name == "iteration_s" else \
                "--" + f.name.replace("_", "-")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{f.name} ({flag}) must be a finite number, got {value!r}")
            if f.name in self.POSITIVE and not value > 0:
                raise ValueError(f"{f.name} ({flag}) must be > 0, got {value}")
            if value < 0:
                raise ValueError(f"{f.name} ({flag}) must be >= 0, got {value}")
        if not 0 < self.fwd_bwd_fraction <= 1:
            raise ValueError(f"fwd_bwd_fraction must be in (0, 1], got {self.fwd_bwd_fraction}")

    def write_bps(self, layout: Layout) -> float:
        """Storage write bandwidth one rank gets when every rank writes at once."""
        per_rank = self.storage_write_gbps * GB / min(layout.gpus, layout.gpus_per_node)
        if self.storage_total_gbps:
            per_rank = min(per_rank, self.storage_total_gbps * GB / layout.gpus)
        return per_rank

    def read_bps(self, layout: Layout) -> float:
        per_rank = self.storage_read_gbps * GB / min(layout.gpus, layout.gpus_per_node)
        if self.storage_total_gbps:
            per_rank = min(per_rank, self.storage_total_gbps * GB / layout.gpus)
        return per_rank

    def network_bps(self, layout: Layout) -> float:
        return self.network_gbps * GB / min(layout.gpus, layout.gpus_per_node)


@dataclass(frozen=True)
class Policy:
    """A checkpoint policy and its settings; only settings the trainer accepts.

    Raises (on construction):
        ValueError: an unknown kind or redundancy, a count out of range, or settings
            the trainer refuses (``k`` above ``k_snapshot``, a PLT threshold outside
            (0, 1)), in the trainer's own words.
    """

    kind: str
    """One of :data:`POLICIES`."""
    interval: int = 1
    """Iterations between checkpoints (two-level: between snapshots)."""
    k: int = 0
    """Experts per MoE layer saved to storage (PEC; two-level: persisted); 0: all."""
    k_snapshot: int = 0
    """Two-level: experts per MoE layer in each memory snapshot; 0: all."""
    persist_interval: int = 1
    """Two-level: persist every N-th snapshot."""
    window: int = 0
    """Exact: iterations per window (W)."""
    redundancy: str = "none"
    """Two-level snapshots also in peers' memory: none/replicate/erasure (the trainer's
    ``--moc-redundancy`` protects two-level snapshots only)."""
    ec_data: int = 4
    """Erasure: data nodes per parity."""
    plt_threshold: float = 0.0375
    """pec-dynamic: accumulated PLT above which K doubles; in (0, 1)."""

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown policy {self.kind!r}; choose from {', '.join(POLICIES)}")
        if self.interval < 1 or self.persist_interval < 1:
            raise ValueError("interval and persist_interval must be >= 1")
        if self.k < 0 or self.k_snapshot < 0:
            raise ValueError("k and k_snapshot must be >= 0 (0: all experts)")
        if self.kind == "exact" and self.window < 1:
            raise ValueError("an exact policy needs a window >= 1")
        if self.redundancy not in REDUNDANCY:
            raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY)}")
        if self.redundancy != "none" and self.kind != "two-level":
            # What the trainer runs: --moc-redundancy protects two-level snapshots only.
            raise ValueError(f"redundancy protects two-level snapshots: not with {self.kind}")
        if self.ec_data < 1:
            raise ValueError("ec_data must be >= 1")
        try:
            trainer_plt.check_threshold(self.plt_threshold)
            if self.kind == "two-level":
                self.trainer_config()
        except ValueError as err:
            raise ValueError(f"the trainer refuses it: {err}") from None

    def trainer_config(self) -> MoCConfig:
        """The trainer's :class:`~deepspeed_ext.config.MoCConfig` of a two-level policy
        (its checks are the trainer's: ``--moc-k-persist`` at most ``--moc-k-snapshot``,
        the redundancy's counts).

        Raises:
            ValueError: what the trainer says.
        """
        return MoCConfig(pec_k=self.k, two_level=True, k_snapshot=self.k_snapshot,
                         persist_interval=self.persist_interval, shm_dir="(planned)",
                         redundancy=self.redundancy, ec_data=self.ec_data)

    def redundancy_spec(self) -> rd.RedundancySpec:
        """The trainer's redundancy of this policy (one replica, one XOR parity: the
        flags :func:`deepspeed_ext.planning.cli.training_flags` gives)."""
        return rd.RedundancySpec(self.redundancy, 1, self.ec_data, 1)

    def label(self) -> str:
        parts = [self.kind]
        if self.kind == "exact":
            parts.append(f"W={self.window}")
        else:
            parts.append(f"every {self.interval}")
        if self.kind in ("pec", "pec-dynamic") or (self.kind == "two-level" and self.k):
            parts.append(f"K={self.k or 'all'}")
        if self.kind == "two-level":
            parts.append(f"Ks={self.k_snapshot or 'all'} persist/{self.persist_interval}")
        if self.redundancy != "none":
            parts.append(self.redundancy + (f"({self.ec_data}+1)" if self.redundancy == "erasure"
                                            else ""))
        return " ".join(parts)
