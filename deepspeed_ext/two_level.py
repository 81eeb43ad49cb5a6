"""Two-level checkpointing: snapshots into the keeper's memory, persistence in the background.

Switched on by ``MoCConfig.two_level``; :class:`deepspeed_ext.checkpointer.MoCCheckpointer`
then routes ``save``/``load``/``wait`` here. Every rank calls them, in the same order.

``save`` (a snapshot), per rank:

1. joins the previous snapshot's copy (normally finished long before: the wrapped
   ``engine.step`` waits for it before the optimizer touches the tensors);
2. only if this snapshot is due for storage (every ``persist_interval``-th): one small
   collective (:class:`deepspeed_ext.runtime.exchange.Exchanger`) of (copy errors, rank 0's view
   of the previous persist, every rank's RNG state). A failed copy is raised on every
   rank; a persist still running defers this one (training never waits for storage); a
   failed persist is logged and its experts count as unsaved again. Snapshots not due
   for storage run no collective at all: they keep only their own rank's RNG state, and
   a copy error surfaces at the next due snapshot or ``wait``;
3. picks the experts: ``k_snapshot`` per MoE layer for memory (sequential rotation),
   plus, when persisting, the PEC policy's ``pec_k`` for storage (always also in the
   snapshot);
4. hands a long-lived thread the copy of every fragment this rank needs to restore itself
   into a free slot (:mod:`deepspeed_ext.snapshot`; on CUDA the copy is queued on a side
   stream, :mod:`deepspeed_ext.engine.hostcopy`); the thread marks the slot complete and hands it
   to the keeper for persistence (:func:`deepspeed_ext.keeper.run_persist_job`), which
   commits through report files (:mod:`deepspeed_ext.store.commit`), no collective.

``wait`` (every rank): joins the copy, waits for the pending persist, and persists the
newest snapshot if it was not (gathering the RNG states it lacks), so that the end of a
job never frees state that storage does not have.

``load``: ranks agree (one ``all_gather`` of a small fixed-size buffer) on the newest
step every rank holds complete in memory with this layout, and restore from memory
(one more such ``all_gather`` makes any rank's failure everyone's); experts not in that
snapshot come from the newest version among older slots and storage. Otherwise they
load from storage, and ranks whose memory survived then take their experts' newer
snapshots from memory (two-level recovery). Every load logs where pieces came from.
"""

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext import keeper
from deepspeed_ext.engine.hostcopy import HostCopier
from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE
from deepspeed_ext.jobs import CommitSpec, ImageEntry, PersistJob
from deepspeed_ext.runtime.exchange import Exchanger
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import (MoCCheckpointError, all_outcomes, broadcast_outcome,
                                          raise_if_failed)
from deepspeed_ext.runtime.retry import Backoff, poll_until
from deepspeed_ext.snapshot import SLOTS, SlotImage, SnapshotSlots
from deepspeed_ext.state import FP32
from deepspeed_ext.store import claims, commit
from deepspeed_ext.store.latest import extended_tag
from deepspeed_ext.store.reader import check_saved_shape

LAYOUT_CACHE = 16
"""Image layouts a rank keeps (one per set of snapshotted experts and object shapes)."""
LOAD_EXCHANGE_BYTES = 4096
"""Bytes per rank of a load's exchanges (steps held; outcome with the expert versions
taken); a value that does not fit costs two more collectives, not an error."""
COMMIT_POLL_BACKOFF = Backoff(first_s=0.01, max_s=0.2)
"""Sleeps between a rank's polls for the pending persist's commit (:meth:`TwoLevel.wait`)."""


logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def _bytes_held(directory: str) -> int:
    """Bytes the files under ``directory`` occupy (a previous attempt's slot images this
    rank will reuse: already taken from the free space)."""
    total = 0
    for dirpath, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _short_nodes(gathered: List) -> List[str]:
    """Every rank, from the gathered ``(problem, needed, held, free, node, root)``: the
    nodes whose shared-memory filesystem cannot hold all their ranks' slots. The ranks
    of a node share it: checking each rank's need alone passed 8 ranks of 10 GiB on 30
    GiB free, and the copies then died of SIGBUS in the middle of a snapshot."""
    nodes: Dict[int, List] = {}
    for _, needed, held, free, node, root in gathered:
        entry = nodes.setdefault(node, [0, free, root, 0])
        entry[0] += max(0, needed - held)
        entry[3] += 1
    return [f"node {node}: {root} has {free / 2**30:.3f} GiB free, its {ranks} rank(s)' "
            f"snapshot slots need {want / 2**30:.3f} GiB more (point --moc-shm-dir at a "
            f"larger shared-memory filesystem, or enlarge it)"
            for node, (want, free, root, ranks) in sorted(nodes.items())
            if free is not None and want > free]


def _newest_stored_step(load_dir: str) -> Optional[int]:
    """Rank 0, before recovery's first exchange (never raises): the step of the
    checkpoint ``latest`` names under ``load_dir``; None when there is none or it cannot
    be read (the storage load would then fall back to an older one: memory wins)."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest
    try:
        tag = latest.read_latest(load_dir) if fs.isdir(load_dir) else None
        return mf.read_manifest(os.path.join(load_dir, tag)).step if tag else None
    except Exception as e:
        _log(f"recovery: cannot read the newest checkpoint of {load_dir} ({type(e).__name__}: "
             f"{e}); memory decides")
        return None


def default_shm_dir(save_dir: str) -> str:
    """A shared-memory directory that is the same for every restart of one job (keyed by
    the absolute checkpoint directory, or its URL) and different for other jobs."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    digest = hashlib.sha256(fs.identity(save_dir).encode()).hexdigest()[:12]
    return os.path.join(root, f"moc-{os.getuid()}-{digest}")


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


class TwoLevel:
    """Level 1 and level 2 state of one rank; created by the checkpointer."""

    def __init__(self, ckpt):
        from deepspeed_ext.policy.pec import make_policy
        cfg = ckpt.config
        self.ckpt = ckpt
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from deepspeed_ext.node_layout import ranks_per_node
        per_node = ranks_per_node(cfg.ranks_per_node, self.world)
        self.node = self.rank // per_node
        self.first_of_node = self.rank % per_node == 0
        self.node_dir = os.path.join(cfg.shm_dir, f"node{self.node}")
        self.spec = cfg.redundancy_spec()
        self.topo = None
        if self.spec.enabled:
            from deepspeed_ext.policy.redundancy import Topology, check_layout
            try:
                self.topo = Topology(self.world, per_node)
                check_layout(self.spec, self.topo)
            except ValueError as err:  # the same on every rank: every rank raises
                raise MoCCheckpointError(str(err)) from None
        # Erasure coding protecting every N-th snapshot rebuilds a lost node from the
        # survivors' own copies of the newest protected one: a fourth slot keeps it while
        # the others hold the newest snapshot and the one being persisted.
        self.num_slots = SLOTS + (1 if self.spec.enabled and self.spec.mode == "erasure"
                                  and cfg.redundancy_interval > 1 else 0)
        from deepspeed_ext.job_identity import agree_run_id
        from deepspeed_ext.state import describe_local_state
        self.run_id = agree_run_id(cfg.save_dir, cfg.shm_dir, log=_log)
        """This job's identity, recorded in every snapshot (:mod:`deepspeed_ext.job_identity`)."""
        frags = describe_local_state(ckpt.engine, ckpt.naming, with_moments=False)
        self.copier = HostCopier(HostCopier.device_of({f.key: f.tensor for f in frags}))
        # The node's directory made private and bound to this job inside the budget
        # check's collective (a refusal reaches every rank); then the keeper.
        self._check_memory_budget(frags)
        self._start_keeper()
        self.exchanger = Exchanger()
        self._load_exchanger: Optional[Exchanger] = None
        """The current load's exchanges (steps held, outcomes), preset to their small size."""
        self.snap_policy = None
        if ckpt.layout is not None:
            k = cfg.k_snapshot or ckpt.layout.num_experts
            self.snap_policy = make_policy("sequential", ckpt.layout,
                                           min(k, ckpt.layout.num_experts))
        self.count = 0
        self.fault_hook: Optional[Callable[[int], None]] = None
        """Fault injection: called by the copy thread with the step once a snapshot's bytes
        are copied, before the slot is published as complete."""
        # One long-lived copy thread: starting a thread per snapshot made the save call
        # wait up to a GIL switch interval (5 ms) for the new thread to start.
        self.copier_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-snapshot")
        self.sender_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-hand-over")
        """Hands persist jobs to the keeper, in order, off the copy thread: the next
        training step waits for the copy, and a busy keeper may take its time to answer."""
        self.send_job: Optional[Future] = None
        """The last hand-over (on ``sender_pool``)."""
        self.copy_job: Optional[Future] = None
        """The running snapshot copy (on ``copier_pool``), joined before the next step."""
        self.copy_error: Optional[str] = None
        self.stall_s: List[float] = []
        self.keeper_gone = False
        self.local_persists: List[threading.Thread] = []
        """Persists run in this process since the keeper died (:meth:`_drain` joins them)."""
        self.persist: Optional[PendingPersist] = None
        """The last persist requested and not yet seen committed."""
        self.last: Optional[NewestSnapshot] = None
        """The newest snapshot: its slot, metadata, write pieces, and whether it was persisted."""
        self.last_load_source: Optional[str] = None
        self._images: Dict[int, SlotImage] = {}
        """Slot images mapped by the load in progress."""
        self.redundancy = None
        if self.spec.enabled:
            from deepspeed_ext.peers import PeerRedundancy
            self.redundancy = PeerRedundancy(self.spec, self.topo, self.node_dir,
                                             cfg.commit_timeout_s)
        self._protected: Optional[Tuple[int, int]] = None
        """(slot, step) of the newest snapshot given to the redundancy (erasure keeps it)."""
        self._evict_warned = False
        self.redundancy_wait_s = 0.0
        """Seconds snapshots waited for a slot still being protected (redundancy slower
        than the snapshots)."""
        self._specs: Dict[tuple, Dict[str, Any]] = {}
        self._described: Optional[tuple] = None
        """(state identity, fragments, signature, rows) of the last snapshot (:meth:`_fragments`)."""
        self._layouts: Dict[tuple, tuple] = {}
        """(keys, shapes, dtypes) -> (image layout, metadata entries) (:meth:`_layout`)."""
        self._wrap_step()

    def _check_memory_budget(self, frags) -> None:
        """Before training: make this rank's home in shared memory (private directories
        bound to this job, the snapshot slots; :meth:`_make_home`), then refuse a failure
        there, or a budget (or a shared-memory filesystem) too small for the slots, on
        every rank (one ``all_gather_object``), naming the flag or size to fix.

        Args:
            frags: this rank's fragments (fp32 master weights; moments are as large).
        """
        home_problem = self._make_home()
        # fp32 master weights plus Adam's two moments, for every slot.
        image = 3 * sum(f.length * 4 for f in frags)
        needed = self.num_slots * image
        if self.spec.enabled:  # what this rank holds for its peers
            from deepspeed_ext.peers import KEEP
            from deepspeed_ext.policy.redundancy import extra_bytes
            needed += extra_bytes(self.spec, image, KEEP)
        problem = None
        budget = self.cfg.host_memory_gb * 2**30
        if budget and needed > budget:
            problem = (f"rank {self.rank}: its {self.num_slots} snapshot slots need "
                       f"{needed / 2**30:.3f} GiB of host memory"
                       + (f" (with what it holds for its peers: --moc-redundancy "
                          f"{self.spec.describe()})" if self.spec.enabled else "")
                       + ", --moc-host-memory-gb allows "
                       f"{self.cfg.host_memory_gb:g}")
        root = os.path.dirname(os.path.abspath(self.cfg.shm_dir)) or "/"
        free = None
        if os.path.isdir(root):
            stat = os.statvfs(root)
            free = stat.f_bavail * stat.f_frsize
        gathered: List = [None] * self.world
        held = _bytes_held(os.path.join(self.node_dir, f"rank{self.rank:05d}"))  # SnapshotSlots.dir
        dist.all_gather_object(gathered, (problem or home_problem, needed, held, free,
                                          self.node, root), group=metadata_group())
        problems = [p for p, *_ in gathered if p] + _short_nodes(gathered)
        if problems:
            raise MoCCheckpointError("; ".join(problems))
        self.budget_bytes = needed
        _log(f"two-level checkpointing: up to {max(g[1] for g in gathered) / 2**20:.1f} MiB of "
             f"snapshot memory per rank ({self.num_slots} slots"
             + (f" and the peers' redundancy, {self.spec.describe()}" if self.spec.enabled else "")
             + f") under {self.cfg.shm_dir}")

    def _make_home(self) -> Optional[str]:
        """This rank, before the start-up exchange: make its node's directory private and
        bind it to this job's run id, and open its slots; returns what went wrong (None:
        nothing), for every rank to raise. Starts no keeper: a job refused here leaves
        no process behind."""
        from deepspeed_ext.job_identity import ForeignJobError
        from deepspeed_ext.private_dir import UnsafeDirectoryError
        try:
            keeper.claim_node_dir(self.node_dir, self.run_id)
            self.slots = SnapshotSlots(self.node_dir, self.rank, slots=self.num_slots,
                                       on_map=self.copier.register,
                                       on_unmap=self.copier.unregister, run_id=self.run_id)
        except (UnsafeDirectoryError, ForeignJobError, keeper.KeeperError, OSError) as e:
            self.slots = None
            return f"rank {self.rank}: {e}"
        return None

    def _start_keeper(self) -> None:
        """Every rank, after the start-up checks: attach to (or start) the node's keeper;
        a keeper that does not answer on one node is raised on every rank (one
        collective), not left to that node's ranks while the others train on."""
        ok, error = True, None
        try:
            keeper.ensure_keeper(self.node_dir, self.cfg.keeper_idle_timeout_s,
                                 run_id=self.run_id, save_dir=self.cfg.save_dir or None)
        except Exception as e:
            traceback.print_exc()
            ok, error = False, f"{type(e).__name__}: {e}"
        raise_if_failed(all_outcomes(ok, error), f"MoC keeper of {self.node_dir}")

    # -- the stall point ---------------------------------------------------------

    def _wrap_step(self) -> None:
        from deepspeed_ext.engine.hostcopy import wait_before_step
        wait_before_step(self.ckpt.engine, lambda: self.copy_job is not None, self.join_copy,
                         self.stall_s)

    def join_copy(self) -> None:
        if self.copy_job is not None:
            self.copy_job.result()  # _copy records its errors; it does not raise
            self.copy_job = None

    # -- snapshot ------------------------------------------------------------------

    def save(self, save_dir: str, tag: Optional[str], client_state, save_latest: bool) -> bool:
        from deepspeed_ext.format.objects import encode
        ck, engine = self.ckpt, self.ckpt.engine
        start = time.perf_counter()
        self.join_copy()
        step = int(engine.global_steps)
        tag = tag or f"global_step{step}"
        # Everything this rank needs to restore itself (its own partitions), so that
        # recovery from memory never needs another node's memory.
        fragments, signature, rows = self._fragments()
        pieces = ck._gather_pieces(fragments)
        want = self.count % self.cfg.persist_interval == 0
        self.count += 1
        rng_state = get_rng_state()
        prepared = None
        if want:
            self._abandon_persist_of_dead_keeper()  # before the view the decision rests on
            view = self._persist_view() if self.rank == 0 else None
            if view is not None and self.rank == 0:
                # This persist will run (nothing pending, or the pending one finished):
                # rank 0 creates its directory now, and the outcome travels with the
                # exchange instead of a second collective in the save call.
                prepared = self._prepare_on_rank0(save_dir, tag, step)
            # The one collective of a snapshot due for storage: copy errors, rank 0's view
            # of the pending persist and of the new directory, and every rank's RNG state
            # (the persist's objects).
            gathered = self.exchanger.exchange((self.copy_error, view, rng_state, prepared))
            self.copy_error = None
            raise_if_failed([(error is None, error) for error, _, _, _ in gathered],
                             "MoC snapshot copy")
            rng_states = [rng for _, _, rng, _ in gathered]
            self._settle_persist(gathered[0][1])
            prepared = gathered[0][3]
        else:
            # No collective at all: memory recovery needs only this rank's own RNG state
            # (other ranks restore theirs from their own snapshots); a copy error is
            # raised on every rank at the next persisted snapshot or wait().
            rng_states = [None] * self.world
            rng_states[self.rank] = rng_state
        persist = want and self.persist is None
        if want and not persist:
            _log(f"snapshot at step {step}: the previous persist ({self.persist.tag}) is "
                 f"still running; this snapshot stays in memory only")
        snap_sel = self.snap_policy.select() if self.snap_policy is not None else None
        persist_sel = ck.select_experts(save_dir) if (persist and ck.policy is not None) \
            else frozenset()
        union = (snap_sel | persist_sel) if snap_sel is not None else None
        if self.snap_policy is not None:
            self.snap_policy.mark_saved(union, step)
            ck.ledger.mark_saved(union, step)  # every persisted expert is in the union
        policy_before = ck.policy.state_dict() if ck.policy is not None else None
        if persist and ck.policy is not None:
            ck.policy.mark_saved(persist_sel, step)
        claim = self._raise_if_unprepared(prepared, save_dir, tag, policy_before) \
            if persist else None
        try:  # rank-local from here on: see the except
            objects = ck._objects(client_state)
            objects["rng_states"] = rng_states
            objects["snapshot_policy"] = (self.snap_policy.state_dict()
                                          if self.snap_policy is not None else None)
            tree, object_tensors = encode(objects)
            tensors, specs = {}, {}
            for key, tensor, expert, spec in rows:
                if expert is None or union is None or expert in union:
                    tensors[key] = tensor
                    specs[key] = spec
            tensors.update(object_tensors)
            layout, entries = self._layout(tensors)
            slot = self._free_slot()
            self.slots.invalidate(slot)
            buffer = self.slots.buffer(slot, layout.nbytes)
            meta = {"step": step, "tag": tag, "signature": signature, "entries": entries,
                    "specs": specs, "experts": sorted(union) if union is not None else None,
                    "objects_tree": tree, "run_id": self.run_id}
            self.last = NewestSnapshot(slot=slot, meta=meta, pieces=pieces, save_dir=save_dir,
                                       save_latest=save_latest,
                                       object_keys=list(object_tensors), persisted=persist,
                                       rng_state=rng_state, rng_gathered=want)
            job = self._persist_job(self.last, persist_sel if union is not None else None,
                                    policy_before, claim) if persist else None
            # CUDA: the copies are queued on a side stream now (microseconds); the thread
            # only waits for them. CPU: the thread does the copy.
            event = self.copier.launch(buffer, layout, tensors)
            # Every rank protects the same snapshots (the count is the same everywhere), so
            # the peers' messages pair up.
            protect = (self.redundancy is not None
                       and (self.count - 1) % self.cfg.redundancy_interval == 0)
            self.copy_job = self.copier_pool.submit(self._copy, slot, event, buffer, layout,
                                                       tensors, meta, job, protect)
            if protect:
                self._protected = (slot, step)
            if persist or self.count == 1:  # a line per snapshot would flood per-iteration runs
                _log(f"snapshot {tag} (step {step}) into {self.node_dir}: "
                     f"{layout.nbytes / 2**20:.2f} MiB on rank 0, "
                     + (f"{len(union)} of {ck.layout.num_moe_layers * ck.layout.num_experts} "
                        f"experts" if union is not None else "no MoE")
                     + ((f", persisting {len(persist_sel)} of them" if union is not None
                         else ", persisting") if persist else ", in memory only")
                     + f"; the save call took {time.perf_counter() - start:.3f} s")
            return True
        except Exception as e:
            # Rank-local (shared memory full on this node, say), after this snapshot's
            # exchange: raising here would leave the other ranks in training's next
            # collective. Recorded like a copy error instead, and raised on every rank
            # at the next persisted snapshot or wait().
            traceback.print_exc()
            if (self.copy_job is None and self.redundancy is not None
                    and (self.count - 1) % self.cfg.redundancy_interval == 0):
                # The copy thread never started, so it will not take part in this
                # snapshot's protection: do it here, or the peers' messages stop pairing.
                self.redundancy.protect(step, -1, None, None)
            self.copy_error = f"snapshot {tag}: {type(e).__name__}: {e}"
            logger.warning(
                f"[moc] rank {self.rank}: WARNING: {self.copy_error} (raised on every rank at "
                f"the next persisted snapshot)")
            return False

    def _fragments(self) -> Tuple[list, str, list]:
        """This rank's fragments (fp32 master and moments), their signature, and per
        fragment ``(key, tensor, expert, manifest spec)``; described again only when the
        tensors they point into changed (a load, a new optimizer state): describing
        hundreds of parameters took milliseconds of every save call. Keeping the
        fragments keeps the old tensors alive, which is what makes
        :func:`~deepspeed_ext.state.state_identity` notice their replacement."""
        from deepspeed_ext.state import describe_local_state, state_identity
        identity = state_identity(self.ckpt.engine)
        if self._described is None or not identity.same(self._described[0]):
            fragments = describe_local_state(self.ckpt.engine, self.ckpt.naming)
            rows = [(f.key, f.tensor, tuple(f.expert) if f.expert is not None else None,
                     self._spec(f)) for f in fragments]
            self._described = (identity, fragments, self.signature(fragments), rows)
        return self._described[1:]

    def _layout(self, tensors: Dict[str, torch.Tensor]) -> Tuple[Any, List[Dict[str, Any]]]:
        """The image layout of ``tensors`` and its metadata entries, computed once per
        set of keys, shapes and dtypes (the same every snapshot unless K's expert choice
        or the layout changes). The entries are shared by the snapshots' metadata and
        never modified."""
        from deepspeed_ext.format.image import layout_of
        key = tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items())
        hit = self._layouts.get(key)
        if hit is None:
            layout = layout_of(tensors)
            entries = [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                        "start": e.start, "nbytes": e.nbytes} for e in layout.entries]
            if len(self._layouts) >= LAYOUT_CACHE:  # bounded: e.g. K's rotation of experts
                self._layouts.clear()
            hit = self._layouts[key] = (layout, entries)
        return hit

    def _free_slot(self) -> int:
        """A slot for the next snapshot that neither the keeper nor the redundancy thread
        still reads, nor holds the snapshot erasure coding needs to rebuild a lost node
        (:meth:`_kept_for_rebuild`); waits for the redundancy only when no other slot is
        free, and gives up the kept snapshot only when even that leaves none."""
        busy = self.redundancy.busy_slots() if self.redundancy is not None else set()
        keep = self._kept_for_rebuild()
        try:
            return self.slots.choose(exclude=busy | keep)
        except RuntimeError:
            pass
        if busy:
            waited = self.redundancy.wait_slots()
            self.redundancy_wait_s += waited
            _log(f"WARNING: the next snapshot waited {waited:.3f} s for the redundancy of an "
                 f"earlier one (snapshots come faster than peers receive them: snapshot less "
                 f"often, or use --moc-redundancy erasure, which sends less)")
        try:
            return self.slots.choose(exclude=keep)
        except RuntimeError:
            if not keep:
                raise
        if not self._evict_warned:
            self._evict_warned = True
            logger.warning(
                f"[moc] rank {self.rank}: WARNING: reusing the slot of step "
                f"{self._protected[1]}'s snapshot, the newest one erasure coding protects "
                f"(the other slots are newer or still being persisted): a node lost "
                f"before the next protected snapshot recovers from storage")
        return self.slots.choose()

    def _kept_for_rebuild(self) -> set:
        """The slot to keep for erasure coding, as a set (empty: none to keep). Rebuilding
        a lost node's snapshot of step S needs the other stripe members' own snapshots
        of S besides the parities; with ``--moc-redundancy-interval`` above 1 the slots
        would otherwise have moved past S before the next protected snapshot (replicas
        need nothing of the survivors, and with interval 1 the newest is kept anyway)."""
        if (self.redundancy is None or self.spec.mode != "erasure"
                or self.cfg.redundancy_interval <= 1 or self._protected is None):
            return set()
        slot, step = self._protected
        meta = self.slots.meta(slot)
        return {slot} if meta is not None and meta["step"] == step else set()

    def _spec(self, frag) -> Dict[str, Any]:
        """The manifest spec of a fragment, built once per fragment (every snapshot needs
        hundreds of them, and they change only with the layout)."""
        from deepspeed_ext.format import assemble
        cache_key = (frag.key, frag.length, tuple(frag.shape), frag.tensor.dtype, frag.expert)
        spec = self._specs.get(cache_key)
        if spec is None:
            spec = self._specs[cache_key] = assemble.FragmentSpec(
                frag.name, frag.kind, frag.offset, frag.length, frag.shape,
                str(frag.tensor.dtype).rsplit(".", 1)[-1], frag.expert).to_json()
        return spec

    def _prepare_dir(self, save_dir: str, tag: str, step: int, policy_before) -> Optional[str]:
        """Every rank: create the persist's tag directory (one broadcast of rank 0's
        :meth:`_prepare_on_rank0` outcome), then :meth:`_raise_if_unprepared`; returns the
        directory's claim. For a persist outside a snapshot's exchange (the end of training)."""
        status = [self._prepare_on_rank0(save_dir, tag, step) if self.rank == 0 else None]
        dist.broadcast_object_list(status, src=0, group=metadata_group())
        return self._raise_if_unprepared(status[0], save_dir, tag, policy_before)

    def _prepare_on_rank0(self, save_dir: str, tag: str, step: int) -> Tuple[bool, Optional[str], Optional[str]]:
        """Rank 0: create a persist's tag directory; ``(ok, error, claim)``, never raises."""
        try:
            self.ckpt.prepare_save_dir(save_dir, tag, step)
            return True, None, claims.read_claim(os.path.join(save_dir, tag))
        except Exception as e:
            traceback.print_exc()
            return False, f"{type(e).__name__}: {e}", None

    def _raise_if_unprepared(self, prepared, save_dir: str, tag: str, policy_before) -> Optional[str]:
        """Every rank, with rank 0's :meth:`_prepare_on_rank0` outcome from the exchange:
        a failure is raised on every rank and the PEC policy's marks are undone. Returns
        the directory's claim, which every rank's persist job carries."""
        if prepared is None or not prepared[0]:
            if self.ckpt.policy is not None:
                self.ckpt.policy.load_state_dict(policy_before)
            why = prepared[1] if prepared is not None else "rank 0 did not prepare it"
            raise MoCCheckpointError(f"MoC persist to {os.path.join(save_dir, tag)} failed "
                                     f"on rank 0: {why}")
        return prepared[2]

    def _persist_job(self, snap: NewestSnapshot, selected, policy_before,
                     claim: Optional[str]) -> PersistJob:
        """This rank's persist job for the snapshot ``snap`` (a ``self.last`` record)
        holding ``selected`` experts on storage (None: no MoE), under rank 0's ``claim``
        on its directory; records it as the pending persist. The keeper runs it
        (:func:`keeper.run_persist_job`; its JSON crosses the keeper's socket)."""
        from deepspeed_ext.policy.plan import build_write_plan
        ck, meta = self.ckpt, snap.meta
        save_dir, tag, step = snap.save_dir, meta["tag"], meta["step"]
        plan = build_write_plan(snap.pieces, self.world, selected)
        keys = list(plan.keys_for(self.rank))
        commit_spec = None
        if self.rank == 0:
            commit_spec = CommitSpec(
                step=step,
                layout=ck._layout_record(self.world, int(ck.engine.zero_optimization_stage())),
                previous_tag=extended_tag(ck._previous, save_dir),
                selected=tuple(sorted(selected)) if selected is not None else None,
                pec_k=ck.policy.k if ck.policy is not None else None,
                save_latest=snap.save_latest, keep=self.cfg.keep,
                timeout_s=self.cfg.commit_timeout_s, attempt_started=ck.attempt_started)
        job = PersistJob(
            image=self.slots.image_path(snap.slot),
            entries=tuple(ImageEntry.from_json(e) for e in meta["entries"]),
            keys=tuple(keys), specs=tuple(meta["specs"][k] for k in keys if k in meta["specs"]),
            save_dir=save_dir, tag=tag, step=step, rank=self.rank,
            objects_tree=meta["objects_tree"] if self.rank == 0 else None,
            # the objects' tensors go to their own small file (objects.OBJECTS_TENSOR_FILE)
            object_keys=tuple(snap.object_keys) if self.rank == 0 else (),
            # Every rank's writer holds the claim: a keeper still running this job after
            # a restart re-saved the tag stands down instead of writing this attempt's
            # file (or report) into the new save.
            claim=claim, run_id=self.run_id,
            # The image's memory checksum (set by the copy thread once it is known;
            # _persist_newest's snapshot has it already): the keeper verifies it.
            checksum=meta.get("checksum"), commit=commit_spec)
        self.persist = PendingPersist(
            save_dir=save_dir, tag=tag,
            selected=selected if selected is not None else frozenset(),
            policy_before=policy_before, slot=snap.slot, in_process=self.keeper_gone,
            claim=claim)
        return job

    def _persist_newest(self) -> Tuple[bool, Optional[str]]:
        """Every rank (from :meth:`wait`, nothing pending): persist the newest snapshot if
        it was not, with every expert it holds, so that ending a job (which frees the
        keepers' memory) never loses the last state.

        Returns:
            This rank's ``(ok, error)`` for the outcome exchange that follows (the hand-over
            after the last collective here is rank-local: its failure must be reported,
            not raised past the others' exchange).

        Raises:
            MoCCheckpointError: on every rank, when preparing the persist failed on one.
        """
        snap = self.last
        if snap is None or snap.persisted:
            return True, None
        ck, meta = self.ckpt, snap.meta
        selected = frozenset(tuple(e) for e in meta["experts"]) \
            if meta["experts"] is not None else None
        policy_before = ck.policy.state_dict() if ck.policy is not None else None
        if ck.policy is not None and selected is not None:
            ck.policy.mark_saved(selected, meta["step"])
        claim = self._prepare_dir(snap.save_dir, meta["tag"], meta["step"], policy_before)
        snap.persisted = True
        extra = {}
        if not snap.rng_gathered:  # the same on every rank: a collective is safe here
            # The snapshot holds only this rank's RNG state; rank 0 writes the objects
            # with every rank's (gathered now) itself, into objects.safetensors, and a
            # failure there is raised on every rank.
            rng_states: List = [None] * self.world
            dist.all_gather_object(rng_states, snap.rng_state, group=metadata_group())
            written = replace(snap, object_keys=[])
            try:
                broadcast_outcome(
                    lambda: extra.update(self._write_objects_with(written, rng_states)),
                    f"MoC objects of {meta['tag']}")
            except Exception:
                if ck.policy is not None:
                    ck.policy.load_state_dict(policy_before)
                snap.persisted = False
                raise
            snap = written
        try:
            job = replace(self._persist_job(snap, selected, policy_before, claim), **extra,
                          done_marker=self.slots.persist_marker(snap.slot))
            _log(f"persisting the newest snapshot {meta['tag']} (step {meta['step']}) before "
                 f"returning from wait")
            self._send(job)
        except Exception as e:  # say, the node's shared memory vanished
            traceback.print_exc()
            why = f"{type(e).__name__}: {e}"
            try:  # the committer stops at this report instead of at its timeout
                commit.write_report(os.path.join(snap.save_dir, meta["tag"]), self.rank,
                                    None, error=why, claim=claim)
            except Exception:
                pass
            return False, why
        return True, None

    def _write_objects_with(self, snap: NewestSnapshot, rng_states: List) -> Dict[str, Any]:
        """Rank 0: write the snapshot's objects, with ``rng_states`` of every rank, as
        ``objects.json`` plus ``objects.safetensors`` into the persist's tag directory.

        Returns:
            :class:`~deepspeed_ext.jobs.PersistJob` fields that make the keeper use these
            files instead of writing objects.
        """
        from deepspeed_ext.format.objects import decode, encode, tensor_keys, write_objects_file
        from deepspeed_ext.format.storage import write_fragment_file
        meta = snap.meta
        tag_dir = os.path.join(snap.save_dir, meta["tag"])
        tree = meta["objects_tree"]
        image = SlotImage(self.slots.image_path(snap.slot))
        try:
            entries = {e["key"]: e for e in meta["entries"]}
            objects = decode(tree, {k: image.read(entries[k]) for k in tensor_keys(tree)})
        finally:
            image.close()
        objects["rng_states"] = rng_states
        tree, tensors = encode(objects)
        files = {}
        if tensors:
            files[OBJECTS_TENSOR_FILE] = write_fragment_file(
                os.path.join(tag_dir, OBJECTS_TENSOR_FILE), tensors).to_json()
        record = write_objects_file(tag_dir, tree, OBJECTS_TENSOR_FILE if tensors else None)
        return {"objects_tree": None, "objects_record": record.to_json(), "extra_files": files}

    def _copy(self, slot, event, buffer, layout, tensors, meta, job, protect=False) -> None:
        """Copy thread: fill the slot, mark it complete, hand it to the keeper and to the
        redundancy thread."""
        published = False
        try:
            # The checksum: recovery and the keeper check it before using the bytes (a bit
            # flipped in memory must neither be loaded nor persisted under a fresh SHA-256).
            meta["checksum"] = self.copier.finish(event, buffer, layout, tensors, checksum=True)
            if self.fault_hook is not None:  # fault injection: die with the slot filled
                self.fault_hook(meta["step"])  # but not yet published as complete
            self.slots.publish(slot, meta)
            published = True
            if job is not None:
                job = replace(job, checksum=meta["checksum"],
                              done_marker=self.slots.persist_marker(slot))
                self.send_job = self.sender_pool.submit(self._send_safely, job)
        except Exception as e:
            traceback.print_exc()
            # Keep the first error: it may be reported only at a later persist or wait.
            self.copy_error = self.copy_error or f"{type(e).__name__}: {e}"
        finally:
            if protect:  # every rank, even after a failed copy: the peers pair up
                image = buffer if published else None
                self.redundancy.protect(meta["step"], slot, image, meta if published else None)

    def _send_safely(self, job: PersistJob) -> None:
        """Hand-over thread: :meth:`_send`; an error fails this persist (reported in its
        directory, so the pending persist ends) instead of vanishing with the thread."""
        try:
            self._send(job)
        except Exception as e:
            traceback.print_exc()
            self._fail_unsent(job, f"{type(e).__name__}: {e}")

    def _send(self, job: PersistJob) -> None:
        if not self.keeper_gone:
            job = replace(job, id=keeper.job_id(job.tag, self.rank))
            try:
                if keeper.hand_over(self.node_dir, job.to_json(),
                                    patience_s=self.cfg.commit_timeout_s):
                    return
            except keeper.KeeperError as e:
                self._fail_unsent(job, str(e))
                return
            self._keeper_died("it did not take the persist of " + job.tag)
        thread = threading.Thread(target=keeper.run_persist_job, args=(job,),
                                  name=f"moc-persist-{job.tag}")
        self.local_persists = [t for t in self.local_persists if t.is_alive()] + [thread]
        thread.start()

    def _fail_unsent(self, job: PersistJob, why: str) -> None:
        """Copy thread: a live keeper never took this rank's job. It may still run it
        (the slot stays marked as persisting until it has read it), so this process
        does not write it too: the persist ends as failed (rank 0 also marks the
        commit failed, having no committer) and training goes on."""
        tag_dir = os.path.join(job.save_dir, job.tag)
        logger.warning(f"[moc] rank {self.rank}: WARNING: persist of {job.tag} abandoned: {why}")
        try:
            commit.write_report(tag_dir, self.rank, None, error=why, claim=job.claim)
            if job.commit is not None:
                commit.write_failure(tag_dir, why, claim=job.claim)
        except Exception as e:  # the pending persist then ends at its deadline
            logger.warning(f"[moc] rank {self.rank}: WARNING: cannot mark {tag_dir} failed "
                           f"({type(e).__name__}: {e})")

    def _keeper_died(self, why: str) -> None:
        """Switch to persisting in this process; say so once per rank."""
        if self.keeper_gone:
            return
        self.keeper_gone = True
        logger.warning(
            f"[moc] rank {self.rank}: WARNING: the keeper of node {self.node} is gone ({why}); "
            f"training goes on, persisting from this process (snapshots still go to "
            f"{self.node_dir}; a restart starts a new keeper)")

    def _abandon_persist_of_dead_keeper(self) -> None:
        """Every rank, before the persist outcome is looked at: a keeper that died with this
        rank's persist in its queue will never report it. Write the report (and, on rank
        0, whose keeper commits, the commit failure) here, so that the persist ends as
        failed; otherwise it would look "still running" forever and every later persist
        would be deferred behind it."""
        p = self.persist
        # Once the keeper is known gone, every persist since runs in this process.
        if p is None or p.in_process or self.keeper_gone:
            return
        if self.send_job is not None and not self.send_job.done():
            return  # the hand-over decides (and persists here if the keeper is dead)
        if not keeper.is_dead(self.node_dir):  # a socket connect, only while a persist is pending
            return
        self._keeper_died("it stopped answering while persisting")
        tag_dir = os.path.join(p.save_dir, p.tag)
        why = f"the keeper of node {self.node} died while persisting {p.tag}"
        try:  # called before collectives: a storage error is logged, never raised
            if not fs.exists(os.path.join(tag_dir, commit.report_name(self.rank))):
                commit.write_report(tag_dir, self.rank, None, error=why, claim=p.claim)
            if self.rank == 0 and commit.commit_outcome(tag_dir, self.world, p.claim) is None:
                commit.write_failure(tag_dir, why, claim=p.claim)
        except Exception as e:
            logger.warning(
                f"[moc] rank {self.rank}: WARNING: cannot mark {tag_dir} failed "
                f"({type(e).__name__}: {e}); its commit ends at the commit timeout instead")
        # The keeper would have removed it once the slot was read: the slot is free again.
        try:
            os.remove(os.path.join(self.slots.dir, f"slot{p.slot}.persisting"))
        except OSError:
            pass

    def signature(self, fragments) -> str:
        """Identifies the layout a snapshot can be restored into (same master-weight
        fragments, so the same with or without the optimizer's moments described)."""
        text = json.dumps([(f.key, f.length) for f in fragments if f.kind == FP32]
                          + [self.world])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- persistence bookkeeping ------------------------------------------------------

    def _persist_view(self):
        """Rank 0: the outcome of the last persist, None while it is running."""
        from deepspeed_ext.store.commit import commit_outcome
        if self.persist is None:
            return "none"
        tag_dir = os.path.join(self.persist.save_dir, self.persist.tag)
        try:
            outcome = commit_outcome(tag_dir, self.world, self.persist.claim)
            if outcome is None and time.monotonic() - self.persist.started > \
                    self.cfg.commit_timeout_s:
                # A commit that ends with neither a manifest nor a failure record (a
                # committer that died, a job dropped) would otherwise defer every later
                # persist for the rest of the run.
                outcome = (False, f"{tag_dir} not committed within "
                                  f"{self.cfg.commit_timeout_s:.0f} s (--moc-commit-timeout)")
        except Exception as e:
            # Read before the snapshot's exchange, which the other ranks are already in:
            # a storage error counts as "still running" (the snapshot stays in memory
            # only, and the next one that is due looks again).
            _log(f"WARNING: cannot read the outcome of persist {self.persist.tag} "
                 f"({type(e).__name__}: {e}); treating it as still running")
            return None
        return list(outcome) if outcome is not None else None

    def _settle_persist(self, view) -> None:
        """Every rank, with rank 0's view: forget a finished persist (undo a failed one)."""
        if self.persist is None or view is None or view == "none":
            return
        ok, message = view
        persist, self.persist = self.persist, None
        if ok:
            self.ckpt._previous = (persist.save_dir, persist.tag)
            return
        _log(f"WARNING: persisting {persist.tag} failed ({message}); latest still names "
             f"the previous checkpoint, and its experts will be saved again")
        self.ckpt._undo_mark_saved(persist.policy_before, persist.selected)

    def wait(self) -> None:
        """Every rank: returns once every snapshot taken so far is on storage and nothing
        this job asked for is still writing. Joins the copy, waits for the pending persist,
        then persists the newest snapshot if it was not (see :meth:`_persist_newest`) and
        waits for that; any rank's failure is raised on every rank. Last, also when it
        raises, :meth:`_drain` (rank-local, no collective)."""
        try:
            self.join_copy()
            ok, message = self.copy_error is None, self.copy_error
            self.copy_error = None
            outcomes = self._wait_pending(ok, message)
            raise_if_failed(outcomes, "MoC two-level wait")
            if self.last is not None and not self.last.persisted:
                ok, message = self._persist_newest()
                raise_if_failed(self._wait_pending(ok, message), "MoC two-level wait")
        finally:
            self._drain()

    def _drain(self) -> None:
        """Every rank, at the end of :meth:`wait`: the hand-over and this process's own
        persists (the keeper died) joined; the first rank of each node then drains its
        keeper (:func:`keeper.drain_keeper`): every job queued so far run, every commit
        of this attempt done.

        The failure it prevents: the wait ended when the last manifest appeared, while the
        committer went on moving ``latest`` and running retention; a job that returned
        then (or a reader right after it) saw ``latest`` name a checkpoint that
        retention was deleting, or lag behind the newest manifest. Waits at most
        ``--moc-commit-timeout`` for each part; a keeper that takes longer is named in a
        warning (it is hung: nothing it runs writes any more without a report)."""
        if self.send_job is not None:
            self.send_job.result()  # _send_safely does not raise
        for thread in self.local_persists:
            thread.join(self.cfg.commit_timeout_s)
        self.local_persists = [t for t in self.local_persists if t.is_alive()]
        if not self.first_of_node or self.keeper_gone:
            return
        try:
            keeper.drain_keeper(self.node_dir, self.cfg.commit_timeout_s, self.run_id,
                                self.ckpt.attempt_started)
        except Exception as e:
            logger.warning(
                f"[moc] rank {self.rank}: WARNING: the keeper of node {self.node} did not "
                f"finish its persists and commits within {self.cfg.commit_timeout_s:.0f} s "
                f"(--moc-commit-timeout; {type(e).__name__}: {e}); it may still write "
                f"into {self.cfg.save_dir}")

    def _wait_pending(self, ok: bool, message) -> list:
        """Every rank: wait for the pending persist's commit (or failure); settle it;
        return every rank's (ok, message)."""
        if self.persist is not None and ok:
            tag_dir = os.path.join(self.persist.save_dir, self.persist.tag)

            def poll() -> Optional[Tuple[bool, str]]:
                try:
                    # Checked on every poll: a keeper dying meanwhile ends the wait with
                    # its error instead of after the whole commit timeout.
                    self._abandon_persist_of_dead_keeper()
                    return commit.commit_outcome(tag_dir, self.world, self.persist.claim)
                except Exception as e:  # storage unreachable: reported, not raised here
                    traceback.print_exc()
                    return (False, f"{type(e).__name__}: {e}")

            def timed_out() -> Tuple[bool, str]:
                return False, (f"{tag_dir} not committed within "
                               f"{self.cfg.commit_timeout_s:.0f} s (--moc-commit-timeout)")

            ok, message = poll_until(poll, self.cfg.commit_timeout_s, COMMIT_POLL_BACKOFF,
                                     timed_out)
        outcomes = all_outcomes(ok, message)
        if self.persist is not None:
            self._settle_persist([all(o for o, _ in outcomes), "see the rank errors"])
        return outcomes

    def shutdown(self) -> None:
        """Every rank, at the end of training: persist finished, keeper stopped, memory
        freed. When the last persist failed (raised on every rank), the keeper and its
        memory are left: the newest snapshots exist nowhere else, and a restart before the
        keeper's idle exit recovers from them."""
        persisted = False
        try:
            self.wait()
            persisted = True
        finally:
            self.copier_pool.shutdown(wait=True)
            self.sender_pool.shutdown(wait=True)
            self.copier.unregister_all()  # CUDA: no copy is in flight any more
            if self.redundancy is not None:
                self.redundancy.close()
                _log(self.redundancy.summary())
            dist.barrier(group=metadata_group())
            if self.first_of_node and persisted:
                keeper.shutdown_keeper(self.node_dir, self.cfg.commit_timeout_s, self.run_id,
                                       self.ckpt.attempt_started)
            elif self.first_of_node:
                logger.warning(
                    f"[moc] rank {self.rank}: WARNING: the newest snapshots are not all on "
                    f"storage: leaving them in {self.node_dir}; its keeper exits "
                    f"{self.cfg.keeper_idle_timeout_s:.0f} s after the last training "
                    f"process, and a restart before that recovers from them")
            dist.barrier(group=metadata_group())
            if self.rank == 0:
                try:
                    os.rmdir(self.cfg.shm_dir)  # only when every node's directory is gone
                except OSError:
                    pass

    def host_memory_bytes(self) -> int:
        """Shared memory this rank's snapshot slots and its peers' redundancy take."""
        extra = self.redundancy.store.host_bytes() if self.redundancy is not None else 0
        return self.slots.host_bytes() + extra

    def drop_node_memory(self) -> None:
        """Fault injection: this node loses its snapshots, as when the machine dies. Kills
        the node's keeper and deletes its shared memory; any rank of the node may call it,
        the other ranks of the node are expected to die with it."""
        import shutil
        import signal
        try:
            os.kill(keeper.request(self.node_dir, {"op": "ping"})["pid"], signal.SIGKILL)
        except Exception as e:  # already gone: its memory is what matters
            _log(f"node {self.node}: keeper not reachable ({e})")
        shutil.rmtree(self.node_dir, ignore_errors=True)

    # -- recovery ----------------------------------------------------------------------

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             load_lr_scheduler_states: bool, from_memory: bool = True):
        from deepspeed_ext.state import (describe_local_state, has_optimizer_state,
                                         prepare_optimizer_state)
        ck, engine = self.ckpt, self.ckpt.engine
        self.join_copy()
        if self.redundancy is not None:
            # A load in a running process: a protection still queued would send its
            # messages over the same group as the rebuild's, and they could pair up.
            self.redundancy.wait_slots()
        # A load may replace the optimizer state: the cached fragments would keep the old
        # tensors alive (on a GPU, a second copy of the moments) until the next snapshot.
        self._described = None
        start = time.perf_counter()
        described: List = []

        def fragments(fresh: bool = False, moments=None):
            # fresh: after a storage load, which may have replaced tensors, or for a
            # snapshot's MomentPresence ``moments`` (None: every group's moments), which
            # may create or drop some.
            if fresh:
                described.clear()
            if not described:
                if load_optimizer_states:
                    prepare_optimizer_state(engine, moments)
                described.append(describe_local_state(engine, ck.naming,
                                                      with_moments=load_optimizer_states))
            return described[0]

        # The signature needs only the master weights: a fresh engine has no moments yet,
        # and creating them (ensure_optimizer_state) advances Adam's step counters, which
        # must happen only once something is actually loaded into them. An engine that
        # has them (a restart inside the job, the benchmark) is described once.
        try:
            if not load_optimizer_states or has_optimizer_state(engine):
                signature = self.signature(fragments())
            else:
                signature = self.signature(describe_local_state(engine, ck.naming,
                                                                with_moments=False))
        except Exception as e:
            # Before the first exchange: raising here would leave the other ranks in it.
            # A rank with no signature offers no snapshot; the storage load that follows
            # describes the state again and reports a failure to every rank.
            traceback.print_exc()
            _log(f"rank {self.rank}: cannot describe its state ({type(e).__name__}: {e}); "
                 f"it offers no memory snapshot")
            signature = None
        # Recovery's two exchanges (the steps held, then every rank's outcome) are small:
        # one all_gather each instead of all_gather_object's two.
        self._load_exchanger = Exchanger(capacity=LOAD_EXCHANGE_BYTES)
        rebuilt = False
        if self.redundancy is not None and from_memory and tag is None:
            rebuilt = self._rebuild_from_peers(signature)
        mine = [dict(m, _slot=i, _entries={e["key"]: e for e in m["entries"]}, _verified=ok)
                for i, m, ok in self._checked_slots(signature)]
        try:
            result = self._load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                from_memory, mine, fragments, start)
            if rebuilt and self.last_load_source == "memory":
                self.last_load_source = "memory+peers"
            return result
        finally:
            for image in self._images.values():
                image.close()
            self._images = {}

    def _checked_slots(self, signature: Optional[str]) -> List[Tuple[int, Dict[str, Any], bool]]:
        """``(slot, meta, verified)`` of this rank's complete snapshots of this layout,
        oldest first. The newest intact one is verified against its checksum now (a
        damaged one is logged and left out, so the ranks agree on an older step or
        storage instead of loading flipped bits); older ones, which a recovery seldom
        reads, are verified when first read (:meth:`_image`): checking every slot up
        front cost ``moc-full``'s recovery from memory 60 ms of its 85 here."""
        candidates = [(i, m) for i, m in self.slots.complete()
                      if m.get("signature") == signature]
        checked: List[Tuple[int, Dict[str, Any], bool]] = []
        newest_found = False
        for i, meta in reversed(candidates):
            if newest_found:
                checked.append((i, meta, False))
                continue
            problem = self.slots.verify(i)
            if problem is not None:
                self._warn_damaged(i, meta, problem)
                continue
            newest_found = True
            checked.append((i, meta, True))
        return checked[::-1]

    def _warn_damaged(self, slot: int, meta: Dict[str, Any], problem: str) -> None:
        logger.warning(
            f"[moc] rank {self.rank}: WARNING: not recovering from the step-{meta['step']} "
            f"snapshot in {self.slots.image_path(slot)}: {problem}")

    def _rebuild_from_peers(self, signature: str) -> bool:
        """Every rank, before a memory recovery: when some ranks lost their snapshots (a
        lost node), rebuild them from the copies or parities their peers hold (one
        ``all_gather_object`` of what each rank holds, then the plan's point-to-point
        transfers, then one outcome collective).

        Returns:
            True when snapshots were rebuilt (the memory recovery can then use them).
        """
        from deepspeed_ext.policy import redundancy as rd
        from deepspeed_ext.snapshot import image_end
        start = time.perf_counter()
        own = {m["step"]: (i, m) for i, m in self.slots.complete() if m["signature"] == signature}
        replicas, parities = self.redundancy.holdings_record()
        gathered: List = [None] * self.world
        dist.all_gather_object(gathered, (sorted(own), replicas, parities), group=metadata_group())
        holdings = rd.Holdings(
            own={r: frozenset(g[0]) for r, g in enumerate(gathered)},
            replicas={r: {int(src): frozenset(steps) for src, steps in g[1].items()}
                      for r, g in enumerate(gathered)},
            parities={r: frozenset(int(s) for s in g[2]) for r, g in enumerate(gathered)})
        plan = rd.plan_rebuild(holdings, self.topo, self.spec)
        if plan.step is None:
            if not any(g[0] or g[1] or g[2] for g in gathered):
                return False  # no memory anywhere (a first start): nothing to explain
            _log(f"recovery: cannot recover from memory, even with the peers' redundancy: "
                 f"{plan.why}; loading from storage")
            return False
        if not plan.rebuilt:
            return False
        chunks = {r: {int(s): c for s, c in g[2].items()} for r, g in enumerate(gathered)}

        def own_image(step):
            slot, meta = own[step]
            size = image_end(meta)
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)
            return torch.from_file(self.slots.image_path(slot), shared=False, size=size,
                                   dtype=torch.uint8)

        ok, result = True, None
        try:
            result = self.redundancy.rebuild(plan, chunks, own_image, self.slots)
        except Exception as e:
            traceback.print_exc()
            ok, result = False, f"{type(e).__name__}: {e}"
        outcomes = all_outcomes(ok, result)
        if not all(o for o, _ in outcomes):
            bad = "; ".join(f"rank {r}: {m}" for r, (o, m) in enumerate(outcomes) if not o)
            _log(f"recovery: rebuilding snapshots from peers failed ({bad})")
            return False
        received = sum(c["received"] for _, c in outcomes)
        nodes = sorted({self.topo.node_of(r) for r in plan.rebuilt})
        _log(f"recovery: rebuilt the step-{plan.step} snapshots of rank(s) "
             f"{list(plan.rebuilt)} (lost node(s) {nodes}) from the peers' memory "
             f"({self.spec.describe()}): {received / 2**20:.2f} MiB in "
             f"{time.perf_counter() - start:.2f} s"
             + (f"; {plan.why}" if plan.why else ""))
        return True

    def _load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
              from_memory, mine, fragments, start):
        ck = self.ckpt
        stored = _newest_stored_step(load_dir) if self.rank == 0 and from_memory and tag is None \
            else None
        exchanged = self._load_exchanger.exchange((sorted({m["step"] for m in mine}), stored))
        steps, stored = [held for held, _ in exchanged], exchanged[0][1]  # rank 0's view
        common = set(steps[0]).intersection(*map(set, steps[1:])) if from_memory and tag is None \
            else set()
        newer_on_storage = bool(common) and stored is not None and stored > max(common)
        if newer_on_storage:
            # A rank rebuilt from its peers holds only the protected step (with
            # --moc-redundancy-interval > 1), or lost its newer slots: recovering that
            # older step would throw away persisted progress, and the next persist's
            # expert index could not extend the newer checkpoint.
            _log(f"recovery: storage holds a newer checkpoint (step {stored}) than every "
                 f"rank's memory (step {max(common)}); loading from storage")
            common = set()
        failed_step = None
        if common:
            step = max(common)
            result = self._load_memory(load_dir, step, mine, fragments, load_optimizer_states,
                                       load_lr_scheduler_states, start)
            if result is not None:
                return result
            failed_step = step
        elif from_memory and tag is None and not newer_on_storage:
            held = sum(1 for s in steps if s)
            _log(f"recovery: no step held in memory by every rank ({held} of {self.world} ranks "
                 f"hold snapshots); loading from storage")
        path, client = ck._load_storage(load_dir, tag, load_optimizer_states,
                                        load_lr_scheduler_states)
        if path is None and failed_step is not None:
            # The failed memory recovery already wrote into the engine; "no checkpoint:
            # start from scratch" would train on from those tensors as iteration 0. The
            # same on every rank (the storage choice is rank 0's, broadcast).
            raise MoCCheckpointError(
                f"recovery from memory at step {failed_step} failed and {load_dir} holds no "
                f"checkpoint to fall back to; restart to try again, or, to start from "
                f"scratch, stop the keepers (pkill -f 'deepspeed_ext.keeper --dir "
                f"{self.cfg.shm_dir}') and remove {self.cfg.shm_dir}")
        self.last_load_source = "storage"
        if path is not None:  # every rank: the overlay ends in a collective
            from deepspeed_ext.state import moment_presence
            # The moments as the storage load left them (none where it had none).
            self._overlay_newer_experts(
                mine, lambda: fragments(fresh=True, moments=moment_presence(ck.engine)))
        return path, client

    def _load_memory(self, load_dir, step, mine, fragments, load_optimizer_states,
                     load_lr_scheduler_states, start):
        from deepspeed_ext.format.objects import decode, tensor_keys
        from deepspeed_ext.state import MomentPresence, refresh_compute_weights
        ck = self.ckpt
        ok, error, objects, counts = True, None, None, {"memory": 0, "storage": 0}
        storage = None
        versions: Dict = {}  # expert -> step of the version taken (lost-token accounting)
        snap_before = self.snap_policy.state_dict() if self.snap_policy is not None else None
        try:
            base = next(m for m in mine if m["step"] == step)
            tree = base["objects_tree"]
            objects = decode(tree, {k: self._read_slot(base, k) for k in tensor_keys(tree)})
            # Before describing: a snapshot taken before the first (non-overflowing)
            # step holds no moments, and the engine must then have none either.
            moments = MomentPresence.from_record(objects.get("optimizer_moments"))
            storage = _StorageVersions(load_dir, step)
            try:
                with torch.no_grad():
                    for frag in fragments(fresh=True, moments=moments):
                        meta, data = self._newest(frag, base, step, mine, storage, counts,
                                                  versions)
                        if meta is not None:  # from memory: straight into the engine
                            self._read_slot_into(meta, frag.key, frag.tensor)
                        else:
                            frag.tensor.copy_(data.to(device=frag.tensor.device,
                                                      dtype=frag.tensor.dtype))
                # What the next persist's expert index extends: read here, before the
                # outcome exchange (a damaged manifest must not raise after it on one rank).
                extends = storage.base_tag()
            finally:
                storage.close()
            counts["versions"] = sorted(versions.items())
            # Before the outcome exchange: it acts on this rank's own slot's objects, and
            # a failure after the exchange would leave the other ranks in the collective
            # that follows. If any rank fails, the storage load restores all of it again.
            ck._restore_objects(objects, load_optimizer_states, load_lr_scheduler_states)
            if self.snap_policy is not None and objects.get("snapshot_policy"):
                self.snap_policy.load_state_dict(objects["snapshot_policy"])
        except Exception as e:
            traceback.print_exc()
            ok, error = False, f"{type(e).__name__}: {e}"
        outcomes = self._load_exchanger.exchange((ok, counts if ok else error))
        if not all(o for o, _ in outcomes):
            bad = "; ".join(f"rank {r}: {m}" for r, (o, m) in enumerate(outcomes) if not o)
            _log(f"recovery from memory at step {step} failed ({bad}); loading from storage")
            if snap_before is not None:  # the storage load does not restore it
                self.snap_policy.load_state_dict(snap_before)
            return None
        # Each rank knows the versions of its own experts; the ledger needs them all
        # (they came with the outcomes: no extra collective).
        ck.account_recovery(objects, {tuple(k): v for _, c in outcomes for k, v in c["versions"]})
        refresh_compute_weights(ck.engine)
        ck._piece_cache = None
        # The next persist's expert index extends the newest readable checkpoint of this
        # step or older (``latest`` unless it is damaged: extending a checkpoint whose
        # manifest cannot be read failed every later persist).
        ck._previous = (load_dir, extends) if extends else None
        memory = sum(c["memory"] for _, c in outcomes)
        stored = sum(c["storage"] for _, c in outcomes)
        _log(f"recovered step {step} from memory in {time.perf_counter() - start:.2f} s: "
             f"{memory} fragment(s) from memory, {stored} from storage")
        self.last_load_source = "memory"
        return f"memory:{self.node_dir}@{step}", objects["client_state"]

    def _newest(self, frag, base, step, mine, storage, counts, versions):
        """Where the newest version (<= step) of one fragment is; records its step in
        ``versions`` for experts.

        Returns:
            ``(meta, None)``: in the memory snapshot ``meta`` (read it with
            :meth:`_read_slot_into`); ``(None, tensor)``: read from storage.
        """
        key = frag.key
        if frag.expert is None:
            if key not in base["specs"]:
                raise RuntimeError(f"snapshot of step {step} lacks {key}")
            counts["memory"] += 1
            return base, None
        holders = [m for m in mine if m["step"] <= step and key in m["specs"]]
        newest_memory = max(holders, key=lambda m: m["step"]) if holders else None
        if newest_memory is not None and newest_memory["step"] == step:
            # Nothing on storage is newer than the recovered step itself.
            counts["memory"] += 1
            versions[tuple(frag.expert)] = step
            return newest_memory, None
        stored = storage.versions.get(tuple(frag.expert))
        if newest_memory is not None and (stored is None or newest_memory["step"] >= stored):
            counts["memory"] += 1
            versions[tuple(frag.expert)] = newest_memory["step"]
            return newest_memory, None
        if stored is None:
            raise RuntimeError(f"no version of expert {frag.expert} ({key}) in memory or storage")
        counts["storage"] += 1
        versions[tuple(frag.expert)] = stored
        reader = storage.reader()
        # Reads go by element range: a tensor of another shape would load silently.
        check_saved_shape(reader, frag, storage.load_dir, storage.tag)
        return None, reader.read(frag.name, frag.kind, frag.offset, frag.length)

    def _image(self, meta) -> SlotImage:
        """The mapped image of a slot of ``mine``, verified against its checksum on first
        use.

        Raises:
            RuntimeError: the image is damaged (the caller's recovery from memory fails,
                on every rank through its outcome exchange).
        """
        slot = meta["_slot"]
        if slot not in self._images:
            if not meta.get("_verified"):
                problem = self.slots.verify(slot)
                if problem is not None:
                    self._warn_damaged(slot, meta, problem)
                    raise RuntimeError(f"the step-{meta['step']} snapshot is damaged: {problem}")
                meta["_verified"] = True
            self._images[slot] = SlotImage(self.slots.image_path(slot))
        return self._images[slot]

    def _read_slot(self, meta, key):
        """One tensor of a complete snapshot of this load's ``mine`` list, as a new tensor."""
        return self._image(meta).read(meta["_entries"][key])

    def _read_slot_into(self, meta, key, out) -> None:
        """One tensor of a complete snapshot of ``mine``, copied straight into ``out``."""
        self._image(meta).read_into(meta["_entries"][key], out)

    def _overlay_newer_experts(self, mine, fragments) -> None:
        """Two-level recovery: after a storage load, take experts whose memory snapshot on
        this rank is newer than what storage gave (every rank calls it; ``fragments()``
        describes the state)."""
        from deepspeed_ext.state import refresh_compute_weights
        versions = self.ckpt.expert_versions_loaded or {}
        newer: Dict = {}
        staged = []
        try:  # read and check everything first: a failure then leaves the storage state whole
            for frag in fragments():
                if frag.expert is None:
                    continue
                loaded = versions.get(tuple(frag.expert), -1)
                holders = [m for m in mine if frag.key in m["specs"] and m["step"] > loaded]
                if holders:
                    newest = max(holders, key=lambda m: m["step"])
                    data = self._read_slot(newest, frag.key)
                    if data.numel() != frag.length:
                        raise RuntimeError(f"{frag.key} in the step-{newest['step']} snapshot "
                                           f"has {data.numel()} elements, this rank holds "
                                           f"{frag.length}")
                    staged.append((frag, data, newest["step"]))
        except Exception as e:  # this rank keeps storage's versions; the others go on
            logger.warning(f"[moc] rank {self.rank}: WARNING: cannot read its memory snapshots "
                           f"({type(e).__name__}: {e}); keeping the versions from storage")
            staged = []
        with torch.no_grad():
            for frag, data, step in staged:
                frag.tensor.copy_(data.to(device=frag.tensor.device, dtype=frag.tensor.dtype))
                newer[tuple(frag.expert)] = step
        taken = len(staged)
        refresh_compute_weights(self.ckpt.engine)
        if taken:
            self.last_load_source = "storage+memory"
        totals: List = [None] * self.world
        dist.all_gather_object(totals, (taken, sorted(newer.items())), group=metadata_group())
        for _, part in totals:
            versions = {**versions, **{tuple(k): v for k, v in part}}
        ck = self.ckpt
        if ck.last_recovery is not None:  # the ledger holds the storage checkpoint's state
            ck.last_recovery = ck.ledger.loss(ck.last_recovery.step, versions)
        totals = [t for t, _ in totals]
        if sum(totals):
            _log(f"two-level recovery: {sum(totals)} expert fragment(s) taken from the memory "
                 f"of ranks {[r for r, t in enumerate(totals) if t]}, newer than storage")


class _StorageVersions:
    """Expert versions of the newest committed checkpoint at or before ``step``, from its
    manifest, read only when a load asks for them (a snapshot holding every expert at
    ``step`` never does: storage cannot be newer); the checkpoint's files are opened (and
    verified) only if a fragment is actually read from storage."""

    def __init__(self, load_dir: str, step: int):
        from deepspeed_ext.format import errors
        from deepspeed_ext.format import manifest as mf
        from deepspeed_ext.store.catalog import scan_checkpoints
        from deepspeed_ext.store.latest import read_latest
        self.load_dir, self.step, self.tag = load_dir, step, None
        self._versions: Optional[Dict] = None
        self._reader = None
        self.latest: Optional[str] = None
        """The newest committed checkpoint (whatever its step)."""
        if not fs.isdir(load_dir):
            self._versions = {}
            return
        try:
            latest = read_latest(load_dir)
        except errors.CheckpointError:
            latest = None
        if latest and fs.exists(os.path.join(load_dir, latest, mf.MANIFEST_FILE)):
            self.latest = latest
        else:  # no or a dangling ``latest``: the newest complete checkpoint is it
            complete = scan_checkpoints(load_dir).complete
            self.latest = complete[-1][1] if complete else None

    def base_tag(self) -> Optional[str]:
        """The newest checkpoint of the step or older whose expert index can be read
        (None: none); the versions are resolved for it."""
        try:
            self.versions
        except (CheckpointError, OSError, ValueError) as e:
            _log(f"WARNING: no readable checkpoint at or before step {self.step} in "
                 f"{self.load_dir} ({type(e).__name__}: {e}); the next persist saves on its own")
            return None
        return self.tag

    @property
    def versions(self) -> Dict:
        """``{(layer, expert): step}`` of the chosen checkpoint's expert index."""
        if self._versions is None:
            self._versions = self._resolve()
        return self._versions

    def _resolve(self) -> Dict:
        from deepspeed_ext.format import errors, expert_index
        from deepspeed_ext.store import catalog
        # Normally ``latest`` is it: one manifest read. Only when storage is ahead of the
        # memory snapshot (or ``latest`` is damaged) are all manifests scanned.
        found = None
        try:
            if self.latest:
                found = (self.latest, *expert_index.read_expert_versions(
                    os.path.join(self.load_dir, self.latest)))
        except errors.CheckpointError:
            found = None
        if found is None or found[1] > self.step:
            complete = catalog.scan_checkpoints(self.load_dir).complete
            candidates = [t for s, t in complete if s <= self.step]
            found = ((candidates[-1], *expert_index.read_expert_versions(
                os.path.join(self.load_dir, candidates[-1]))) if candidates else None)
        if found is None:
            return {}
        self.tag = found[0]
        return found[2]

    def reader(self):
        from deepspeed_ext.store.reader import CheckpointReader
        if self._reader is None:
            # Each file this rank reads is checked (size, checksum) before its first read;
            # not every rank's files, which would make every rank open the whole
            # checkpoint. A failure here fails the memory recovery on every rank, and the
            # storage load that follows checks the structure on rank 0.
            self._reader = CheckpointReader(self.load_dir, self.tag, verify_checksums=True,
                                            check_structure=False)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
