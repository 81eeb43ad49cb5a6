"""The two-level backend of :class:`deepspeed_ext.checkpointer.MoCCheckpointer`
(``MoCConfig.two_level``): :class:`TwoLevel` puts its collaborators together and is
what ``engine.moc.two_level`` is. See :mod:`deepspeed_ext.two_level` for the save,
wait and load protocols; every rank calls them, in the same order."""

import logging
import os
from typing import Callable, Optional

import torch.distributed as dist

import deepspeed_ext.keeper as keeper
from deepspeed_ext.engine.hostcopy import HostCopier
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import MoCCheckpointError, raise_if_failed
from deepspeed_ext.session import CheckpointSession
from deepspeed_ext.snapshot import SLOTS
from deepspeed_ext.storage_load import StorageLoad
from deepspeed_ext.two_level.budget import check_memory_budget, prepare_slots, start_keeper
from deepspeed_ext.two_level.handover import KeeperHandOver
from deepspeed_ext.two_level.layouts import SnapshotLayouts
from deepspeed_ext.two_level.persister import Persister
from deepspeed_ext.two_level.records import NewestSnapshot, PendingPersist, RankPlace
from deepspeed_ext.two_level.recovery import Recovery
from deepspeed_ext.two_level.snapshotter import Snapshotter

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def _rank_place(session: CheckpointSession) -> RankPlace:
    """Every rank: this rank's node, its directory, the redundancy's topology (a bad
    layout is raised on every rank, the same everywhere) and the number of slots."""
    from deepspeed_ext.node_layout import first_of_node, node_of, ranks_per_node
    cfg = session.config
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = ranks_per_node(cfg.ranks_per_node, world)
    node = node_of(rank, per_node)
    place = RankPlace(session=session, cfg=cfg, rank=rank, world=world, node=node,
                      first_of_node=first_of_node(rank, per_node),
                      node_dir=keeper.node_directory(cfg.shm_dir, node),
                      spec=cfg.redundancy_spec())
    if place.spec.enabled:
        from deepspeed_ext.policy.redundancy import Topology, check_layout
        try:
            place.topo = Topology(world, per_node)
            check_layout(place.spec, place.topo)
        except ValueError as err:  # the same on every rank: every rank raises
            raise MoCCheckpointError(str(err)) from None
    # Erasure coding protecting every N-th snapshot rebuilds a lost node from the
    # survivors' own copies of the newest protected one: a fourth slot keeps it while
    # the others hold the newest snapshot and the one being persisted.
    from deepspeed_ext.policy.redundancy import extra_own_slots
    place.num_slots = SLOTS + extra_own_slots(place.spec, cfg.redundancy_interval)
    return place


class TwoLevel:
    """Level 1 and level 2 state of one rank; created by the checkpointer on every rank
    (its start-up runs collectives: the run id, the memory budget, the keeper)."""

    def __init__(self, session: CheckpointSession, storage: StorageLoad):
        from deepspeed_ext.job_identity import agree_run_id
        from deepspeed_ext.state import describe_local_state
        cfg = session.config
        self.session = session
        self.cfg = cfg
        self.place = place = _rank_place(session)
        place.run_id = agree_run_id(cfg.save_dir, cfg.shm_dir, log=_log)
        frags = describe_local_state(session.engine, session.naming, with_moments=False)
        place.copier = HostCopier(HostCopier.device_of({f.key: f.tensor for f in frags}))
        # The node's directory made private and bound to this job inside the budget
        # check's collective (a refusal reaches every rank); then the keeper.
        check_memory_budget(place, frags)
        start_keeper(place)
        self.layouts = SnapshotLayouts(session, place.world)
        self.prepare_s = prepare_slots(place, self.layouts.fragments()[0])
        """Seconds the start-up took to make every slot ready (sized, allocated, mapped and,
        on CUDA, page-locked), so that no snapshot maps or registers memory in training."""
        self.handover = KeeperHandOver(place)
        self.persister = Persister(place, self.handover)
        self.snapshotter = Snapshotter(place, self.layouts, self.persister, self.handover)
        self.recovery = Recovery(place, self.layouts, self.snapshotter, storage, self.wait)
        if place.spec.enabled:
            from deepspeed_ext.peers import PeerRedundancy
            place.redundancy = PeerRedundancy(place.spec, place.topo, place.node_dir,
                                              cfg.commit_timeout_s)
        self.snapshotter.wrap_step()

    # -- what the trainer, tests and benchmarks read ----------------------------------

    rank = property(lambda self: self.place.rank, doc="This process's rank.")
    world = property(lambda self: self.place.world, doc="The number of ranks.")
    node = property(lambda self: self.place.node, doc="This rank's node.")
    first_of_node = property(lambda self: self.place.first_of_node,
                             doc="Whether this rank is its node's first (it talks for the keeper).")
    node_dir = property(lambda self: self.place.node_dir,
                        doc="This node's directory under ``--moc-shm-dir``.")
    slots = property(lambda self: self.place.slots, doc="This rank's snapshot slots.")
    redundancy = property(lambda self: self.place.redundancy,
                          doc="The peers' redundancy (None: ``--moc-redundancy none``).")
    budget_bytes = property(lambda self: self.place.budget_bytes,
                            doc="Shared memory this rank's slots may take.")
    stages = property(lambda self: self.snapshotter.stages,
                      doc="The copy and seal threads of the snapshots.")
    stall_s = property(lambda self: self.snapshotter.stall_s,
                       doc="Seconds ``engine.step`` waited for each snapshot copy.")
    timings = property(lambda self: self.snapshotter.stages.settled_timings(),
                       doc="Where each recent snapshot's time went (``SnapshotTiming``, oldest "
                           "first; final once ``sealed``).")
    redundancy_wait_s = property(lambda self: self.snapshotter.redundancy_wait_s,
                                 doc="Seconds snapshots waited for a slot still being protected.")
    keeper_gone = property(lambda self: self.handover.keeper_gone,
                           doc="Whether this rank persists in process (its keeper died).")

    @property
    def last(self) -> Optional[NewestSnapshot]:
        """The newest snapshot: its slot, metadata, write pieces, and whether it was persisted."""
        return self.snapshotter.last

    @property
    def persist(self) -> Optional[PendingPersist]:
        """The last persist requested and not yet seen committed."""
        return self.persister.pending

    @property
    def fault_hook(self) -> Optional[Callable[[int], None]]:
        """Fault injection: called by the copy thread with the step once a snapshot's bytes
        are copied, before the slot is published as complete (the trainer sets it)."""
        return self.snapshotter.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Optional[Callable[[int], None]]) -> None:
        self.snapshotter.fault_hook = hook

    @property
    def last_load_source(self) -> Optional[str]:
        """Where the last load came from: ``memory``, ``memory+peers``, ``storage`` or
        ``storage+memory``."""
        return self.recovery.last_load_source

    @property
    def load_exchanger(self):
        """The last load's exchanges (:class:`deepspeed_ext.runtime.exchange.Exchanger`)."""
        return self.recovery.load_exchanger

    def join_copy(self) -> None:
        """This rank: wait for the snapshots in flight, copied and sealed."""
        self.snapshotter.join_copy()

    def note_exact_replay(self, where: str) -> None:
        """Exact recovery replayed frames from ``where``: two-level reports its own loads
        only (:attr:`last_load_source` is left as it is)."""

    def host_memory_bytes(self) -> int:
        """Shared memory this rank's snapshot slots and its peers' redundancy take."""
        redundancy = self.place.redundancy
        extra = redundancy.store.host_bytes() if redundancy is not None else 0
        return self.place.slots.host_bytes() + extra

    # -- save, wait, load ---------------------------------------------------------------

    def save(self, save_dir: str, tag: Optional[str], client_state, save_latest: bool) -> bool:
        """Every rank: a snapshot (:meth:`Snapshotter.save`)."""
        return self.snapshotter.save(save_dir, tag, client_state, save_latest)

    def wait(self) -> None:
        """Every rank: returns once every snapshot taken so far is on storage and nothing
        this job asked for is still writing. Joins the copy, waits for the pending persist,
        then persists the newest snapshot if it was not (see
        :meth:`Persister.persist_newest`) and waits for that; any rank's failure is raised
        on every rank. A pending persist that failed only because a keeper died with it
        is not raised: every rank settles it as failed and persists the newest snapshot
        from this process (:meth:`_redo_lost_persist`). Last, also when it raises,
        :meth:`KeeperHandOver.drain` (rank-local, no collective)."""
        snap = self.snapshotter
        try:
            snap.join_copy()
            message = snap.take_copy_error()
            ok = message is None
            outcomes, lost_with_keeper = self.persister.wait_pending(ok, message)
            if lost_with_keeper:
                self._redo_lost_persist()
            else:
                raise_if_failed(outcomes, "MoC two-level wait")
            if snap.last is not None and not snap.last.persisted:
                ok, message = self.persister.persist_newest(snap.last)
                raise_if_failed(self.persister.wait_pending(ok, message)[0],
                                "MoC two-level wait")
        finally:
            self.handover.drain()

    def _redo_lost_persist(self) -> None:
        """Every rank (the same decision everywhere, from the wait's outcome exchange): the
        pending persist died with a keeper. The newest snapshot is that persist's, or a
        later one kept in memory only: it is marked not persisted, so the wait persists
        it from this process. This rank's own writes of the lost persist end first (they
        stand down on its failure record), so that none of them lands in the directory
        the redo prepares again."""
        _log("a keeper died with the pending persist: persisting the newest snapshot from "
             "the training processes instead")
        self.handover.join_local_persists()
        if self.snapshotter.last is not None:
            self.snapshotter.last.persisted = False

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             load_lr_scheduler_states: bool, from_memory: bool = True):
        """Every rank: a new timeline, then :meth:`Recovery.load`."""
        self.session.timeline.new_timeline()
        return self.recovery.load(load_dir, tag, load_optimizer_states,
                                  load_lr_scheduler_states, from_memory)

    def shutdown(self) -> None:
        """Every rank, at the end of training: persist finished, keeper stopped, memory
        freed. When the last persist failed (raised on every rank), the keeper and its
        memory are left: the newest snapshots exist nowhere else, and a restart before the
        keeper's idle exit recovers from them."""
        place, cfg = self.place, self.cfg
        persisted = False
        try:
            self.wait()
            persisted = True
        finally:
            self.snapshotter.stages.shutdown()
            self.handover.sender_pool.shutdown(wait=True)
            place.copier.unregister_all()  # CUDA: no copy is in flight any more
            if place.redundancy is not None:
                place.redundancy.close()
                _log(place.redundancy.summary())
            dist.barrier(group=metadata_group())
            if place.first_of_node and persisted:
                keeper.shutdown_keeper(place.node_dir, cfg.commit_timeout_s, place.run_id,
                                       self.session.timeline.attempt_started)
            elif place.first_of_node:
                logger.warning(
                    f"[moc] rank {place.rank}: WARNING: the newest snapshots are not all on "
                    f"storage: leaving them in {place.node_dir}; its keeper exits "
                    f"{cfg.keeper_idle_timeout_s:.0f} s after the last training "
                    f"process, and a restart before that recovers from them")
            dist.barrier(group=metadata_group())
            if place.rank == 0:
                try:
                    os.rmdir(cfg.shm_dir)  # only when every node's directory is gone
                except OSError:
                    pass

    def abandon(self) -> None:
        """This rank alone, after its run failed (a peer died, a collective broke): stop
        the copy and seal threads once their current work ends, the hand-over thread and
        the redundancy thread, and unregister the slots' host memory; no collective runs
        (the peers may be gone). The keeper and the node's snapshots stay: the next round
        of an in-job restart recovers from them. Errors are logged, not raised: the
        caller is already handling a failure."""
        place = self.place
        steps = [("snapshot stages", self.snapshotter.stages.shutdown),
                 ("hand-over", lambda: self.handover.sender_pool.shutdown(wait=True)),
                 ("host memory", place.copier.unregister_all)]
        if place.redundancy is not None:
            steps.append(("redundancy", place.redundancy.stop))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001  (a broken peer's error, reported below)
                logger.warning(f"[moc] rank {place.rank}: abandoning the run: {what}: "
                               f"{type(e).__name__}: {e}")

    def drop_node_memory(self) -> None:
        """Fault injection: this node loses its snapshots, as when the machine dies. Kills
        the node's keeper and deletes its shared memory; any rank of the node may call it,
        the other ranks of the node are expected to die with it."""
        import shutil
        import signal
        try:
            os.kill(keeper.request(self.place.node_dir, {"op": "ping"})["pid"], signal.SIGKILL)
        except Exception as e:  # already gone: its memory is what matters
            _log(f"node {self.place.node}: keeper not reachable ({e})")
        shutil.rmtree(self.place.node_dir, ignore_errors=True)
