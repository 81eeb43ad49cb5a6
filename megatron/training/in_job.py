"""``--moc-restart in-job``: one launched process's life over the job's recovery rounds.

MoC's supervisor (``python -m deepspeed_ext.supervisor``, started by
``scripts/run_elastic.sh ... --moc-restart in-job``) starts every process with its slot
(``MOC_SLOT``) and the address of the job's store, which it keeps
(:mod:`deepspeed_ext.runtime.rounds`). Each process, training rank or hot spare, runs
:func:`run_in_job`:

1. imports everything training needs (a spare then waits with nothing to import: a
   takeover costs no import time, and no restart can land inside a half-done import);
2. waits for the newest round that gives its slot a rank (a spare waits here, without
   training memory, until a training process dies or the job ends);
3. trains in that round: its rank and round in the environment, the round's process
   group on the store under the round's prefix, then :func:`pretrain`, which resumes
   from the newest checkpoint under ``--load`` (with ``--moc-two-level`` the snapshots
   in the node keeper's memory: the survivors their own, a spare the failed rank's);
4. when training raises and the supervisor has written a newer round (a peer died), it
   leaves the failed run (MoC's threads stopped, the keeper and its memory kept), tears
   its process groups down and goes back to 2 in the same process; an error with no
   newer round is this process's own and is raised (the supervisor then counts its
   death; a deterministic error runs out of rounds and the job stops).
"""

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from deepspeed_ext.runtime import rounds
from megatron.training.group_leaks import describe, group_refs, outlived
from megatron.training.round_watch import RoundWatcher
from megatron.errors import ConfigError

PEER_FAILURE_WAIT_S = 15.0
"""How long a process whose run raised waits for the supervisor's next round before it
takes the error as its own (the supervisor notices a death within a fraction of a
second)."""
POLL_S = 0.02
"""Between two reads of the store's round number while waiting (a spare's takeover and
a survivor's decision wait at most this long for a round the supervisor wrote)."""


class RoundClient:
    """This process's view of the job's rounds (every launched process has one)."""

    def __init__(self, store, slot: int):
        self.store, self.slot = store, slot

    @classmethod
    def from_env(cls, timeout_s: float = 300.0) -> "RoundClient":
        """The store the supervisor named in the environment, and this process's slot."""
        from datetime import timedelta
        import torch.distributed as dist
        host, port = rounds.store_address(os.environ[rounds.STORE_ENV])
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, int(os.environ[rounds.SLOT_ENV]))

    def newest(self) -> int:
        """The newest round's number."""
        return int(self.store.get(rounds.CURRENT_KEY))

    def assignment(self, round_number: int) -> rounds.RoundAssignment:
        return rounds.RoundAssignment.from_json(self.store.get(rounds.round_key(round_number)))

    def done(self) -> Optional[str]:
        """The job's end as the supervisor wrote it, or None while it runs."""
        if not self.store.check([rounds.DONE_KEY]):
            return None
        return self.store.get(rounds.DONE_KEY).decode("utf-8", "replace")

    def wait_for_rank(self, after: int) -> Optional[rounds.RoundAssignment]:
        """The newest round after ``after`` that gives this slot a rank; None once the job
        ended (a spare that was never needed)."""
        while True:
            if self.done() is not None:
                return None
            newest = self.newest()
            if newest > after:
                assignment = self.assignment(newest)
                if assignment.rank_of(self.slot) is not None:
                    return assignment
                after = newest  # still waiting in this round
            time.sleep(POLL_S)

    def base_round(self, assignment: rounds.RoundAssignment) -> rounds.RoundAssignment:
        """The round whose process group ``assignment``'s processes form: itself, or for
        a refill round (``--moc-refill-spares``: only a spare added, nothing failed) the
        recovery round (or round 0) before it, which has the same ranks. Processes that
        read ``current`` just before and just after a refill round so meet in one group
        instead of forming two that never fill."""
        while assignment.round and not assignment.failed:
            assignment = self.assignment(assignment.round - 1)
        return assignment

    def recoveries_until(self, number: int) -> int:
        """How many of rounds 1..``number`` were recoveries (a refill round is not)."""
        return rounds.recoveries(self.assignment(r) for r in range(1, number + 1))

    def peer_failed(self, mine: rounds.RoundAssignment, within_s: float) -> bool:
        """Whether, within ``within_s`` seconds, a round after ``mine`` says one of
        ``mine``'s training processes died (a round that only drops a dead spare does
        not: this process's error is then its own)."""
        deadline = time.monotonic() + within_s
        while True:
            if rounds.superseded(self.store, mine) is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def on_hang_in_job(event: Dict, rank: int, stop_job: Callable[[Dict], None],
                   exit_hung: Callable[[], None],
                   client: Optional[RoundClient] = None) -> str:
    """``--moc-monitor`` under ``--moc-restart in-job``, on every rank whose watchdog found
    a hang (its thread; the main thread may be blocked in a collective): end only the
    hung process, so that the others recover in place with a spare instead of every
    rank exiting for a relaunch. Returns what it did: ``exit``, ``kill`` or ``stop``.

    - ``event``'s suspects are this rank alone (the others wait for it): ``exit_hung``
      (exit 75 at once; the supervisor sees a death).
    - They are other ranks (those that lag, or whose whole process is frozen: see
      :func:`megatron.training.monitor.rules.find_hang`): ask the supervisor to SIGKILL
      them (:func:`rounds.request_kill`): a stopped process, or one holding the GIL,
      cannot end itself. This rank's collective with them then fails, and this rank
      joins the next round.
    - Every rank stalled in the same iteration and none is frozen (the culprit
      unknown): the suspects are every rank, this one too; the supervisor recovers in
      place while spares last, then stops the job for a relaunch. Waiting for a
      collective's timeout instead would leave a stuck process, and the job, hung.
    - The store unreachable (no rank named): ``stop_job``, as without in-job restarts.
    """
    hung = event.get("rank", -1)
    suspects = sorted(event.get("suspects") or [])
    if hung is None or hung < 0 or not suspects:
        stop_job(event)
        return "stop"
    if suspects == [rank]:
        exit_hung()
        return "exit"
    request_kills(suspects, f"no progress for {event.get('seconds_since_progress')} s in "
                            f"iteration {event.get('iteration')}, found by rank {rank}", client)
    return "kill"


def request_kills(ranks: List[int], why: str, client: Optional[RoundClient] = None) -> None:
    """Ask the supervisor to SIGKILL ``ranks`` of this process's current round (this
    process's own rank too when it is stuck in a run the others left)."""
    client = client or RoundClient.from_env(timeout_s=10.0)
    round_number = int(os.environ.get(rounds.ROUND_ENV, "0"))
    for rank in ranks:
        rounds.request_kill(client.store, round_number, rank, why)


def preload() -> None:
    """Import what a run imports lazily (DeepSpeed, its MoE layer, the model, the data,
    the checkpoint library): a spare takes over without import time, and a failure
    delivered while a module imports cannot leave it half made."""
    import deepspeed  # noqa: F401
    import deepspeed.moe.layer  # noqa: F401
    import deepspeed_ext.patch  # noqa: F401
    import deepspeed_ext.two_level  # noqa: F401
    import megatron.data  # noqa: F401
    import megatron.model.gpt_moe  # noqa: F401
    import megatron.training.lr_schedule  # noqa: F401


def enter_round(assignment: rounds.RoundAssignment, slot: int, recoveries: int = -1) -> int:
    """Set this process's rank, world and round in the environment (what the process
    group, DeepSpeed and the event file read; ``recoveries``: how many rounds so far were
    recoveries, -1: the round's number); returns the rank."""
    rank = assignment.rank_of(slot)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or assignment.world_size)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node),
                      WORLD_SIZE=str(assignment.world_size),
                      **{rounds.ROUND_ENV: str(assignment.round),
                         rounds.RECOVERIES_ENV: str(assignment.round if recoveries < 0
                                                    else recoveries)})
    return rank


@dataclass
class LeftRound:
    """When this process left a failed round (``time.time()`` readings)."""

    round: int
    caught: float
    """Its run raised."""
    torn_down: float = 0.0
    """Its process groups were gone."""


def round_event(assignment: rounds.RoundAssignment, slot: int, left: Optional[LeftRound],
                joined: float) -> Dict:
    """The ``in-job-round`` event of this process joining a recovery round: who it is
    (a survivor, or the spare taking a failed rank) and, counted from the supervisor's
    round (written right after it saw the death: ``died``), when it left the failed run,
    had torn its groups down and had joined the new round. The round's ``start`` and
    ``recovery`` events (the loop's start, the load) follow from its run."""
    event = {"kind": "in-job-round", "round": assignment.round, "slot": slot,
             "rank": assignment.rank_of(slot), "pid": os.getpid(),
             "role": "survivor" if left is not None else "spare",
             "failed_slots": list(assignment.failed), "died": assignment.at,
             "joined_s": round(joined - assignment.at, 4)}
    if left is not None:
        event.update(left_s=round(left.caught - assignment.at, 4),
                     torn_down_s=round(left.torn_down - assignment.at, 4))
    return event


def _event_file(args: argparse.Namespace) -> Optional[str]:
    """``--moc-event-file`` as validation fills it (``<save>/moc-events.jsonl`` by default)."""
    if args.moc_event_file or not args.moc_checkpoint:
        return args.moc_event_file
    from megatron.training.events import default_event_file
    return default_event_file(args.save)


def _record_round(args, assignment, slot, left, joined) -> None:
    path = _event_file(args)
    if path and assignment.round:
        from megatron.training.events import EventLog
        EventLog(path).append(round_event(assignment, slot, left, joined))


def free_run_objects(max_passes: int = 5) -> int:
    """This process, after a run's groups are destroyed (a failed run's above all): free
    the run's engine and model now, and with them the connections of every group its
    parameters still name, so that a peer blocked in a collective with this process sees
    them close and leaves the round too (4 training ranks, one SIGKILLed: rank 3 waited in ZeRO's
    gradient all-reduce until its peers' round-1 group timed out).

    One collection is not enough: a parameter whose tensor autograd still held when the
    collection began (an accumulator node of the optimizer's) is not traversed, and
    survives it with its group; the next collection, the node gone, frees it. Collects
    until nothing more is freed (at most ``max_passes`` times); returns the passes."""
    for passes in range(1, max_passes + 1):
        if not gc.collect():
            return passes
    return max_passes


def run_in_job(argv: List[str], parse: Callable[[List[str]], argparse.Namespace],
               train: Callable[[argparse.Namespace], object],
               close: Callable[[], None], log: Callable[[str], None],
               abort: Optional[Callable[[], bool]] = None) -> int:
    """Every process the supervisor started: train in each round this slot has a rank in
    until the job is done (see the module docstring). Returns 0 when this process's last
    run finished or the job ended without needing it.

    Args:
        argv: the training flags, parsed anew for each round (``parse``).
        train: one run (``pretrain``), raising when it fails.
        close: what follows a run on this process (its process groups torn down), after
            a finished run and after a failed one.
        log: one line to the user.
        abort: with NCCL, what ends this process's communicators without waiting for
            peers (:func:`megatron.training.process.abort_communicators`): called after a
            failed run, before ``close``, and by a :class:`RoundWatcher` beside each run
            once a newer round names a peer failed (a kernel waiting for a dead peer
            never errs). None: neither (gloo).

    Raises:
        ConfigError: bad flags (the same on every process: no round would fix them).
        Exception: a failure of this process's own (no newer round came).
    """
    client = RoundClient.from_env()
    preload()
    # The ~300,000 objects of the imports are never garbage: out of the collector's
    # sight, each full collection that frees a failed run (free_run_objects) scans only
    # what the runs made (0.16 s a collection before, on an idle core; nearly 0 after).
    gc.freeze()
    seen, left = -1, None
    while True:
        assignment = client.wait_for_rank(seen)
        joined = time.time()
        if assignment is None:
            log(f"[moc] slot {client.slot}: the job ended ({client.done()}); this spare was "
                "not needed")
            return 0
        newest, assignment = assignment.round, client.base_round(assignment)
        rank = enter_round(assignment, client.slot, client.recoveries_until(assignment.round))
        if assignment.round:
            log(f"[moc] slot {client.slot} (pid {os.getpid()}): round {assignment.round} as "
                f"rank {rank} (slots {list(assignment.failed)} failed)")
        watch = (RoundWatcher(lambda: RoundClient.from_env().store, assignment, abort, log)
                 if abort is not None else contextlib.nullcontext())
        with watch:
            failure = _run_round(argv, parse, train, close,
                                 lambda args: _record_round(args, assignment, client.slot,
                                                            left, joined), abort)
        if failure is None:
            return 0
        left = LeftRound(assignment.round, caught=failure.caught, torn_down=time.time())
        if not client.peer_failed(assignment, PEER_FAILURE_WAIT_S):
            failure.raise_again()
        log(f"[moc] slot {client.slot} (rank {rank}, pid {os.getpid()}): round "
            f"{assignment.round} failed ({failure.summary}); joining the next round")
        seen = newest


def _run_round(argv, parse, train, close, record, abort=None) -> Optional["OwnError"]:
    """One round's run on this process: None when it finished, else its error, once the
    failed run is left (its groups closed, its objects freed).

    Out of the except clause the error and its frames (which hold the run's engine and
    model) are gone, so the run is left before anyone asks why it failed: a peer blocked
    in a collective with this process is released only once this process's groups, and
    the parameters naming them, are."""
    try:
        args = parse(argv)
        record(args)
        train(args)
    except ConfigError:
        close()
        raise
    except Exception as e:  # noqa: BLE001  (a peer's death, or this process's own error)
        failure = OwnError(e)
    except BaseException:  # interrupted (KeyboardInterrupt, SystemExit): no next round
        close()
        raise
    else:
        close()
        return None
    refs = group_refs()
    if abort is not None:
        abort()  # NCCL: a destroy would wait for the failed collectives
    close()
    free_run_objects()
    survivors = outlived(refs)
    if survivors:  # a peer blocked in one of them waits out its timeout (group_leaks)
        sys.stderr.write(f"[moc] WARNING: {len(survivors)} process group(s) of the failed run "
                         f"outlived its teardown: {describe(survivors)}\n")
    return failure


class OwnError(RuntimeError):
    """A failed run's error kept as text (its traceback printed when raised again), so
    that the error object and the frames it holds do not keep the run alive while the
    process leaves it."""

    def __init__(self, error: BaseException):
        self.caught = time.time()
        self.summary = f"{type(error).__name__}: {str(error)[:200]}"
        self.text = "".join(traceback.format_exception(error))
        super().__init__(f"this process's run failed ({self.summary}) and no peer died: "
                         "its traceback is above")

    def raise_again(self) -> None:
        """Print the original traceback to stderr and raise this error (no newer round
        named a peer: the error is this process's own)."""
        sys.stderr.write(self.text)
        sys.stderr.flush()
        raise self
