"""What a finished training job left in its directory, as the restart benchmarks read it:
JSON-lines files (the metrics file, ``moc-events.jsonl``) and each iteration's final
loss. Used by restart_bench and restart_trials."""

import json
import os


def json_lines(path: str) -> list:
    """The records of a JSON-lines file; [] when it does not exist (the job died first)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_losses(job_dir: str) -> dict:
    """{iteration: lm loss} of the job's ``metrics.jsonl``, the last record of each
    iteration (a redone iteration's second record replaces its first)."""
    return {r["iteration"]: r["lm_loss"] for r in json_lines(os.path.join(job_dir, "metrics.jsonl"))
            if r.get("kind") == "train"}


NEVER = 10 ** 6
"""--save-interval / --eval-interval that a job never reaches."""


def elastic_job_command(nproc: int, restarts: int, data: str, iters: int, job_dir: str,
                        shm: str, extra=(), two_level: bool = True) -> list:
    """``scripts/run_elastic.sh``'s command line for the restart benchmarks' small job:
    ``configs/tiny.yaml`` on ``data`` for ``iters`` iterations, a two-level snapshot every
    iteration into ``shm`` (``two_level`` False: only the memory directory; ``extra``
    then names the mode), no evaluation or periodic save, ``--save`` = ``--load`` and
    the metrics file in ``job_dir``; ``extra`` flags last."""
    ckpt = os.path.join(job_dir, "ckpt")
    return ["bash", "scripts/run_elastic.sh", str(nproc), str(restarts),
            "--config", "configs/tiny.yaml", "--data-path", data,
            "--train-iters", str(iters), "--lr-decay-iters", str(iters),
            "--eval-interval", str(NEVER), "--eval-iters", "1", "--log-interval", "1",
            "--save", ckpt, "--load", ckpt, "--save-interval", str(NEVER),
            "--metrics-file", os.path.join(job_dir, "metrics.jsonl"),
            "--moc-checkpoint",
            *(("--moc-two-level", "--moc-snapshot-interval", "1") if two_level else ()),
            "--moc-shm-dir", shm, *extra]
