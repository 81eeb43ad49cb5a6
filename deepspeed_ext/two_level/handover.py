"""Handing persist jobs to the node's keeper, or persisting in this process once the
keeper is gone; draining the keeper at the end of a wait (:mod:`deepspeed_ext.two_level`).

Rank-local: nothing here runs a collective. The copy thread hands each job over through
a long-lived hand-over thread (:meth:`KeeperHandOver.submit`), in order."""

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
import traceback
from typing import List, Optional, Tuple

import deepspeed_ext.keeper as keeper
from deepspeed_ext.format import fs
from deepspeed_ext.jobs import PersistJob
from deepspeed_ext.runtime.retry import Backoff, poll_until
from deepspeed_ext.store import commit
from deepspeed_ext.two_level.records import PendingPersist, RankPlace

logger = logging.getLogger(__name__)

LATE_HAND_OVER_ENV = "MOC_FAULT_LATE_HAND_OVER"
"""Fault injection (tests): ``RANK@STEP`` holds that rank's hand-over of that step's
persist until its node's keeper is gone (at most ``--moc-commit-timeout``), as a loaded
machine can: the rank then persists its share in process while the other ranks' shares
died with the keeper. Unset or empty: never (every normal run)."""


def _hand_over_is_late(rank: int, step: int) -> bool:
    """Whether :data:`LATE_HAND_OVER_ENV` holds this rank's hand-over of ``step``."""
    return os.environ.get(LATE_HAND_OVER_ENV, "") == f"{rank}@{step}"


class KeeperHandOver:
    """This rank's way to its node's keeper, and its persists run in process."""

    def __init__(self, place: RankPlace):
        self.place = place
        self.sender_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-hand-over")
        """Hands persist jobs to the keeper, in order, off the copy thread: the next
        training step waits for the copy, and a busy keeper may take its time to answer."""
        self.send_job: Optional[Future] = None
        """The last hand-over (on ``sender_pool``)."""
        self.keeper_gone = False
        self.local_persists: List[threading.Thread] = []
        """Persists run in this process since the keeper died (:meth:`drain` joins them)."""
        self.ran_here: Optional[Tuple[str, str, Optional[str]]] = None
        """``(save_dir, tag, claim)`` of the last save whose share this process wrote itself."""

    def submit(self, job: PersistJob) -> None:
        """Copy thread: hand ``job`` over on the hand-over thread (:meth:`send_safely`)."""
        self.send_job = self.sender_pool.submit(self.send_safely, job)

    def send_safely(self, job: PersistJob) -> None:
        """Hand-over thread: :meth:`send`; an error fails this persist (reported in its
        directory, so the pending persist ends) instead of vanishing with the thread."""
        try:
            self.send(job)
        except Exception as e:
            traceback.print_exc()
            self.fail_unsent(job, f"{type(e).__name__}: {e}")

    def send(self, job: PersistJob) -> None:
        """Hand ``job`` to the keeper; once it is gone, run it in a thread of this process."""
        place = self.place
        if not self.keeper_gone:
            job = replace(job, id=keeper.job_id(job.tag, place.rank,
                                                place.session.timeline.attempt_started))
            if _hand_over_is_late(place.rank, job.step):
                self._hold_until_keeper_gone(job)
            try:
                if keeper.hand_over(place.node_dir, job.to_json(),
                                    patience_s=place.cfg.commit_timeout_s):
                    return
            except keeper.KeeperError as e:
                self.fail_unsent(job, str(e))
                return
            self.keeper_died("it did not take the persist of " + job.tag)
        self.ran_here = (job.save_dir, job.tag, job.claim)
        thread = threading.Thread(target=keeper.run_persist_job, args=(job,),
                                  name=f"moc-persist-{job.tag}")
        self.local_persists = [t for t in self.local_persists if t.is_alive()] + [thread]
        thread.start()

    def _hold_until_keeper_gone(self, job: PersistJob) -> None:
        """Hand-over thread, under :data:`LATE_HAND_OVER_ENV` only: wait for the keeper's death."""
        logger.warning(f"[moc] rank {self.place.rank}: {LATE_HAND_OVER_ENV}: handing over "
                       f"the persist of {job.tag} once the keeper of node {self.place.node} "
                       f"is gone")
        poll_until(lambda: True if keeper.is_dead(self.place.node_dir) else None,
                   self.place.cfg.commit_timeout_s, Backoff(first_s=0.01, max_s=0.1),
                   lambda: None)

    def fail_unsent(self, job: PersistJob, why: str) -> None:
        """Copy thread: a live keeper never took this rank's job. It may still run it
        (the slot stays marked as persisting until it has read it), so this process
        does not write it too: the persist ends as failed (rank 0 also marks the
        commit failed, having no committer) and training goes on."""
        tag_dir = os.path.join(job.save_dir, job.tag)
        logger.warning(f"[moc] rank {self.place.rank}: WARNING: persist of {job.tag} abandoned: {why}")
        try:
            commit.write_report(tag_dir, self.place.rank, None, error=why, claim=job.claim)
            if job.commit is not None:
                commit.write_failure(tag_dir, why, claim=job.claim)
        except Exception as e:  # the pending persist then ends at its deadline
            logger.warning(f"[moc] rank {self.place.rank}: WARNING: cannot mark {tag_dir} failed "
                           f"({type(e).__name__}: {e})")

    def keeper_died(self, why: str) -> None:
        """Switch to persisting in this process; say so once per rank."""
        if self.keeper_gone:
            return
        self.keeper_gone = True
        place = self.place
        logger.warning(
            f"[moc] rank {place.rank}: WARNING: the keeper of node {place.node} is gone ({why}); "
            f"training goes on, persisting from this process (snapshots still go to "
            f"{place.node_dir}; a restart starts a new keeper)")

    def abandon_if_keeper_died(self, p: Optional[PendingPersist]) -> None:
        """Every rank, before the persist outcome is looked at: once this rank knows its
        keeper is gone, the persist ``p`` asked for while it was thought alive ends as
        failed, the same way whichever rank learned it first and however (its hand-over
        finding nothing listening, or the check here).

        The failure it prevents: a rank whose late hand-over found the keeper dead wrote
        its share (and, rank 0, the commit) itself, while the shares of the node's other
        ranks died in the keeper's queue. Rank 0's view of the persist then depended on
        whether those ranks had written their error reports yet: "still running" deferred
        the next snapshot's persist, and a wait that came next raised. Now this rank's
        share that died with the keeper gets its error report, and rank 0 marks the save
        failed unless it is committed (its committer here stands down), before any view
        of it is taken. A hand-over still under way to a dead keeper ends at once, and is
        waited for: it decides whether this rank's share is written here."""
        place = self.place
        if p is None or p.in_process or p.keeper_lost:
            return
        if not self.keeper_gone and not keeper.is_dead(place.node_dir):
            return  # a socket connect, only while a persist is pending
        if self.send_job is not None:
            self.send_job.result()  # send_safely does not raise
        self.keeper_died("it stopped answering while persisting")
        p.keeper_lost = True
        self._fail_lost_persist(p, (p.save_dir, p.tag, p.claim) == self.ran_here)

    def _fail_lost_persist(self, p: PendingPersist, written_here: bool) -> None:
        """Mark ``p`` failed for a keeper that died with it (see :meth:`abandon_if_keeper_died`);
        ``written_here``: this rank's share is being written by this process."""
        place = self.place
        tag_dir = os.path.join(p.save_dir, p.tag)
        why = f"the keeper of node {place.node} died while persisting {p.tag}"
        try:  # called before collectives: a storage error is logged, never raised
            if not written_here and not fs.exists(
                    os.path.join(tag_dir, commit.report_name(place.rank))):
                commit.write_report(tag_dir, place.rank, None, error=why, claim=p.claim)
            if place.rank == 0:
                commit.fail_unless_committed(tag_dir, why, claim=p.claim)
        except Exception as e:
            logger.warning(
                f"[moc] rank {place.rank}: WARNING: cannot mark {tag_dir} failed "
                f"({type(e).__name__}: {e}); its commit ends at the commit timeout instead")
        if written_here:
            return  # the writer here frees the slot once it has read it
        # The keeper would have removed it once the slot was read: the slot is free again.
        try:
            os.remove(os.path.join(place.slots.dir, f"slot{p.slot}.persisting"))
        except OSError:
            pass

    def join_local_persists(self) -> None:
        """This rank: wait for the persists this process runs itself (each at most
        ``--moc-commit-timeout``)."""
        for thread in self.local_persists:
            thread.join(self.place.cfg.commit_timeout_s)
        self.local_persists = [t for t in self.local_persists if t.is_alive()]

    def drain(self) -> None:
        """Every rank, at the end of a wait: the hand-over and this process's own
        persists (the keeper died) joined; the first rank of each node then drains its
        keeper (:func:`keeper.drain_keeper`): every job queued so far run, every commit
        of this attempt done.

        The failure it prevents: the wait ended when the last manifest appeared, while the
        committer went on moving ``latest`` and running retention; a job that returned
        then (or a reader right after it) saw ``latest`` name a checkpoint that
        retention was deleting, or lag behind the newest manifest. Waits at most
        ``--moc-commit-timeout`` for each part; a keeper that takes longer is named in a
        warning (it is hung: nothing it runs writes any more without a report)."""
        place, cfg = self.place, self.place.cfg
        if self.send_job is not None:
            self.send_job.result()  # send_safely does not raise
        self.join_local_persists()
        if not place.first_of_node or self.keeper_gone:
            return
        try:
            keeper.drain_keeper(place.node_dir, cfg.commit_timeout_s, place.run_id,
                                place.session.timeline.attempt_started)
        except Exception as e:
            logger.warning(
                f"[moc] rank {place.rank}: WARNING: the keeper of node {place.node} did not "
                f"finish its persists and commits within {cfg.commit_timeout_s:.0f} s "
                f"(--moc-commit-timeout; {type(e).__name__}: {e}); it may still write "
                f"into {cfg.save_dir}")
