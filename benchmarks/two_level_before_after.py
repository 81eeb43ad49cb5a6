#!/usr/bin/env python
"""The two-level benchmark on an earlier commit and on this tree, alternated, side by side.

A change that touches the snapshot path must show that training did not get slower: this
runs ``benchmarks/two_level_bench.py`` (with the arguments after ``--``) from a temporary
git worktree of ``--before`` and from this working tree, alternating ``--rounds`` times
(before, after, before, after, ...) so that the machine's drift hits both alike, and
prints every MoC row's median stall and iteration overhead per round, side by side, and
where the snapshot's time went: the median of the step's wait for the snapshot (``moc.stall_s``,
the part of the stall after the save call, in both trees), of its host wait and of the checksum
(``TwoLevel.timings``, ``-`` from a tree that records none). When the checksum leaves the
step's path, the step's wait falls by the checksum's time. It asserts nothing. Both trees
get the same arguments: give only flags both know, and ``--iters`` explicitly (its
default went from 20 to 30 with ``--warmup``).

    python benchmarks/two_level_before_after.py --before f3db971 --rounds 2 -- \
        --systems moc-full,moc-pec --intervals 1,10
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join("benchmarks", "two_level_bench.py")


def run_bench(root: str, args, out_json: str) -> list:
    """One benchmark run from the tree at ``root``; returns its rows (empty: it failed)."""
    command = [sys.executable, os.path.join(root, BENCH), *args, "--json", out_json]
    print(f"$ (cd {root}) {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    tail = done.stdout.splitlines()[-60:]  # both tables and the notes
    print("\n".join(tail), flush=True)
    if done.returncode != 0 or not os.path.exists(out_json):
        print(f"run failed (exit {done.returncode})", flush=True)
        return []
    with open(out_json) as f:
        return json.load(f)


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def cell(row) -> str:
    """One run's figures for one MoC row: stall median (ms), overhead, then the medians
    of the step's wait, its host wait and the checksum (ms; ``-`` where not measured)."""
    if row is None or row.get("stall_s_median") is None:
        return "failed"
    overhead = row.get("iter_overhead")
    stages = row.get("stages_median") or {}
    return (f"{_ms(row['stall_s_median'])}, "
            + ("-" if overhead is None else f"{100 * overhead:+.1f} %")
            + f", {_ms(row.get('wait_s_median'))}, {_ms(stages.get('host_wait'))}, "
              f"{_ms(stages.get('checksum'))}")


def print_side_by_side(before: str, rounds: int, runs: list) -> None:
    """Every MoC row (system, interval) of any run, one column per run."""
    print(f"\nbefore = {before}, after = this tree; {rounds} rounds alternated")
    print("each cell: stall median (ms), iteration overhead, the step's wait median (ms: the "
          "optimizer step's waits for the snapshot, moc.stall_s, in both trees), host wait median (ms), "
          "checksum median (ms)")
    keys = []
    for run in runs:
        for row in run["rows"]:
            key = (row["system"], row.get("interval"))
            if row["system"].startswith("moc") and key not in keys:
                keys.append(key)
    cells = [["system", "every"] + [f"{r['label']} {r['round'] + 1}" for r in runs]]
    for system, interval in keys:
        cells.append([system, str(interval)] + [
            cell(next((r for r in run["rows"] if (r["system"], r.get("interval")) == (system, interval)),
                      None)) for run in runs])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="commit to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs to run")
    parser.add_argument("--json", help="write every round's rows here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="arguments for two_level_bench.py, after --")
    opts = parser.parse_args()
    bench_args = [a for a in opts.bench_args if a != "--"]
    work = tempfile.mkdtemp(prefix="moc-before-after-")
    worktree = os.path.join(work, "before")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", worktree, opts.before],
                   check=True, stdout=subprocess.DEVNULL)
    runs = []
    try:
        for round_ in range(opts.rounds):
            for label, root in (("before", worktree), ("after", REPO)):
                rows = run_bench(root, bench_args, os.path.join(work, f"{label}{round_}.json"))
                runs.append({"label": label, "round": round_, "rows": rows})
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree],
                       stdout=subprocess.DEVNULL)
    print_side_by_side(opts.before, opts.rounds, runs)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"before": opts.before, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
