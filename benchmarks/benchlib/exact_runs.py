"""The training jobs of ``exact_bench.py``: one job under ``scripts/run_elastic.sh``
(:func:`run_job`, through :func:`benchlib.stamped_job.run_stamped`, which also cleans up
what its MoC keepers leave in ``/dev/shm``)."""

import os
import shlex
import shutil

from benchlib.stamped_job import run_stamped

NEVER = 10 ** 6
"""--save-interval / --eval-interval that a run never reaches."""


def policy_flags(name: str, save_interval: int) -> list:
    """The trainer flags of a policy (besides the common ones of :func:`run_job`)."""
    every = str(save_interval)
    return {
        "none": ["--save-interval", str(NEVER)],
        "exact": ["--moc-mode", "exact", "--save-interval", str(NEVER)],
        "exact-w4": ["--moc-mode", "exact", "--moc-window", "4", "--save-interval", str(NEVER)],
        "pec-dynamic": ["--moc-pec-k", "1", "--moc-dynamic-k", "--save-interval", every],
        "two-level-full": ["--moc-two-level", "--moc-snapshot-interval", "1",
                           "--moc-persist-interval", every, "--save-interval", every],
    }[name]


POLICIES = ("none", "exact", "exact-w4", "pec-dynamic", "two-level-full")


def run_job(name: str, policy: str, opts, data: str, run_dir: str, restarts: int,
            extra: list, iters: int) -> dict:
    """One training job under scripts/run_elastic.sh; returns the raw run (lines stamped
    with the wall clock, exit code, paths)."""
    os.makedirs(run_dir)
    ckpt = os.path.join(run_dir, "ckpt")
    phase = os.path.basename(os.path.dirname(run_dir))
    shm = f"/dev/shm/moc-exact-bench-{os.getuid()}-{os.getpid()}-{phase}-{os.path.basename(run_dir)}"
    shutil.rmtree(shm, ignore_errors=True)
    cmd = ["bash", "scripts/run_elastic.sh", str(opts.nproc), str(restarts),
           "--config", opts.config, "--data-path", data,
           "--train-iters", str(iters), "--lr-decay-iters", str(iters),
           "--eval-interval", str(NEVER), "--eval-iters", "1", "--log-interval", "1",
           "--save", ckpt, "--load", ckpt,
           "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
           "--moc-checkpoint", "--moc-shm-dir", shm,
           *policy_flags(policy, opts.save_interval), *extra]
    run = run_stamped(cmd, os.path.join(run_dir, "log.txt"), shm, opts.timeout)
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    return {"name": name, "policy": policy, "rc": run.rc, "timed_out": run.timed_out,
            "wall_s": run.wall_s, "start": run.start, "lines": run.lines, "run_dir": run_dir,
            "ckpt": ckpt, "iters": iters, "command": shlex.join(cmd), "leftover": run.leftover}
