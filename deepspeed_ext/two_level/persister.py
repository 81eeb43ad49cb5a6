"""Persisting snapshots to storage (:mod:`deepspeed_ext.two_level`): the persist's tag
directory, its job for the keeper, rank 0's view of the pending persist and how every
rank settles it, waiting for it, and persisting the newest snapshot at the end.

Collectives: :meth:`Persister.prepare_dir` (one broadcast), :meth:`Persister.persist_newest`
(an ``all_gather_object`` of RNG states and one outcome broadcast when the snapshot
lacks them) and :meth:`Persister.wait_pending` (one outcome exchange); every rank calls
them in the same order. The rest is rank-local."""

import logging
import os
import time
import traceback
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE
from deepspeed_ext.jobs import CommitSpec, PersistJob, image_entry_from_json
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import MoCCheckpointError, all_outcomes, broadcast_outcome
from deepspeed_ext.runtime.retry import Backoff, poll_until
from deepspeed_ext.snapshot import SlotImage
from deepspeed_ext.store import claims, commit
from deepspeed_ext.store.latest import extended_tag
from deepspeed_ext.two_level.handover import KeeperHandOver
from deepspeed_ext.two_level.records import (NewestSnapshot, PendingPersist, PersistRequest,
                                             RankPlace)

COMMIT_POLL_BACKOFF = Backoff(first_s=0.01, max_s=0.2)
"""Sleeps between a rank's polls for the pending persist's commit (:meth:`Persister.wait_pending`)."""

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


class Persister:
    """This rank's persists: the pending one, and the jobs it hands to the keeper."""

    def __init__(self, place: RankPlace, handover: Optional[KeeperHandOver]):
        self.place = place
        self.handover = handover
        self.pending: Optional[PendingPersist] = None
        """The last persist requested and not yet seen committed."""

    # -- the persist's directory ------------------------------------------------------

    def prepare_dir(self, save_dir: str, tag: str, step: int, policy_before) -> Optional[str]:
        """Every rank: create the persist's tag directory (one broadcast of rank 0's
        :meth:`prepare_on_rank0` outcome), then :meth:`raise_if_unprepared`; returns the
        directory's claim. For a persist outside a snapshot's exchange (the end of training)."""
        status = [self.prepare_on_rank0(save_dir, tag, step) if self.place.rank == 0 else None]
        dist.broadcast_object_list(status, src=0, group=metadata_group())
        return self.raise_if_unprepared(status[0], save_dir, tag, policy_before)

    def prepare_on_rank0(self, save_dir: str, tag: str, step: int) -> Tuple[bool, Optional[str], Optional[str]]:
        """Rank 0: create a persist's tag directory; ``(ok, error, claim)``, never raises."""
        try:
            self.place.session.prepare_save_dir(save_dir, tag, step)
            return True, None, claims.read_claim(os.path.join(save_dir, tag))
        except Exception as e:
            traceback.print_exc()
            return False, f"{type(e).__name__}: {e}", None

    def raise_if_unprepared(self, prepared, save_dir: str, tag: str, policy_before) -> Optional[str]:
        """Every rank, with rank 0's :meth:`prepare_on_rank0` outcome from the exchange:
        a failure is raised on every rank and the PEC policy's marks are undone. Returns
        the directory's claim, which every rank's persist job carries."""
        if prepared is None or not prepared[0]:
            if self.place.session.policy is not None:
                self.place.session.policy.load_state_dict(policy_before)
            why = prepared[1] if prepared is not None else "rank 0 did not prepare it"
            raise MoCCheckpointError(f"MoC persist to {os.path.join(save_dir, tag)} failed "
                                     f"on rank 0: {why}")
        return prepared[2]

    # -- the job ------------------------------------------------------------------------

    def request(self, snap: NewestSnapshot, selected, policy_before,
                claim: Optional[str]) -> PersistRequest:
        """Save call (main thread): persist the snapshot ``snap`` (a ``TwoLevel.last``
        record) holding ``selected`` experts on storage (None: no MoE), under rank 0's
        ``claim`` on its directory; records it as the pending persist now (the next
        save's decisions rest on it) and leaves the job's heavy part (the write plan,
        the layout records) to :meth:`job_for` on the seal thread."""
        place, ses, meta = self.place, self.place.session, snap.meta
        commit_spec = None
        if place.rank == 0:
            commit_spec = CommitSpec(
                step=meta["step"],
                layout=ses.layout_record(place.world, int(ses.engine.zero_optimization_stage())),
                previous_tag=extended_tag(ses.previous, snap.save_dir),
                selected=tuple(sorted(selected)) if selected is not None else None,
                pec_k=ses.policy.k if ses.policy is not None else None,
                save_latest=snap.save_latest, keep=place.cfg.keep,
                timeout_s=place.cfg.commit_timeout_s,
                attempt_started=ses.timeline.attempt_started)
        self.pending = PendingPersist(
            save_dir=snap.save_dir, tag=meta["tag"],
            selected=selected if selected is not None else frozenset(),
            policy_before=policy_before, slot=snap.slot, in_process=self.handover.keeper_gone,
            claim=claim)
        return PersistRequest(snap=snap, selected=selected, claim=claim, commit=commit_spec)

    def job_for(self, request: PersistRequest) -> PersistJob:
        """Seal thread (or the main thread at the end of training): the keeper's job for
        ``request`` (:func:`keeper.run_persist_job`; its JSON crosses the keeper's
        socket). Reads only what the save call fixed: the snapshot's pieces, metadata
        and slot."""
        from deepspeed_ext.policy.plan import build_write_plan
        place, snap = self.place, request.snap
        meta = snap.meta
        plan = build_write_plan(snap.pieces, place.world, request.selected)
        keys = list(plan.keys_for(place.rank))
        return PersistJob(
            image=place.slots.image_path(snap.slot),
            entries=tuple(image_entry_from_json(e) for e in meta["entries"]),
            keys=tuple(keys), specs=tuple(meta["specs"][k] for k in keys if k in meta["specs"]),
            save_dir=snap.save_dir, tag=meta["tag"], step=meta["step"], rank=place.rank,
            objects_tree=meta["objects_tree"] if place.rank == 0 else None,
            # the objects' tensors go to their own small file (objects.OBJECTS_TENSOR_FILE)
            object_keys=tuple(snap.object_keys) if place.rank == 0 else (),
            # Every rank's writer holds the claim: a keeper still running this job after
            # a restart re-saved the tag stands down instead of writing this attempt's
            # file (or report) into the new save.
            claim=request.claim, run_id=place.run_id,
            # The image's memory checksum (set by the seal once it is known;
            # persist_newest's snapshot has it already): the keeper verifies it.
            checksum=meta.get("checksum"), commit=request.commit)

    def report_failed(self, request: PersistRequest, why: str) -> None:
        """Seal thread: this rank's share of ``request`` failed before its job reached
        the keeper (the slot could not be published, say): its failure report lets
        rank 0's commit stop now instead of at its timeout."""
        meta = request.snap.meta
        try:
            commit.write_report(os.path.join(request.snap.save_dir, meta["tag"]),
                                self.place.rank, None, error=why, claim=request.claim)
        except Exception:  # the commit then fails at its timeout, as it would have
            traceback.print_exc()

    def persist_newest(self, snap: Optional[NewestSnapshot]) -> Tuple[bool, Optional[str]]:
        """Every rank (from ``TwoLevel.wait``, nothing pending): persist the newest
        snapshot ``snap`` if it was not, with every expert it holds, so that ending a job
        (which frees the keepers' memory) never loses the last state.

        Returns:
            This rank's ``(ok, error)`` for the outcome exchange that follows (the hand-over
            after the last collective here is rank-local: its failure must be reported,
            not raised past the others' exchange).

        Raises:
            MoCCheckpointError: on every rank, when preparing the persist failed on one.
        """
        if snap is None or snap.persisted:
            return True, None
        ses, meta = self.place.session, snap.meta
        selected = frozenset(tuple(e) for e in meta["experts"]) \
            if meta["experts"] is not None else None
        policy_before = ses.policy.state_dict() if ses.policy is not None else None
        if ses.policy is not None and selected is not None:
            ses.policy.mark_saved(selected, meta["step"])
        claim = self.prepare_dir(snap.save_dir, meta["tag"], meta["step"], policy_before)
        snap.persisted = True
        extra: Dict[str, Any] = {}
        if not snap.rng_gathered:  # the same on every rank: a collective is safe here
            snap = self._with_every_rng_state(snap, policy_before, extra)
        try:
            job = replace(self.job_for(self.request(snap, selected, policy_before, claim)),
                          **extra,
                          done_marker=self.place.slots.persist_marker(snap.slot))
            _log(f"persisting the newest snapshot {meta['tag']} (step {meta['step']}) before "
                 f"returning from wait")
            self.handover.send(job)
        except Exception as e:  # say, the node's shared memory vanished
            traceback.print_exc()
            why = f"{type(e).__name__}: {e}"
            try:  # the committer stops at this report instead of at its timeout
                commit.write_report(os.path.join(snap.save_dir, meta["tag"]), self.place.rank,
                                    None, error=why, claim=claim)
            except Exception:
                pass
            return False, why
        return True, None

    def _with_every_rng_state(self, snap: NewestSnapshot, policy_before,
                              extra: Dict[str, Any]) -> NewestSnapshot:
        """Every rank: the snapshot holds only this rank's RNG state; rank 0 writes the
        objects with every rank's (gathered now) itself, into objects.safetensors, and a
        failure there is raised on every rank. Fills ``extra`` with the job's fields."""
        ses = self.place.session
        rng_states: List = [None] * self.place.world
        dist.all_gather_object(rng_states, snap.rng_state, group=metadata_group())
        written = replace(snap, object_keys=[])
        try:
            broadcast_outcome(
                lambda: extra.update(self._write_objects_with(written, rng_states)),
                f"MoC objects of {snap.meta['tag']}")
        except Exception:
            if ses.policy is not None:
                ses.policy.load_state_dict(policy_before)
            snap.persisted = False
            raise
        return written

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
        image = SlotImage(self.place.slots.image_path(snap.slot))
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

    # -- the pending persist's outcome -------------------------------------------------

    def persist_view(self):
        """Rank 0, before a snapshot's exchange: the outcome of the last persist
        (``"none"``: there is none), None while it is running."""
        from deepspeed_ext.store.commit import commit_outcome
        p, cfg = self.pending, self.place.cfg
        if p is None:
            return "none"
        tag_dir = os.path.join(p.save_dir, p.tag)
        try:
            outcome = commit_outcome(tag_dir, self.place.world, p.claim)
            if outcome is None and time.monotonic() - p.started > cfg.commit_timeout_s:
                # A commit that ends with neither a manifest nor a failure record (a
                # committer that died, a job dropped) would otherwise defer every later
                # persist for the rest of the run.
                outcome = (False, f"{tag_dir} not committed within "
                                  f"{cfg.commit_timeout_s:.0f} s (--moc-commit-timeout)")
        except Exception as e:
            # Read before the snapshot's exchange, which the other ranks are already in:
            # a storage error counts as "still running" (the snapshot stays in memory
            # only, and the next one that is due looks again).
            _log(f"WARNING: cannot read the outcome of persist {p.tag} "
                 f"({type(e).__name__}: {e}); treating it as still running")
            return None
        return list(outcome) if outcome is not None else None

    def settle(self, view) -> None:
        """Every rank, with rank 0's view: forget a finished persist (undo a failed one)."""
        if self.pending is None or view is None or view == "none":
            return
        ok, message = view
        persist, self.pending = self.pending, None
        if ok:
            self.place.session.previous = (persist.save_dir, persist.tag)
            return
        _log(f"WARNING: persisting {persist.tag} failed ({message}); latest still names "
             f"the previous checkpoint, and its experts will be saved again")
        self.place.session.undo_mark_saved(persist.policy_before, persist.selected)

    def wait_pending(self, ok: bool, message) -> Tuple[list, bool]:
        """Every rank: wait for the pending persist's commit (or failure); settle it.

        Returns:
            Every rank's ``(ok, message)`` (one outcome exchange), and whether the pending
            persist failed only because a keeper died with it (some rank's
            ``keeper_lost``, no rank's snapshot copy failed): then it is settled as failed
            on every rank, and the caller persists the newest snapshot in process instead
            of raising (the snapshot is still in memory; only its writer died).
        """
        cfg = self.place.cfg
        copied = ok
        if self.pending is not None and ok:
            tag_dir = os.path.join(self.pending.save_dir, self.pending.tag)

            def poll() -> Optional[Tuple[bool, str]]:
                try:
                    # Checked on every poll: a keeper dying meanwhile ends the wait with
                    # its error instead of after the whole commit timeout.
                    self.handover.abandon_if_keeper_died(self.pending)
                    return commit.commit_outcome(tag_dir, self.place.world, self.pending.claim)
                except Exception as e:  # storage unreachable: reported, not raised here
                    traceback.print_exc()
                    return (False, f"{type(e).__name__}: {e}")

            def timed_out() -> Tuple[bool, str]:
                return False, (f"{tag_dir} not committed within "
                               f"{cfg.commit_timeout_s:.0f} s (--moc-commit-timeout)")

            ok, message = poll_until(poll, cfg.commit_timeout_s, COMMIT_POLL_BACKOFF, timed_out)
        lost = copied and self.pending is not None and self.pending.keeper_lost
        gathered = all_outcomes(ok, (message, copied, lost))
        outcomes = [(o, m) for o, (m, _, _) in gathered]
        failed = not all(o for o, _ in outcomes)
        lost_with_keeper = failed and any(l for _, (_, _, l) in gathered) \
            and all(c for _, (_, c, _) in gathered)
        if self.pending is not None:
            self.settle([not failed, next((f"rank {r}: {m}" for r, (o, m) in enumerate(outcomes)
                                           if not o), None)])
        return outcomes, lost_with_keeper
