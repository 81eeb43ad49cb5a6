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
from typing import Dict, List, Optional, Sequence

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


def report_ettr(args: argparse.Namespace, iteration: int,
                iter_s: Sequence[float]) -> Optional[Dict]:
    """Rank 0, after the loop: the job's effective training time ratio so far.

    ``ETTR = (iterations gained since the job's first attempt started x this attempt's
    median iteration time) / wall time since then``. The median includes what
    checkpointing costs per iteration, so this figure counts what failures cost
    (restarts, loads, replayed and lost iterations), not checkpoint overhead; the
    benchmark's ETTR divides by the fault-free run's iteration time instead. Logged,
    appended as an ``ettr`` event and returned; None without an event file or before
    any measured iteration.
    """
    if not getattr(args, "moc_event_file", None) or dist.get_rank() != 0 or not iter_s:
        return None
    log = EventLog(args.moc_event_file)
    starts = [e for e in log.read("start") if e.get("restart") == 0]
    if not starts:
        return None
    first = starts[-1]
    wall = time.time() - float(first["time"])
    median = sorted(iter_s)[len(iter_s) // 2]
    gained = iteration - int(first["iteration"])
    ettr = gained * median / wall if wall > 0 else None
    event = {"kind": "ettr", "ettr": ettr, "iterations": gained, "median_iter_s": median,
             "wall_s": wall, "recoveries": len([e for e in log.read("recovery")
                                                if float(e.get("time", 0)) >= float(first["time"])])}
    log.append(event)
    print_rank_0(f"[moc] ETTR {ettr:.3f}: {gained} iterations x {median * 1e3:.1f} ms (this run's "
                 f"median) over {wall:.1f} s since the job started, {event['recoveries']} "
                 f"recovery(ies)")
    return event


def restart_count(args: Optional[argparse.Namespace] = None) -> int:
    """Which attempt of the job this is: ``--moc-restart-count`` (scripts/launch_cluster.sh
    passes it: the DeepSpeed launcher does not carry its own environment to other
    nodes' ranks), else torchrun's elastic agent's ``TORCHELASTIC_RESTART_COUNT``, else
    ``MOC_RESTART_COUNT``."""
    given = getattr(args, "moc_restart_count", None)
    if given is not None:
        return int(given)
    for key in ("TORCHELASTIC_RESTART_COUNT", "MOC_RESTART_COUNT"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


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
