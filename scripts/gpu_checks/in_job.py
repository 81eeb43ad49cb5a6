"""``in_job_restart``: what one GPU can show of an in-job restart (issue 37). NCCL takes
one rank per GPU, so no survivor can wait for a dead peer here; what runs instead:

1. the survivor's group cycle, five times in one process (``reform_worker.py``): the
   round's groups formed on the store under the round's prefix, an all-reduce, then
   ``abort_communicators`` (``ncclCommAbort`` on every group) and ``close_process_groups``;
   each phase timed, every sum checked;
2. a hot spare taking over on the GPU: 1 training rank and 1 spare under
   ``scripts/run_elastic.sh`` (``--moc-restart in-job``), the rank SIGKILLed at 7, the
   spare (imports done, no CUDA context yet) builds the model and engine and restores
   iteration 6 from the keeper's memory; every loss equal to the uninterrupted run's to
   the bit (``--deterministic``), with the recovery's phases from the event file.
"""

import json
import os
import time

from gpu_checks.common import (FAIL, PASS, TINY, CheckResult, Context, child_env, compare_losses,
                               ensure_corpus, events, losses, outcome, result, run_capped)
from gpu_checks.recovery import recovery_events, recovery_metrics, run_pair

REFORM_ROUNDS = 5


def reform_rounds(ctx: Context, log: str, cap_s: float):
    """Part 1: (why it failed or None, the rounds' records)."""
    out = os.path.join(ctx.work, "reform.json")
    rc, timed_out, _ = run_capped([ctx.python, "scripts/gpu_checks/reform_worker.py",
                                   str(REFORM_ROUNDS), out], log, cap_s, child_env())
    if timed_out or rc != 0 or not os.path.exists(out):
        return f"the group cycle {outcome(rc, timed_out)}", []
    with open(out) as f:
        rounds = json.load(f)["rounds"]
    if ctx.mode == "cuda" and not all(r["aborted"] for r in rounds):
        return "abort_communicators did not abort the NCCL groups", rounds
    return None, rounds


def spare_takeover(ctx: Context, log: str, cap_s: float):
    """Part 2: (why it failed or None, its metrics)."""
    corpus = ensure_corpus(ctx, log)
    base = TINY + ["--eval-iters", "0", "--data-path", corpus, "--deterministic",
                   "--moc-checkpoint", "--save-interval", "4"]
    ref, run = os.path.join(ctx.work, "in-job-ref"), os.path.join(ctx.work, "in-job")
    shm = f"/dev/shm/moc-gpu-in-job-{os.getpid()}"
    failed = run_pair(ctx, log, cap_s, base, ref, run, "0",
                      ["--moc-two-level", "--moc-snapshot-interval", "1", "--moc-shm-dir", shm,
                       "--moc-restart", "in-job", "--moc-spares", "1",
                       "--moc-fault", "crash@7:rank=0"], shm, nproc="2")
    if failed:
        return failed, {}
    ckpt = os.path.join(run, "ckpt")
    recoveries = recovery_events(ckpt)
    rounds = [e for e in events(ckpt) if e["kind"] == "in-job-round"]
    metrics = dict(recoveries=recovery_metrics(recoveries), rounds=rounds,
                   losses_compared=len(losses(os.path.join(ref, "m.jsonl"))))
    if len(recoveries) != 1 or recoveries[0].get("source") != "memory":
        return (f"expected one recovery from memory, got {[r.get('source') for r in recoveries]}",
                metrics)
    if [r.get("role") for r in rounds] != ["spare"]:
        return f"expected the spare to take rank 0, got {rounds}", metrics
    differ = compare_losses(losses(os.path.join(ref, "m.jsonl")), losses(os.path.join(run, "m.jsonl")))
    return (f"losses differ: {differ}" if differ else None), metrics


def check_in_job_restart(ctx: Context, cap_s: float) -> CheckResult:
    """PASS when every round of the group cycle summed right (and aborted, on CUDA) and the
    spare's takeover recovered from memory with every loss equal."""
    name = "in_job_restart"
    log = os.path.join(ctx.work, f"{name}.log")
    start = time.monotonic()
    failed, rounds = reform_rounds(ctx, log, min(60.0, cap_s / 3))
    metrics = dict(reform_rounds=rounds)
    if failed:
        return result(name, FAIL, failed, **metrics)
    failed, takeover = spare_takeover(ctx, log, cap_s - (time.monotonic() - start))
    metrics.update(spare=takeover)
    if failed:
        return result(name, FAIL, failed, **metrics)
    later = rounds[1:] or rounds
    cycle = max(r["total_s"] for r in later)
    return result(name, PASS, f"{len(rounds)} group cycles in one process (rounds 1+: at most "
                  f"{cycle:.3f} s each, abort and close included); a spare took rank 0 at 7 and "
                  f"recovered from memory, {takeover['losses_compared']} losses equal to the "
                  "uninterrupted run's to the bit", **metrics)
