"""The checks in the order they run (cheapest and most basic first, the benchmark that
writes tens of GB last), and the loop that runs each under its cap within the run's
budget, printing its line and rewriting the summary after each."""

import glob
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Set

from gpu_checks.bandwidth import check_snapshot_bandwidth
from gpu_checks.common import FAIL, PASS, SKIP, Check, CheckResult, Context, tail
from gpu_checks.in_job import check_in_job_restart
from gpu_checks.ranks import check_ranks_per_gpu
from gpu_checks.recovery import check_exact_replay, check_memory_recovery
from gpu_checks.stall import check_checkpoint_stall, check_checkpoint_stall_large
from gpu_checks.summary import SCHEMA, Environment, Summary, line, verdict, write_summary
from gpu_checks.unit_tests import check_cuda_unit_tests

CPU_CAP_SCALE = 4  # --mode cpu: every cap times this

CHECKS = [
    # The caps of all but in_job_restart add up to 9 min 20 s: with the install (under a
    # minute on 16 cores) they fit 10 minutes (the first H200 run took 6 min for six checks).
    Check("cuda_unit_tests", 45, check_cuda_unit_tests),
    Check("ranks_per_gpu", 30, check_ranks_per_gpu),
    Check("snapshot_bandwidth", 40, check_snapshot_bandwidth),
    Check("memory_recovery", 90, check_memory_recovery),
    Check("exact_replay", 90, check_exact_replay),
    # Issue 37's rows; with them the caps add up to 11 min, more than one 10-minute call
    # of the lent GPU: run them alone (--only in_job_restart) where the others were measured.
    Check("in_job_restart", 100, check_in_job_restart),
    Check("checkpoint_stall", 125, check_checkpoint_stall),
    # Last: it writes tens of GB (27 GB of slots, a 9 GB persist).
    Check("checkpoint_stall_large", 140, check_checkpoint_stall_large),
]


@dataclass
class Run:
    """One run of the checks: its mode (``cuda``, ``cpu``, ``no-cuda`` or ``dry-run``),
    where it runs, the install's outcome, where the summary goes, when it started."""
    mode: str
    env: Environment
    install: CheckResult
    paths: List[str]
    started: float  # time.monotonic()


def skip_reason(run: Run, check: Check, only: Set[str], cap: float, left: float) -> Optional[str]:
    """Why ``check`` does not run (None when it does)."""
    if run.mode == "dry-run":
        return "dry run"
    if run.install.status == FAIL:
        return "the install failed"
    if run.mode == "no-cuda":
        return "no CUDA device (torch.cuda.is_available() is False)"
    if only and check.name not in only:
        return "not in --only"
    if cap < min(10.0, check.cap_s):
        return f"out of the time budget ({left:.0f} s left)"
    return None


def run_one(check: Check, ctx: Context, cap: float) -> CheckResult:
    """``check`` under ``cap``, timed; its exception is its FAIL."""
    t0 = time.monotonic()
    try:
        r = check.run(ctx, cap)
    except Exception as e:  # a check's own bug is its FAIL, not the run's end
        r = CheckResult(check.name, FAIL, f"{type(e).__name__}: {str(e)[:300]}")
    r.seconds = time.monotonic() - t0
    return r


def run_checks(run: Run, only: Set[str], budget_s: Optional[float], work: str) -> List[CheckResult]:
    """Every check of CHECKS in order, run or SKIP with the reason; each one's line
    printed and the summary rewritten after it. ``budget_s`` None: the caps' sum."""
    # On CPU (2 shared cores, no GPU) the same jobs take several times longer.
    scale = CPU_CAP_SCALE if run.mode == "cpu" else 1
    budget = budget_s if budget_s is not None else scale * sum(c.cap_s for c in CHECKS)
    ctx = Context(mode="cpu" if run.mode == "cpu" else "cuda", work=work,
                  deadline=time.monotonic() + budget, python=sys.executable)
    results: List[CheckResult] = []
    for check in CHECKS:
        left = ctx.deadline - time.monotonic()
        cap = min(scale * check.cap_s, left)
        why = skip_reason(run, check, only, cap, left)
        r = CheckResult(check.name, SKIP, why) if why else run_one(check, ctx, cap)
        r.cap_s = cap if r.seconds else scale * check.cap_s  # the cap it ran under, else its own
        results.append(r)
        print(line(r), flush=True)
        write_summary(Summary(SCHEMA, run.env, run.install, results, time.monotonic() - run.started,
                              verdict(run.install, results)), run.paths)
    return results


def finish(run: Run, results: List[CheckResult], work: str) -> int:
    """The final summary and line, every check's log into ``$OUT`` (when set and checks
    ran); returns the exit status (1 if anything failed)."""
    total = time.monotonic() - run.started + run.install.seconds
    final = verdict(run.install, results)
    write_summary(Summary(SCHEMA, run.env, run.install, results, total, final), run.paths)
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, FAIL, SKIP)}
    print(f"[gpu_check] {final}: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP "
          f"in {total:.0f} s; summary {' and '.join(run.paths)}", flush=True)
    logs = os.path.join(os.environ["OUT"], "gpu_check_logs.txt") if os.environ.get("OUT") else None
    if logs and run.mode not in ("dry-run", "no-cuda"):
        with open(logs, "w") as f:  # every check's log, in one file beside the summary
            for path in sorted(glob.glob(os.path.join(work, "*.log"))):
                f.write(f"===== {os.path.basename(path)}\n{tail(path, 400)}\n")
    return 1 if final == FAIL else 0
