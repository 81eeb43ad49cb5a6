#!/usr/bin/env python
"""Seeded trials of the in-job restart: each kills a process of a small job at a random
moment (a training rank, the spare, or a second rank during the recovery) and checks
that the job still finishes with every loss of the fault-free run, in place or through
the relaunch it falls back to.

    python benchmarks/restart_trials.py [--trials 20] [--seed 1] [--ranks 2|4]
        [--iters 12] [--refill] [--pipeline] [--out-dir DIR]

Every job runs ``pretrain_gpt_moe.py`` under ``scripts/run_elastic.sh NPROC 1`` with
``--moc-restart in-job --moc-spares 1`` (NPROC = ranks + 1: one hot spare; MAX_RESTARTS
1: a relaunch when the supervisor gives up), ``configs/tiny.yaml``, EP 2, a two-level
snapshot every iteration (``--pipeline``: two pipeline stages in exact mode with upstream
logs, where a crash replays only its stage when it can), on the quickstart's corpus. A
fault-free job first gives the reference losses. Each trial draws, from
``random.Random(seed * 1000 + trial)``:

- ``rank`` (8 in 20): a random training rank is SIGKILLed a random 0-150 ms after a
  random iteration's log line (iterations 2 to ``--iters`` - 2): the spare takes it;
- ``spare`` (3 in 20): the waiting spare is SIGKILLed at such a moment: the job goes on
  without one;
- ``second`` (5 in 20): as ``rank``, then a random other training process of the new
  round is SIGKILLed a random 0-300 ms after the supervisor wrote it (during the
  recovery): no spare is left, so the supervisor stops the job and ``run_elastic.sh``
  relaunches it, which recovers from the keeper's memory or storage (with ``--refill``,
  the first death's slot has a new spare by then, which takes the rank in place);
- ``stop`` (4 in 20): a random training rank is SIGSTOPped at such a moment (a hang its
  own watchdog cannot end): the others' watchdogs (every job runs ``--moc-monitor
  --moc-hang-timeout 2``) find it and ask the supervisor, which SIGKILLs it; the spare
  takes it.

The kills come from this script, from outside the job (the pids are read from the
supervisor's start line and its round lines), so they land anywhere in the processes'
work: inside a collective, a snapshot, a persist hand-over, a recovery. A trial passes
when the job exits 0 and each iteration's last logged loss equals the reference's to the
bit. The table says how each trial went (in place, relaunched) and its wall time;
``trials.json`` in the output directory keeps every row. Nothing is asserted about
times; the exit status is 1 when a trial failed.
"""

import argparse
import json
import os
import random
import re
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.ranks import finish_out_dir  # noqa: E402
from benchlib.job_files import elastic_job_command, final_losses  # noqa: E402
from benchlib.stamped_job import run_stamped  # noqa: E402
from benchlib.tables import print_aligned  # noqa: E402

KINDS = ("rank",) * 8 + ("spare",) * 3 + ("second",) * 5 + ("stop",) * 4
STARTED = re.compile(r"\[moc supervisor\] store .* started (.*?): ")
SLOT_PID = re.compile(r"slot (\d+) pid (\d+) \((rank \d+|spare)\)")
ROUND = re.compile(r"\[moc supervisor\] slot \d+ .*: round (\d+), rank (\d+) -> slot (\d+)")
ANY_ROUND = re.compile(r"\[moc supervisor\] slot \d+ .*: round \d+, ")
ITERATION = re.compile(r"^\s*iteration\s+(\d+)/")
RESULTS = "trials.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Seeded random kills of an in-job restart job.")
    p.add_argument("--trials", type=int, default=20, help="Number of trials.")
    p.add_argument("--seed", type=int, default=1, help="Seed of the trials' draws.")
    p.add_argument("--ranks", type=int, choices=(2, 4), default=2,
                   help="Training ranks (EP 2); every job has one spare more.")
    p.add_argument("--iters", type=int, default=12, help="Training iterations per job.")
    p.add_argument("--refill", action="store_true",
                   help="Every job with --moc-refill-spares: a dead process's slot gets a new "
                        "spare, so a second kill is recovered in place too.")
    p.add_argument("--pipeline", action="store_true",
                   help="Two pipeline stages (--ranks 4: 2 ranks each) in exact mode with "
                        "upstream logs instead of two-level snapshots: a crash replays only "
                        "its stage when it can (the table counts those as localized).")
    p.add_argument("--out-dir", metavar="DIR",
                   help=f"Where every job's log, metrics and {RESULTS} go, kept (default: a "
                        "temporary directory, deleted at the end).")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    p.add_argument("--timeout", type=float, default=300, help="Seconds per job.")
    return p


def draw(seed: int, trial: int, ranks: int, iters: int) -> dict:
    """The trial's fault: its kind, the rank (or spare) killed, after which iteration's
    line, the delays, and the second victim's pick."""
    rng = random.Random(seed * 1000 + trial)
    return {"kind": rng.choice(KINDS), "rank": rng.randrange(ranks),
            "after_iteration": rng.randint(2, max(2, iters - 2)),
            "delay_s": round(rng.uniform(0.0, 0.15), 3),
            "second_delay_s": round(rng.uniform(0.0, 0.3), 3), "second_pick": rng.random()}


class Killer:
    """Reads the job's lines as they come and SIGKILLs the trial's victims (reader thread;
    the kill itself runs on a timer thread, so the reader never sleeps)."""

    def __init__(self, fault: dict, ranks: int):
        self.fault, self.ranks = fault, ranks
        self.slots = {}  # slot -> pid
        self.rank_slot = {}  # rank -> slot, as the rounds move ranks
        self.spare_slot = None
        self.killed = []
        self.first_done = self.second_done = False

    def on_line(self, now: float, text: str) -> None:
        started = STARTED.search(text)
        if started and not self.slots:  # the first supervisor's start line only
            for slot, pid, role in SLOT_PID.findall(started.group(1)):
                self.slots[int(slot)] = int(pid)
                if role == "spare":
                    self.spare_slot = int(slot)
                else:
                    self.rank_slot[int(role.split()[1])] = int(slot)
            return
        moved = ROUND.search(text)
        if moved:
            self.rank_slot[int(moved.group(2))] = int(moved.group(3))
            if self.fault["kind"] == "second" and self.first_done and not self.second_done:
                self.second_done = True
                dead = set(s for s, _ in self.killed)
                alive = sorted(s for s in self.rank_slot.values() if s not in dead)
                victim = alive[int(self.fault["second_pick"] * len(alive))]
                self._later(self.fault["second_delay_s"], victim, "second")
            return
        it = ITERATION.match(text)
        if it and not self.first_done and int(it.group(1)) == self.fault["after_iteration"]:
            self.first_done = True
            slot = self.spare_slot if self.fault["kind"] == "spare" else \
                self.rank_slot.get(self.fault["rank"])
            if slot is not None:
                stop = self.fault["kind"] == "stop"
                self._later(self.fault["delay_s"], slot, "first",
                            signal.SIGSTOP if stop else signal.SIGKILL)

    def _later(self, delay: float, slot: int, which: str, signum=signal.SIGKILL) -> None:
        def kill():
            try:
                os.kill(self.slots[slot], signum)
                self.killed.append((slot, which))
            except (KeyError, ProcessLookupError):
                pass  # already gone (it finished, or the job stopped it)
        threading.Timer(delay, kill).start()


PIPELINE = ("--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--expert-interval", "1",
            "--moc-mode", "exact", "--moc-window", "2", "--moc-upstream-logging")
"""``--pipeline``'s job: two stages, every layer MoE (a stage needs one), frames every
iteration in windows of 2, upstream logs."""
LOCALIZED = re.compile(r"\[moc\] recovered in .* localized in-job: stage")


def job_command(opts, data: str, job_dir: str, shm: str) -> list:
    refill = ["--moc-refill-spares"] if opts.refill else []
    return elastic_job_command(opts.ranks + 1, 1, data, opts.iters, job_dir, shm, [
        "--moc-restart", "in-job", "--moc-spares", "1", *refill,
        "--moc-monitor", "--moc-hang-timeout", "2", "--moc-monitor-poll", "0.25",
        *(PIPELINE if opts.pipeline else ())], two_level=not opts.pipeline)


def run_trial(opts, data: str, out: str, name: str, fault) -> dict:
    """One job (``fault`` None: the reference); its row."""
    job_dir = os.path.join(out, name)
    os.makedirs(job_dir)
    shm = f"/dev/shm/moc-restart-trials-{os.getuid()}-{os.getpid()}-{name}"
    killer = Killer(fault, opts.ranks) if fault else None
    run = run_stamped(job_command(opts, data, job_dir, shm), os.path.join(job_dir, "log.txt"),
                      shm, opts.timeout, env_extra={"PYTHONUNBUFFERED": "1"},
                      on_line=killer.on_line if killer else None)
    texts = [text for _, text in run.lines]
    return {"name": name, "fault": fault, "rc": run.rc, "timed_out": run.timed_out,
            "wall_s": round(run.wall_s, 2), "killed": killer.killed if killer else [],
            "rounds": sum(bool(ANY_ROUND.search(t)) for t in texts),
            "relaunched": sum(bool(STARTED.search(t)) for t in texts) > 1,
            "localized": sum(bool(LOCALIZED.search(t)) for t in texts),
            "losses": final_losses(job_dir), "leftover": run.leftover}


def judge(row: dict, reference: dict) -> dict:
    row["equal"] = row["rc"] == 0 and row["losses"] == reference and bool(reference)
    row["outcome"] = ("FAILED" if not row["equal"] else "relaunched" if row["relaunched"]
                      else "in place" if row["rounds"] else "no fault landed")
    if row["equal"] and row.get("localized"):
        row["outcome"] += ", localized"
    return row


def print_report(opts, command: str, reference: dict, rows: list) -> None:
    launch.print_header("Seeded kills of an in-job restart job", command)
    mode = ("2 pipeline stages, exact mode (W = 2) with upstream logs" if opts.pipeline
            else "a two-level snapshot every iteration")
    print(f"jobs: configs/tiny.yaml, {opts.ranks} training ranks (EP 2) + 1 spare"
          f"{' (refilled after each death: --moc-refill-spares)' if opts.refill else ''}, "
          f"{opts.iters} iterations, {mode}, --moc-monitor "
          f"--moc-hang-timeout 2, run_elastic.sh MAX_RESTARTS 1; reference: {reference['wall_s']} s, "
          f"{len(reference['losses'])} iterations")
    table = [["trial", "fault", "after it.", "killed (slot)", "rounds", "outcome", "wall s",
              "losses"]]
    for row in rows:
        f = row["fault"]
        what = "spare" if f["kind"] == "spare" else \
            f"rank {f['rank']}" + {"second": " + a second", "stop": " stopped"}.get(f["kind"], "")
        table.append([row["name"], what, str(f["after_iteration"]),
                      " ".join(f"{s}" for s, _ in row["killed"]) or "-", str(row["rounds"]),
                      row["outcome"], f"{row['wall_s']:.1f}",
                      "equal" if row["equal"] else "DIFFER"])
    print_aligned(table)
    passed = sum(row["equal"] for row in rows)
    print(f"\n{passed} of {len(rows)} trials finished with every loss equal to the "
          f"fault-free run's (in place: {sum(r['outcome'].startswith('in place') for r in rows)}"
          f"{', of them localized: ' + str(sum(r['outcome'].endswith('localized') for r in rows)) if opts.pipeline else ''}, "
          f"relaunched: {sum(r['outcome'].startswith('relaunched') for r in rows)})")


def main() -> int:
    opts = build_parser().parse_args()
    bad = "--trials must be at least 1 and --iters at least 4" \
        if opts.trials < 1 or opts.iters < 4 else None
    if opts.pipeline and opts.ranks != 4:
        bad = "--pipeline needs --ranks 4 (2 ranks per stage: expert parallelism 2 in each)"
    setup = launch.job_run_setup(opts, "moc-restart-trials-", bad)
    if setup is None:
        return 2
    out, created, data, command = setup
    reference = run_trial(opts, data, out, "reference", None)
    rows = []
    for trial in range(opts.trials):
        fault = draw(opts.seed, trial, opts.ranks, opts.iters)
        print(f"[restart-trials] trial {trial}: {fault}", flush=True)
        rows.append(judge(run_trial(opts, data, out, f"t{trial:02d}", fault),
                          reference["losses"]))
        print(f"[restart-trials] trial {trial}: {rows[-1]['outcome']} in "
              f"{rows[-1]['wall_s']} s", flush=True)
    print_report(opts, command, reference, rows)
    with open(os.path.join(out, RESULTS), "w") as f:
        json.dump({"command": command, "options": vars(opts), "reference": reference,
                   "trials": rows}, f, indent=1)
    if opts.out_dir:
        print(f"kept {out}: {RESULTS}, t<N>/ (log.txt, metrics.jsonl, ckpt/)")
    else:
        finish_out_dir(out, created, keep=False)
    return 0 if reference["rc"] == 0 and all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    launch.exit_after(main)
