#!/usr/bin/env python
"""Exact recovery (``--moc-mode exact``) against MoC's PEC and two-level checkpointing, on
the real trainer: per-iteration overhead, one crash's recovery, and ETTR under random
failures, all in ONE invocation (the machine is shared and noisy: quote only ratios of
rows measured by the same invocation).

    python benchmarks/exact_bench.py                      # the full run (about 10-11 min here)
    python benchmarks/exact_bench.py --quick --out /tmp/exb --json /tmp/exb.json --plot /tmp/exb.png
    python benchmarks/exact_bench.py --iters 60 --rounds 2 --ettr-iters 100 --mtbf 11 --seed 1 \\
                                     --phases overhead,recovery,ettr --out runs/exact_bench

Every run is one training job of ``pretrain_gpt_moe.py`` under torchrun's elastic agent
(``scripts/run_elastic.sh NPROC RESTARTS``) with ``configs/small.yaml`` (2.7 M parameters,
8 experts every 2nd layer, ZeRO-2, expert-parallel 2) on ``--nproc`` (2) CPU ranks, trained
on the quickstart's corpus (the Python standard library's sources, byte-level tokens;
prepared by ``megatron.data.stdlib_corpus`` if missing), ``--log-interval 1``
and no evaluation. (``two_level_bench.py`` drives its own engine with
``checkpoint_bench.py``'s synthetic model on 4 ranks; faults and restarts need the real
trainer, so this uses the model and data of ``experiments/accuracy.py`` and the
quickstart.) The script reads rank 0's output line by line as it comes and stamps
each line with the wall clock (``OUT/<phase>/<policy>/log.txt`` keeps the stamps), and
reads the run's metrics file, event file (``<save>/moc-events.jsonl``), manifests and
exact-recovery frames afterwards. Nothing is asserted about the numbers.

Policies (every one with ``--moc-checkpoint``):

- ``none``: no checkpoint during the run (``--save-interval`` larger than the run);
- ``exact``: ``--moc-mode exact``, window chosen automatically (a sparse frame of one group
  of operators' fp32 state plus the later groups' compute weights, every iteration, copied
  in the background into the node keeper's shared memory, from where it is written to
  ``<save>/exact``); no periodic checkpoint;
- ``exact-w4``: the same with ``--moc-window 4`` (overhead phase only, by default);
- ``pec-dynamic``: ``--moc-pec-k 1 --moc-dynamic-k``, a checkpoint every ``--save-interval``
  (10) iterations;
- ``two-level-full``: ``--moc-two-level --moc-snapshot-interval 1 --moc-persist-interval
  10`` with every expert (a snapshot into the node keeper's shared memory every iteration,
  every 10th persisted).

Phases (``--phases``):

1. ``overhead``: every policy of ``--policies`` for ``--iters`` iterations without failures,
   ``--rounds`` (2) times in alternating order (none, exact, ..., two-level-full, then
   back); each policy's row is its fastest run, since other work on the machine only ever
   slows a run down (every run's figures are in the JSON, ``rounds``).
2. ``recovery``: every policy of ``--fault-policies`` once more with ``--moc-fault
   crash@N:rank=1`` (``--crash-at``; default the middle of a save interval near the middle
   of the run, 35 for 60 iterations) and up to 2 restarts.
3. ``ettr``: every policy of ``--fault-policies`` for ``--ettr-iters`` iterations with
   ``--moc-fault-mtbf S --moc-fault-seed K`` (the same S and K for all; S from ``--mtbf``,
   default: 2 x ``--ettr-iters`` x phase 1's ``none`` iteration time / ``--target-failures``
   (4), e.g. 11 s for 100 iterations of 225 ms) and up to ``--max-restarts`` restarts. The
   fault schedule runs on the job's wall clock from its first fault injector; crashes due
   while no process of the job has an injector (start-up, restarts) are skipped, so the
   policies see different counts. The factor 2: the fault clock also runs during re-done
   iterations, each restart's load and its slower first iterations; measured here, the
   training loops of a faulted run ran about twice the clean run's time. With
   ``--ettr-reference ITERS`` a clean ``none`` run of ITERS iterations goes right before
   each ETTR run (``<policy>-ref``), and the row's ``ettr_ref`` uses its iteration time:
   this machine's speed drifts by 5 % or more over the minutes between the phases.

Columns of the overhead table:

- ``iter med (ms)``: median of the wall-clock gaps between consecutive iteration lines
  (iterations after ``--warmup``); a gap covers the whole iteration: forward, backward,
  step, the frame copy wait, snapshot and save calls.
- ``iter mean (ms)``: (time of the last iteration line - time of the line of iteration
  ``--warmup`` + 1) / iterations between them: the steady-state iteration time, which
  includes the periodic saves a median hides.
- ``overhead``: ``iter mean`` / ``none``'s ``iter mean`` - 1.
- ``to memory MiB/it``: bytes copied into host memory per iteration, all ranks (exact: the
  mean frame of the last complete window from the frame records; pec: the checkpoint's
  bytes / its interval, since an asynchronous save copies the state to a host buffer
  first; two-level: the persisted snapshot's bytes / snapshot interval (K_snapshot = all).
- ``to storage MiB/it``: bytes written to storage per iteration, all ranks (exact: the
  frame, written every iteration; pec: mean bytes of the periodic checkpoints in the
  manifests / interval (PEC's first checkpoint, which holds every expert, and the save at
  the end of the run not counted); two-level: the same for the persisted snapshots).
- ``host mem/rank (MiB)``: exact: the close line's host memory of rank 0 (two frames in
  flight); two-level: the keeper's snapshot memory budget per rank ("up to", 3 slots);
  others ``-``.
- ``stall med/max (ms)``: exact: the close line's waits of the training loop for a frame
  copy or write (rank 0); pec and two-level: the save calls ("saved checkpoint ... in X s",
  1 ms resolution); ``-``: no save in the loop.
- ``W``: the exact window (from the close line).

Columns of the recovery table (one crash, ``crash@N:rank=1``):

- ``source``: where the restart loaded from (event ``source``: storage, memory, exact
  replay from memory / storage).
- ``resumed at``: the iteration training resumed from (event ``iteration``).
- ``redone``: iterations the failed run had finished beyond it (event ``iterations_lost``):
  re-run by every policy; lost updates only where PLT > 0 (exact replays them bit for bit).
- ``PLT``: this recovery's proportion of lost tokens; ``K after``: experts per checkpoint
  from then on (dynamic K).
- ``restart (s)``: from the fault (the crashing rank's event) to the restarted job's load
  start (event time - ``load_s``): detection, teardown, relaunch, model build.
- ``load (s)``: event ``load_s``; ``replay (s)``: from the end of the load until the job is
  back at iteration N-1, the last one finished before the crash (0 when it resumed there).
- ``crash->back (s)``: the sum: the failure's cost in wall-clock time.

Columns of the ETTR table:

- ``failures``: faults injected (events of kind ``fault``); ``recoveries``, ``redone``
  (sum of ``iterations_lost``), ``K final`` and ``PLT acc.`` (accumulated) from the events.
- ``wall (s)``: from the first "training from iteration" line to the last iteration line:
  the initial start-up is not counted, every restart is.
- ``ETTR``: useful iterations x T_iter(none) / wall, with T_iter(none) the ``iter mean``
  of the fault-free ``none`` run of phase 1 (the MoEvement paper's effective training time
  ratio: the share of wall-clock time that advanced training at full speed).
- ``ETTR own``: the same with the policy's own fault-free ``iter mean``: the failure
  factor alone.
- ``E[R] (s)``: measured cost per failure = (wall - iterations x own T_iter) / failures.
- ``ETTR model``: DESIGN.md section 3's formula, ETTR = [1 / (1 + T_ckpt / (T_iter *
  interval))] x [1 / (1 + E[R] / MTBF)], with the first factor measured as T_iter(none) /
  own T_iter (phase 1) and E[R] the recovery phase's crash->back seconds, MTBF = S.

Output: the tables (printed and written to ``OUT/table.md``), ``OUT/results.json`` and
``--json FILE`` (every run's figures and raw measurements), ``--plot FILE.png`` (iteration
time and overhead, the recovery breakdown and ETTR per policy; needs matplotlib). A run
that fails is a row marked FAILED, with its exit code and the tail of its log under the
table; the script then exits with 1. MoC keepers this script's runs leave behind are shut
down and their ``/dev/shm`` directories removed; each run's checkpoint directory is deleted
once measured (``--keep-checkpoints`` keeps them), its event and fault files are kept.
"""

import argparse
import json
import os
import platform
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron.data.stdlib_corpus import prepare_stdlib_corpus  # noqa: E402  (the quickstart's corpus)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.exact_measure import (add_reference, combine_rounds, ettr_model,  # noqa: E402
                                    measure_ettr, measure_overhead, measure_recovery)
from benchlib.exact_report import PHASES, failure_notes, plot, tables  # noqa: E402
from benchlib.exact_runs import POLICIES, run_job  # noqa: E402

MARKER = ".exact_bench"
"""File in --out saying this script made it (so replacing it is safe)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/exact_bench",
                   help="Directory of the runs (replaced if this script made it).")
    p.add_argument("--json", metavar="FILE", help="Also write the results here.")
    p.add_argument("--plot", metavar="FILE", help="PNG of the results (needs matplotlib).")
    p.add_argument("--quick", action="store_true",
                   help="Smoke run: --iters 20 --rounds 1 --warmup 3 --ettr-iters 30 --target-failures 2.")
    p.add_argument("--phases", default=",".join(PHASES), help="Comma list of phases to run.")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="Policies of the overhead phase (comma list).")
    p.add_argument("--fault-policies", default="exact,pec-dynamic,two-level-full",
                   help="Policies of the recovery and ETTR phases (comma list).")
    p.add_argument("--iters", type=int, default=None,
                   help="Iterations of each overhead and recovery run (default 60; quick 20).")
    p.add_argument("--rounds", type=int, default=None,
                   help="Overhead phase: run every policy this many times, in alternating "
                        "order, and keep each policy's fastest run (other work on the machine "
                        "only ever slows a run down) (default 2; quick 1).")
    p.add_argument("--warmup", type=int, default=None,
                   help="First iterations left out of the iteration times (default 5; quick 3).")
    p.add_argument("--save-interval", type=int, default=10,
                   help="pec-dynamic: checkpoint every N iterations; two-level: persist every N.")
    p.add_argument("--crash-at", type=int, default=None,
                   help="Recovery phase: crash@N:rank=1 (default: the middle of the save "
                        "interval nearest the middle of the run, 35 for 60 iterations).")
    p.add_argument("--ettr-iters", type=int, default=None,
                   help="Iterations of each ETTR run (default 100; quick 30).")
    p.add_argument("--mtbf", default=None,
                   help="--moc-fault-mtbf seconds, or several comma-separated (each policy "
                        "runs at each) (default: 2 x --ettr-iters x none's iteration time / "
                        "--target-failures).")
    p.add_argument("--target-failures", type=float, default=None,
                   help="Failures an ETTR run should see on average, for the automatic "
                        "--mtbf (default 4; quick 2).")
    p.add_argument("--seed", default="1",
                   help="--moc-fault-seed (every policy), or several comma-separated: the ETTR "
                        "phase runs each policy at each MTBF once per seed.")
    p.add_argument("--ettr-reference", type=int, default=0, metavar="ITERS",
                   help="ETTR phase: before each run, a clean none run of this many iterations "
                        "(0: none); its iteration time is the run's ETTR reference (ettr_ref), "
                        "so a machine that got slower between the phases does not count as "
                        "the policy's loss.")
    p.add_argument("--max-restarts", type=int, default=20, help="ETTR runs: torchrun restarts.")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (expert-parallel 2).")
    p.add_argument("--config", default="configs/small.yaml", help="Model config.")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    p.add_argument("--timeout", type=float, default=600, help="Seconds a run may take.")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="Keep every run's checkpoint directory (a full run writes about 2 GB); "
                        "by default only its event and fault files are kept, beside the log.")
    return p


def finish_options(opts) -> None:
    defaults = {"iters": (60, 20), "warmup": (5, 3), "ettr_iters": (100, 30), "rounds": (2, 1),
                "target_failures": (4.0, 2.0)}
    for key, (full, quick) in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, quick if opts.quick else full)
    try:
        opts.seeds = [int(x) for x in str(opts.seed).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --seed: expected integers, got {opts.seed!r}")
    if not opts.seeds:
        raise SystemExit("error: --seed: at least one")
    opts.seed = opts.seeds[0]
    if opts.mtbf is not None:
        try:
            opts.mtbf = [float(m) for m in str(opts.mtbf).split(",") if m.strip()]
        except ValueError:
            raise SystemExit(f"error: --mtbf: expected seconds, got {opts.mtbf!r}")
        if not opts.mtbf or min(opts.mtbf) <= 0:
            raise SystemExit("error: --mtbf must be > 0 seconds")
    if opts.crash_at is None:
        k = opts.save_interval
        opts.crash_at = max(2, (opts.iters // 2 // k) * k + k // 2)


def _list(text: str) -> list:
    return [x.strip() for x in text.split(",") if x.strip()]


def prepare_out(out: str) -> None:
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, MARKER)):
            raise SystemExit(f"error: --out {out} exists, is not empty and was not made by this "
                             f"script (no {MARKER}); choose another directory")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, MARKER), "w").close()


def _option_error(opts, phases: list, policies: list):
    """Why the options cannot run (the ``error:`` line), or None."""
    bad = [p for p in phases if p not in PHASES] + [p for p in policies if p not in POLICIES]
    if bad:
        return (f"unknown phase or policy: {', '.join(bad)} (phases: {', '.join(PHASES)}; "
                f"policies: {', '.join(POLICIES)})")
    if (opts.iters <= opts.warmup + 2 or not 1 < opts.crash_at <= opts.iters
            or opts.ettr_iters < 2 or opts.rounds < 1
            or (opts.ettr_reference and opts.ettr_reference <= opts.warmup + 2)):
        return ("need --iters > --warmup + 2, 1 < --crash-at <= --iters, --ettr-iters >= 2, "
                "--rounds >= 1, --ettr-reference 0 or > --warmup + 2")
    return None


class _Jobs:
    """The training jobs of one invocation: each under ``OUT/<phase>/<label>``, on the
    corpus at ``data``, with a progress line once measured."""

    def __init__(self, opts, out: str, data: str):
        self.opts, self.out, self.data = opts, out, data
        self.began = time.time()

    def run(self, name: str, where: str, restarts: int, extra: list, iters: int) -> dict:
        """Policy ``name``'s job in ``OUT/<where>`` (a phase and a label)."""
        return run_job(name, name, self.opts, self.data, os.path.join(self.out, where),
                       restarts=restarts, extra=extra, iters=iters)

    def progress(self, phase: str, row: dict, run: dict) -> None:
        """Note the load and what the run left behind in ``row``, drop its checkpoints
        (unless ``--keep-checkpoints``), print the row's figures."""
        row["loadavg_after"] = os.getloadavg()[0]
        if run["leftover"]:
            row["leftover"] = run["leftover"]
        if not self.opts.keep_checkpoints:  # measured: keep what says what happened, not the bytes
            for name in ("moc-events.jsonl", "moc-faults.json"):
                if os.path.exists(os.path.join(run["ckpt"], name)):
                    shutil.copy(os.path.join(run["ckpt"], name), run["run_dir"])
            shutil.rmtree(run["ckpt"], ignore_errors=True)
        brief = {k: v for k, v in row.items() if k not in ("tail", "iter_gaps_s", "run_dir",
                                                            "checkpoint_bytes")}
        print(f"[exact_bench {time.time() - self.began:6.0f} s] {phase} / {row['policy']}: "
              f"{json.dumps(brief, default=str)}", flush=True)


def _overhead_phase(jobs: _Jobs, policies: list) -> list:
    """Every policy ``--rounds`` times without failures, in alternating order; one row
    per policy (:func:`combine_rounds`)."""
    opts = jobs.opts
    per_policy = {name: [] for name in policies}
    for k in range(opts.rounds):
        for name in policies if k % 2 == 0 else list(reversed(policies)):
            label = name if opts.rounds == 1 else f"{name}-r{k + 1}"
            run = jobs.run(name, os.path.join("overhead", label), restarts=0, extra=[],
                           iters=opts.iters)
            row = measure_overhead(run, opts)
            row["round"] = k + 1
            per_policy[name].append(row)
            jobs.progress("overhead", row, run)
    return combine_rounds(per_policy)


def _recovery_phase(jobs: _Jobs, fault_policies: list) -> list:
    """Every fault policy once with one crash (``--crash-at``) and up to 2 restarts."""
    opts = jobs.opts
    rows = []
    for name in fault_policies:
        run = jobs.run(name, os.path.join("recovery", name), restarts=2,
                       extra=["--moc-fault", f"crash@{opts.crash_at}:rank=1"], iters=opts.iters)
        row = measure_recovery(run, opts)
        rows.append(row)
        jobs.progress("recovery", row, run)
    return rows


def _ettr_mtbfs(opts, clean: dict, results: dict) -> list:
    """``--mtbf``, else from the ``none`` policy's clean iteration time (the choice noted
    in ``results["mtbf_note"]``)."""
    if opts.mtbf is not None:
        return opts.mtbf
    t = (clean.get("none") or {}).get("iter_s_mean")
    results["mtbf_note"] = ("from none's iteration time" if t else
                            "none's iteration time not measured: 10 s")
    return [round(2 * opts.ettr_iters * t / opts.target_failures, 1) if t else 10.0]


def _ettr_phase(jobs: _Jobs, fault_policies: list, mtbfs: list, clean: dict,
               recovery: dict) -> list:
    """Every fault policy under random crashes, at each MTBF with each seed (after a clean
    reference run with ``--ettr-reference``)."""
    opts = jobs.opts
    rows = []
    for seed in opts.seeds:
        for mtbf in mtbfs:
            for name in fault_policies:
                where = name + ("" if len(mtbfs) == 1 else f"-mtbf{mtbf:g}") \
                    + ("" if len(opts.seeds) == 1 else f"-seed{seed}")
                if opts.ettr_reference:
                    ref_run = jobs.run("none", os.path.join("ettr", where + "-ref"), restarts=0,
                                       extra=[], iters=opts.ettr_reference)
                    ref = measure_overhead(ref_run, opts)
                    jobs.progress("ettr reference", ref, ref_run)
                run = jobs.run(name, os.path.join("ettr", where), restarts=opts.max_restarts,
                               iters=opts.ettr_iters,
                               extra=["--moc-fault-mtbf", str(mtbf), "--moc-fault-seed", str(seed)])
                row = measure_ettr(run, opts, mtbf, clean, seed)
                if opts.ettr_reference:
                    add_reference(row, ref)
                row["ettr_model"] = ettr_model(name, clean, recovery, mtbf)
                rows.append(row)
                jobs.progress("ettr", row, run)
    return rows


def _report(results: dict, out: str, opts) -> int:
    """Print the tables and notes, write ``OUT/table.md``, ``OUT/results.json``, ``--json``
    and ``--plot``; 1 if a run failed, else 0."""
    text = tables(results)
    notes = failure_notes(results)
    print()
    print(text)
    if notes:
        print("\n" + notes)
    print(f"\nall runs: {results['total_s']:.0f} s (1-minute load average {results['loadavg_before']:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after); logs, metrics and events under "
          f"{out}/<phase>/<policy>/")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n" + (f"\n```\n{notes}\n```\n" if notes else ""))
    for path in [os.path.join(out, "results.json")] + ([opts.json] if opts.json else []):
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"wrote {os.path.join(out, 'table.md')}, {os.path.join(out, 'results.json')}"
          + (f", {opts.json}" if opts.json else ""))
    if opts.plot:
        print(plot(results, opts.plot))
    failed = any(not r["ok"] for p in PHASES for r in results.get(p, []))
    return 1 if failed else 0


def main() -> int:
    opts = build_parser().parse_args()
    finish_options(opts)
    phases, policies, fault_policies = _list(opts.phases), _list(opts.policies), _list(opts.fault_policies)
    problem = _option_error(opts, phases, policies + fault_policies)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = os.path.abspath(opts.out)
    prepare_out(out)
    data = prepare_stdlib_corpus(os.path.join(REPO, opts.data_prefix))
    command = launch.command_line()
    results = {"command": command, "options": vars(opts),
               "machine": f"{os.cpu_count()} CPU cores, {platform.platform()}",
               "loadavg_before": os.getloadavg()[0]}
    print(f"exact-recovery benchmark\ncommand: {command}\nmachine: {results['machine']}; "
          f"load average {results['loadavg_before']:.1f} (other work on the machine skews "
          f"every figure: compare rows of one invocation)\nruns under {out}", flush=True)
    jobs = _Jobs(opts, out, data)
    clean, recovery = {}, {}
    if "overhead" in phases:
        results["overhead"] = _overhead_phase(jobs, policies)
        clean = {r["policy"]: r for r in results["overhead"] if r["ok"]}
    if "recovery" in phases:
        results["recovery"] = _recovery_phase(jobs, fault_policies)
        recovery = {r["policy"]: r for r in results["recovery"] if r["ok"]}
    if "ettr" in phases:
        mtbfs = _ettr_mtbfs(opts, clean, results)
        results["ettr"] = _ettr_phase(jobs, fault_policies, mtbfs, clean, recovery)
    results["total_s"] = time.time() - jobs.began
    return _report(results, out, opts)


if __name__ == "__main__":
    sys.exit(main())
