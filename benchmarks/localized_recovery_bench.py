#!/usr/bin/env python
"""Localized vs global recovery of a pipeline stage (MoEtion's upstream logging), side by
side in one run, at several pipeline sizes.

For each ``--stages P`` it trains the GPT-MoE trainer on ``P`` local ranks (one per stage,
gloo on CPU; ``P`` decoder layers, every one MoE, so each stage holds one), exact mode
with ``--moc-window W``, four jobs of the same steps and data:

* ``plain``: no upstream logs, no failure (the iteration time without logs);
* ``logged``: ``--moc-upstream-logging``, no failure (the logs' cost, their memory per
  stage, and the reference losses);
* ``localized``: logged, and ``--moc-fault lose-stage@F:rank=R`` for each ``--fail-at F``
  (a middle stage, or the last of two, loses its state in place): it alone replays from
  its window;
* ``global``: the same fault without the logs: every stage replays.

It prints, per ``P``: the recovery's wall time (per failure, fault to the end of the
replay, every rank waiting), the speedup ``moc-plan pipeline``'s model predicts, the steps replayed,
the training loop's ETTR of each failed job (the fault-free job's median step times the
steps, over the sum of the job's logged step times, a recovery inside the step it
precedes; start-up excluded), the median iteration times with and without the logs, the memory each stage's log held, and whether each failed job's losses
equal the ``logged`` job's to the bit. It asserts nothing about the numbers.

On CPU the ranks share the machine's cores: a stage replaying alone also gets the cores
the waiting stages leave, which a GPU per stage would not give it. The times say what
this machine measured, not what a cluster will.

    python benchmarks/localized_recovery_bench.py [--stages 2 4] [--iters 40] [--window 3]
        [--fail-at 12 22 32] [--json FILE]
"""

import argparse
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.ranks import file_tail, finish_out_dir, run_rank_processes  # noqa: E402
from benchlib.tables import print_aligned  # noqa: E402

JOBS = ("plain", "logged", "localized", "global")
RECOVERED = re.compile(r"\[moc\] recovered in ([0-9.]+) s, (localized|global)")
ETTR = re.compile(r"\[moc\] ETTR ([0-9.]+):")
LOGS = re.compile(r"stage (\d+) ([0-9.]+) MiB \(peak ([0-9.]+)\)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Localized vs global in-place recovery of a "
                                            "pipeline stage.")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="Pipeline sizes.")
    p.add_argument("--iters", type=int, default=40, help="Training steps per job.")
    p.add_argument("--window", type=int, default=3, help="Exact mode's --moc-window.")
    p.add_argument("--fail-at", type=int, nargs="+", default=[12, 22, 32],
                   help="The steps the stage is lost at (the top of each).")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4, help="Per step (per stage).")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    p.add_argument("--json", metavar="FILE", help="Also write the rows here as JSON.")
    p.add_argument("--out-dir", metavar="DIR", help="Job directories (default: a new "
                                                    "temporary directory, deleted at the end).")
    p.add_argument("--keep", action="store_true", help="Keep --out-dir.")
    p.add_argument("--timeout", type=float, default=900, help="Seconds per job.")
    return p


def _flags(opts, stages: int, data: str, job_dir: str, job: str) -> list:
    shm = f"/dev/shm/moc-localized-bench-{os.getuid()}-{os.getpid()}-{stages}-{job}"
    flags = ["--config", "configs/tiny.yaml", "--num-layers", str(stages), "--hidden-size", str(opts.hidden),
             "--num-attention-heads", "4", "--seq-length", str(opts.seq),
             "--max-position-embeddings", str(opts.seq), "--num-experts", "4",
             "--expert-interval", "1", "--moe-expert-parallel-size", "1", "--topk", "1",
             "--micro-batch-size", str(opts.micro_batch),
             "--global-batch-size", str(opts.micro_batch * opts.micro_batches),
             "--train-iters", str(opts.iters), "--lr", "1e-3", "--lr-warmup-iters", "2",
             "--eval-interval", "1000000", "--eval-iters", "1", "--log-interval", "1",
             "--split", "100,0,0", "--tokenizer-type", "ByteLevelTokenizer",
             "--data-path", data, "--zero-stage", "1", "--pipeline-model-parallel-size",
             str(stages), "--moc-checkpoint", "--save", os.path.join(job_dir, "ckpt"),
             "--save-interval", "1000000", "--moc-mode", "exact", "--moc-window",
             str(opts.window), "--moc-shm-dir", shm,
             "--metrics-file", os.path.join(job_dir, "metrics.jsonl")]
    if job in ("logged", "localized"):
        flags.append("--moc-upstream-logging")
    if job in ("localized", "global"):
        for step in opts.fail_at:
            flags += ["--moc-fault", f"lose-stage@{step}:rank={stages // 2}"]
    return flags


def _run(opts, stages: int, data: str, out: str, job: str) -> dict:
    job_dir = os.path.join(out, f"pp{stages}", job)
    os.makedirs(job_dir)
    argv = [sys.executable, os.path.join(REPO, "pretrain_gpt_moe.py"),
            *_flags(opts, stages, data, job_dir, job)]
    codes, timed_out = run_rank_processes(argv, stages, job_dir, opts.timeout)
    log = file_tail(os.path.join(job_dir, "logs", "rank0.log"), 10 ** 6)
    if timed_out or any(codes):
        raise RuntimeError(f"PP {stages} {job}: exit codes {codes}"
                           f"{' (timed out)' if timed_out else ''}\n{log[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(job_dir, "metrics.jsonl"))]
    train = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}
    times = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
    recs = RECOVERED.findall(log)
    ettr = ETTR.search(log)
    logs = LOGS.findall(log.split("[moc] upstream logs:")[-1].splitlines()[0]) if \
        "[moc] upstream logs:" in log else []
    return {"train": train, "iter_ms": statistics.median(times[2:] or times),
            "loop_ms": sum(times),
            "recovery_s": statistics.mean(float(r[0]) for r in recs) if recs else None,
            "recoveries": len(recs), "how": sorted({r[1] for r in recs}),
            "ettr": float(ettr.group(1)) if ettr else None,
            "log_mib": max((float(m) for _, m, _ in logs), default=0.0),
            "log_peak_mib": max((float(p) for _, _, p in logs), default=0.0)}


def _replayed(opts, fail_at: int) -> int:
    """Steps replayed after a loss at the top of step ``fail_at``: from the start of the
    newest complete window (frames from step 1 on) to the last finished step."""
    done = fail_at - 1
    complete = (done // opts.window) * opts.window  # the last frame of a complete window
    return done - (complete - opts.window + 1)


HEADER = ["PP", "failed stage", "steps replayed", "localized s", "global s", "speedup",
          "model speedup", "ETTR no failure", "ETTR localized", "ETTR global",
          "iter ms plain", "iter ms logged", "log MiB/stage", "exact"]


def _stage_row(opts, stages: int, runs: dict) -> dict:
    """One pipeline size's row from its four jobs (``runs``; each gets its ``loop_ettr``)."""
    from deepspeed_ext.planning import pipeline as pm
    exact = all(runs[j]["train"] == runs["logged"]["train"] for j in ("localized", "global"))
    loc, glo = runs["localized"], runs["global"]
    # the training loop's ETTR: the fault-free logged job's median step x steps over
    # the loop's wall time (each logged step's elapsed time; a recovery at the top of
    # a step counts in that step's), start-up excluded
    useful = opts.iters * runs["logged"]["iter_ms"]
    for run in runs.values():
        run["loop_ettr"] = useful / run["loop_ms"]
    row = {"stages": stages, "failed_stage": stages // 2,
           "replayed": statistics.mean(_replayed(opts, f) for f in opts.fail_at),
           "recoveries": (loc["recoveries"], glo["recoveries"]),
           "localized_s": loc["recovery_s"], "global_s": glo["recovery_s"],
           "ettr_localized": loc["loop_ettr"], "ettr_global": glo["loop_ettr"],
           "ettr_logged": runs["logged"]["loop_ettr"],
           "trainer_ettr": {j: runs[j]["ettr"] for j in JOBS},
           "loop_s": {j: runs[j]["loop_ms"] / 1e3 for j in JOBS},
           "iter_ms_plain": runs["plain"]["iter_ms"], "iter_ms_logged": runs["logged"]["iter_ms"],
           "log_mib": runs["logged"]["log_mib"], "log_peak_mib": runs["logged"]["log_peak_mib"],
           "exact": exact, "how": (loc["how"], glo["how"])}
    model = pm.PipelineRecovery(stages, opts.micro_batches, opts.window,
                                runs["logged"]["iter_ms"] / 1e3)
    row["model_speedup"] = pm.replay_step_s(model, False) / pm.replay_step_s(model, True)
    return row


def _table_cells(row: dict, runs: dict) -> list:
    loc, glo = runs["localized"], runs["global"]
    return [str(row["stages"]), str(row["failed_stage"]), f"{row['replayed']:g}",
            f"{loc['recovery_s']:.2f}",
            f"{glo['recovery_s']:.2f}", f"{glo['recovery_s'] / loc['recovery_s']:.2f}x",
            f"{row['model_speedup']:.2f}x", f"{runs['logged']['loop_ettr']:.3f}",
            f"{loc['loop_ettr']:.3f}", f"{glo['loop_ettr']:.3f}", f"{row['iter_ms_plain']:.0f}",
            f"{row['iter_ms_logged']:.0f}", f"{row['log_peak_mib']:.2f}",
            "yes" if row["exact"] else "NO"]


def _print_report(opts, command: str, table: list) -> None:
    launch.print_header("Localized vs global in-place recovery of a pipeline stage", command)
    print(f"model: {opts.stages} stages x 1 MoE layer (4 experts), hidden {opts.hidden}, "
          f"seq {opts.seq}, {opts.micro_batches} micro-batches of {opts.micro_batch}; W = "
          f"{opts.window}; {opts.iters} steps; the stage is lost at the top of steps "
          f"{', '.join(map(str, opts.fail_at))}")
    print_aligned(table)
    print("model speedup: moc-plan pipeline's (deepspeed_ext/planning/pipeline.py), the "
          "1F1B bubble a stage replaying alone saves, (M + P - 1) / M, one device per stage.")
    print("localized/global s: per failure (the mean), fault to the end of the replay "
          "(every rank waits); steps replayed: per failure; ETTR: the "
          "training loop's (the fault-free logged job's median step x steps over the sum of "
          "the job's logged step times, the recovery inside one; start-up excluded; 'no "
          "failure' is that job's own, the noise floor of the measure); log "
          "MiB: the most one stage's upstream log held; exact: the failed jobs' losses and "
          "gradient norms equal the logged job's to the bit.")


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    bad = ("every --fail-at must be after the first window (> --window) and at most --iters"
           if any(f <= opts.window or f > opts.iters for f in opts.fail_at) else None)
    setup = launch.job_run_setup(opts, "moc-localized-bench-", bad)
    if setup is None:
        return 2
    out, created, data, command = setup
    table = [HEADER]
    results = []
    for stages in opts.stages:
        runs = {job: _run(opts, stages, data, out, job) for job in JOBS}
        row = _stage_row(opts, stages, runs)
        results.append(row)
        table.append(_table_cells(row, runs))
    _print_report(opts, command, table)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"command": command, "rows": results}, f, indent=1)
    finish_out_dir(out, created, opts.keep)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
