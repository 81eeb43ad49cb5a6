"""Plain records of two-level checkpointing: this rank's place, the newest snapshot, the
pending persist, and one snapshot's plan (:mod:`deepspeed_ext.two_level`)."""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.session import CheckpointSession


@dataclass
class RankPlace:
    """Where this rank's two-level state lives; built once by
    :class:`deepspeed_ext.two_level.mode.TwoLevel` and shared by its collaborators."""

    session: CheckpointSession
    cfg: MoCConfig
    rank: int
    world: int
    node: int
    first_of_node: bool
    node_dir: str
    """This node's directory under ``--moc-shm-dir`` (the keeper's, and the slots')."""
    spec: Any
    """The redundancy spec (:class:`deepspeed_ext.policy.redundancy.RedundancySpec`)."""
    topo: Any = None
    """The node topology when redundancy is on (else None)."""
    num_slots: int = 0
    run_id: Optional[str] = None
    """This job's identity, recorded in every snapshot (:mod:`deepspeed_ext.job_identity`)."""
    copier: Any = None
    """The device-to-host copier (:class:`deepspeed_ext.engine.hostcopy.HostCopier`)."""
    slots: Any = None
    """This rank's snapshot slots (:class:`deepspeed_ext.snapshot.SnapshotSlots`)."""
    redundancy: Any = None
    """The peers' redundancy (:class:`deepspeed_ext.peers.PeerRedundancy`), or None."""
    budget_bytes: int = 0
    """Shared memory this rank's slots (and what it holds for its peers) may take."""


@dataclass
class NewestSnapshot:
    """``TwoLevel.last``: the newest snapshot of this rank, as its persist needs it."""

    slot: int
    meta: Dict[str, Any]
    """The slot's published metadata (``step``, ``tag``, ``entries``, ``specs``, ...)."""
    pieces: Any
    """The write plan's pieces (:func:`deepspeed_ext.policy.plan.build_write_plan`)."""
    save_dir: str
    save_latest: bool
    object_keys: List[str]
    persisted: bool
    """Whether a persist of it was asked for (every rank the same)."""
    rng_state: Any
    rng_gathered: bool
    """Whether its objects hold every rank's RNG state (else only this rank's)."""


@dataclass
class PendingPersist:
    """``TwoLevel.persist``: the last persist requested and not yet seen committed."""

    save_dir: str
    tag: str
    selected: FrozenSet
    """The experts it saves (empty without MoE), unmarked should it fail."""
    policy_before: Any
    """The PEC policy's state before this persist marked them."""
    slot: int
    in_process: bool
    """Persisted by this process (its keeper was gone), not by the keeper."""
    claim: Optional[str]
    started: float = field(default_factory=time.monotonic)
    keeper_lost: bool = False
    """This rank's keeper died while it was pending: it ends as failed (a wait persists
    the newest snapshot in process instead of raising)."""


@dataclass(frozen=True)
class PersistRequest:
    """A persist the save call decided; the seal thread builds its keeper job from it
    (:meth:`deepspeed_ext.two_level.persister.Persister.job_for`)."""

    snap: NewestSnapshot
    selected: Optional[FrozenSet]
    """The experts it saves (None: no MoE)."""
    claim: Optional[str]
    """Rank 0's claim on the persist's directory."""
    commit: Any = None
    """Rank 0: what its keeper commits (:class:`deepspeed_ext.jobs.CommitSpec`); else None."""


@dataclass
class SnapshotPlan:
    """One snapshot as every rank decided it, before its bytes are copied."""

    save_dir: str
    tag: str
    step: int
    save_latest: bool
    start: float
    """``time.perf_counter()`` when the save call began."""
    want: bool
    """Due for storage (every ``persist_interval``-th snapshot)."""
    persist: bool = False
    """Due and nothing pending: this snapshot is persisted."""
    rng_state: Any = None
    rng_states: List = field(default_factory=list)
    prepared: Any = None
    """Rank 0's outcome of preparing the persist's directory ``(ok, error, claim)``."""
    union: Optional[FrozenSet] = None
    """Experts in the snapshot (None: no MoE)."""
    persist_sel: FrozenSet = frozenset()
    """Experts the persist saves."""
    policy_before: Any = None
    claim: Optional[str] = None
    started: bool = False
    """Its copy and seal were handed to the stages' threads."""


@dataclass
class SnapshotTiming:
    """Where one snapshot's time went, stage by stage (``TwoLevel.timings``).

    The save call's thread fills the first fields, the copy thread ``copy_s`` (and on
    CPU ``copies``), the optimizer step's hook ``host_wait_s``/``device_wait_s``, the seal
    thread the rest. Benchmarks read them once the snapshot is sealed (``sealed``);
    nothing in training depends on them.
    """

    step: int
    persist: bool
    """Whether this snapshot was handed to the keeper for storage."""
    nbytes: int = 0
    """Bytes of the image copied into the slot."""
    copies: int = 0
    """``copy_`` calls that moved the image (a few per parameter group with a cached plan)."""
    save_s: float = 0.0
    """The save call, start to return (includes ``slot_wait_s``)."""
    slot_wait_s: float = 0.0
    """Part of the save call spent waiting for a slot (every slot busy: the oldest seal,
    a persist, or the peers' redundancy)."""
    host_wait_s: float = 0.0
    """The optimizer step's host wait for the copy (CPU: the end of the fill; CUDA: 0, the
    compute stream waits on the copy's event instead)."""
    device_wait_s: Optional[float] = None
    """CUDA: how long the compute stream waited for the copy's event (CUDA events);
    None on CPU."""
    copy_s: float = 0.0
    """The copy itself (CPU: the fill on the copy thread; CUDA: the side stream's events)."""
    checksum_s: float = 0.0
    """The seal's checksum of the image."""
    checksum_threads: int = 0
    """Threads the checksum used."""
    publish_s: float = 0.0
    """The seal's metadata write (and hand-over of the persist job)."""
    sealed: bool = False
    """Set last, once every other field is final."""
