"""``checkpoint_stall`` and ``checkpoint_stall_large``: ``benchmarks/two_level_bench.py``
with the flags of each (:func:`stall_flags`, :func:`large_stall_flags`), and the verdicts
read from its rows (:func:`stall_verdict`, :func:`large_stall_verdict`)."""

import glob
import json
import os
import time
from typing import Dict, List, Optional, Tuple

from gpu_checks.bandwidth import pinned_reference
from gpu_checks.common import (BANDWIDTH_MIN_RATIO, FAIL, PASS, SKIP, CheckResult, Context,
                               outcome, result, run_capped, stop_keepers_under, tail)

STALL_GAP_MAX_S = 0.005  # checkpoint_stall_large: the stall at most this past the save call


def stall_flags(mode: str) -> List[str]:
    """two_level_bench.py's flags: on CUDA an 84 M-parameter GPT-MoE (8 layers, hidden 512,
    8 heads, 8 experts every 2nd layer, top-1; fp32 as the benchmark trains, sequence 512,
    the byte vocabulary: 1.1 GB of state), EP 1, one rank; on CPU a small model of the same
    structure. 30 timed iterations with a checkpoint each (3 warm-up saves before, not
    timed), DeepSpeed's turn 5 (its saves take 1.8 s each there)."""
    common = ["--zero-stage", "2", "--expert-interval", "2", "--topk", "1", "--intervals", "1",
              "--systems", "deepspeed,moc-full,moc-pec", "--persist-interval", "10",
              "--train-steps", "2"]
    if mode == "cuda":
        # The first H200 run (2026-11-27) used 284 M parameters: DeepSpeed's saves of 4.3 GB
        # each ran the benchmark past its cap before moc-pec's turn.
        return common + ["--nproc", "1", "--ep", "1", "--num-layers", "8", "--hidden-size", "512",
                         "--num-attention-heads", "8", "--num-experts", "8", "--seq-length", "512",
                         "--micro-batch-size", "4", "--iters", "30", "--min-saves", "6",
                         "--warmup", "3", "--system-iters", "deepspeed=5"]
    return common + ["--nproc", "1", "--ep", "1", "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4", "--num-experts", "4", "--seq-length", "32",
                     "--micro-batch-size", "2", "--iters", "3", "--min-saves", "2",
                     "--warmup", "2", "--system-iters", "deepspeed=2", "--pec-k-snapshot", "2"]


def large_stall_flags(mode: str) -> List[str]:
    """two_level_bench.py's flags for the large state: on CUDA 8 layers, hidden 1536 (FFN
    6144), 12 heads, 8 experts every 2nd layer, top-1, sequence 512, fp32: 757 M parameters,
    9.1 GB of master weights and Adam moments on the one rank (3 slots of it: 27 GB of
    /dev/shm; about 20 GB of GPU memory). A snapshot every 4 iterations (the 180 ms copy at
    50 GB/s fits), 6 timed; only the warm-up's first snapshot persists
    (``--persist-interval 1000``), no recovery loads (seconds per GB, not what this
    measures). On CPU a small model of the same structure."""
    common = ["--zero-stage", "2", "--expert-interval", "2", "--topk", "1", "--systems",
              "moc-full", "--persist-interval", "1000", "--train-steps", "2", "--no-recovery",
              "--nproc", "1", "--ep", "1"]
    if mode == "cuda":
        return common + ["--num-layers", "8", "--hidden-size", "1536", "--ffn-hidden-size", "6144",
                         "--num-attention-heads", "12", "--num-experts", "8", "--seq-length",
                         "512", "--micro-batch-size", "4", "--intervals", "4", "--iters", "8",
                         "--min-saves", "6", "--warmup", "2"]
    return common + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--num-experts", "4", "--seq-length", "32", "--micro-batch-size", "2",
                     "--intervals", "2", "--iters", "2", "--min-saves", "2", "--warmup", "1"]


def run_stall_bench(ctx: Context, name: str, stem: str, flags: List[str], cap_s: float):
    """Check ``name``: two_level_bench.py with ``flags`` under ``cap_s`` (its JSON, plot and
    out dir named ``stem`` in the work directory); (rows or None, why not)."""
    log = os.path.join(ctx.work, f"{name}.log")
    out = os.path.join(ctx.work, f"{stem}.json")
    before = set(glob.glob("/dev/shm/moc-two-level-bench-*"))
    try:
        rc, timed_out, _ = run_capped(
            [ctx.python, "benchmarks/two_level_bench.py", *flags, "--json", out,
             "--plot", os.path.join(ctx.work, f"{stem}.png"), "--out-dir",
             os.path.join(ctx.work, stem), "--timeout", str(max(10, int(cap_s) - 15))],
            log, cap_s)
    finally:
        for root in set(glob.glob("/dev/shm/moc-two-level-bench-*")) - before:
            stop_keepers_under(root)
    if timed_out or not os.path.exists(out):
        return None, (f"two_level_bench {outcome(rc, timed_out)}: "
                      f"{tail(log, 2).strip()[-200:]}")
    return json.load(open(out)), None


MOC_ROW_KEYS = ("stall_s_median", "stall_s_max", "save_call_s_median", "wait_s_median",
                "iter_s_mean", "ref_iter_s_mean", "ref_iter_s_mean_before",
                "ref_iter_s_mean_after", "iter_overhead", "recovery_memory_s",
                "recovery_storage_s", "bytes_persisted", "host_mem_bytes", "error", "setup_s",
                "prepare_s", "warmup_stalls_s", "stages_median", "saves_memory_only",
                "saves_persist", "stall_s_median_memory_only", "stall_s_median_persist",
                "stages_median_memory_only", "stages_median_persist", "iter_s_mean_memory_only",
                "iter_s_mean_persist", "stall_s", "save_stages", "warmup_save_stages")


def row_metrics(row: dict) -> dict:
    """What the summary keeps of one benchmark row: every key of MOC_ROW_KEYS, None where
    the row has none (DeepSpeed's rows have no stages; a failed row few figures)."""
    return {k: row.get(k) for k in MOC_ROW_KEYS}


def _model(row: dict) -> dict:
    """The model's shape of a row's config (None where the row has none)."""
    return {k: (row or {}).get("config", {}).get(k) for k in
            ("params_total", "params_expert", "num_layers", "hidden_size", "ffn_hidden_size",
             "num_experts", "seq_length", "dtype")}


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def stall_verdict(rows: List[dict]) -> Tuple[str, str, dict]:
    """``checkpoint_stall``'s (status, reason, metrics) from two_level_bench's rows: PASS
    when moc-full's median stall is below DeepSpeed's; the metrics also say whether the
    issue's targets hold (stall <= 0.5 % of DeepSpeed's, overhead <= +5 % full, +2 % PEC)."""
    by_system = {r["system"]: r for r in rows if r.get("interval") == 1}
    metrics: Dict[str, object] = {s: row_metrics(r) for s, r in by_system.items()}
    base = next((r for r in rows if r["system"] == "no-checkpoint"), {})
    metrics["iter_s_no_checkpoint"] = base.get("iter_s_mean")
    metrics["iter_s_no_checkpoint_before_after"] = [base.get("iter_s_mean_before"),
                                                    base.get("iter_s_mean_after")]
    metrics["model"] = _model(by_system.get("deepspeed") or by_system.get("moc-full"))
    ds, moc = by_system.get("deepspeed", {}), by_system.get("moc-full", {})
    errors = [f"{s}: {r['error']}" for s, r in by_system.items() if r.get("error")]
    if errors or ds.get("stall_s_median") is None or moc.get("stall_s_median") is None:
        return FAIL, "; ".join(errors)[:300] or "no stall measured", metrics
    ratio = moc["stall_s_median"] / ds["stall_s_median"]
    metrics["moc_full_vs_deepspeed"] = ratio
    pec = by_system.get("moc-pec", {})
    targets = {"moc-full stall <= 0.5 % of deepspeed's": ratio <= 0.005}
    for system, most in (("moc-full", 0.05), ("moc-pec", 0.02)):
        overhead = by_system.get(system, {}).get("iter_overhead")
        if overhead is not None:
            targets[f"{system} overhead <= +{most:.0%}"] = overhead <= most
    metrics["targets"] = targets
    stages = moc.get("stages_median") or {}
    text = (f"stall per snapshot (every iteration): moc-full {_ms(moc['stall_s_median'])}"
            + (f", moc-pec {_ms(pec['stall_s_median'])}" if pec.get("stall_s_median") is not None else "")
            + f" vs deepspeed save_checkpoint {ds['stall_s_median'] * 1e3:.0f} ms ({ratio:.3f}x); "
            + "overhead " + ", ".join(f"{s} {100 * r['iter_overhead']:+.1f} %" for s, r in
                                      (("moc-full", moc), ("moc-pec", pec))
                                      if r.get("iter_overhead") is not None)
            + f"; prepare {_s(moc.get('prepare_s'))}; moc-full save call "
              f"{_ms(stages.get('save_call'))}, host wait {_ms(stages.get('host_wait'))}, "
              f"device wait {_ms(stages.get('device_wait'))}, copy {_ms(stages.get('copy'))}, "
              f"checksum {_ms(stages.get('checksum'))}")
    return (PASS if ratio < 1 else FAIL), text, metrics


def large_stall_verdict(rows: List[dict], pinned_gb_per_s: Optional[float]) -> Tuple[str, str, dict]:
    """``checkpoint_stall_large``'s (status, reason, metrics): PASS when moc-full's median
    stall is within STALL_GAP_MAX_S of its median save call and its copy reaches
    BANDWIDTH_MIN_RATIO of the pinned copy's GB/s; SKIP without a pinned reference (CPU)."""
    moc = next((r for r in rows if r["system"] == "moc-full" and r.get("interval")), {})
    metrics: Dict[str, object] = {"moc-full": row_metrics(moc), "model": _model(moc),
                                  "interval": moc.get("interval"),
                                  "pinned_gb_per_s": pinned_gb_per_s}
    stages = moc.get("stages_median") or {}
    if moc.get("error") or moc.get("stall_s_median") is None:
        return FAIL, str(moc.get("error") or "no stall measured")[:300], metrics
    if not stages:
        return FAIL, "no per-save stage timings (TwoLevel.timings) in the rows", metrics
    gap = moc["stall_s_median"] - stages["save_call"]
    copy_rate = stages.get("copy_gb_s")
    ratio = copy_rate / pinned_gb_per_s if copy_rate and pinned_gb_per_s else None
    nbytes = next((s["nbytes"] for s in moc.get("save_stages") or [] if s), None)
    metrics.update(stall_minus_save_call_s=gap, copy_gb_per_s=copy_rate, copy_vs_pinned=ratio,
                   snapshot_bytes=nbytes)
    text = (f"{(nbytes or 0) / 1e9:.1f} GB per snapshot every {moc['interval']}: stall "
            f"{_ms(moc['stall_s_median'])} vs save call {_ms(stages['save_call'])} "
            f"(+{gap * 1e3:.1f} ms, want <= {STALL_GAP_MAX_S * 1e3:.0f}); copy "
            + ("-" if copy_rate is None else f"{copy_rate:.1f} GB/s")
            + (f" vs {pinned_gb_per_s:.1f} GB/s pinned ({ratio:.2f}x, want >= {BANDWIDTH_MIN_RATIO})"
               if ratio is not None else " (no pinned reference)")
            + f"; prepare {_s(moc.get('prepare_s'))}")
    if pinned_gb_per_s is None:
        return SKIP, text + "; the pinned reference needs CUDA", metrics
    ok = gap <= STALL_GAP_MAX_S and ratio is not None and ratio >= BANDWIDTH_MIN_RATIO
    return (PASS if ok else FAIL), text, metrics


def check_checkpoint_stall(ctx: Context, cap_s: float) -> CheckResult:
    """The stall benchmark at :func:`stall_flags`, judged by :func:`stall_verdict`."""
    name = "checkpoint_stall"
    rows, why = run_stall_bench(ctx, name, "stall", stall_flags(ctx.mode), cap_s)
    if rows is None:
        return result(name, FAIL, why)
    status, text, metrics = stall_verdict(rows)
    return result(name, status, text, **metrics)


def check_checkpoint_stall_large(ctx: Context, cap_s: float) -> CheckResult:
    """The pinned reference (a quarter of the cap, 40 s at most), then the benchmark at
    :func:`large_stall_flags`, judged by :func:`large_stall_verdict`."""
    name = "checkpoint_stall_large"
    start = time.monotonic()
    pinned = pinned_reference(ctx, min(40.0, cap_s / 4))
    rows, why = run_stall_bench(ctx, name, "stall-large", large_stall_flags(ctx.mode),
                                cap_s - (time.monotonic() - start))
    if rows is None:
        return result(name, FAIL, why)
    status, text, metrics = large_stall_verdict(rows, pinned)
    return result(name, status, text, **metrics)
