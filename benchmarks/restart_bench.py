#!/usr/bin/env python
"""One crash in a small job: relaunched by torchrun's agent, or recovered in place by
MoC's supervisor with a hot spare (``--moc-restart in-job``), side by side in one run,
repeated.

    python benchmarks/restart_bench.py [--ranks 2|4] [--repeats 2] [--iters 16]
        [--crash-at 8] [--fault crash|hang] [--hang-timeout 2] [--out-dir DIR] [--quick]

Each repeat runs four jobs of ``pretrain_gpt_moe.py`` under ``scripts/run_elastic.sh``
on the same data (the quickstart's corpus, prepared by ``megatron.data.stdlib_corpus`` if
missing) and the same flags: ``configs/tiny.yaml``, ``--ranks`` training ranks (EP 2),
``--iters`` iterations, ``--moc-checkpoint --moc-two-level --moc-snapshot-interval 1``
(a snapshot into the node keeper's memory every iteration), no evaluation, and per job a
fresh ``--save`` = ``--load`` and a fresh ``--moc-shm-dir``:

- ``fault-free``: NPROC = ranks, MAX_RESTARTS 0 (relaunch mode, no fault): the reference
  wall time and losses;
- ``relaunch``: NPROC = ranks, MAX_RESTARTS 1, ``--moc-fault crash@K:rank=1`` (``K``:
  ``--crash-at``): torchrun's agent stops the survivors and starts every rank again,
  which recover from the keeper's memory;
- ``in-job-no-fault``: NPROC = ranks + 1, MAX_RESTARTS 0, ``--moc-restart in-job
  --moc-spares 1``, no fault: the start-up with MoC's supervisor and the spare, and the
  losses under the supervisor (on a machine with fewer cores than processes, the spare's
  imports slow the training ranks' start-up);
- ``in-job``: the same with the fault: the survivors leave the failed run in their
  processes, the spare takes rank 1, all recover from the keeper's memory.

The jobs of a repeat run one after another (every other repeat in the opposite order, so
the machine's drift does not always favour the same job). The script reads each job's
output as it comes and stamps every line with its arrival time (``OUT/r<N>/<job>/log.txt``
keeps the stamps; the trainer runs with ``PYTHONUNBUFFERED=1`` so a line arrives when it
is written), and reads the metrics file and ``<save>/moc-events.jsonl`` afterwards.

Columns of the jobs table:

- ``wall s``: ``run_elastic.sh``'s wall time, start to exit;
- ``start-up s``: from the start to the first ``training from iteration`` line;
- ``cost s``: wall - the same repeat's ``fault-free`` wall (the issue's measure of what
  the failure cost);
- ``loop cost s``: the same after start-up: (wall - start-up) - the ``fault-free``
  job's (wall - start-up): the failure's cost without the start-ups, whose differences
  are the spare's and the supervisor's imports and the machine's noise (the
  ``in-job-no-fault`` job's start-up shows the first);
- ``fault->step s``: from the ``[fault]`` line to the first iteration line after the
  recovery;
- ``launch cost s``: for ``in-job``, its wall - the same repeat's ``in-job-no-fault``
  wall (the failure's cost against the same launch without it, the spare and the
  supervisor in both); for ``relaunch``, its cost (its launch is the fault-free job's);
  ``in-job-no-fault``'s ``cost s`` is what that launch costs without a failure;
- ``cost ratio``, ``loop ratio``, ``launch ratio``, ``step ratio``: in-job / relaunch of
  the four figures above, in the same repeat (the issue's target: cost ratio <= 0.25);
- ``losses``: ``equal`` when every iteration's final loss (the last metrics record of
  each iteration) equals the ``fault-free`` job's to the bit;
- ``recovered``, ``since progress s``, ``load s``: the ``recovery`` event's source and
  iteration, ``seconds_since_progress`` (from the last finished iteration to the
  recovery) and ``load_s``;
- ``survivors' pids``: in-job, whether each survivor trained round 1 in the process it
  started round 0 in (the supervisor's start line against the ``in-job-round`` events).

The phases table gives, per failed job, when each step of the recovery was seen, in
seconds after the ``[fault]`` line (``-``: not in that mode): the death noticed (the
supervisor's ``exited with signal`` line; torchrun's ``failed (exitcode`` or ``closing
signal`` line), for in-job the supervisor's round written and the slowest process
leaving the failed run, having torn its groups down and having the new round (the
``in-job-round`` events: ``died``, ``left_s``, ``torn_down_s``, ``joined_s``), for
relaunch the new interpreters up (the last of their DeepSpeed ``Setting accelerator``
lines), then for both the model being built again (``building GPT-MoE model``), the state
restored (``[moc] restart N after failure``), training resumed (``training from
iteration``) and the first iteration done. Nothing is asserted about the numbers; the
exit status is 1 when a job failed or a job's losses differ from the fault-free job's.

On a shared CPU machine the processes compete for the same cores: the supervisor's and
the spare's start-up (their imports) run beside the training ranks' and are part of the
in-job jobs' wall time. Compare only the rows of one run.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.job_files import elastic_job_command, final_losses, json_lines  # noqa: E402
from benchlib.stamped_job import run_stamped  # noqa: E402
from benchlib.ranks import finish_out_dir  # noqa: E402
from benchlib.tables import fmt, print_aligned  # noqa: E402

JOBS = ("fault-free", "relaunch", "in-job-no-fault", "in-job")
FAILED_JOBS = ("relaunch", "in-job")
RESULTS = "restart_bench.json"

FAULT = re.compile(r"\[fault\] rank \d+: injected (crash|hang) at iteration")
ITERATION = re.compile(r"^\s*iteration\s+(\d+)/")
STARTED = re.compile(r"slot (\d+) pid (\d+) \(rank \d+\)")
"""The supervisor's start line: each training slot's first process."""

# (phase, pattern, how many matches after the fault it waits for: "ranks" = one per rank)
COMMON_TAIL = [("model being built", r"> building GPT-MoE model", 1),
               ("state restored", r"\[moc\] restart \d+ after failure", 1),
               ("training resumed", r"training from iteration \d+ to", 1)]
MARKERS = {
    "relaunch": [("death noticed", r"failed \(exitcode: |closing signal SIG", 1),
                 ("new interpreters up", r"Setting accelerator to CPU", "ranks"),
                 *COMMON_TAIL],
    "in-job": [("death noticed", r"\[moc supervisor\] slot \d+ \(rank \d+, pid \d+\) exited",
                1), *COMMON_TAIL],
}
ROUND_PHASES = [("round written", "died", None), ("survivors left", "left_s", "survivor"),
                ("survivors torn down", "torn_down_s", "survivor"),
                ("every process in round 1", "joined_s", None)]
"""In-job phases from the ``in-job-round`` events: (phase, field, role or any); the
slowest process's figure, counted from the round's write (``died``)."""
PHASE_ORDER = ["death noticed", "new interpreters up", *(p for p, _, _ in ROUND_PHASES),
               *(p for p, _, _ in COMMON_TAIL), "first iteration done"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One crash: relaunch against in-job restart "
                                            "with a hot spare, side by side.")
    p.add_argument("--ranks", type=int, choices=(2, 4), default=2,
                   help="Training ranks (EP 2); the in-job jobs have one more, the spare.")
    p.add_argument("--repeats", type=int, default=2, help="Repeats of the four jobs.")
    p.add_argument("--iters", type=int, default=16, help="Training iterations per job.")
    p.add_argument("--crash-at", type=int, help="Rank 1 is SIGKILLed (or hangs) at the top "
                                                "of this iteration (default: --iters / 2).")
    p.add_argument("--fault", choices=("crash", "hang"), default="crash",
                   help="crash: rank 1 SIGKILLed; hang: rank 1 sleeps before its next "
                        "collective, every job runs --moc-monitor with --hang-timeout, which "
                        "ends it (relaunch: every rank exits 75; in-job: the hung rank alone).")
    p.add_argument("--hang-timeout", type=float, default=2.0,
                   help="--moc-hang-timeout of every job with --fault hang (seconds).")
    p.add_argument("--out-dir", metavar="DIR",
                   help=f"Where the jobs' logs, metrics, checkpoints and {RESULTS} (every "
                        "measurement) go, kept; an empty or absent directory (default: a "
                        "temporary one, deleted at the end).")
    p.add_argument("--quick", action="store_true",
                   help="The smallest run: 2 ranks, 1 repeat, 10 iterations, crash at 6.")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    p.add_argument("--timeout", type=float, default=300,
                   help="Seconds per job; a job still running then is killed (its row: FAILED).")
    return p


def _checked(opts):
    """``opts`` with ``--quick`` and the default crash applied, or an error message."""
    if opts.quick:
        opts.ranks, opts.repeats, opts.iters, opts.crash_at = 2, 1, 10, 6
    if opts.crash_at is None:
        opts.crash_at = max(2, opts.iters // 2)
    if opts.repeats < 1:
        return "--repeats must be at least 1"
    if not 2 <= opts.crash_at <= opts.iters:
        return f"--crash-at must be between 2 and --iters ({opts.iters}), got {opts.crash_at}"
    return None


def _job_command(opts, job: str, data: str, job_dir: str, shm: str) -> list:
    """``scripts/run_elastic.sh``'s command line for ``job``."""
    nproc, restarts = opts.ranks, 0
    extra = []
    if job in FAILED_JOBS:
        extra = ["--moc-fault", f"{opts.fault}@{opts.crash_at}:rank=1"]
    if opts.fault == "hang":  # every job watched alike, the reference too
        extra += ["--moc-monitor", "--moc-hang-timeout", f"{opts.hang_timeout:g}",
                  "--moc-monitor-poll", f"{opts.hang_timeout / 8:g}"]
    if job == "relaunch":
        restarts = 1
    if job.startswith("in-job"):
        nproc += 1
        extra += ["--moc-restart", "in-job", "--moc-spares", "1"]
    return elastic_job_command(nproc, restarts, data, opts.iters, job_dir, shm, extra)


def run_job(opts, job: str, data: str, job_dir: str) -> dict:
    """One job under ``scripts/run_elastic.sh`` (in its own session, killed whole after
    ``--timeout``); then its keepers and shared memory are cleaned up. Returns the raw run:
    stamped lines, exit code, wall time, paths."""
    os.makedirs(job_dir)
    shm = f"/dev/shm/moc-restart-bench-{os.getuid()}-{os.getpid()}-" + \
        "-".join(job_dir.split(os.sep)[-2:])
    cmd = _job_command(opts, job, data, job_dir, shm)
    with open(os.path.join(job_dir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    run = run_stamped(cmd, os.path.join(job_dir, "log.txt"), shm, opts.timeout,
                      env_extra={"PYTHONUNBUFFERED": "1"})
    return {"job": job, "rc": run.rc, "timed_out": run.timed_out, "wall_s": run.wall_s,
            "start": run.start, "lines": run.lines, "dir": job_dir,
            "ckpt": os.path.join(job_dir, "ckpt"), "command": shlex.join(cmd),
            "leftover": run.leftover}


def _nth_match(lines: list, first: int, pattern: str, count: int):
    """(index, time) of the ``count``-th line from ``first`` on matching ``pattern``."""
    seen = 0
    for i in range(first, len(lines)):
        if re.search(pattern, lines[i][1]):
            seen += 1
            if seen == count:
                return i, lines[i][0]
    return None, None


def stream_phases(lines: list, mode: str, ranks: int) -> tuple:
    """(the fault line's time, {phase: seconds after it}) from the stamped output; the
    first iteration is the first iteration line after ``training resumed``."""
    start = next((i for i, (_, text) in enumerate(lines) if FAULT.search(text)), None)
    if start is None:
        return None, {}
    fault_t, phases = lines[start][0], {}
    resumed_at = None
    for phase, pattern, count in MARKERS[mode]:
        index, t = _nth_match(lines, start, pattern, ranks if count == "ranks" else count)
        if t is not None:
            phases[phase] = t - fault_t
            resumed_at = index if phase == "training resumed" else resumed_at
    if resumed_at is not None:
        _, t = _nth_match(lines, resumed_at, ITERATION.pattern, 1)
        if t is not None:
            phases["first iteration done"] = t - fault_t
    return fault_t, phases


def round_phases(events: list, fault_t: float) -> dict:
    """{phase: seconds after the fault} from the ``in-job-round`` events of round 1: the
    slowest process's figure of :data:`ROUND_PHASES`."""
    rounds = [e for e in events if e.get("kind") == "in-job-round" and e.get("round") == 1]
    if not rounds or fault_t is None:
        return {}
    died = rounds[0]["died"]
    out = {"round written": died - fault_t}
    for phase, field, role in ROUND_PHASES[1:]:
        values = [e[field] for e in rounds if field in e and role in (None, e.get("role"))]
        if values:
            out[phase] = died + max(values) - fault_t
    return out


def survivors_kept_pids(lines: list, events: list):
    """(kept, survivors): how many survivors of round 1 run in their slot's round-0
    process, per the supervisor's start line; None when either record is missing."""
    start = next((text for _, text in lines if "[moc supervisor] store" in text), None)
    survivors = [e for e in events if e.get("kind") == "in-job-round"
                 and e.get("role") == "survivor"]
    if start is None or not survivors:
        return None
    first = {int(slot): int(pid) for slot, pid in STARTED.findall(start)}
    return sum(first.get(e["slot"]) == e["pid"] for e in survivors), len(survivors)


def _recovery(events: list):
    """The job's first ``recovery`` event's figures, or None."""
    found = next((e for e in events if e.get("kind") == "recovery"), None)
    if found is None:
        return None
    return {k: found.get(k) for k in ("source", "iteration", "seconds_since_progress",
                                       "load_s", "iterations_lost", "restart")}


def _startup_s(run: dict):
    """Seconds from the job's start to its first ``training from iteration`` line."""
    return next((t - run["start"] for t, text in run["lines"]
                 if "training from iteration" in text), None)


def measure(run: dict, ranks: int, reference: dict) -> tuple:
    """One job's figures from its raw run and its final losses: (row, losses);
    ``reference``: the fault-free job's losses (None for that job itself)."""
    ok = run["rc"] == 0 and not run["timed_out"]
    events = json_lines(os.path.join(run["ckpt"], "moc-events.jsonl"))
    losses = final_losses(run["dir"])
    row = {"job": run["job"], "ok": ok, "rc": run["rc"], "timed_out": run["timed_out"],
           "wall_s": run["wall_s"], "command": run["command"], "dir": run["dir"],
           "leftover": run["leftover"], "iterations": len(losses),
           "losses_equal": None if reference is None or not ok else losses == reference,
           "recovery": _recovery(events), "phases_s": {}, "survivors_kept_pid": None,
           "startup_s": _startup_s(run)}
    row["after_startup_s"] = None if row["startup_s"] is None else \
        run["wall_s"] - row["startup_s"]
    if run["job"] in FAILED_JOBS:
        fault_t, phases = stream_phases(run["lines"], run["job"], ranks)
        if run["job"] == "in-job":
            phases.update(round_phases(events, fault_t))
            row["survivors_kept_pid"] = survivors_kept_pids(run["lines"], events)
        row["phases_s"] = {p: phases[p] for p in PHASE_ORDER if p in phases}
        row["fault_to_step_s"] = phases.get("first iteration done")
    if not ok:
        row["log_tail"] = "\n".join(error_lines([text for _, text in run["lines"]]))
    return row, losses


def error_lines(lines: list, keep: int = 12) -> list:
    """The last ``keep`` lines of a failed job's output without its tracebacks' frames
    (a rank's traceback is dozens of lines; its last line says what failed)."""
    frame = re.compile(r"^(\[rank\d+\]: )*(\s|Traceback \(most recent)")
    return [line for line in lines if not frame.match(line)][-keep:]


def run_repeat(opts, data: str, out: str, repeat: int) -> dict:
    """The four jobs of one repeat (every other repeat in the opposite order) and their
    costs: {job: row}."""
    order = JOBS if repeat % 2 == 0 else tuple(reversed(JOBS))
    runs = {}
    for job in order:
        print(f"[restart-bench] repeat {repeat + 1}: {job} ...", flush=True)
        runs[job] = run_job(opts, job, data, os.path.join(out, f"r{repeat + 1}", job))
        print(f"[restart-bench] repeat {repeat + 1}: {job} exit {runs[job]['rc']} in "
              f"{runs[job]['wall_s']:.1f} s", flush=True)
    free, reference = measure(runs["fault-free"], opts.ranks, None)
    rows = {"fault-free": free}
    for job in JOBS[1:]:
        rows[job], _ = measure(runs[job], opts.ranks, reference if free["ok"] else None)
    for job in (*FAILED_JOBS, "in-job-no-fault"):
        rows[job]["cost_s"] = _less(rows[job], free, "wall_s")
        rows[job]["loop_cost_s"] = _less(rows[job], free, "after_startup_s")
    in_job = rows["in-job"]
    # the failure alone: against the same launch (4 ranks + a spare, the supervisor)
    # without it; the launch's own cost is in-job-no-fault's cost
    in_job["launch_cost_s"] = _less(in_job, rows["in-job-no-fault"], "wall_s")
    rows["relaunch"]["launch_cost_s"] = rows["relaunch"]["cost_s"]
    for ratio, field in (("cost_ratio", "cost_s"), ("loop_cost_ratio", "loop_cost_s"),
                         ("launch_cost_ratio", "launch_cost_s"),
                         ("window_ratio", "fault_to_step_s")):
        relaunch, value = rows["relaunch"].get(field), in_job.get(field)
        both = rows["relaunch"]["ok"] and in_job["ok"] and value is not None
        in_job[ratio] = value / relaunch if both and relaunch else None
    return rows


def _less(row: dict, base: dict, field: str):
    """``row``'s ``field`` less ``base``'s; None unless both jobs finished well."""
    if not (row["ok"] and base["ok"]) or row[field] is None or base[field] is None:
        return None
    return row[field] - base[field]


def _yes_no(value) -> str:
    return "-" if value is None else ("equal" if value else "DIFFER")


def _job_cells(repeat: int, row: dict) -> list:
    rec = row.get("recovery") or {}
    kept = row.get("survivors_kept_pid")
    return [str(repeat), row["job"] + ("" if row["ok"] else " (FAILED)"),
            fmt(row["wall_s"], ".1f"), fmt(row["startup_s"], ".1f"),
            fmt(row.get("cost_s"), ".1f"), fmt(row.get("loop_cost_s"), ".1f"),
            fmt(row.get("launch_cost_s"), ".1f"),
            fmt(row.get("fault_to_step_s"), ".2f"), fmt(row.get("cost_ratio"), ".2f"),
            fmt(row.get("loop_cost_ratio"), ".2f"), fmt(row.get("launch_cost_ratio"), ".2f"),
            fmt(row.get("window_ratio"), ".2f"),
            _yes_no(row["losses_equal"]),
            f"{rec['source']} @ {rec['iteration']}" if rec else "-",
            fmt(rec.get("seconds_since_progress"), ".2f"), fmt(rec.get("load_s"), ".3f"),
            "-" if kept is None else f"{kept[0]} of {kept[1]} kept"]


JOB_HEADER = ["repeat", "job", "wall s", "start-up s", "cost s", "loop cost s",
              "launch cost s", "fault->step s", "cost ratio", "loop ratio", "launch ratio",
              "step ratio", "losses",
              "recovered", "since progress s", "load s", "survivors' pids"]


def _phase_table(repeats: list) -> list:
    columns = [(i + 1, job) for i in range(len(repeats)) for job in FAILED_JOBS]
    table = [["seconds after the fault"] + [f"{job} #{r}" for r, job in columns]]
    for phase in PHASE_ORDER:
        cells = [fmt(repeats[r - 1][job]["phases_s"].get(phase), ".2f") for r, job in columns]
        if any(c != "-" for c in cells):
            table.append([phase] + cells)
    return table


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(repeats: list) -> dict:
    """Medians over the repeats: each failed job's costs and fault-to-step time, and the
    in-job/relaunch ratios of each repeat."""
    out = {}
    for job in FAILED_JOBS:
        for field in ("cost_s", "loop_cost_s", "launch_cost_s", "fault_to_step_s"):
            out[f"{job}_{field}"] = _median([r[job].get(field) for r in repeats])
    out["in-job-no-fault_cost_s"] = _median([r["in-job-no-fault"].get("cost_s") for r in repeats])
    for ratio in ("cost_ratio", "loop_cost_ratio", "launch_cost_ratio", "window_ratio"):
        out[ratio] = _median([r["in-job"].get(ratio) for r in repeats])
    out["all_equal"] = all(r[j]["losses_equal"] for r in repeats for j in JOBS[1:])
    return out


def print_report(opts, command: str, repeats: list, total: dict) -> None:
    launch.print_header(f"One {opts.fault}: relaunch against in-job restart with a hot "
                        "spare", command)
    watched = (f"; every job --moc-monitor --moc-hang-timeout {opts.hang_timeout:g}"
               if opts.fault == "hang" else "")
    print(f"jobs: configs/tiny.yaml, {opts.ranks} training ranks (EP 2), {opts.iters} "
          f"iterations, a two-level snapshot every iteration; relaunch and in-job: "
          f"{opts.fault}@{opts.crash_at}:rank=1{watched}; in-job jobs: {opts.ranks} ranks + 1 spare under "
          "MoC's supervisor; gloo on CPU")
    table = [JOB_HEADER] + [_job_cells(i + 1, rows[job]) for i, rows in enumerate(repeats)
                            for job in JOBS]
    print_aligned(table)
    print()
    print_aligned(_phase_table(repeats))
    print()
    print(f"median over {len(repeats)} repeat(s), in-job against relaunch: cost "
          f"{fmt(total['in-job_cost_s'], '.1f')} s / {fmt(total['relaunch_cost_s'], '.1f')} s "
          f"= {fmt(total['cost_ratio'], '.2f')} (the issue's target: <= 0.25); loop cost "
          f"{fmt(total['in-job_loop_cost_s'], '.1f')} s / {fmt(total['relaunch_loop_cost_s'], '.1f')}"
          f" s = {fmt(total['loop_cost_ratio'], '.2f')}; launch cost "
          f"{fmt(total['in-job_launch_cost_s'], '.1f')} s / {fmt(total['relaunch_cost_s'], '.1f')}"
          f" s = {fmt(total['launch_cost_ratio'], '.2f')}; fault->step "
          f"{fmt(total['in-job_fault_to_step_s'], '.2f')} s / "
          f"{fmt(total['relaunch_fault_to_step_s'], '.2f')} s = {fmt(total['window_ratio'], '.2f')}")
    print(f"the in-job launch without a fault cost {fmt(total['in-job-no-fault_cost_s'], '.1f')} s "
          "more than the fault-free job (the supervisor's and the spare's start-up, paid once "
          "per job whether or not a failure comes)")
    print("every loss equal to the fault-free job's: "
          f"{'yes' if total['all_equal'] else 'NO'}")
    for rows in repeats:
        for row in rows.values():
            if not row["ok"]:
                print(f"\n{row['job']} failed (exit {row['rc']}"
                      f"{', timed out' if row['timed_out'] else ''}); its last lines:\n"
                      f"{row.get('log_tail', '')}")


def main() -> int:
    opts = build_parser().parse_args()
    setup = launch.job_run_setup(opts, "moc-restart-bench-", _checked(opts))
    if setup is None:
        return 2
    out, created, data, command = setup
    repeats = [run_repeat(opts, data, out, r) for r in range(opts.repeats)]
    total = summary(repeats)
    print_report(opts, command, repeats, total)
    with open(os.path.join(out, RESULTS), "w") as f:
        json.dump({"command": command, "options": vars(opts), "summary": total,
                   "repeats": repeats}, f, indent=1)
    if opts.out_dir:  # the user's directory: every job's files and the JSON stay
        print(f"kept {out}: {RESULTS} (every measurement), r<N>/<job>/ (log.txt with arrival "
              "times, metrics.jsonl, ckpt/ with moc-events.jsonl, command.txt)")
    else:
        finish_out_dir(out, created, keep=False)
    ok = all(row["ok"] for rows in repeats for row in rows.values())
    return 0 if ok and total["all_equal"] else 1


if __name__ == "__main__":
    launch.exit_after(main)
