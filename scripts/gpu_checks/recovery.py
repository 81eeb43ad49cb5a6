"""``memory_recovery`` and ``exact_replay``: one rank trained twice on the same corpus,
uninterrupted and then with a crash under ``scripts/run_elastic.sh`` (torchrun restarts
it, it resumes from ``--load``), and what the crashed run recovered compared with the
uninterrupted one, to the bit."""

import os
import time
from typing import List, Optional

from gpu_checks.common import (FAIL, PASS, TINY, CheckResult, Context, child_env, compare_losses,
                               ensure_corpus, events, losses, one_rank_env, outcome, result,
                               run_capped, stop_keepers_under)


def run_pair(ctx: Context, log: str, cap_s: float, base: List[str], ref: str, run: str,
             max_restarts: str, crash_flags: List[str], shm: Optional[str] = None,
             nproc: str = "1") -> Optional[str]:
    """The uninterrupted run (``pretrain_gpt_moe.py``, one rank, checkpoints and metrics
    under ``ref``), then the crashed one (``run_elastic.sh NPROC max_restarts``, under
    ``run``, with ``crash_flags``; the keepers under ``shm`` stopped after it), both
    within ``cap_s`` from now. Returns why one failed, or None."""
    start = time.monotonic()
    rc, timed_out, _ = run_capped([ctx.python, "pretrain_gpt_moe.py", *base, "--save",
                                   os.path.join(ref, "ckpt"), "--metrics-file",
                                   os.path.join(ref, "m.jsonl")],
                                  log, cap_s - (time.monotonic() - start), one_rank_env(ctx))
    if timed_out or rc != 0:
        return f"uninterrupted run {outcome(rc, timed_out)}"
    ckpt = os.path.join(run, "ckpt")
    try:
        rc, timed_out, _ = run_capped(
            ["bash", "scripts/run_elastic.sh", nproc, max_restarts, *base, "--save", ckpt,
             "--load", ckpt, "--metrics-file", os.path.join(run, "m.jsonl"), *crash_flags],
            log, cap_s - (time.monotonic() - start), child_env({"OMP_NUM_THREADS": "2"}))
    finally:
        if shm is not None:
            stop_keepers_under(shm)
    if timed_out or rc != 0:
        return f"crashed run {outcome(rc, timed_out)}"
    return None


def recovery_events(ckpt: str) -> List[dict]:
    """The crashed run's ``recovery`` events."""
    return [e for e in events(ckpt) if e["kind"] == "recovery"]


def recovery_metrics(recoveries: List[dict]) -> List[dict]:
    """What the summary keeps of each recovery event."""
    return [{k: r.get(k) for k in ("source", "iteration", "seconds", "iterations_lost")}
            for r in recoveries]


def check_memory_recovery(ctx: Context, cap_s: float) -> CheckResult:
    """PASS when a crash at 7 is recovered once, from the keeper's memory, and every loss
    equals the uninterrupted run's (``--deterministic``, two-level every iteration)."""
    name = "memory_recovery"
    log = os.path.join(ctx.work, f"{name}.log")
    start = time.monotonic()
    corpus = ensure_corpus(ctx, log)
    base = TINY + ["--eval-iters", "0", "--data-path", corpus, "--deterministic",
                   "--moc-checkpoint", "--save-interval", "4"]
    ref, run = os.path.join(ctx.work, "recovery-ref"), os.path.join(ctx.work, "recovery")
    shm = f"/dev/shm/moc-gpu-check-{os.getpid()}"
    failed = run_pair(ctx, log, cap_s - (time.monotonic() - start), base, ref, run, "2",
                      ["--moc-two-level", "--moc-snapshot-interval", "1",
                       "--moc-persist-interval", "4", "--moc-shm-dir", shm,
                       "--moc-fault", "crash@7:rank=0"], shm)
    if failed:
        return result(name, FAIL, failed)
    recoveries = recovery_events(os.path.join(run, "ckpt"))
    differ = compare_losses(losses(os.path.join(ref, "m.jsonl")), losses(os.path.join(run, "m.jsonl")))
    metrics = dict(ranks=1, recoveries=recovery_metrics(recoveries),
                   losses_compared=len(losses(os.path.join(ref, "m.jsonl"))))
    if len(recoveries) != 1 or recoveries[0].get("source") != "memory":
        return result(name, FAIL, f"expected one recovery from memory, got "
                      f"{[r.get('source') for r in recoveries]}", **metrics)
    if differ:
        return result(name, FAIL, f"losses differ: {differ}", **metrics)
    return result(name, PASS, f"crash at 7, recovered iteration {recoveries[0]['iteration']} from "
                  f"memory; {metrics['losses_compared']} losses equal to the uninterrupted run's "
                  "to the bit (--deterministic, 1 rank)", **metrics)


def check_exact_replay(ctx: Context, cap_s: float) -> CheckResult:
    """PASS when a crash at 9 under ``--moc-mode exact`` is replayed once, and every tensor
    of the final checkpoint and every loss equal the uninterrupted run's."""
    name = "exact_replay"
    log = os.path.join(ctx.work, f"{name}.log")
    start = time.monotonic()
    corpus = ensure_corpus(ctx, log)
    base = TINY + ["--train-iters", "12", "--eval-interval", "5", "--eval-iters", "1",
                   "--data-path", corpus, "--moc-checkpoint", "--save-interval", "100",
                   "--moc-mode", "exact", "--moc-window", "3"]
    ref, run = os.path.join(ctx.work, "exact-ref"), os.path.join(ctx.work, "exact")
    failed = run_pair(ctx, log, cap_s - (time.monotonic() - start), base, ref, run, "3",
                      ["--moc-fault", "crash@9:rank=0"])
    if failed:
        return result(name, FAIL, failed)
    recoveries = recovery_events(os.path.join(run, "ckpt"))
    metrics = dict(ranks=1, recoveries=recovery_metrics(recoveries))
    if len(recoveries) != 1 or "exact replay" not in str(recoveries[0].get("source")):
        return result(name, FAIL, f"expected one exact replay, got "
                      f"{[r.get('source') for r in recoveries]}", **metrics)
    want, got = final_tensors(os.path.join(ref, "ckpt")), final_tensors(os.path.join(run, "ckpt"))
    import torch
    differ = [k for k in want if k not in got or not torch.equal(want[k], got[k])]
    metrics["tensors_compared"] = len(want)
    loss_diff = compare_losses(losses(os.path.join(ref, "m.jsonl")), losses(os.path.join(run, "m.jsonl")))
    if differ or want.keys() != got.keys():
        return result(name, FAIL, f"{len(differ)} of {len(want)} final tensors differ, e.g. "
                      f"{differ[:3]}", **metrics)
    if loss_diff:
        return result(name, FAIL, f"losses differ: {loss_diff}", **metrics)
    return result(name, PASS, f"crash at 9, {recoveries[0]['source']} at iteration "
                  f"{recoveries[0]['iteration']}; all {len(want)} final tensors and every loss "
                  "equal to the uninterrupted run's to the bit (1 rank)", **metrics)


def final_tensors(root: str) -> dict:
    """Every tensor of the checkpoint ``global_step12`` under ``root``, by key."""
    from deepspeed_ext.store.reader import CheckpointReader
    with CheckpointReader(root, "global_step12") as reader:
        return {key: reader.read_full(*key) for key in reader.keys()}
