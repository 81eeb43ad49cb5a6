"""What a recovery cost, reported when a job (re)starts from a MoC checkpoint: the level
it came from, the iterations the failure lost, the seconds from the last progress to
training again, the Proportion of Lost Tokens (PLT) of this recovery and of all
recoveries of the job so far, and dynamic K.

Every load of a MoC checkpoint counts as a recovery, planned restarts included: with
partial experts checkpointing even a planned restart resumes some experts from older
versions (their updates since then are lost), so the accounting must see it.

Called by every rank, in order, right after ``engine.load_checkpoint`` (see
:func:`megatron.training.checkpointing.load_checkpoint`)::

    report = account_recovery(engine, args, iteration, load_s)   # rank 0 reads/appends the event file
    # report.k is set on every rank's checkpointer already (dynamic K)
"""

import argparse
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.distributed as dist

from deepspeed_ext.runtime.groups import metadata_group
from megatron.training.events import PROGRESS_FILE, EventLog, Progress
from megatron.training.log import print_rank_0


@dataclass
class RecoveryReport:
    """The outcome of :func:`account_recovery`, identical on every rank."""

    iteration: int
    """Iteration training resumes from."""
    source: Optional[str]
    """``memory``, ``storage`` or ``storage+memory``."""
    plt: Optional[float] = None
    """This recovery's PLT (None: the checkpoint predates the token ledger)."""
    cumulative_plt: Optional[float] = None
    """Accumulated PLT of every recovery of the job so far."""
    k: Optional[int] = None
    """Experts per MoE layer per checkpoint from now on."""
    iterations_lost: Optional[int] = None
    """Iterations the previous run had finished beyond ``iteration`` (None: unknown)."""
    seconds_since_progress: Optional[float] = None
    """From the previous run's last finished iteration to now."""
    failure: Optional[str] = None
    """What ended the previous run, from the event file (an injected fault, a detected hang
    or straggler), or "unknown" after a launcher restart that left no event."""

    def metrics(self) -> Dict:
        """Numeric fields for the metrics file / TensorBoard (``moc/...``)."""
        out = {"plt": self.plt, "cumulative_plt": self.cumulative_plt, "k": self.k,
               "iterations_lost": self.iterations_lost}
        return {k: v for k, v in out.items() if v is not None}


def progress_path(event_file: str) -> str:
    """The progress record beside the event file."""
    return os.path.join(os.path.dirname(os.path.abspath(event_file)), PROGRESS_FILE)


def account_recovery(engine, args: argparse.Namespace, iteration: int,
                     load_s: float) -> Optional[RecoveryReport]:
    """Report a MoC load; every rank calls it after ``engine.load_checkpoint``.

    Rank 0 reads the job's earlier recoveries and the failed run's progress from
    ``--moc-event-file``, computes the accumulated PLT and (with ``--moc-dynamic-k``)
    the new K, appends a ``recovery`` event and logs; the result is broadcast so every
    rank sets the same K (the selection of experts must agree across ranks).

    Returns:
        The report, or None when MoC is off or nothing was loaded.
    """
    moc = getattr(engine, "moc", None)
    if moc is None:
        return None
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = (True, _rank0_report(moc, args, iteration, load_s))
        except Exception as e:  # every rank must learn it, or they would wait forever
            payload[0] = (False, f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(payload, src=0, group=metadata_group())  # a host object
    ok, report = payload[0]
    if not ok:
        raise RuntimeError(f"recovery accounting failed on rank 0: {report}")
    if report.k is not None:
        moc.set_k(report.k)
    return report


def _rank0_report(moc, args, iteration: int, load_s: float) -> RecoveryReport:
    from deepspeed_ext.policy.plt import RecoveryLoss, cumulative_plt, dynamic_k
    loss = moc.last_recovery
    log = EventLog(args.moc_event_file) if args.moc_event_file else None
    everything = log.read() if log is not None else []
    earlier = [e for e in everything if e.get("kind") == "recovery"]
    report = RecoveryReport(iteration=iteration, source=moc.last_load_source,
                            failure=describe_failure(everything, restart_count(args)))
    progress = Progress(progress_path(args.moc_event_file)).read() if log is not None else None
    if progress is not None:
        report.iterations_lost = max(0, int(progress["iteration"]) - iteration)
        report.seconds_since_progress = time.time() - float(progress["time"])
    flag_k = args.moc_k_persist if args.moc_k_persist is not None else args.moc_pec_k
    k = flag_k or args.num_experts
    if (report.source or "").startswith("exact replay"):  # every update rebuilt: none lost
        report.plt = 0.0
        report.cumulative_plt = next((e["cumulative_plt"] for e in reversed(earlier)
                                      if e.get("cumulative_plt") is not None), 0.0)
    if loss is not None:
        losses = [RecoveryLoss.from_json(e["loss"]) for e in earlier if e.get("loss")]
        report.plt = loss.plt
        report.cumulative_plt = cumulative_plt(losses + [loss])
        if args.moc_dynamic_k:
            # K follows from the job's whole history, replayed in order: a restart
            # continues with the K the previous run had reached.
            for event in earlier:
                if event.get("cumulative_plt") is not None:
                    k = dynamic_k(k, args.num_experts, event["cumulative_plt"],
                                  args.moc_plt_threshold)
            before = k
            k = dynamic_k(k, args.num_experts, report.cumulative_plt, args.moc_plt_threshold)
            report.k = k
            if k != before:
                print_rank_0(f"[moc] dynamic K: accumulated PLT {100 * report.cumulative_plt:.2f} % "
                             f"> {100 * args.moc_plt_threshold:.2f} % (--moc-plt-threshold): "
                             f"K {before} -> {k} experts per MoE layer")
    _log_recovery(report, load_s, loss, restart_count(args))
    if log is not None:
        event = {"kind": "recovery", "iteration": iteration, "source": report.source,
                 "load_s": load_s, "plt": report.plt, "cumulative_plt": report.cumulative_plt,
                 "k": report.k if report.k is not None else k,
                 "iterations_lost": report.iterations_lost,
                 "seconds_since_progress": report.seconds_since_progress,
                 "failed_run": progress.get("run") if progress else None,
                 "failed_run_loop": progress.get("loop") if progress else None,
                 "failure": report.failure,
                 "restart": restart_count(args),
                 "loss": loss.to_json() if loss is not None else None}
        log.append(event)
    return report


def record_start(args: argparse.Namespace, iteration: int) -> None:
    """Rank 0, before the loop: a ``start`` event (this attempt's restart number and the
    iteration it starts from), from which :func:`report_ettr` finds the job's start."""
    if not getattr(args, "moc_event_file", None) or dist.get_rank() != 0:
        return
    EventLog(args.moc_event_file).append({"kind": "start", "restart": restart_count(args),
                                          "iteration": iteration})


class LoopTime:
    """This attempt's training iterations as the ETTR counts them; rank 0 keeps it, in
    O(1) memory: how many ran, and the seconds they took, each from its start to the next
    one's start (its evaluation and checkpoint saves included), the last one to the end of
    the loop. Iterations run back to back, so that sum is the time from the first one's
    start to the last one's end. ``now`` values are ``time.perf_counter()`` readings."""

    def __init__(self) -> None:
        self.started = time.time()
        """Wall clock when this attempt's loop began (a failed run's record says whether
        it belongs to the job a later ETTR reports on)."""
        self.iterations = 0
        self._first: Optional[float] = None
        self._end: Optional[float] = None

    def top(self, now: float) -> None:
        """An iteration starts."""
        if self._first is None:
            self._first = now
        self.iterations += 1
        self._end = None

    def stop(self, now: float) -> None:
        """The loop has ended: the last iteration's time ends here."""
        self._end = now

    def seconds(self, now: Optional[float] = None) -> float:
        """The measured iterations' time so far (up to ``now`` while the loop runs)."""
        if self._first is None:
            return 0.0
        end = self._end if self._end is not None else (
            time.perf_counter() if now is None else now)
        return end - self._first

    def record(self, now: Optional[float] = None) -> Dict:
        """What the progress record keeps of this attempt (a restart's ETTR reads it)."""
        return {"started": self.started, "iterations": self.iterations,
                "seconds": self.seconds(now)}


def ettr_figures(events: List[Dict], iteration: int, attempt: Dict,
                 now: float) -> Optional[Dict]:
    """The job's effective training time ratio at ``iteration`` (a pure function of the
    event file's records; rank 0's :func:`report_ettr` and tests call it).

    ``ETTR = counted iteration time / wall time since the job's first attempt started``.
    Iteration time is measured (:class:`LoopTime`): this attempt's (``attempt``, a
    :meth:`LoopTime.record`) and that of the failed attempts of the job before it (the
    ``failed_run_loop`` their recoveries copied from the progress record). Iterations a
    failure lost were run twice; of the ``run`` iterations measured, the ``gained`` ones
    count: ``counted = measured x min(gained, run) / run``. The measured spans lie apart
    inside the wall time, so the ratio cannot pass 1 however iteration times vary (a
    count times a median could). It charges restarts, loads and lost iterations, not the
    per-iteration cost of checkpointing (inside iteration time). None before any
    iteration, or without a ``start`` event of the job's first attempt.
    """
    starts = [e for e in events if e.get("kind") == "start" and e.get("restart") == 0]
    if not starts or not attempt.get("iterations"):
        return None
    since = float(starts[-1]["time"])
    recoveries = [e for e in events
                  if e.get("kind") == "recovery" and float(e.get("time", 0)) >= since]
    failed = {e["failed_run"]: e["failed_run_loop"] for e in recoveries
              if e.get("failed_run") and isinstance(e.get("failed_run_loop"), dict)
              and float(e["failed_run_loop"].get("started", 0)) >= since}
    loops = list(failed.values()) + [attempt]
    run = sum(int(loop["iterations"]) for loop in loops)
    measured = sum(float(loop["seconds"]) for loop in loops)
    gained = iteration - int(starts[-1]["iteration"])
    counted = measured * max(0, min(gained, run)) / run
    wall = now - since
    return {"kind": "ettr", "ettr": counted / wall if wall > 0 else None,
            "iterations": gained, "iterations_run": run, "measured_s": measured,
            "counted_s": counted, "wall_s": wall, "recoveries": len(recoveries)}


def report_ettr(args: argparse.Namespace, iteration: int, loop: LoopTime) -> Optional[Dict]:
    """Rank 0, after the loop: the job's ETTR so far (:func:`ettr_figures`), logged,
    appended as an ``ettr`` event and returned; None on other ranks, without an event
    file or before any iteration."""
    if not getattr(args, "moc_event_file", None) or dist.get_rank() != 0:
        return None
    log = EventLog(args.moc_event_file)
    event = ettr_figures(log.read(), iteration, loop.record(), time.time())
    if event is None or event["ettr"] is None:
        return None
    log.append(event)
    print_rank_0(f"[moc] ETTR {event['ettr']:.3f}: {event['counted_s']:.1f} s of iteration "
                 f"time counted over {event['wall_s']:.1f} s since the job started "
                 f"({event['iterations']} iterations gained of {event['iterations_run']} run, "
                 f"{event['measured_s']:.1f} s measured, each from its start to the next "
                 f"one's), {event['recoveries']} recovery(ies)")
    return event


def restart_count(args: Optional[argparse.Namespace] = None) -> int:
    """Which attempt of the job this is: ``--moc-restart-count`` (scripts/launch_cluster.sh
    passes it: the DeepSpeed launcher does not carry its own environment to other
    nodes' ranks), else torchrun's elastic agent's ``TORCHELASTIC_RESTART_COUNT``, else
    ``MOC_RESTART_COUNT``; plus, under ``--moc-restart in-job``, the recoveries up to the
    round this process trains in (``MOC_RECOVERIES``, else the round, ``MOC_ROUND``): a
    round after a failure is a restart too, and the
    ETTR takes the job's start from the one start with 0 (when round 1 of a launch that
    passed ``--moc-restart-count 0`` counted 0 as well, its start hid the failure)."""
    from deepspeed_ext.runtime.rounds import RECOVERIES_ENV, ROUND_ENV
    # the recoveries so far (refill rounds of --moc-refill-spares are not restarts)
    recovery_round = os.environ.get(RECOVERIES_ENV, os.environ.get(ROUND_ENV, ""))
    extra = int(recovery_round) if recovery_round.isdigit() else 0
    given = getattr(args, "moc_restart_count", None)
    if given is not None:
        return int(given) + extra
    for key in ("TORCHELASTIC_RESTART_COUNT", "MOC_RESTART_COUNT"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) + extra
    return extra


_FAULTS_TRAINED_THROUGH = ("slow", "slow-compute", "persist-crash")
"""Injected faults after which the run goes on (a slow rank; a keeper that died, whose
persists the training process takes over): never named as what ended a run."""


def _ended_the_run(event: Dict) -> bool:
    """Whether an event stops a run: a fault the run does not train through, a hang, or a
    straggler with action stop (a reported straggler trains on)."""
    kind = event.get("kind")
    if kind == "fault":
        return event.get("fault") not in _FAULTS_TRAINED_THROUGH
    return kind == "hang" or (kind == "straggler" and event.get("action") == "stop")


def describe_failure(events: List[Dict], restart: int) -> Optional[str]:
    """The newest failure event since the last recovery, in words.

    Called by rank 0 alone while it builds the recovery report (before broadcasting it),
    and by tests. No collective.

    Args:
        events: the event log's records, oldest first.
        restart: this attempt's restart count (0: the first attempt).

    Returns:
        The failure in words; ``"unknown ..."`` at a restart with no failure recorded;
        None on the first attempt with none.
    """
    failures = []
    for event in events:
        if event.get("kind") == "recovery":
            failures = []  # recovered from those already
        elif _ended_the_run(event):
            failures.append(event)
    if failures:
        e = failures[-1]
        if e["kind"] == "hang" and e.get("phase") is not None:  # before the first iteration
            return (f"hang detected on rank {e.get('rank')} (host {e.get('host')}) in "
                    f"start-up phase '{e['phase']}'")
        if e["kind"] == "hang":  # a heartbeat says which iteration a rank *started*
            return (f"hang detected on rank {e.get('rank')} (host {e.get('host')}; its last "
                    f"heartbeat: iteration {e.get('iteration')})")
        what = "injected " + str(e.get("fault")) if e["kind"] == "fault" else \
            "straggler stopped the job"
        return f"{what} on rank {e.get('rank')} at iteration {e.get('iteration')}"
    if restart > 0:
        return "unknown (no event recorded: see the launcher's log)"
    return None


def _log_recovery(report: RecoveryReport, load_s: float, loss, restart: int) -> None:
    parts = [f"recovered iteration {report.iteration} from {report.source} in {load_s:.2f} s"]
    if report.failure is not None:
        parts.insert(0, f"restart {restart} after failure: {report.failure}")
    if report.iterations_lost is not None:
        parts.append(f"{report.iterations_lost} iteration(s) lost, "
                     f"{report.seconds_since_progress:.1f} s since the last finished iteration")
    if report.plt is not None:
        exact = "" if loss is None or loss.exact else " (at least)"
        parts.append(f"PLT {100 * report.plt:.3f} %{exact}, accumulated "
                     f"{100 * report.cumulative_plt:.3f} %")
    else:
        parts.append("PLT unknown (checkpoint without a token ledger)")
    print_rank_0("[moc] " + "; ".join(parts))
