"""``snapshot_bandwidth``: ``benchmarks/hostcopy_bench.py``'s snapshot copy into the
registered shared-memory slot against a plain pinned copy of the same bytes; and the
pinned copy's GB/s alone, the reference of ``checkpoint_stall_large``."""

import json
import os
import shutil
from typing import Optional

from gpu_checks.common import (BANDWIDTH_MIN_RATIO, FAIL, PASS, SKIP, CheckResult, Context,
                               outcome, result, run_capped, tail)

PINNED = "reference: torch-pinned memory"


def check_snapshot_bandwidth(ctx: Context, cap_s: float) -> CheckResult:
    """PASS at BANDWIDTH_MIN_RATIO of the pinned copy's GB/s or better with the slot
    page-locked; SKIP on CPU (no pinned reference). Keeps the pinned GB/s in ``ctx``."""
    name = "snapshot_bandwidth"
    log = os.path.join(ctx.work, f"{name}.log")
    out = os.path.join(ctx.work, "hostcopy.json")
    mib = 1024 if ctx.mode == "cuda" else 64
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    mib = max(16, min(mib, int(shm / 2**20 / 3)))  # the slot must fit in /dev/shm
    rc, timed_out, _ = run_capped(
        [ctx.python, "benchmarks/hostcopy_bench.py", "--device", ctx.mode, "--mib", str(mib),
         "--repeats", "5", "--json", out], log, cap_s)
    if timed_out or rc != 0:
        return result(name, FAIL, f"hostcopy_bench {outcome(rc, timed_out)}: "
                      f"{tail(log, 2).strip()[-200:]}")
    bench = json.load(open(out))
    copies = {c["what"]: c for c in bench["copies"]}
    moc = next(c for w, c in copies.items() if w.startswith("moc snapshot"))
    pinned = copies.get(PINNED)
    metrics = dict(mib=mib, moc_what=moc["what"], moc_gb_per_s=moc["gb_per_s"],
                   pinned_gb_per_s=pinned["gb_per_s"] if pinned else None,
                   pageable_gb_per_s=copies.get("reference: .to('cpu'), pageable", {}).get("gb_per_s"),
                   register_error=bench["register_error"], stall_s=bench["stall_s"],
                   compute_s=bench["compute_s"], join_s=bench["join_s"])
    if pinned is None:
        return result(name, SKIP, f"{moc['gb_per_s']:.1f} GB/s into the slot on CPU; the pinned "
                      "reference needs CUDA", **metrics)
    ratio = moc["gb_per_s"] / pinned["gb_per_s"]
    metrics["ratio_to_pinned"] = ratio
    ctx.pinned_gb_per_s = pinned["gb_per_s"]
    text = (f"{moc['gb_per_s']:.1f} GB/s into the registered slot vs {pinned['gb_per_s']:.1f} GB/s "
            f"pinned ({ratio:.2f}x, want >= {BANDWIDTH_MIN_RATIO}); stall {bench['stall_s'] * 1e3:.1f} ms "
            f"on a {bench['compute_s'] * 1e3:.0f} ms loop")
    if bench["register_error"]:
        return result(name, FAIL, f"the slot was not page-locked ({bench['register_error']}); " + text,
                      **metrics)
    return result(name, PASS if ratio >= BANDWIDTH_MIN_RATIO else FAIL, text, **metrics)


def pinned_reference(ctx: Context, cap_s: float) -> Optional[float]:
    """GB/s of a copy into torch-pinned memory: snapshot_bandwidth's, else measured here
    (hostcopy_bench.py, 1 GiB); None on CPU or when it fails."""
    if ctx.pinned_gb_per_s is not None or ctx.mode != "cuda":
        return ctx.pinned_gb_per_s
    out = os.path.join(ctx.work, "hostcopy-large.json")
    rc, timed_out, _ = run_capped(
        [ctx.python, "benchmarks/hostcopy_bench.py", "--device", "cuda", "--mib", "1024",
         "--repeats", "3", "--json", out], os.path.join(ctx.work, "checkpoint_stall_large.log"),
        cap_s)
    if rc != 0 or timed_out:
        return None
    copies = {c["what"]: c for c in json.load(open(out))["copies"]}
    pinned = copies.get(PINNED)
    ctx.pinned_gb_per_s = pinned["gb_per_s"] if pinned else None
    return ctx.pinned_gb_per_s
