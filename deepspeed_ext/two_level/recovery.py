"""Two-level recovery (:mod:`deepspeed_ext.two_level`): from memory, the peers, or storage.

:meth:`Recovery.load`, every rank: ranks agree (one ``all_gather`` of a small fixed-size
buffer) on the newest step every rank holds complete in memory with this layout, and
restore from memory (one more such ``all_gather`` makes any rank's failure everyone's);
experts not in that snapshot come from the newest version among older slots and
storage. Otherwise they load from storage, and ranks whose memory survived then take
their experts' newer snapshots from memory (one ``all_gather_object``). With
redundancy, lost nodes' snapshots are first rebuilt from their peers
(:mod:`deepspeed_ext.two_level.peer_rebuild`). Every load logs where pieces came from."""

import logging
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from deepspeed_ext.runtime.exchange import Exchanger
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.storage_load import StorageLoad
from deepspeed_ext.store.reader import check_saved_shape
from deepspeed_ext.two_level.layouts import SnapshotLayouts
from deepspeed_ext.two_level.memory_images import MemorySnapshots
from deepspeed_ext.two_level.records import RankPlace
from deepspeed_ext.two_level.snapshotter import Snapshotter
from deepspeed_ext.two_level.storage_versions import StorageVersions, newest_stored_step

LOAD_EXCHANGE_BYTES = 4096
"""Bytes per rank of a load's exchanges (steps held; outcome with the expert versions
taken); a value that does not fit costs two more collectives, not an error."""

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


class _Described:
    """This rank's fragments for a load, described once (or again when ``fresh``)."""

    def __init__(self, session, load_optimizer_states: bool):
        self.session = session
        self.load_optimizer_states = load_optimizer_states
        self.described: List = []

    def __call__(self, fresh: bool = False, moments=None):
        # fresh: after a storage load, which may have replaced tensors, or for a
        # snapshot's MomentPresence ``moments`` (None: every group's moments), which
        # may create or drop some.
        from deepspeed_ext.state import describe_local_state, prepare_optimizer_state
        if fresh:
            self.described.clear()
        if not self.described:
            if self.load_optimizer_states:
                prepare_optimizer_state(self.session.engine, moments)
            self.described.append(describe_local_state(
                self.session.engine, self.session.naming, with_moments=self.load_optimizer_states))
        return self.described[0]


class Recovery:
    """Loads into this rank's engine for two-level checkpointing."""

    def __init__(self, place: RankPlace, layouts: SnapshotLayouts, snapshotter: Snapshotter,
                 storage: StorageLoad, wait: Callable[[], None]):
        self.place = place
        self.layouts = layouts
        self.snapshotter = snapshotter
        self.storage = storage
        self.wait = wait
        """The backend's wait, run before a storage load (every rank)."""
        self.load_exchanger: Optional[Exchanger] = None
        """The current load's exchanges (steps held, outcomes), preset to their small size."""
        self.last_load_source: Optional[str] = None

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             load_lr_scheduler_states: bool, from_memory: bool = True):
        """Every rank: see the module docstring. Returns ``(path, client_state)``."""
        from deepspeed_ext.two_level.peer_rebuild import rebuild_from_peers
        place = self.place
        self.snapshotter.join_copy()
        if place.redundancy is not None:
            # A load in a running process: a protection still queued would send its
            # messages over the same group as the rebuild's, and they could pair up.
            place.redundancy.wait_slots()
        self.layouts.forget()
        start = time.perf_counter()
        fragments = _Described(place.session, load_optimizer_states)
        signature = self._signature(fragments, load_optimizer_states)
        # Recovery's two exchanges (the steps held, then every rank's outcome) are small:
        # one all_gather each instead of all_gather_object's two.
        self.load_exchanger = Exchanger(capacity=LOAD_EXCHANGE_BYTES)
        rebuilt = False
        if place.redundancy is not None and from_memory and tag is None:
            rebuilt = rebuild_from_peers(place, signature)
        memory = MemorySnapshots(place, signature)
        try:
            result = self._load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                from_memory, memory, fragments, start)
            if rebuilt and self.last_load_source == "memory":
                self.last_load_source = "memory+peers"
            return result
        finally:
            memory.close()

    def _signature(self, fragments: _Described, load_optimizer_states: bool) -> Optional[str]:
        """This rank's layout signature, before the first exchange (never raises).

        The signature needs only the master weights: a fresh engine has no moments yet,
        and creating them (ensure_optimizer_state) advances Adam's step counters, which
        must happen only once something is actually loaded into them. An engine that
        has them (a restart inside the job, the benchmark) is described once."""
        from deepspeed_ext.state import describe_local_state, has_optimizer_state
        engine, naming = self.place.session.engine, self.place.session.naming
        try:
            if not load_optimizer_states or has_optimizer_state(engine):
                return self.layouts.signature(fragments())
            return self.layouts.signature(describe_local_state(engine, naming,
                                                               with_moments=False))
        except Exception as e:
            # Before the first exchange: raising here would leave the other ranks in it.
            # A rank with no signature offers no snapshot; the storage load that follows
            # describes the state again and reports a failure to every rank.
            traceback.print_exc()
            _log(f"rank {self.place.rank}: cannot describe its state ({type(e).__name__}: {e}); "
                 f"it offers no memory snapshot")
            return None

    def _common_step(self, load_dir: str, tag: Optional[str], from_memory: bool,
                     memory: MemorySnapshots):
        """Every rank (the first exchange): the steps every rank holds in memory (empty:
        none, or storage is newer), each rank's steps, and whether storage is newer."""
        stored = newest_stored_step(load_dir) \
            if self.place.rank == 0 and from_memory and tag is None else None
        exchanged = self.load_exchanger.exchange((memory.steps(), stored))
        steps, stored = [held for held, _ in exchanged], exchanged[0][1]  # rank 0's view
        common = set(steps[0]).intersection(*map(set, steps[1:])) \
            if from_memory and tag is None else set()
        newer_on_storage = bool(common) and stored is not None and stored > max(common)
        if newer_on_storage:
            # A rank rebuilt from its peers holds only the protected step (with
            # --moc-redundancy-interval > 1), or lost its newer slots: recovering that
            # older step would throw away persisted progress, and the next persist's
            # expert index could not extend the newer checkpoint.
            _log(f"recovery: storage holds a newer checkpoint (step {stored}) than every "
                 f"rank's memory (step {max(common)}); loading from storage")
            common = set()
        return common, steps, newer_on_storage

    def _load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
              from_memory, memory: MemorySnapshots, fragments: _Described, start):
        """Every rank: from memory when every rank holds a common step, else from storage
        with the newer experts of memory laid over it."""
        place = self.place
        common, steps, newer_on_storage = self._common_step(load_dir, tag, from_memory, memory)
        failed_step = None
        if common:
            step = max(common)
            result = self._load_memory(load_dir, step, memory, fragments, load_optimizer_states,
                                       load_lr_scheduler_states, start)
            if result is not None:
                return result
            failed_step = step
        elif from_memory and tag is None and not newer_on_storage:
            held = sum(1 for s in steps if s)
            _log(f"recovery: no step held in memory by every rank ({held} of {place.world} ranks "
                 f"hold snapshots); loading from storage")
        self.wait()  # a save still being written must be committed (or failed) first
        path, client = self.storage.load(load_dir, tag, load_optimizer_states,
                                         load_lr_scheduler_states)
        if path is None and failed_step is not None:
            # The failed memory recovery already wrote into the engine; "no checkpoint:
            # start from scratch" would train on from those tensors as iteration 0. The
            # same on every rank (the storage choice is rank 0's, broadcast).
            raise MoCCheckpointError(
                f"recovery from memory at step {failed_step} failed and {load_dir} holds no "
                f"checkpoint to fall back to; restart to try again, or, to start from "
                f"scratch, stop the keepers (pkill -f 'deepspeed_ext.keeper --dir "
                f"{place.cfg.shm_dir}') and remove {place.cfg.shm_dir}")
        self.last_load_source = "storage"
        if path is not None:  # every rank: the overlay ends in a collective
            from deepspeed_ext.state import moment_presence
            # The moments as the storage load left them (none where it had none).
            self._overlay_newer_experts(
                memory, lambda: fragments(fresh=True, moments=moment_presence(place.session.engine)))
        return path, client

    def _load_memory(self, load_dir, step, memory: MemorySnapshots, fragments: _Described,
                     load_optimizer_states, load_lr_scheduler_states, start):
        """Every rank: restore ``step`` from memory (older experts from older slots or
        storage); one outcome exchange. Returns ``(path, client_state)``, or None when
        some rank failed (the caller then loads from storage)."""
        from deepspeed_ext.state import refresh_compute_weights
        place, ses = self.place, self.place.session
        snap_policy = self.snapshotter.snap_policy
        snap_before = snap_policy.state_dict() if snap_policy is not None else None
        ok, error, objects, counts, extends = True, None, None, None, None
        try:
            objects, counts, extends = self._read_memory(load_dir, step, memory, fragments)
            # Before the outcome exchange: it acts on this rank's own slot's objects, and
            # a failure after the exchange would leave the other ranks in the collective
            # that follows. If any rank fails, the storage load restores all of it again.
            ses.restore_objects(objects, load_optimizer_states, load_lr_scheduler_states)
            if snap_policy is not None and objects.get("snapshot_policy"):
                snap_policy.load_state_dict(objects["snapshot_policy"])
        except Exception as e:
            traceback.print_exc()
            ok, error = False, f"{type(e).__name__}: {e}"
        outcomes = self.load_exchanger.exchange((ok, counts if ok else error))
        if not all(o for o, _ in outcomes):
            bad = "; ".join(f"rank {r}: {m}" for r, (o, m) in enumerate(outcomes) if not o)
            _log(f"recovery from memory at step {step} failed ({bad}); loading from storage")
            if snap_before is not None:  # the storage load does not restore it
                snap_policy.load_state_dict(snap_before)
            return None
        # Each rank knows the versions of its own experts; the ledger needs them all
        # (they came with the outcomes: no extra collective).
        ses.account_recovery(objects, {tuple(k): v for _, c in outcomes for k, v in c["versions"]})
        refresh_compute_weights(ses.engine)
        ses.forget_pieces()
        # The next persist's expert index extends the newest readable checkpoint of this
        # step or older (``latest`` unless it is damaged: extending a checkpoint whose
        # manifest cannot be read failed every later persist).
        ses.previous = (load_dir, extends) if extends else None
        from_memory = sum(c["memory"] for _, c in outcomes)
        stored = sum(c["storage"] for _, c in outcomes)
        _log(f"recovered step {step} from memory in {time.perf_counter() - start:.2f} s: "
             f"{from_memory} fragment(s) from memory, {stored} from storage")
        self.last_load_source = "memory"
        return f"memory:{place.node_dir}@{step}", objects["client_state"]

    def _read_memory(self, load_dir, step, memory: MemorySnapshots, fragments: _Described):
        """This rank (raises; the caller reports it in the outcome exchange): copy the
        newest version (<= ``step``) of every fragment into the engine. Returns the
        snapshot's objects, the counts (``memory``, ``storage``, ``versions``) and the
        tag the next persist's expert index extends."""
        from deepspeed_ext.format.objects import decode, tensor_keys
        from deepspeed_ext.state import MomentPresence
        counts = {"memory": 0, "storage": 0}
        versions: Dict = {}  # expert -> step of the version taken (lost-token accounting)
        base = next(m for m in memory.mine if m["step"] == step)
        tree = base["objects_tree"]
        objects = decode(tree, {k: memory.read(base, k) for k in tensor_keys(tree)})
        # Before describing: a snapshot taken before the first (non-overflowing)
        # step holds no moments, and the engine must then have none either.
        moments = MomentPresence.from_record(objects.get("optimizer_moments"))
        storage = StorageVersions(load_dir, step)
        try:
            with torch.no_grad():
                for frag in fragments(fresh=True, moments=moments):
                    meta, data = self._newest(frag, base, step, memory.mine, storage, counts,
                                              versions)
                    if meta is not None:  # from memory: straight into the engine
                        memory.read_into(meta, frag.key, frag.tensor)
                    else:
                        frag.tensor.copy_(data.to(device=frag.tensor.device,
                                                  dtype=frag.tensor.dtype))
            # What the next persist's expert index extends: read here, before the
            # outcome exchange (a damaged manifest must not raise after it on one rank).
            extends = storage.base_tag()
        finally:
            storage.close()
        counts["versions"] = sorted(versions.items())
        return objects, counts, extends

    def _newest(self, frag, base, step, mine, storage, counts, versions):
        """Where the newest version (<= step) of one fragment is; records its step in
        ``versions`` for experts.

        Returns:
            ``(meta, None)``: in the memory snapshot ``meta`` (read it with
            :meth:`MemorySnapshots.read_into`); ``(None, tensor)``: read from storage.
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
        return None, reader.read(frag.name, frag.kind, frag.offset, frag.length, split=frag.split)

    def _overlay_newer_experts(self, memory: MemorySnapshots, fragments) -> None:
        """Two-level recovery: after a storage load, take experts whose memory snapshot on
        this rank is newer than what storage gave (every rank calls it; ``fragments()``
        describes the state)."""
        from deepspeed_ext.state import refresh_compute_weights
        ses = self.place.session
        versions = ses.expert_versions_loaded or {}
        staged = self._stage_newer(memory, fragments, versions)
        newer: Dict = {}
        with torch.no_grad():
            for frag, data, step in staged:
                frag.tensor.copy_(data.to(device=frag.tensor.device, dtype=frag.tensor.dtype))
                newer[tuple(frag.expert)] = step
        taken = len(staged)
        refresh_compute_weights(ses.engine)
        if taken:
            self.last_load_source = "storage+memory"
        totals: List = [None] * self.place.world
        dist.all_gather_object(totals, (taken, sorted(newer.items())), group=metadata_group())
        for _, part in totals:
            versions = {**versions, **{tuple(k): v for k, v in part}}
        if ses.last_recovery is not None:  # the ledger holds the storage checkpoint's state
            ses.last_recovery = ses.ledger.loss(ses.last_recovery.step, versions)
        totals = [t for t, _ in totals]
        if sum(totals):
            _log(f"two-level recovery: {sum(totals)} expert fragment(s) taken from the memory "
                 f"of ranks {[r for r, t in enumerate(totals) if t]}, newer than storage")

    def _stage_newer(self, memory: MemorySnapshots, fragments, versions) -> list:
        """This rank: ``(fragment, data, step)`` of every expert fragment its memory holds
        newer than ``versions``; empty when a snapshot cannot be read (this rank keeps
        storage's versions; the others go on). Reads and checks everything first: a
        failure then leaves the storage state whole."""
        staged = []
        try:
            for frag in fragments():
                if frag.expert is None:
                    continue
                loaded = versions.get(tuple(frag.expert), -1)
                holders = [m for m in memory.mine if frag.key in m["specs"] and m["step"] > loaded]
                if holders:
                    newest = max(holders, key=lambda m: m["step"])
                    data = memory.read(newest, frag.key)
                    if data.numel() != frag.length:
                        raise RuntimeError(f"{frag.key} in the step-{newest['step']} snapshot "
                                           f"has {data.numel()} elements, this rank holds "
                                           f"{frag.length}")
                    staged.append((frag, data, newest["step"]))
        except Exception as e:
            logger.warning(f"[moc] rank {self.place.rank}: WARNING: cannot read its memory "
                           f"snapshots ({type(e).__name__}: {e}); keeping the versions from storage")
            staged = []
        return staged
