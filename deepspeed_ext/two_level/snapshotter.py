"""Snapshots into this rank's shared-memory slots (:mod:`deepspeed_ext.two_level`).

:meth:`Snapshotter.save`, every rank, in order: waits for the previous copy (normally
long done: the optimizer step waited for it); only for a snapshot due for storage, one
small collective (:class:`deepspeed_ext.runtime.exchange.Exchanger`) of copy errors, rank
0's view of the previous persist and of the new directory, and every rank's RNG state;
picks the experts; then picks a free slot (not one still being sealed) and hands the
snapshot to its two stages (:mod:`deepspeed_ext.two_level.stages`): the copy, which the
next optimizer step waits for, and the seal (checksum, publish, the persist job to the
keeper through :class:`deepspeed_ext.two_level.handover.KeeperHandOver`), which it does
not."""

import logging
import time
import traceback
from typing import Callable, List, Optional, Tuple

from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.runtime.exchange import Exchanger
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import raise_if_failed
from deepspeed_ext.snapshot import choose_waiting
from deepspeed_ext.two_level.handover import KeeperHandOver
from deepspeed_ext.two_level.layouts import SnapshotLayouts
from deepspeed_ext.two_level.persister import Persister
from deepspeed_ext.two_level.records import (NewestSnapshot, RankPlace, SnapshotPlan,
                                             SnapshotTiming)
from deepspeed_ext.two_level.stages import SnapshotStages, SnapshotWork

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


class Snapshotter:
    """Takes this rank's snapshots; holds the newest one and its copy in flight."""

    def __init__(self, place: RankPlace, layouts: SnapshotLayouts, persister: Persister,
                 handover: KeeperHandOver):
        from deepspeed_ext.policy.pec import make_policy
        self.place = place
        self.layouts = layouts
        self.persister = persister
        self.handover = handover
        self.exchanger = Exchanger()
        layout = place.session.layout
        self.snap_policy = None
        """The snapshots' own expert rotation (``k_snapshot`` per MoE layer)."""
        if layout is not None:
            k = place.cfg.k_snapshot or layout.num_experts
            self.snap_policy = make_policy("sequential", layout, min(k, layout.num_experts))
        self.count = 0
        self.fault_hook: Optional[Callable[[int], None]] = None
        """Fault injection: called by the seal thread with the step once a snapshot's bytes
        are copied, before the slot is published as complete."""
        self.stages = SnapshotStages(place, persister, handover.submit,
                                     lambda: self.fault_hook)
        """The copy and seal of the snapshots taken (:mod:`deepspeed_ext.two_level.stages`)."""
        self.stall_s: List[float] = []
        self.last: Optional[NewestSnapshot] = None
        """The newest snapshot: its slot, metadata, write pieces, and whether it was persisted."""
        self.protected: Optional[Tuple[int, int]] = None
        """(slot, step) of the newest snapshot given to the redundancy (erasure keeps it)."""
        self._evict_warned = False
        self.redundancy_wait_s = 0.0
        """Seconds snapshots waited for a slot still being protected (redundancy slower
        than the snapshots)."""

    @property
    def copy_error(self) -> Optional[str]:
        """This rank's first copy or seal error not yet reported."""
        return self.stages.error

    def take_copy_error(self) -> Optional[str]:
        """This rank's first copy or seal error not yet reported, and forget it."""
        return self.stages.take_error()

    # -- the stall point ---------------------------------------------------------

    def wrap_step(self) -> None:
        """Once, at start-up: ``engine.step`` waits for the copy in flight (only the copy,
        not its seal) before the optimizer touches the tensors, and records how long the
        host waited in :attr:`stall_s`."""
        from deepspeed_ext.engine.hostcopy import wait_before_step
        wait_before_step(self.place.session.engine, self.stages.copy_pending,
                         self.stages.wait_copied, self.stall_s)

    def join_copy(self) -> None:
        """This rank: wait for every snapshot in flight, copied and sealed (its errors are
        recorded, not raised)."""
        self.stages.join()

    # -- snapshot ------------------------------------------------------------------

    def save(self, save_dir: str, tag: Optional[str], client_state, save_latest: bool) -> bool:
        """Every rank: take a snapshot (see the module docstring). Returns False when this
        rank failed after the exchange (raised on every rank at the next due snapshot or
        wait), True otherwise."""
        start = time.perf_counter()
        # The previous copy must be done before this one is planned (a save without an
        # optimizer step in between); its seal may go on.
        self.stages.wait_copied()
        step = int(self.place.session.engine.global_steps)
        plan = SnapshotPlan(save_dir=save_dir, tag=tag or f"global_step{step}", step=step,
                            save_latest=save_latest, start=start,
                            want=self.count % self.place.cfg.persist_interval == 0)
        # Everything this rank needs to restore itself (its own partitions), so that
        # recovery from memory never needs another node's memory.
        fragments, signature, rows = self.layouts.fragments()
        pieces = self.place.session.gather_pieces(fragments)
        self.count += 1
        plan.rng_state = get_rng_state()
        self._agree(plan)
        plan.persist = plan.want and self.persister.pending is None
        if plan.want and not plan.persist:
            _log(f"snapshot at step {step}: the previous persist ({self.persister.pending.tag}) "
                 f"is still running; this snapshot stays in memory only")
        self._choose_experts(plan)
        if plan.persist:
            plan.claim = self.persister.raise_if_unprepared(plan.prepared, save_dir, plan.tag,
                                                            plan.policy_before)
        try:  # rank-local from here on: see _record_failure
            self._fill_slot(plan, client_state, signature, rows, pieces)
            return True
        except Exception as e:
            self._record_failure(plan, e)
            return False

    def _agree(self, plan: SnapshotPlan) -> None:
        """Every rank: for a snapshot due for storage, the one collective of the snapshot;
        fills ``plan.rng_states`` and ``plan.prepared`` and settles the pending persist."""
        place = self.place
        if not plan.want:
            # No collective at all: memory recovery needs only this rank's own RNG state
            # (other ranks restore theirs from their own snapshots); a copy error is
            # raised on every rank at the next persisted snapshot or wait().
            plan.rng_states = [None] * place.world
            plan.rng_states[place.rank] = plan.rng_state
            return
        prepared = None
        # before the view the decision rests on
        self.handover.abandon_if_keeper_died(self.persister.pending)
        view = self.persister.persist_view() if place.rank == 0 else None
        if view is not None and place.rank == 0:
            # This persist will run (nothing pending, or the pending one finished):
            # rank 0 creates its directory now, and the outcome travels with the
            # exchange instead of a second collective in the save call.
            prepared = self.persister.prepare_on_rank0(plan.save_dir, plan.tag, plan.step)
        # The one collective of a snapshot due for storage: copy errors, rank 0's view
        # of the pending persist and of the new directory, and every rank's RNG state
        # (the persist's objects).
        gathered = self.exchanger.exchange((self.take_copy_error(), view, plan.rng_state,
                                            prepared))
        raise_if_failed([(error is None, error) for error, _, _, _ in gathered],
                         "MoC snapshot copy")
        plan.rng_states = [rng for _, _, rng, _ in gathered]
        self.persister.settle(gathered[0][1])
        plan.prepared = gathered[0][3]

    def _choose_experts(self, plan: SnapshotPlan) -> None:
        """Every rank, identically: ``k_snapshot`` experts per MoE layer for memory, plus,
        when persisting, the PEC policy's for storage (always also in the snapshot);
        marks them saved (``plan.policy_before``: the PEC state before)."""
        ses = self.place.session
        snap_sel = self.snap_policy.select() if self.snap_policy is not None else None
        plan.persist_sel = ses.select_experts(plan.save_dir) \
            if (plan.persist and ses.policy is not None) else frozenset()
        plan.union = (snap_sel | plan.persist_sel) if snap_sel is not None else None
        if self.snap_policy is not None:
            self.snap_policy.mark_saved(plan.union, plan.step)
            ses.ledger.mark_saved(plan.union, plan.step)  # every persisted expert is in the union
        plan.policy_before = ses.policy.state_dict() if ses.policy is not None else None
        if plan.persist and ses.policy is not None:
            ses.policy.mark_saved(plan.persist_sel, plan.step)

    def _fill_slot(self, plan: SnapshotPlan, client_state, signature, rows, pieces) -> None:
        """This rank: lay the snapshot out in a free slot and start its copy and seal."""
        from deepspeed_ext.format.objects import encode
        place = self.place
        objects = place.session.objects(client_state)
        objects["rng_states"] = plan.rng_states
        objects["snapshot_policy"] = (self.snap_policy.state_dict()
                                      if self.snap_policy is not None else None)
        tree, object_tensors = encode(objects)
        content = self.layouts.content(rows, plan.union)
        tensors = dict(content.tensors)
        tensors.update(object_tensors)
        cached = self.layouts.layout(plan.union, content, tensors, object_tensors)
        timing = SnapshotTiming(step=plan.step, persist=plan.persist)
        slot = self._free_slot(timing)
        place.slots.invalidate(slot)
        buffer = place.slots.buffer(slot, cached.image.nbytes)
        meta = {"step": plan.step, "tag": plan.tag, "signature": signature,
                "entries": cached.entries, "specs": content.specs,
                "experts": sorted(plan.union) if plan.union is not None else None,
                "objects_tree": tree, "run_id": place.run_id}
        self.last = NewestSnapshot(slot=slot, meta=meta, pieces=pieces, save_dir=plan.save_dir,
                                   save_latest=plan.save_latest,
                                   object_keys=list(object_tensors), persisted=plan.persist,
                                   rng_state=plan.rng_state, rng_gathered=plan.want)
        persist = self.persister.request(
            self.last, plan.persist_sel if plan.union is not None else None,
            plan.policy_before, plan.claim) if plan.persist else None
        # Every rank protects the same snapshots (the count is the same everywhere), so
        # the peers' messages pair up.
        protect = self._protects_this_one()
        self.stages.start(SnapshotWork(slot=slot, buffer=buffer, layout=cached.image,
                                       plan=cached.plan, tensors=tensors, meta=meta,
                                       layout_id=cached.layout_id, persist=persist,
                                       protect=protect,
                                       timing=timing))
        plan.started = True
        if protect:
            self.protected = (slot, plan.step)
        timing.save_s = time.perf_counter() - plan.start
        if plan.persist or self.count == 1:  # a line per snapshot would flood per-iteration runs
            self._log_snapshot(plan, cached.image)

    def _protects_this_one(self) -> bool:
        """Whether the redundancy protects the snapshot being taken (the same on every rank)."""
        return (self.place.redundancy is not None
                and (self.count - 1) % self.place.cfg.redundancy_interval == 0)

    def _log_snapshot(self, plan: SnapshotPlan, layout) -> None:
        layout_of_experts, union = self.place.session.layout, plan.union
        _log(f"snapshot {plan.tag} (step {plan.step}) into {self.place.node_dir}: "
             f"{layout.nbytes / 2**20:.2f} MiB on rank 0, "
             + (f"{len(union)} of {layout_of_experts.num_moe_layers * layout_of_experts.num_experts} "
                f"experts" if union is not None else "no MoE")
             + ((f", persisting {len(plan.persist_sel)} of them" if union is not None
                 else ", persisting") if plan.persist else ", in memory only")
             + f"; the save call took {time.perf_counter() - plan.start:.3f} s")

    def _record_failure(self, plan: SnapshotPlan, e: Exception) -> None:
        """Rank-local (shared memory full on this node, say), after this snapshot's
        exchange: raising here would leave the other ranks in training's next
        collective. Recorded like a copy error instead, and raised on every rank at the
        next persisted snapshot or wait(). Called inside the ``except`` clause."""
        traceback.print_exc()
        if not plan.started and self._protects_this_one():
            # The seal thread never got it, so it will not take part in this
            # snapshot's protection: do it here, or the peers' messages stop pairing.
            self.place.redundancy.protect(plan.step, -1, None, None)
        error = f"snapshot {plan.tag}: {type(e).__name__}: {e}"
        self.stages.record_error(error)
        logger.warning(
            f"[moc] rank {self.place.rank}: WARNING: {error} (raised on every rank at "
            f"the next persisted snapshot)")

    def _free_slot(self, timing: SnapshotTiming) -> int:
        """A slot for the next snapshot that is not being sealed, that neither the keeper
        nor the redundancy thread still reads, and that does not hold the snapshot
        erasure coding needs to rebuild a lost node (:meth:`_kept_for_rebuild`). Waits
        for the oldest seal, then for the redundancy, only while no slot is free (the
        waits go to ``timing.slot_wait_s``), gives up the kept snapshot only when even
        that leaves none, and waits for the keeper to read a slot it persists when every
        slot is being persisted (:func:`deepspeed_ext.snapshot.choose_waiting`)."""
        place = self.place
        keep = self._kept_for_rebuild()
        while True:
            busy = place.redundancy.busy_slots() if place.redundancy is not None else set()
            sealing = self.stages.sealing()
            try:
                return place.slots.choose(exclude=busy | keep | sealing)
            except RuntimeError:
                if not sealing:
                    break
            timing.slot_wait_s += self.stages.wait_oldest_seal()
        if busy:
            waited = place.redundancy.wait_slots()
            self.redundancy_wait_s += waited
            timing.slot_wait_s += waited
            _log(f"WARNING: the next snapshot waited {waited:.3f} s for the redundancy of an "
                 f"earlier one (snapshots come faster than peers receive them: snapshot less "
                 f"often, or use --moc-redundancy erasure, which sends less)")
        try:
            return place.slots.choose(exclude=keep)
        except RuntimeError:
            pass
        try:  # the slot erasure coding keeps, when it is not being persisted
            slot = place.slots.choose()
        except RuntimeError:  # the keeper still reads every other slot: wait (bounded)
            slot, waited = choose_waiting(place.slots)
            timing.slot_wait_s += waited
            logger.warning(f"[moc] rank {place.rank}: WARNING: the snapshot of step "
                           f"{timing.step} waited {waited:.2f} s for the keeper to read a slot "
                           "it persists (storage slower than the snapshots)")
            return slot
        if not self._evict_warned:
            self._evict_warned = True
            logger.warning(
                f"[moc] rank {place.rank}: WARNING: reusing the slot of step "
                f"{self.protected[1]}'s snapshot, the newest one erasure coding protects "
                f"(the other slots are newer or still being persisted): a node lost "
                f"before the next protected snapshot recovers from storage")
        return slot

    def _kept_for_rebuild(self) -> set:
        """The slot to keep for erasure coding, as a set (empty: none to keep). Rebuilding
        a lost node's snapshot of step S needs the other stripe members' own snapshots
        of S besides the parities; with ``--moc-redundancy-interval`` above 1 the slots
        would otherwise have moved past S before the next protected snapshot (replicas
        need nothing of the survivors, and with interval 1 the newest is kept anyway)."""
        place = self.place
        if (place.redundancy is None or place.spec.mode != "erasure"
                or place.cfg.redundancy_interval <= 1 or self.protected is None):
            return set()
        slot, step = self.protected
        meta = place.slots.meta(slot)
        return {slot} if meta is not None and meta["step"] == step else set()
