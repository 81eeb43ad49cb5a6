"""Typed configuration of MoC checkpointing."""

from dataclasses import dataclass
from typing import Optional

from deepspeed_ext.format.vocab import PaddedVocab


@dataclass
class MoCConfig:
    """What MoC saves and keeps. Built from ``--moc-*`` flags or a ``moc:`` YAML section."""

    pec_k: int = 0
    """Experts saved per MoE layer per checkpoint; 0 means all (``--moc-pec-k``)."""
    pec_policy: str = "sequential"
    """Which experts: ``sequential`` rotation or ``load-aware`` (``--moc-pec-policy``)."""
    pec_scope: str = "wo"
    """What PEC leaves out of unselected experts: ``wo`` weights and optimizer state,
    ``w`` weights only, ``o`` optimizer state only (``--moc-pec-scope``)."""
    keep: int = 0
    """Complete checkpoints to retain; 0 keeps all (``--moc-keep``). Versions still
    referenced by a kept checkpoint's expert index are never deleted."""
    verify_on_load: bool = True
    """Check every file's checksum before loading from it."""
    chunk_bytes: int = 64 << 20
    """Replicated tensors are cut into chunks of this size so their writes can be balanced."""
    async_save: bool = True
    """Return from a save once the state is copied to host memory; write and commit in the
    background (``--moc-sync-save`` turns it off: the save returns once committed)."""
    commit_timeout_s: float = 600.0
    """Rank 0 gives up committing a checkpoint when a rank's file is not durable by then
    (``--moc-commit-timeout``)."""
    two_level: bool = False
    """Saves are snapshots into a per-node keeper's shared memory, persisted to storage in
    the background (``--moc-two-level``)."""
    k_snapshot: int = 0
    """Experts per MoE layer in each in-memory snapshot; 0: all (``--moc-k-snapshot``)."""
    persist_interval: int = 1
    """Persist every N-th snapshot to storage, with ``pec_k`` experts per MoE layer
    (``--moc-persist-interval``)."""
    shm_dir: str = ""
    """The job's shared-memory directory (one ``nodeN/`` per node); required with two_level.
    Created private (mode 0700) or refused when another user could reach it."""
    save_dir: str = ""
    """The job's checkpoint directory (``--save``, or ``--load`` without one): keeps its
    run id, which binds the shared memory to this job (:mod:`deepspeed_ext.job_identity`),
    and is the only directory its keepers persist into; empty: the job is known by
    ``shm_dir`` alone."""
    ranks_per_node: int = 0
    """Ranks per node for keeper placement; 0: the launcher's count (``LOCAL_WORLD_SIZE``,
    ``LOCAL_SIZE`` or ``SLURM_NTASKS_PER_NODE``: :mod:`deepspeed_ext.node_layout`; ``--moc-ranks-per-node``
    simulates several nodes on one machine)."""
    keeper_idle_timeout_s: float = 600.0
    """A keeper exits when none of its training processes has been alive this long."""
    host_memory_gb: float = 0.0
    """Budget for one rank's snapshot slots; 0: unchecked (``--moc-host-memory-gb``)."""
    checksum_threads: int = 0
    """Threads hashing each snapshot's image after its copy, off the step's path; 0: up
    to 4, half the host's cores (``--moc-checksum-threads``)."""
    redundancy: str = "none"
    """Copies of the snapshots in other nodes' memory: ``none``, ``replicate`` or
    ``erasure`` (``--moc-redundancy``); needs two_level."""
    replicas: int = 1
    """Peer nodes holding a copy of each node's snapshots (``--moc-replicas``)."""
    ec_data: int = 2
    """Data nodes per erasure group (``--moc-ec-data``)."""
    ec_parity: int = 1
    """Parity pieces per erasure group; 1 (XOR) (``--moc-ec-parity``)."""
    redundancy_interval: int = 1
    """Protect every N-th snapshot in the peers' memory (``--moc-redundancy-interval``)."""
    padded_vocab: Optional[PaddedVocab] = None
    """The model's tensors whose rows are a padded vocabulary, and how many rows hold
    tokens (the trainer sets it from its tokenizer and its padded vocabulary size): saved
    with each checkpoint, and a load under another padding (another tensor-parallel size)
    trims or adds padding rows (:mod:`deepspeed_ext.format.vocab`). None: such a load is
    refused."""

    def __post_init__(self):
        if self.pec_k < 0:
            raise ValueError(f"--moc-pec-k must be >= 0 (0: all experts), got {self.pec_k}")
        if self.pec_policy not in ("sequential", "load-aware"):
            raise ValueError("--moc-pec-policy must be sequential or load-aware, "
                             f"got {self.pec_policy!r}")
        if self.pec_scope not in ("wo", "w", "o"):
            raise ValueError(f"--moc-pec-scope must be wo, w or o, got {self.pec_scope!r}")
        # Snapshots and the two-level overlay keep one version per expert; a one-part
        # variant's split versions would be overwritten by an older memory copy.
        if self.two_level and self.pec_scope != "wo":
            raise ValueError(f"--moc-pec-scope {self.pec_scope} is not supported with "
                             "--moc-two-level (use wo)")
        if self.keep < 0:
            raise ValueError(f"--moc-keep must be >= 0 (0: keep all), got {self.keep}")
        if not 0 < self.commit_timeout_s < float("inf"):  # inf hung the shutdown barrier
            raise ValueError(f"commit_timeout_s must be a finite number > 0, got {self.commit_timeout_s}")
        if self.k_snapshot < 0 or self.persist_interval < 1:
            raise ValueError("--moc-k-snapshot must be >= 0 and --moc-persist-interval >= 1, got "
                             f"{self.k_snapshot} and {self.persist_interval}")
        if self.two_level and self.pec_k and self.k_snapshot and self.pec_k > self.k_snapshot:
            raise ValueError(f"--moc-k-persist/--moc-pec-k ({self.pec_k}) must not exceed "
                             f"--moc-k-snapshot ({self.k_snapshot})")
        if self.two_level and not self.shm_dir:
            raise ValueError("two-level checkpointing needs shm_dir (the trainer derives it "
                             "from --save)")
        self.redundancy_spec()  # raises on a bad mode or count, naming the flag
        if self.redundancy_interval < 1:
            raise ValueError(f"--moc-redundancy-interval must be >= 1, got "
                             f"{self.redundancy_interval}")
        if self.redundancy != "none" and not self.two_level:
            raise ValueError(f"--moc-redundancy {self.redundancy} protects two-level snapshots: "
                             "add --moc-two-level")
        if self.checksum_threads < 0:
            raise ValueError(f"--moc-checksum-threads must be >= 0 (0: automatic), got "
                             f"{self.checksum_threads}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")

    def redundancy_spec(self):
        """The :class:`deepspeed_ext.policy.redundancy.RedundancySpec` of these settings."""
        from deepspeed_ext.policy.redundancy import RedundancySpec
        return RedundancySpec(self.redundancy, self.replicas, self.ec_data, self.ec_parity)
