"""``ranks_per_gpu``: which backends and collectives two ranks sharing one device can use.

The check starts two processes per backend, each ``scripts/gpu_check.py --probe-rank
BACKEND DEVICE OUT`` (:func:`probe_rank`), which write what each collective did to
``OUT``; the check merges the two reports (a rank's failure wins over the other's success).
"""

import datetime
import json
import os
import signal
import subprocess
import time
from typing import List, Optional

from gpu_checks.common import (ENTRY_POINT, FAIL, PASS, REPO, CheckResult, Context, child_env,
                               free_port, result)

PROBE_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "barrier")


def probe_rank(backend: str, device: str, out: str) -> int:
    """One rank of the ranks-per-GPU probe (``--probe-rank``): join a 2-rank group of
    ``backend`` on ``device``, try each collective, write what happened to ``out``."""
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    report = {"backend": backend, "device": device, "init": None, "ops": {}}
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(0)  # both ranks on the one GPU
        dist.init_process_group(backend, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        report["init"] = "ok"
    except Exception as e:
        report["init"] = f"{type(e).__name__}: {str(e)[:300]}"
    if report["init"] == "ok":
        for op in PROBE_OPS:
            try:
                x = torch.full((4,), float(rank + 1), device=device)
                if op == "all_reduce":
                    dist.all_reduce(x)
                    ok = x.tolist() == [3.0] * 4
                elif op == "broadcast":
                    dist.broadcast(x, 0)
                    ok = x.tolist() == [1.0] * 4
                elif op == "all_gather_into_tensor":
                    y = torch.empty(8, device=device)
                    dist.all_gather_into_tensor(y, x)
                    ok = y.tolist() == [1.0] * 4 + [2.0] * 4
                elif op == "reduce_scatter_tensor":
                    y = torch.empty(2, device=device)
                    dist.reduce_scatter_tensor(y, x)
                    ok = y.tolist() == [3.0, 3.0]
                elif op == "all_to_all_single":
                    y = torch.empty(4, device=device)
                    dist.all_to_all_single(y, x)
                    ok = y.tolist() == [1.0, 1.0, 2.0, 2.0]
                else:
                    dist.barrier()
                    ok = True
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                report["ops"][op] = "ok" if ok else "wrong result"
            except Exception as e:
                report["ops"][op] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


def check_ranks_per_gpu(ctx: Context, cap_s: float) -> CheckResult:
    """PASS when some backend runs some collective with 2 ranks on the one device; the
    reason names, per backend, every collective, only some, or nothing and why."""
    name = "ranks_per_gpu"
    log = os.path.join(ctx.work, f"{name}.log")
    import torch.distributed as dist
    device = "cuda" if ctx.mode == "cuda" else "cpu"
    backends = ["nccl", "gloo"] if ctx.mode == "cuda" else ["gloo"]
    findings, started = {}, time.monotonic()
    for backend in backends:
        if backend == "nccl" and not dist.is_nccl_available():
            findings[backend] = {"init": "NCCL is not available in this torch", "ops": {}}
            continue
        left = cap_s - (time.monotonic() - started)
        # Each backend its share of the cap: an NCCL that hangs leaves gloo its turn.
        share_s = max(5.0, min(left, cap_s / len(backends)))
        findings[backend] = merge_reports(probe_pair(ctx, backend, device, share_s, log))
    working = {b: [op for op, s in f["ops"].items() if s == "ok"] for b, f in findings.items()}
    usable = [b for b, ops in working.items() if len(ops) == len(PROBE_OPS)]
    status = PASS if any(working.values()) else FAIL
    return result(name, status, f"2 ranks on one {device}: {describe(findings, working)}",
                  backends=findings, backends_with_every_op=usable)


def probe_pair(ctx: Context, backend: str, device: str, share_s: float,
               log: str) -> List[Optional[dict]]:
    """Run the two probe ranks of ``backend``; past ``share_s`` a rank's process group is
    killed. Returns each rank's report, None for a rank that wrote none."""
    port = str(free_port())
    procs, outs = [], []
    with open(log, "a") as logf:
        for rank in range(2):
            out = os.path.join(ctx.work, f"probe-{backend}-{rank}.json")
            outs.append(out)
            env = child_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": port})
            procs.append(subprocess.Popen(
                [ctx.python, ENTRY_POINT, "--probe-rank", backend, device, out],
                cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + share_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    reports = []
    for out in outs:
        try:
            reports.append(json.load(open(out)))
        except (OSError, ValueError):
            reports.append(None)
    return reports


def merge_reports(reports: List[Optional[dict]]) -> dict:
    """One backend's finding from its two ranks' reports: ``init`` and each op ``ok`` only
    when both ranks say so, else the first rank's failure."""
    if reports[0] is None and reports[1] is None:
        return {"init": "no rank reported (hung or crashed; see the log)", "ops": {}}
    # A rank's failure wins over the other's success: both must succeed.
    merged = {"init": next((r["init"] for r in reports if r and r["init"] != "ok"), "ok"),
              "ops": {}}
    for op in PROBE_OPS:
        seen = [r["ops"].get(op, "not reached") if r else "rank hung or crashed"
                for r in reports]
        merged["ops"][op] = next((s for s in seen if s != "ok"), "ok")
    return merged


def describe(findings: dict, working: dict) -> str:
    """Per backend: every collective, only some, or nothing (and why)."""
    parts = []
    for backend, ops in working.items():
        if len(ops) == len(PROBE_OPS):
            parts.append(f"{backend}: every collective")
        elif ops:
            parts.append(f"{backend}: only {', '.join(ops)}")
        else:
            init = findings[backend]["init"]
            parts.append(f"{backend}: nothing ({init if init != 'ok' else 'every op failed'})"[:200])
    return "; ".join(parts)
