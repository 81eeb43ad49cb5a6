"""The keeper's background commits: which run, which a drain or a shutdown waits for, and
the gate that keeps a commit from writing once a shutdown has chosen its commits.

Who calls what: the persist thread (:func:`deepspeed_ext.keeper.persist.run_persist_job`)
starts a commit with :func:`start_background_commit` for the committing rank's job; a
``drain`` request calls :func:`drain_commits`, a ``shutdown`` request
:func:`join_finishing_commits`, and the serve loop :func:`reopen_gate` when a shutdown
is called off. The registry and the gate are this module's globals (one keeper per
process); tests replace :data:`COMMITS` and :data:`GATE`.
"""

import threading
import traceback
from typing import Callable, List, NamedTuple, Optional

from deepspeed_ext.jobs import PersistJob


class CommitRun(NamedTuple):
    """One background commit of the keeper."""

    thread: threading.Thread
    reports_in: threading.Event
    """Set once every report is in and the gate let it write (manifest, ``latest``,
    retention)."""
    attempt_started: Optional[float] = None
    """The job attempt whose save it commits (None: unknown)."""


COMMITS: List[CommitRun] = []
"""The keeper's background commits; :func:`commits_to_finish` says which a drain or a
shutdown waits for."""


class CommitGate:
    """Whether a commit whose reports are all in may start writing, decided under one lock
    with a shutdown's choice of the commits it waits for.

    The failure it prevents: a requested shutdown waited only for the commits whose
    reports were in when it was asked; one whose reports arrived a moment later (another
    node's keeper finishing an earlier attempt's share) went on writing its manifest,
    ``latest`` and retention while the keeper exited under it, after the training side
    had been told that nothing was running any more. Once :meth:`close` ran, a commit
    not chosen then writes nothing (its directory stays a manifest-less leftover for
    retention, as a commit killed with its keeper would)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.closed = False
        self.allowed: set = set()
        """Threads a closing shutdown waits for: they may still write."""

    def enter(self, reports_in: threading.Event) -> bool:
        """A commit thread with every report in: True (``reports_in`` set) to write."""
        with self.lock:
            if self.closed and threading.current_thread() not in self.allowed:
                return False
            reports_in.set()
            return True

    def close(self, attempt_started: Optional[float]) -> List[threading.Thread]:
        """A shutdown: from now on only the returned commits write; join them."""
        with self.lock:
            self.closed = True
            chosen = commits_to_finish(attempt_started)
            self.allowed = set(chosen)
            return chosen

    def reopen(self) -> None:
        """The shutdown was called off (a new job attached): commits write again."""
        with self.lock:
            self.closed = False
            self.allowed = set()


GATE = CommitGate()


def commits_to_finish(attempt_started: Optional[float]) -> List[threading.Thread]:
    """The running commits a drain or shutdown asked by attempt ``attempt_started`` waits
    for: those past their reports (writing the manifest, ``latest``, retention), and every
    commit of that attempt (one still waiting for reports is bounded by its commit
    timeout: the training side gave up on it, but it may still commit). A commit of
    another attempt still waiting for reports (a crashed attempt's, waiting for a dead
    node) is not: it would hold the caller for its whole timeout."""
    return [c.thread for c in COMMITS if c.thread.is_alive() and (
        c.reports_in.is_set()
        or (attempt_started is not None and c.attempt_started == attempt_started))]


def commits_running() -> bool:
    """Whether any background commit still runs (an idle keeper serves on meanwhile)."""
    return any(c.thread.is_alive() for c in COMMITS)


def join_finishing_commits(attempt_started: Optional[float] = None) -> None:
    """On a requested shutdown: close the gate (:class:`CommitGate`) and wait for the
    commits :func:`commits_to_finish` names.

    A commit goes on after its manifest (``latest``, retention), and exiting under it
    left ``latest`` at the previous checkpoint and a stray ``latest.tmp.<pid>``: those
    are waited for. A commit of another attempt still waiting for reports is not, and
    stands down should its reports still arrive. (An idle keeper serves on until every
    commit has ended.)
    """
    for thread in GATE.close(attempt_started):
        thread.join()


def drain_commits(attempt_started: Optional[float] = None) -> None:
    """A drain: wait for the commits :func:`commits_to_finish` names; the keeper serves on."""
    with GATE.lock:
        chosen = commits_to_finish(attempt_started)
    for thread in chosen:
        thread.join()


def reopen_gate() -> None:
    """The serve loop, when a requested shutdown is called off: commits write again."""
    GATE.reopen()


def start_background_commit(job: PersistJob, tag_dir: str, log: Callable[[str], None]) -> None:
    """The persist thread, for the committing rank's job: commit on a thread of its own
    (the reports of the keeper's other local ranks are written by jobs queued behind
    this one, so waiting for them on the persist thread would deadlock its queue)."""
    reports_in = threading.Event()
    thread = threading.Thread(target=commit_job, args=(job, tag_dir, log, reports_in),
                              daemon=True, name=f"commit-{job.tag}")
    with GATE.lock:
        COMMITS[:] = [c for c in COMMITS if c[0].is_alive()]  # a keeper lives for weeks
        COMMITS.append(CommitRun(thread, reports_in, job.commit.attempt_started))
    thread.start()


def commit_job(job: PersistJob, tag_dir: str, log: Callable[[str], None],
               reports_in: Optional[threading.Event] = None) -> None:
    """Wait for every rank's report of ``job``'s save, then commit it (manifest,
    ``latest``, retention); a failure is written into ``tag_dir`` while the save is
    still ours (:func:`still_ours`). With ``reports_in`` (a background commit), the
    gate decides first whether it may still write."""
    # Imported here: the store imports torch, which the keeper must not wait for at start.
    from deepspeed_ext.store import claims, commit
    info = job.commit
    claim = job.claim  # rank 0's, from preparing the directory (None: unchecked)
    try:
        shares = commit.wait_for_reports(tag_dir, info.world_size, info.timeout_s, claim=claim)
        if reports_in is not None and not GATE.enter(reports_in):
            log(f"not committing {tag_dir}: the keeper is shutting down (its reports came "
                f"in after the shutdown was asked for)")
            return
        commit.commit_checkpoint(job.save_dir, job.tag, info.step, dict(info.layout), shares,
                                 info.previous_tag,
                                 [list(p) for p in info.selected]
                                 if info.selected is not None else None,
                                 info.pec_k, info.save_latest, info.keep, log=log,
                                 claim=claim, attempt_started=info.attempt_started)
        commit.remove_reports(tag_dir, info.world_size, claim)
        log(f"committed {tag_dir}")
    except claims.Superseded as e:
        # A restarted job claimed the tag (or retention removed it) while this commit of
        # an earlier attempt waited: its directory is not ours to mark failed.
        log(f"not committing: {e}")
    except Exception as e:
        traceback.print_exc()
        if still_ours(tag_dir, claim):
            commit.write_failure(tag_dir, f"{type(e).__name__}: {e}", claim=claim)


def still_ours(tag_dir: str, claim: Optional[str]) -> bool:
    """Whether a failed writer or commit may mark ``tag_dir`` failed: it was not claimed
    by another save since. An unreadable claim counts as ours: saying that the save
    failed beats leaving the training side to wait for it until the commit timeout."""
    from deepspeed_ext.store import claims  # torch: see commit_job
    try:
        claims.check_claim(tag_dir, claim)
        return True
    except claims.Superseded:
        return False
    except claims.CommitError:
        return True
