#!/usr/bin/env python
"""Any benchmark on an earlier commit and on this tree, alternated, one after the other.

A refactor must show that nothing got slower: this runs ``benchmarks/BENCH.py`` (with the
arguments after ``--``) from a temporary git worktree of ``--before`` and from this
working tree, alternating ``--rounds`` times (before, after, before, after, ...) so that
the machine's drift hits both alike, and prints the last ``--tail`` lines of each run's
output (its table) under a header naming the tree and the round. It asserts nothing; the
two-level benchmark has its own side-by-side table (two_level_before_after.py).

    python benchmarks/before_after.py checkpoint_bench --before 815b8fc --rounds 1 -- \
        --nproc 2 --ep 2 --repeats 2
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(root: str, bench: str, args, tail: int, out_dir: str) -> int:
    """One run of ``bench`` from the tree at ``root``; prints its last ``tail`` lines."""
    command = [sys.executable, os.path.join(root, "benchmarks", bench + ".py"), *args]
    print(f"$ (cd <{'before' if root != REPO else 'this tree'}>) "
          f"{' '.join(command[1:])}", flush=True)
    env = dict(os.environ, TMPDIR=out_dir)  # each run's scratch stays apart
    done = subprocess.run(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    print("\n".join(done.stdout.splitlines()[-tail:]), flush=True)
    if done.returncode != 0:
        print(f"run failed (exit {done.returncode})", flush=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="benchmark script name in benchmarks/, without .py")
    parser.add_argument("--before", required=True, help="commit to compare against")
    parser.add_argument("--rounds", type=int, default=1, help="before/after pairs to run")
    parser.add_argument("--tail", type=int, default=40, help="lines of each run's output shown")
    argv = sys.argv[1:]
    # Everything after the first "--" goes to the benchmark untouched (argparse's
    # REMAINDER after a positional would swallow this script's own options too).
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    if not os.path.isfile(os.path.join(REPO, "benchmarks", opts.bench + ".py")):
        parser.error(f"no benchmarks/{opts.bench}.py in this tree")
    work = tempfile.mkdtemp(prefix="moc-before-after-")
    worktree = os.path.join(work, "before")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", worktree, opts.before],
                   check=True, stdout=subprocess.DEVNULL)
    if os.path.isdir(os.path.join(REPO, ".venv")):
        # Scripts that start their own ranks (run_elastic.sh) use the tree's .venv; the
        # worktree's Python code still comes first (the script's own directory).
        os.symlink(os.path.join(REPO, ".venv"), os.path.join(worktree, ".venv"))
    failed = 0
    try:
        for round_ in range(opts.rounds):
            for label, root in (("before", worktree), ("after", REPO)):
                print(f"\n=== round {round_ + 1}, {label} "
                      f"({opts.before if label == 'before' else 'this tree'}) ===", flush=True)
                scratch = os.path.join(work, f"{label}{round_}")
                os.makedirs(scratch)
                failed += run_once(root, opts.bench, bench_args, opts.tail, scratch) != 0
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
