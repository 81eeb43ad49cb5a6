"""Typed configuration of MoC checkpointing."""

from dataclasses import dataclass


@dataclass
class MoCConfig:
    """What MoC saves and keeps. Built from ``--moc-*`` flags or a ``moc:`` YAML section."""

    pec_k: int = 0
    """Experts saved per MoE layer per checkpoint; 0 means all (``--moc-pec-k``)."""
    pec_policy: str = "sequential"
    """Which experts: ``sequential`` rotation or ``load-aware`` (``--moc-pec-policy``)."""
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
    """Rank 0 gives up committing a checkpoint when a rank's file is not durable by then."""

    def __post_init__(self):
        if self.pec_k < 0:
            raise ValueError(f"--moc-pec-k must be >= 0 (0: all experts), got {self.pec_k}")
        if self.pec_policy not in ("sequential", "load-aware"):
            raise ValueError("--moc-pec-policy must be sequential or load-aware, "
                             f"got {self.pec_policy!r}")
        if self.keep < 0:
            raise ValueError(f"--moc-keep must be >= 0 (0: keep all), got {self.keep}")
        if not self.commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
