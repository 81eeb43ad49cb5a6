#!/usr/bin/env python
"""The checks of ``scripts/gpu_check.sh``: MoC's CUDA paths on one GPU, each under a time
cap, with one JSON summary and a ``PASS``/``FAIL``/``SKIP`` line per check.

Run by ``gpu_check.sh`` after its offline install (which passes the install's outcome in
``--install-*``); it can be run alone where the project's dependencies are importable.
One process, no rank of its own: every check starts its own processes (pytest, the
benchmarks, training jobs under ``scripts/run_elastic.sh``) in a process group of their
own, killed whole when the check's cap runs out, so a hung check costs its cap and no
more. The checks, in the order they run (cheapest and most basic first, the benchmark
that writes tens of GB last):

1. ``cuda_unit_tests``: the tests marked skip-without-CUDA (``scripts/pytest_cuda_only.py``).
2. ``ranks_per_gpu``: which backends and collectives two ranks sharing one GPU can use.
3. ``snapshot_bandwidth``: ``benchmarks/hostcopy_bench.py``: the snapshot copy into the
   registered shared-memory slot against a plain pinned copy of the same bytes (>= 0.8x).
4. ``memory_recovery``: a crash, torchrun's restart, recovery from the keeper's memory,
   and the losses after it equal (bitwise, ``--deterministic``) to an uninterrupted run's.
5. ``exact_replay``: ``--moc-mode exact``: a crash mid-window, the replay, and every
   tensor of the final checkpoint and every loss equal to the uninterrupted run's.
6. ``in_job_restart``: issue 37's rows (one GPU shows no multi-rank recovery): the
   survivor's group cycle five times in one process (the round's groups, an
   all-reduce, ``abort_communicators``, ``close_process_groups``), and a hot spare
   taking rank 0 over after a crash at 7 (1 rank + 1 spare, ``--moc-restart in-job``),
   recovering from memory with every loss equal to the bit.
7. ``checkpoint_stall``: ``benchmarks/two_level_bench.py`` on an 84 M-parameter GPT-MoE,
   one rank (EP 1), a checkpoint every iteration, 30 timed: MoC's stall against DeepSpeed's
   ``save_checkpoint``, the iteration overhead (A/B/A), the slot preparation at start-up
   and the median of each snapshot stage.
8. ``checkpoint_stall_large``: the same benchmark, ``moc-full`` only, on a 757 M-parameter
   GPT-MoE (9.1 GB of fp32 master weights and Adam moments on the one rank), a snapshot
   every 4 iterations: the stall against the save call (within a few ms) and the copy's
   GB/s against a pinned copy's (>= 0.8x; ``snapshot_bandwidth``'s, else measured here).

The checks live in ``scripts/gpu_checks/`` (one module per check or pair of checks, a
common module, the summary, the runner); this file is the command line.

Modes: ``auto`` (CUDA when present; without it every check is SKIP, naming why),
``cpu`` (the checks that can run on CPU do, at CPU sizes: exercises this script end to
end on a machine without a GPU; their verdicts say nothing about CUDA), ``--dry-run``
(nothing runs; the summary's shape only).
"""

import argparse
import os
import shutil
import sys
import time

# scripts/ on the path: the checks are the package scripts/gpu_checks, next to this file
# (without this, loading the file by path, as the tests do, could not import them).
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from gpu_checks.common import FAIL, PASS, REPO, SKIP, CheckResult  # noqa: E402
from gpu_checks.ranks import probe_rank  # noqa: E402
from gpu_checks.runner import CHECKS, Run, finish, run_checks  # noqa: E402
from gpu_checks.summary import environment, header, line, summary_paths  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["auto", "cpu"], default="auto",
                   help="auto: the CUDA checks where CUDA is present, else each SKIP; cpu: "
                        "run what can run on CPU, at CPU sizes.")
    p.add_argument("--dry-run", action="store_true", help="Run nothing; every check SKIP.")
    p.add_argument("--only", default="", help="Comma list of checks to run (the rest SKIP).")
    p.add_argument("--budget-s", type=float, default=None,
                   help="Seconds all checks together may take (default: the sum of their "
                        "caps).")
    p.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK", "/tmp/moc-gpu-check"),
                   help="Scratch directory (emptied first).")
    p.add_argument("--summary-dir", default=os.path.join(REPO, "benchmarks", "gpu"),
                   help="Where <date>-<device>.json goes (and to $OUT when set).")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--install-status", default=SKIP, choices=[PASS, FAIL, SKIP])
    p.add_argument("--install-reason", default="not run by gpu_check.sh")
    p.add_argument("--install-seconds", type=float, default=0.0)
    p.add_argument("--probe-rank", nargs=3, metavar=("BACKEND", "DEVICE", "OUT"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    """The run: the environment, the install's line, every check's, the summary; exit
    status 1 if anything failed, 2 for an unknown ``--only`` check. ``--probe-rank`` is
    one rank of ``ranks_per_gpu``'s probe instead."""
    args = parse_args(argv)
    if args.probe_rank:
        return probe_rank(*args.probe_rank)
    started = time.monotonic()
    import torch
    cuda = torch.cuda.is_available()
    mode = "dry-run" if args.dry_run else ("cpu" if args.mode == "cpu" else "cuda" if cuda else "no-cuda")
    env = environment(mode, args.commit)
    install = CheckResult("install", args.install_status, args.install_reason,
                          seconds=args.install_seconds)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    run = Run(mode, env, install, summary_paths(args.summary_dir, env), started)
    print(header(env), flush=True)
    print(line(install), flush=True)
    only = {c for c in args.only.split(",") if c}
    unknown = only - {c.name for c in CHECKS}
    if unknown:
        print(f"error: --only: unknown check(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    results = run_checks(run, only, args.budget_s, args.work)
    return finish(run, results, args.work)


if __name__ == "__main__":
    sys.exit(main())
