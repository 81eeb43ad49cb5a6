#!/usr/bin/env python
"""Validate ``moc-plan``'s cost model against what we can measure: predicted vs measured
ETTR and stall, for the policies, MTBFs and seeds of one ``benchmarks/exact_bench.py`` run.

    python experiments/plan_validation.py --out runs/plan_validation      # runs the benchmark
    python experiments/plan_validation.py --bench-json runs/plan_validation/bench.json

Step 1 (unless ``--bench-json``): ``exact_bench.py --phases overhead,recovery,ettr
--mtbf A,B --seed 1,2,3 --iters 240 --save-interval 5`` on 2 CPU ranks (``configs/small.yaml``): clean iteration times
per policy, one crash per policy (its restart time and save calls), and runs under random
crashes at each MTBF with each seed (``--ettr-iters``), each right after a short clean run
(``--reference-iters``) that gives the machine's speed at that time.

Step 2: the hardware figures the model needs, none taken from the runs it is compared
with: the iteration time (each crash run's reference; the ``none`` rows without one),
each policy's restart time (fault to load start of its one-crash run), the save calls'
fixed costs (medians of the "saved checkpoint ... in X s" lines of the first clean run
of pec-dynamic and two-level-full), the warm-up of a start and the background cost per GB
(``moc-plan calibrate --from-json``'s reading of the clean runs), and the copy and
storage bandwidths measured here (``moc-plan calibrate``'s functions).

Step 3: predictions, next to the measured ETTR (iterations x clean iteration time / wall,
the clean time of the run's reference; the model uses the same iteration time):
per run, replaying that run's own crash times through the simulator (on the training
clock); per policy and MTBF, the mean over seeds against the simulator's expectation at
that MTBF (500 failure schedules of the injector's kind: exponential from the job start,
crashes due during a restart skipped) and MoEtion's formula. Per policy, the model's
stall per checkpoint against the second clean run's save calls. Nothing is asserted; the
tables say where the model is off by more than 15 %.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from deepspeed_ext.planning import costs as cm  # noqa: E402
from deepspeed_ext.planning.calibrate import (exact_bench_figures, measure_copy_gbps,  # noqa: E402
                                              measure_storage_gbps)
from deepspeed_ext.planning.cli import model_from_config  # noqa: E402
from deepspeed_ext.planning.simulate import Failure, simulate_many, simulate_run  # noqa: E402

TOLERANCE = 0.15


def run_bench(out: str, mtbfs: str, seeds: str, iters: int, ettr_iters: int,
              reference: int, save_interval: int) -> str:
    path = os.path.join(out, "bench.json")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "exact_bench.py"),
           "--phases", "overhead,recovery,ettr",
           "--policies", "none,exact,pec-dynamic,two-level-full", "--mtbf", mtbfs,
           "--seed", seeds, "--iters", str(iters), "--ettr-iters", str(ettr_iters),
           "--ettr-reference", str(reference), "--save-interval", str(save_interval), "--out", os.path.join(out, "bench"),
           "--json", path]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    return path


WINDOW = re.compile(r"exact recovery: window W = (\d+)")


def window_of(run_dir: str):
    """The window an exact-mode run chose (it depends on the MTBF it was given)."""
    try:
        with open(os.path.join(run_dir, "log.txt"), errors="replace") as f:
            for line in f:
                m = WINDOW.search(line)
                if m:
                    return int(m.group(1))
    except OSError:
        pass
    return None


def policy_of(name: str, bench: dict, run_dir: str = "") -> cm.Policy:
    """The cost model's policy for one of exact_bench's policy names (for exact mode, the
    window ``run_dir``'s run chose, else the overhead run's)."""
    every = int(bench["options"]["save_interval"])
    if name == "pec-dynamic":
        return cm.Policy("pec-dynamic", interval=every, k=1)
    if name == "two-level-full":
        return cm.Policy("two-level", interval=1, persist_interval=every)
    if name.startswith("exact"):
        rows = {r["policy"]: r for r in bench.get("overhead", []) if r.get("ok")}
        window = (run_dir and window_of(run_dir)) or (rows.get(name) or {}).get("window") or 4
        return cm.Policy("exact", window=int(window))
    raise ValueError(f"no cost-model policy for {name!r}")


def hardware_of(bench: dict, storage_dir: str) -> tuple:
    clean = {r["policy"]: r for r in bench.get("overhead", []) if r.get("ok")}
    if "none" not in clean:
        raise SystemExit("the benchmark has no clean 'none' row: no iteration time")
    restarts = [r["restart_s"] for r in bench.get("recovery", []) if r.get("restart_s")]
    calls = calls_of(bench)
    copy = measure_copy_gbps()
    storage = measure_storage_gbps(storage_dir)
    hw = cm.Hardware(iteration_s=clean["none"]["iter_s_mean"], d2h_gbps=copy, h2d_gbps=copy,
                     storage_write_gbps=storage["write_gbps"],
                     storage_read_gbps=storage["read_gbps"], storage_total_gbps=0.0,
                     restart_s=statistics.median(restarts) if restarts else 5.0, **calls)
    # moc-plan calibrate's own reading of the clean runs: the warm-up of a start and
    # the background copy/write cost (calibrated on two-level-full alone).
    figures = exact_bench_figures(bench)
    hw = replace(hw, **{k: v for k, (v, _) in figures.items()})
    sources = {"iteration_s": "exact_bench none rows", "restart_s":
               f"median of {len(restarts)} recovery rows (fault to load start)",
               "d2h_gbps": "measured copy into shared memory",
               "storage": f"measured write+fsync / cold read under {storage_dir}",
               "save/snapshot/persist calls": "the first clean run (round 1) of pec-dynamic "
                                              "and two-level-full" if calls else "not found: 0",
               **{k: why for k, (_, why) in exact_bench_figures(bench).items()}}
    return hw, sources




def restart_of(bench: dict, policy: str):
    """The policy's own restart time, from the benchmark's separate one-crash run."""
    for r in bench.get("recovery", []):
        if r.get("policy") == policy and r.get("restart_s"):
            return r["restart_s"]
    return None


START = re.compile(r"^\[\s*([0-9.]+)\] .*training from iteration \d+ to")


def uptime_trace(run_dir: str, fault_times: list) -> list:
    """The run's crashes as seconds of training (each restart's downtime, from a crash
    to the next "training from" line, taken out), read from the run's stamped log."""
    starts = []
    with open(os.path.join(run_dir, "log.txt"), errors="replace") as f:
        for line in f:
            m = START.match(line)
            if m:
                starts.append(float(m.group(1)))
    if not starts:
        return []
    starts = [t - starts[0] for t in starts]
    out, down = [], 0.0
    for fault in sorted(fault_times):
        out.append(fault - down)
        resumed = next((t for t in starts if t > fault), None)
        if resumed is not None:
            down += resumed - fault
    return out


def model_and_layout(bench: dict) -> tuple:
    """The benchmark's model, on one node of ``--nproc`` ranks, expert-parallel over all."""
    opts = bench["options"]
    nproc = int(opts["nproc"])
    return model_from_config(os.path.join(REPO, opts["config"])), cm.Layout(nproc, nproc, nproc)


def at_reference(hw: cm.Hardware, row: dict) -> tuple:
    """(hardware at the ETTR run's own clean reference speed, the ETTR measured against
    it); without a reference (``--reference-iters 0``, or it failed), phase 1's."""
    if row.get("ettr_ref") and row.get("ref_iter_s"):
        return replace(hw, iteration_s=row["ref_iter_s"]), row["ettr_ref"]
    return hw, row["ettr"]


def compare(bench: dict, hw: cm.Hardware) -> list:
    model, layout = model_and_layout(bench)
    rows = []
    for r in bench.get("ettr", []):
        if not r.get("ok") or r.get("ettr") is None:
            continue
        policy = policy_of(r["policy"], bench, r["run_dir"])
        # Replayed on the uptime clock: each crash at the same point of its training
        # segment as in the real run, whatever the model's downtime.
        trace = [Failure(t) for t in uptime_trace(r["run_dir"], r.get("fault_times_s") or [])]
        own = restart_of(bench, r["policy"])
        # The policy's restart (fault -> load start: its start-up work differs, e.g. the
        # keeper and the memory agreement of two-level) as measured in the recovery phase.
        phw = replace(hw, restart_s=own) if own else hw
        # The machine's speed at the time of the run: its clean reference run, if any.
        phw, measured = at_reference(phw, r)
        sim = simulate_run(policy, model, layout, phw, int(r["iters"]), trace, r["mtbf_s"],
                           uptime_clock=True)
        common = simulate_run(policy, model, layout, replace(hw, iteration_s=phw.iteration_s),
                              int(r["iters"]), trace, r["mtbf_s"],
                              uptime_clock=True)
        pred = cm.predict(policy, model, layout, phw, r["mtbf_s"])
        rows.append({"policy": r["policy"], "model_policy": policy.label(), "mtbf_s": r["mtbf_s"],
                     "seed": r.get("seed"), "iters": int(r["iters"]), "run_dir": r["run_dir"],
                     "failures": r["failures"], "measured_ettr": measured,
                     "ettr_phase1_reference": r["ettr"], "iteration_s": phw.iteration_s,
                     "trace_ettr": sim.ettr, "analytic_ettr": pred.ettr,
                     "trace_ettr_median_restart": common.ettr, "restart_s": phw.restart_s,
                     "trace_error": sim.ettr / measured - 1,
                     "analytic_error": pred.ettr / measured - 1,
                     "measured_redone": r.get("redone"), "model_redone": sim.redone_iterations})
    return rows


SAVED_AT = re.compile(r"saved checkpoint at iteration\s+(\d+) to .* in ([0-9.]+) s")
PERSISTING = re.compile(r"\[moc\] snapshot \S+ \(step (\d+)\).*persisting")


def save_calls(run_dir: str) -> tuple:
    """(memory-only snapshot calls, calls that went to storage) of one run's log, seconds
    (the trainer logs them at 1 ms resolution)."""
    memory, storage, persisted, snapshots = [], [], set(), False
    with open(os.path.join(run_dir, "log.txt"), errors="replace") as f:
        lines = f.readlines()
    for line in lines:
        m = PERSISTING.search(line)
        if m:
            persisted.add(int(m.group(1)))
        snapshots = snapshots or "[moc] snapshot " in line
    for line in lines:
        m = SAVED_AT.search(line)
        if m:
            step, took = int(m.group(1)), float(m.group(2))
            (storage if not snapshots or step in persisted else memory).append(took)
    return memory, storage


def _round_dir(bench: dict, policy: str, k: int):
    for r in bench.get("overhead", []):
        if r.get("policy") == policy:
            rounds = r.get("rounds") or [r]
            return rounds[k]["run_dir"] if len(rounds) > k else None
    return None


def calls_of(bench: dict) -> dict:
    """The save-call costs, from each policy's first clean run (round 1): a PEC save, a
    memory-only snapshot, and what a persisted snapshot adds. {} without round 1 logs."""
    pec1, two1 = _round_dir(bench, "pec-dynamic", 0), _round_dir(bench, "two-level-full", 0)
    if not (pec1 and two1):
        return {}
    memory1, persisted1 = save_calls(two1)
    snapshot = statistics.median(memory1)
    return {"save_call_s": statistics.median(save_calls(pec1)[1]), "snapshot_call_s": snapshot,
            "persist_call_s": max(0.0, statistics.median(persisted1) - snapshot)}


def stalls(bench: dict, hw: cm.Hardware) -> list:
    """Stall per checkpoint: the model (its call costs calibrated on round 1) against
    each policy's second clean run (round 2), for every kind of checkpoint; exact mode's
    frame waits against the model's copy wait."""
    model, layout = model_and_layout(bench)
    out = []
    pec2, two2 = _round_dir(bench, "pec-dynamic", 1), _round_dir(bench, "two-level-full", 1)
    if not (pec2 and two2 and hw.snapshot_call_s):
        return out
    chw = hw
    pec = cm.policy_costs(policy_of("pec-dynamic", bench), model, layout, chw, 60.0)
    two = cm.policy_costs(policy_of("two-level-full", bench), model, layout, chw, 60.0)
    memory2, persisted2 = save_calls(two2)
    rows = [("pec-dynamic (a save)", statistics.median(save_calls(pec2)[1]), pec.stall_s),
            ("two-level-full (a memory snapshot)", statistics.median(memory2), two.stall_s),
            ("two-level-full (a persisted snapshot)", statistics.median(persisted2),
             two.stall_s + hw.persist_call_s)]
    for name, measured, modelled in rows:
        out.append({"policy": name, "measured_stall_ms": 1000 * measured,
                    "model_stall_ms": 1000 * modelled,
                    "error": modelled / measured - 1 if measured else None})
    for r in bench.get("overhead", []):
        if r.get("ok") and r["policy"].startswith("exact") and r.get("stall_ms_median") is not None:
            costs = cm.policy_costs(policy_of(r["policy"], bench), model, layout, chw, 60.0)
            out.append({"policy": f"{r['policy']} (frame waits)",
                        "measured_stall_ms": r["stall_ms_median"],
                        "model_stall_ms": 1000 * costs.stall_s, "error": None})
    return out


def by_policy_and_mtbf(bench: dict, hw: cm.Hardware, rows: list, schedules: int) -> list:
    """Per (policy, MTBF): the mean measured ETTR over seeds against the simulator's
    expectation (``schedules`` failure schedules, the injector's semantics) and the formula."""
    model, layout = model_and_layout(bench)
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["policy"], r["mtbf_s"]), []).append(r)
    out = []
    for (name, mtbf), runs in groups.items():
        policy = policy_of(name, bench, runs[0]["run_dir"])
        own = restart_of(bench, name)
        phw = replace(hw, restart_s=own or hw.restart_s,
                      iteration_s=statistics.mean(r["iteration_s"] for r in runs))
        iters = runs[0]["iters"]
        expected = simulate_many(policy, model, layout, phw, mtbf, iters, range(schedules),
                                 downtime_failures=False)
        measured = statistics.mean(r["measured_ettr"] for r in runs)
        formula = cm.predict(policy, model, layout, phw, mtbf).ettr
        out.append({"policy": name, "mtbf_s": mtbf, "seeds": len(runs),
                    "failures": [r["failures"] for r in runs], "measured_mean": measured,
                    "measured": [r["measured_ettr"] for r in runs],
                    "expected": expected.ettr, "expected_failures": expected.failures,
                    "expected_error": expected.ettr / measured - 1, "formula": formula,
                    "formula_error": formula / measured - 1,
                    "trace_mean": statistics.mean(r["trace_ettr"] for r in runs)})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/plan_validation")
    p.add_argument("--bench-json", help="Use this exact_bench.py JSON instead of running it.")
    p.add_argument("--mtbf", default="8,16", help="The MTBFs of the ETTR runs (seconds).")
    p.add_argument("--seed", default="1,2,3", help="Failure seeds of the ETTR runs.")
    p.add_argument("--bench-iters", type=int, default=240,
                   help="Iterations of the clean and one-crash runs (more give the call-cost "
                        "calibration more samples).")
    p.add_argument("--save-interval", type=int, default=5,
                   help="pec-dynamic's checkpoint and two-level's persist interval (a save "
                        "call varies from 8 to 30 ms here: the medians need many of them).")
    p.add_argument("--ettr-iters", type=int, default=200,
                   help="Iterations of each crash run (longer runs make a crash near the end, "
                        "which the model may put after it, a smaller share of the run).")
    p.add_argument("--reference-iters", type=int, default=40,
                   help="A clean none run of this many iterations before each crash run: its "
                        "iteration time is that run's reference (0: phase 1's none rows).")
    p.add_argument("--schedules", type=int, default=500,
                   help="Simulated failure schedules per policy and MTBF.")
    p.add_argument("--json", help="Write the comparison here.")
    return p


def print_runs(rows: list) -> None:
    """Per ETTR run: measured against the replayed trace and the analytic model."""
    print(f"\n{'policy':<16} {'MTBF':>5} {'fail':>4} {'restart':>7} {'measured':>8} {'trace':>7} "
          f"{'err':>7} {'analytic':>8} {'err':>7} {'trace, median restart':>22}")
    for r in rows:
        flag = "" if abs(r["trace_error"]) <= TOLERANCE else "  > 15 %"
        median_err = r["trace_ettr_median_restart"] / r["measured_ettr"] - 1
        print(f"{r['policy']:<16} {r['mtbf_s']:>5g} {r['failures']:>4} {r['restart_s']:>6.2f}s "
              f"{r['measured_ettr']:>8.3f} {r['trace_ettr']:>7.3f} {r['trace_error']:>+7.1%} "
              f"{r['analytic_ettr']:>8.3f} {r['analytic_error']:>+7.1%} "
              f"{r['trace_ettr_median_restart']:>14.3f} ({median_err:+.1%}){flag}")


def print_stalls(st: list) -> None:
    """The model's stall per checkpoint against the measured one (nothing if none)."""
    if not st:
        return
    print(f"\n{'stall per checkpoint':<40} {'measured (ms)':>14} {'model (ms)':>11} {'err':>7}"
          "   (calls calibrated on round 1, measured on round 2)")
    for r in st:
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        print(f"{r['policy']:<40} {r['measured_stall_ms']:>14.1f} {r['model_stall_ms']:>11.1f} "
              f"{err:>7}")


def print_groups(groups: list) -> None:
    """Per policy and MTBF: the mean over seeds against the expectation and the formula."""
    print(f"\n{'policy':<16} {'MTBF':>5} {'seeds':>5} {'failures':>10} {'measured':>8} "
          f"{'expected':>8} {'err':>7} {'formula':>7} {'err':>7}")
    for g in groups:
        flag = "" if abs(g["expected_error"]) <= TOLERANCE else "  > 15 %"
        print(f"{g['policy']:<16} {g['mtbf_s']:>5g} {g['seeds']:>5} "
              f"{','.join(map(str, g['failures'])):>10} {g['measured_mean']:>8.3f} "
              f"{g['expected']:>8.3f} {g['expected_error']:>+7.1%} {g['formula']:>7.3f} "
              f"{g['formula_error']:>+7.1%}{flag}")


def main() -> int:
    opts = build_parser().parse_args()
    os.makedirs(opts.out, exist_ok=True)
    path = opts.bench_json or run_bench(opts.out, opts.mtbf, opts.seed, opts.bench_iters,
                                             opts.ettr_iters, opts.reference_iters,
                                             opts.save_interval)
    with open(path) as f:
        bench = json.load(f)
    hw, sources = hardware_of(bench, opts.out)
    print("\nhardware:", {k: round(v, 4) if isinstance(v, float) else v
                          for k, v in vars(hw).items()})
    for k, v in sources.items():
        print(f"  {k}: {v}")
    rows = compare(bench, hw)
    print_runs(rows)
    st = stalls(bench, hw)
    print_stalls(st)
    groups = by_policy_and_mtbf(bench, hw, rows, opts.schedules)
    print_groups(groups)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"hardware": vars(hw), "sources": sources, "ettr": rows, "stall": st,
                       "by_policy_and_mtbf": groups}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
