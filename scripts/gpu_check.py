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
6. ``checkpoint_stall``: ``benchmarks/two_level_bench.py`` on an 84 M-parameter GPT-MoE,
   one rank (EP 1), a checkpoint every iteration, 30 timed: MoC's stall against DeepSpeed's
   ``save_checkpoint``, the iteration overhead (A/B/A), the slot preparation at start-up
   and the median of each snapshot stage.
7. ``checkpoint_stall_large``: the same benchmark, ``moc-full`` only, on a 757 M-parameter
   GPT-MoE (9.1 GB of fp32 master weights and Adam moments on the one rank), a snapshot
   every 4 iterations: the stall against the save call (within a few ms) and the copy's
   GB/s against a pinned copy's (>= 0.8x; ``snapshot_bandwidth``'s, else measured here).

Modes: ``auto`` (CUDA when present; without it every check is SKIP, naming why),
``cpu`` (the checks that can run on CPU do, at CPU sizes: exercises this script end to
end on a machine without a GPU; their verdicts say nothing about CUDA), ``--dry-run``
(nothing runs; the summary's shape only).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = 1
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--moe-expert-parallel-size", "1"]
BANDWIDTH_MIN_RATIO = 0.8
STALL_GAP_MAX_S = 0.005  # checkpoint_stall_large: the stall at most this past the save call
CPU_CAP_SCALE = 4  # --mode cpu: every cap times this


@dataclass
class CheckResult:
    """One check's outcome: ``status`` is PASS, FAIL or SKIP; ``reason`` one line."""
    name: str
    status: str
    reason: str
    seconds: float = 0.0
    cap_s: float = 0.0
    metrics: Dict[str, object] = field(default_factory=dict)


@dataclass
class Environment:
    """Where the checks ran."""
    mode: str
    device: str
    date: str
    commit: str
    host: str
    python: str
    torch: str
    cuda: Optional[str]
    nccl: Optional[str]
    deepspeed: Optional[str]
    megatron_core: Optional[str]
    shm_free_gib: Optional[float]


@dataclass
class Summary:
    schema: int
    environment: Environment
    install: CheckResult
    checks: List[CheckResult]
    total_s: float
    verdict: str


@dataclass
class Context:
    """What every check gets: the mode, the scratch directory, the deadline."""
    mode: str          # "cuda" or "cpu"
    work: str          # scratch directory of this run
    deadline: float    # time.monotonic() by which every check must be done
    python: str
    corpus: Optional[str] = None  # indexed dataset prefix, made once for the training checks
    pinned_gb_per_s: Optional[float] = None  # snapshot_bandwidth's pinned copy, for the large stall


@dataclass
class Check:
    name: str
    cap_s: float
    run: Callable[[Context, float], CheckResult]


# ------------------------------------------------------------------------------ helpers

def _env(extra: Optional[dict] = None) -> dict:
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + (os.pathsep + path if path else ""))
    env.update(extra or {})
    return env


def run_capped(cmd: List[str], log: str, cap_s: float, env: Optional[dict] = None) -> Tuple[int, bool, float]:
    """Run ``cmd`` in the repository in a new session, output to ``log``; past ``cap_s``
    its whole process group is killed (torchrun, its ranks). Returns (exit code, timed
    out?, seconds)."""
    start = time.monotonic()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, cap_s))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this call started
            except ProcessLookupError:
                pass
            rc = proc.wait()
    return rc, timed_out, time.monotonic() - start


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def stop_keepers_under(root: str) -> None:
    """Stop MoC keepers a killed job left under ``root`` (a ``--moc-shm-dir``, or a
    benchmark's shared-memory root) and remove it: they hold host memory for minutes."""
    if not os.path.isdir(root):
        return
    try:
        from deepspeed_ext.keeper import shutdown_keeper
        for name in os.listdir(root):
            if os.path.isdir(os.path.join(root, name)):
                shutdown_keeper(os.path.join(root, name), 15)
    except Exception:  # the check reports its own failure; cleanup is best effort
        pass
    shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env(ctx: Context) -> dict:
    """The variables a launcher sets for a job of one rank."""
    return _env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "OMP_NUM_THREADS": "2" if ctx.mode == "cpu" else "4"})


def losses(path: str) -> Dict[str, float]:
    """``{"train 5": lm loss, ...}`` of a metrics file; a later record of the same
    iteration (one redone after a restart) replaces the earlier."""
    found = {}
    if os.path.exists(path):
        for line in open(path):
            record = json.loads(line)
            if record.get("kind") in ("train", "valid"):
                found[f"{record['kind']} {record['iteration']}"] = record["lm_loss"]
    return found


def events(ckpt: str) -> List[dict]:
    path = os.path.join(ckpt, "moc-events.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def compare_losses(ref: Dict[str, float], got: Dict[str, float]) -> Optional[str]:
    """None when equal to the bit; else the first difference, as a sentence."""
    if not ref:
        return "the uninterrupted run logged no loss"
    if ref.keys() != got.keys():
        missing = sorted(ref.keys() - got.keys())[:3]
        return f"iterations logged differ (missing after the crash: {missing})"
    for key in ref:
        if ref[key] != got[key]:
            return f"{key}: {got[key]!r} after the crash vs {ref[key]!r} uninterrupted"
    return None


def ensure_corpus(ctx: Context, log: str) -> str:
    """An indexed byte-level dataset of 300 standard-library files (as tests/conftest.py)."""
    if ctx.corpus is None:
        import sysconfig
        prefix = os.path.join(ctx.work, "corpus", "stdlib")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        rc, timed_out, _ = run_capped(
            [ctx.python, "tools/preprocess_data.py", "--input", sysconfig.get_paths()["stdlib"],
             "--input-ext", ".py", "--output-prefix", prefix, "--tokenizer-type",
             "ByteLevelTokenizer", "--append-eod", "--workers", "1", "--max-documents", "300",
             "--exclude-dirs", "site-packages", "dist-packages"], log, 60)
        if rc != 0 or timed_out:
            raise RuntimeError(f"preparing the corpus failed (exit {rc}): {tail(log, 5)}")
        ctx.corpus = prefix + "_text_document"
    return ctx.corpus


def result(name: str, status: str, reason: str, **metrics) -> CheckResult:
    return CheckResult(name, status, reason, metrics=metrics)


# ------------------------------------------------------------------------------- checks

def check_cuda_unit_tests(ctx: Context, cap_s: float) -> CheckResult:
    name = "cuda_unit_tests"
    files = sorted(p for p in glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)
                   if "torch.cuda.is_available" in open(p).read())
    if not files:
        return result(name, FAIL, "no test file checks torch.cuda.is_available")
    log = os.path.join(ctx.work, f"{name}.log")
    junit = os.path.join(ctx.work, "cuda_unit_tests.xml")
    env = _env({"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "scripts"), _env()["PYTHONPATH"]])})
    rc, timed_out, _ = run_capped(
        [ctx.python, "-m", "pytest", "-q", "-p", "pytest_cuda_only", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *[os.path.relpath(f, REPO) for f in files]], log, cap_s, env)
    if timed_out:
        return result(name, FAIL, f"timed out after {cap_s:.0f} s", files=len(files))
    try:
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (OSError, ET.ParseError, AttributeError):
        return result(name, FAIL, f"pytest exit {rc}, no report: {tail(log, 3).strip()}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [c.get("name") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    metrics = dict(files=[os.path.relpath(f, REPO) for f in files], passed=passed,
                   failed=failed, skipped=counts["skipped"])
    if failed or rc not in (0, 5):
        return result(name, FAIL, f"{len(failed)} failed: {', '.join(failed[:4])} (pytest exit {rc})",
                      **metrics)
    if passed == 0:
        why = "no CUDA here" if ctx.mode == "cpu" else "skipped although CUDA is available"
        return result(name, SKIP if ctx.mode == "cpu" else FAIL,
                      f"all {counts['skipped']} CUDA tests skipped ({why})", **metrics)
    return result(name, PASS, f"{passed} CUDA tests passed in {len(files)} files", **metrics)


PROBE_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "barrier")


def probe_rank(backend: str, device: str, out: str) -> int:
    """One rank of the ranks-per-GPU probe (``--probe-rank``): join a 2-rank group of
    ``backend`` on ``device``, try each collective, write what happened to ``out``."""
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    report = {"backend": backend, "device": device, "init": None, "ops": {}}
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(0)  # both ranks on the one GPU
        dist.init_process_group(backend, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        report["init"] = "ok"
    except Exception as e:
        report["init"] = f"{type(e).__name__}: {str(e)[:300]}"
    if report["init"] == "ok":
        for op in PROBE_OPS:
            try:
                x = torch.full((4,), float(rank + 1), device=device)
                if op == "all_reduce":
                    dist.all_reduce(x)
                    ok = x.tolist() == [3.0] * 4
                elif op == "broadcast":
                    dist.broadcast(x, 0)
                    ok = x.tolist() == [1.0] * 4
                elif op == "all_gather_into_tensor":
                    y = torch.empty(8, device=device)
                    dist.all_gather_into_tensor(y, x)
                    ok = y.tolist() == [1.0] * 4 + [2.0] * 4
                elif op == "reduce_scatter_tensor":
                    y = torch.empty(2, device=device)
                    dist.reduce_scatter_tensor(y, x)
                    ok = y.tolist() == [3.0, 3.0]
                elif op == "all_to_all_single":
                    y = torch.empty(4, device=device)
                    dist.all_to_all_single(y, x)
                    ok = y.tolist() == [1.0, 1.0, 2.0, 2.0]
                else:
                    dist.barrier()
                    ok = True
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                report["ops"][op] = "ok" if ok else "wrong result"
            except Exception as e:
                report["ops"][op] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


def check_ranks_per_gpu(ctx: Context, cap_s: float) -> CheckResult:
    name = "ranks_per_gpu"
    log = os.path.join(ctx.work, f"{name}.log")
    import torch.distributed as dist
    device = "cuda" if ctx.mode == "cuda" else "cpu"
    backends = ["nccl", "gloo"] if ctx.mode == "cuda" else ["gloo"]
    findings, started = {}, time.monotonic()
    for backend in backends:
        if backend == "nccl" and not dist.is_nccl_available():
            findings[backend] = {"init": "NCCL is not available in this torch", "ops": {}}
            continue
        left = cap_s - (time.monotonic() - started)
        port = str(free_port())
        procs, outs = [], []
        with open(log, "a") as logf:
            for rank in range(2):
                out = os.path.join(ctx.work, f"probe-{backend}-{rank}.json")
                outs.append(out)
                env = _env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port})
                procs.append(subprocess.Popen(
                    [ctx.python, os.path.abspath(__file__), "--probe-rank", backend, device, out],
                    cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
            # Each backend its share of the cap: an NCCL that hangs leaves gloo its turn.
            deadline = time.monotonic() + max(5.0, min(left, cap_s / len(backends)))
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        reports = []
        for out in outs:
            try:
                reports.append(json.load(open(out)))
            except (OSError, ValueError):
                reports.append(None)
        if reports[0] is None and reports[1] is None:
            findings[backend] = {"init": "no rank reported (hung or crashed; see the log)", "ops": {}}
        else:
            # A rank's failure wins over the other's success: both must succeed.
            merged = {"init": next((r["init"] for r in reports if r and r["init"] != "ok"), "ok"),
                      "ops": {}}
            for op in PROBE_OPS:
                seen = [r["ops"].get(op, "not reached") if r else "rank hung or crashed"
                        for r in reports]
                merged["ops"][op] = next((s for s in seen if s != "ok"), "ok")
            findings[backend] = merged
    working = {b: [op for op, s in f["ops"].items() if s == "ok"] for b, f in findings.items()}
    parts = []
    for backend, ops in working.items():
        if len(ops) == len(PROBE_OPS):
            parts.append(f"{backend}: every collective")
        elif ops:
            parts.append(f"{backend}: only {', '.join(ops)}")
        else:
            init = findings[backend]["init"]
            parts.append(f"{backend}: nothing ({init if init != 'ok' else 'every op failed'})"[:200])
    usable = [b for b, ops in working.items() if len(ops) == len(PROBE_OPS)]
    status = PASS if any(working.values()) else FAIL
    return result(name, status, f"2 ranks on one {device}: {'; '.join(parts)}", backends=findings,
                  backends_with_every_op=usable)


def check_snapshot_bandwidth(ctx: Context, cap_s: float) -> CheckResult:
    name = "snapshot_bandwidth"
    log = os.path.join(ctx.work, f"{name}.log")
    out = os.path.join(ctx.work, "hostcopy.json")
    mib = 1024 if ctx.mode == "cuda" else 64
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    mib = max(16, min(mib, int(shm / 2**20 / 3)))  # the slot must fit in /dev/shm
    rc, timed_out, _ = run_capped(
        [ctx.python, "benchmarks/hostcopy_bench.py", "--device", ctx.mode, "--mib", str(mib),
         "--repeats", "5", "--json", out], log, cap_s)
    if timed_out or rc != 0:
        return result(name, FAIL, f"hostcopy_bench {'timed out' if timed_out else f'exit {rc}'}: "
                      f"{tail(log, 2).strip()[-200:]}")
    bench = json.load(open(out))
    copies = {c["what"]: c for c in bench["copies"]}
    moc = next(c for w, c in copies.items() if w.startswith("moc snapshot"))
    pinned = copies.get("reference: torch-pinned memory")
    metrics = dict(mib=mib, moc_what=moc["what"], moc_gb_per_s=moc["gb_per_s"],
                   pinned_gb_per_s=pinned["gb_per_s"] if pinned else None,
                   pageable_gb_per_s=copies.get("reference: .to('cpu'), pageable", {}).get("gb_per_s"),
                   register_error=bench["register_error"], stall_s=bench["stall_s"],
                   compute_s=bench["compute_s"], join_s=bench["join_s"])
    if pinned is None:
        return result(name, SKIP, f"{moc['gb_per_s']:.1f} GB/s into the slot on CPU; the pinned "
                      "reference needs CUDA", **metrics)
    ratio = moc["gb_per_s"] / pinned["gb_per_s"]
    metrics["ratio_to_pinned"] = ratio
    ctx.pinned_gb_per_s = pinned["gb_per_s"]
    text = (f"{moc['gb_per_s']:.1f} GB/s into the registered slot vs {pinned['gb_per_s']:.1f} GB/s "
            f"pinned ({ratio:.2f}x, want >= {BANDWIDTH_MIN_RATIO}); stall {bench['stall_s'] * 1e3:.1f} ms "
            f"on a {bench['compute_s'] * 1e3:.0f} ms loop")
    if bench["register_error"]:
        return result(name, FAIL, f"the slot was not page-locked ({bench['register_error']}); " + text,
                      **metrics)
    return result(name, PASS if ratio >= BANDWIDTH_MIN_RATIO else FAIL, text, **metrics)


def check_memory_recovery(ctx: Context, cap_s: float) -> CheckResult:
    name = "memory_recovery"
    log = os.path.join(ctx.work, f"{name}.log")
    start = time.monotonic()
    corpus = ensure_corpus(ctx, log)
    base = TINY + ["--eval-iters", "0", "--data-path", corpus, "--deterministic",
                   "--moc-checkpoint", "--save-interval", "4"]
    ref, run = os.path.join(ctx.work, "recovery-ref"), os.path.join(ctx.work, "recovery")
    rc, timed_out, _ = run_capped([ctx.python, "pretrain_gpt_moe.py", *base, "--save",
                                   os.path.join(ref, "ckpt"), "--metrics-file",
                                   os.path.join(ref, "m.jsonl")],
                                  log, cap_s - (time.monotonic() - start), one_rank_env(ctx))
    if timed_out or rc != 0:
        return result(name, FAIL, f"uninterrupted run {'timed out' if timed_out else f'exit {rc}'}")
    shm = f"/dev/shm/moc-gpu-check-{os.getpid()}"
    ckpt = os.path.join(run, "ckpt")
    try:
        rc, timed_out, _ = run_capped(
            ["bash", "scripts/run_elastic.sh", "1", "2", *base, "--save", ckpt, "--load", ckpt,
             "--metrics-file", os.path.join(run, "m.jsonl"), "--moc-two-level",
             "--moc-snapshot-interval", "1", "--moc-persist-interval", "4", "--moc-shm-dir", shm,
             "--moc-fault", "crash@7:rank=0"],
            log, cap_s - (time.monotonic() - start), _env({"OMP_NUM_THREADS": "2"}))
    finally:
        stop_keepers_under(shm)
    if timed_out or rc != 0:
        return result(name, FAIL, f"crashed run {'timed out' if timed_out else f'exit {rc}'}")
    recoveries = [e for e in events(ckpt) if e["kind"] == "recovery"]
    differ = compare_losses(losses(os.path.join(ref, "m.jsonl")), losses(os.path.join(run, "m.jsonl")))
    metrics = dict(ranks=1, recoveries=[{k: r.get(k) for k in ("source", "iteration", "seconds",
                                                                 "iterations_lost")}
                                        for r in recoveries],
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
    name = "exact_replay"
    log = os.path.join(ctx.work, f"{name}.log")
    start = time.monotonic()
    corpus = ensure_corpus(ctx, log)
    base = TINY + ["--train-iters", "12", "--eval-interval", "5", "--eval-iters", "1",
                   "--data-path", corpus, "--moc-checkpoint", "--save-interval", "100",
                   "--moc-mode", "exact", "--moc-window", "3"]
    ref, run = os.path.join(ctx.work, "exact-ref"), os.path.join(ctx.work, "exact")
    rc, timed_out, _ = run_capped([ctx.python, "pretrain_gpt_moe.py", *base, "--save",
                                   os.path.join(ref, "ckpt"), "--metrics-file",
                                   os.path.join(ref, "m.jsonl")],
                                  log, cap_s - (time.monotonic() - start), one_rank_env(ctx))
    if timed_out or rc != 0:
        return result(name, FAIL, f"uninterrupted run {'timed out' if timed_out else f'exit {rc}'}")
    ckpt = os.path.join(run, "ckpt")
    rc, timed_out, _ = run_capped(
        ["bash", "scripts/run_elastic.sh", "1", "3", *base, "--save", ckpt, "--load", ckpt,
         "--metrics-file", os.path.join(run, "m.jsonl"), "--moc-fault", "crash@9:rank=0"],
        log, cap_s - (time.monotonic() - start), _env({"OMP_NUM_THREADS": "2"}))
    if timed_out or rc != 0:
        return result(name, FAIL, f"crashed run {'timed out' if timed_out else f'exit {rc}'}")
    recoveries = [e for e in events(ckpt) if e["kind"] == "recovery"]
    metrics = dict(ranks=1, recoveries=[{k: r.get(k) for k in ("source", "iteration", "seconds",
                                                                 "iterations_lost")}
                                        for r in recoveries])
    if len(recoveries) != 1 or "exact replay" not in str(recoveries[0].get("source")):
        return result(name, FAIL, f"expected one exact replay, got "
                      f"{[r.get('source') for r in recoveries]}", **metrics)
    import torch
    from deepspeed_ext.store.reader import CheckpointReader
    tensors = []
    for root in (os.path.join(ref, "ckpt"), ckpt):
        with CheckpointReader(root, "global_step12") as reader:
            tensors.append({key: reader.read_full(*key) for key in reader.keys()})
    want, got = tensors
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


def stall_flags(mode: str) -> List[str]:
    """two_level_bench.py's flags: on CUDA an 84 M-parameter GPT-MoE (8 layers, hidden 512,
    8 heads, 8 experts every 2nd layer, top-1; fp32 as the benchmark trains, sequence 512,
    the byte vocabulary: 1.1 GB of state), EP 1, one rank; on CPU a small model of the same
    structure. 30 timed iterations with a checkpoint each (3 warm-up saves before, not
    timed), DeepSpeed's turn 5 (its saves take 1.8 s each there)."""
    common = ["--zero-stage", "2", "--expert-interval", "2", "--topk", "1", "--intervals", "1",
              "--systems", "deepspeed,moc-full,moc-pec", "--persist-interval", "10",
              "--train-steps", "2"]
    if mode == "cuda":
        # The first H200 run (2026-11-27) used 284 M parameters: DeepSpeed's saves of 4.3 GB
        # each ran the benchmark past its cap before moc-pec's turn.
        return common + ["--nproc", "1", "--ep", "1", "--num-layers", "8", "--hidden-size", "512",
                         "--num-attention-heads", "8", "--num-experts", "8", "--seq-length", "512",
                         "--micro-batch-size", "4", "--iters", "30", "--min-saves", "6",
                         "--warmup", "3", "--system-iters", "deepspeed=5"]
    return common + ["--nproc", "1", "--ep", "1", "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4", "--num-experts", "4", "--seq-length", "32",
                     "--micro-batch-size", "2", "--iters", "3", "--min-saves", "2",
                     "--warmup", "2", "--system-iters", "deepspeed=2", "--pec-k-snapshot", "2"]


def large_stall_flags(mode: str) -> List[str]:
    """two_level_bench.py's flags for the large state: on CUDA 8 layers, hidden 1536 (FFN
    6144), 12 heads, 8 experts every 2nd layer, top-1, sequence 512, fp32: 757 M parameters,
    9.1 GB of master weights and Adam moments on the one rank (3 slots of it: 27 GB of
    /dev/shm; about 20 GB of GPU memory). A snapshot every 4 iterations (the 180 ms copy at
    50 GB/s fits), 6 timed; only the warm-up's first snapshot persists
    (``--persist-interval 1000``), no recovery loads (seconds per GB, not what this
    measures). On CPU a small model of the same structure."""
    common = ["--zero-stage", "2", "--expert-interval", "2", "--topk", "1", "--systems",
              "moc-full", "--persist-interval", "1000", "--train-steps", "2", "--no-recovery",
              "--nproc", "1", "--ep", "1"]
    if mode == "cuda":
        return common + ["--num-layers", "8", "--hidden-size", "1536", "--ffn-hidden-size", "6144",
                         "--num-attention-heads", "12", "--num-experts", "8", "--seq-length",
                         "512", "--micro-batch-size", "4", "--intervals", "4", "--iters", "8",
                         "--min-saves", "6", "--warmup", "2"]
    return common + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--num-experts", "4", "--seq-length", "32", "--micro-batch-size", "2",
                     "--intervals", "2", "--iters", "2", "--min-saves", "2", "--warmup", "1"]


def run_stall_bench(ctx: Context, name: str, stem: str, flags: List[str], cap_s: float):
    """Check ``name``: two_level_bench.py with ``flags`` under ``cap_s`` (its JSON, plot and
    out dir named ``stem`` in the work directory); (rows or None, why not)."""
    log = os.path.join(ctx.work, f"{name}.log")
    out = os.path.join(ctx.work, f"{stem}.json")
    before = set(glob.glob("/dev/shm/moc-two-level-bench-*"))
    try:
        rc, timed_out, _ = run_capped(
            [ctx.python, "benchmarks/two_level_bench.py", *flags, "--json", out,
             "--plot", os.path.join(ctx.work, f"{stem}.png"), "--out-dir",
             os.path.join(ctx.work, stem), "--timeout", str(max(10, int(cap_s) - 15))],
            log, cap_s)
    finally:
        for root in set(glob.glob("/dev/shm/moc-two-level-bench-*")) - before:
            stop_keepers_under(root)
    if timed_out or not os.path.exists(out):
        return None, (f"two_level_bench {'timed out' if timed_out else f'exit {rc}'}: "
                      f"{tail(log, 2).strip()[-200:]}")
    return json.load(open(out)), None


MOC_ROW_KEYS = ("stall_s_median", "stall_s_max", "save_call_s_median", "wait_s_median",
                "iter_s_mean", "ref_iter_s_mean", "ref_iter_s_mean_before",
                "ref_iter_s_mean_after", "iter_overhead", "recovery_memory_s",
                "recovery_storage_s", "bytes_persisted", "host_mem_bytes", "error", "setup_s",
                "prepare_s", "warmup_stalls_s", "stages_median", "saves_memory_only",
                "saves_persist", "stall_s_median_memory_only", "stall_s_median_persist",
                "stages_median_memory_only", "stages_median_persist", "iter_s_mean_memory_only",
                "iter_s_mean_persist", "stall_s", "save_stages", "warmup_save_stages")


def row_metrics(row: dict) -> dict:
    """What the summary keeps of one benchmark row: every key of MOC_ROW_KEYS, None where
    the row has none (DeepSpeed's rows have no stages; a failed row few figures)."""
    return {k: row.get(k) for k in MOC_ROW_KEYS}


def _model(row: dict) -> dict:
    return {k: (row or {}).get("config", {}).get(k) for k in
            ("params_total", "params_expert", "num_layers", "hidden_size", "ffn_hidden_size",
             "num_experts", "seq_length", "dtype")}


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def stall_verdict(rows: List[dict]) -> Tuple[str, str, dict]:
    """``checkpoint_stall``'s (status, reason, metrics) from two_level_bench's rows: PASS
    when moc-full's median stall is below DeepSpeed's; the metrics also say whether the
    issue's targets hold (stall <= 0.5 % of DeepSpeed's, overhead <= +5 % full, +2 % PEC)."""
    by_system = {r["system"]: r for r in rows if r.get("interval") == 1}
    metrics: Dict[str, object] = {s: row_metrics(r) for s, r in by_system.items()}
    base = next((r for r in rows if r["system"] == "no-checkpoint"), {})
    metrics["iter_s_no_checkpoint"] = base.get("iter_s_mean")
    metrics["iter_s_no_checkpoint_before_after"] = [base.get("iter_s_mean_before"),
                                                    base.get("iter_s_mean_after")]
    metrics["model"] = _model(by_system.get("deepspeed") or by_system.get("moc-full"))
    ds, moc = by_system.get("deepspeed", {}), by_system.get("moc-full", {})
    errors = [f"{s}: {r['error']}" for s, r in by_system.items() if r.get("error")]
    if errors or ds.get("stall_s_median") is None or moc.get("stall_s_median") is None:
        return FAIL, "; ".join(errors)[:300] or "no stall measured", metrics
    ratio = moc["stall_s_median"] / ds["stall_s_median"]
    metrics["moc_full_vs_deepspeed"] = ratio
    pec = by_system.get("moc-pec", {})
    targets = {"moc-full stall <= 0.5 % of deepspeed's": ratio <= 0.005}
    for system, most in (("moc-full", 0.05), ("moc-pec", 0.02)):
        overhead = by_system.get(system, {}).get("iter_overhead")
        if overhead is not None:
            targets[f"{system} overhead <= +{most:.0%}"] = overhead <= most
    metrics["targets"] = targets
    stages = moc.get("stages_median") or {}
    text = (f"stall per snapshot (every iteration): moc-full {_ms(moc['stall_s_median'])}"
            + (f", moc-pec {_ms(pec['stall_s_median'])}" if pec.get("stall_s_median") is not None else "")
            + f" vs deepspeed save_checkpoint {ds['stall_s_median'] * 1e3:.0f} ms ({ratio:.3f}x); "
            + "overhead " + ", ".join(f"{s} {100 * r['iter_overhead']:+.1f} %" for s, r in
                                      (("moc-full", moc), ("moc-pec", pec))
                                      if r.get("iter_overhead") is not None)
            + f"; prepare {_s(moc.get('prepare_s'))}; moc-full save call "
              f"{_ms(stages.get('save_call'))}, host wait {_ms(stages.get('host_wait'))}, "
              f"device wait {_ms(stages.get('device_wait'))}, copy {_ms(stages.get('copy'))}, "
              f"checksum {_ms(stages.get('checksum'))}")
    return (PASS if ratio < 1 else FAIL), text, metrics


def large_stall_verdict(rows: List[dict], pinned_gb_per_s: Optional[float]) -> Tuple[str, str, dict]:
    """``checkpoint_stall_large``'s (status, reason, metrics): PASS when moc-full's median
    stall is within STALL_GAP_MAX_S of its median save call and its copy reaches
    BANDWIDTH_MIN_RATIO of the pinned copy's GB/s; SKIP without a pinned reference (CPU)."""
    moc = next((r for r in rows if r["system"] == "moc-full" and r.get("interval")), {})
    metrics: Dict[str, object] = {"moc-full": row_metrics(moc), "model": _model(moc),
                                  "interval": moc.get("interval"),
                                  "pinned_gb_per_s": pinned_gb_per_s}
    stages = moc.get("stages_median") or {}
    if moc.get("error") or moc.get("stall_s_median") is None:
        return FAIL, str(moc.get("error") or "no stall measured")[:300], metrics
    if not stages:
        return FAIL, "no per-save stage timings (TwoLevel.timings) in the rows", metrics
    gap = moc["stall_s_median"] - stages["save_call"]
    copy_rate = stages.get("copy_gb_s")
    ratio = copy_rate / pinned_gb_per_s if copy_rate and pinned_gb_per_s else None
    nbytes = next((s["nbytes"] for s in moc.get("save_stages") or [] if s), None)
    metrics.update(stall_minus_save_call_s=gap, copy_gb_per_s=copy_rate, copy_vs_pinned=ratio,
                   snapshot_bytes=nbytes)
    text = (f"{(nbytes or 0) / 1e9:.1f} GB per snapshot every {moc['interval']}: stall "
            f"{_ms(moc['stall_s_median'])} vs save call {_ms(stages['save_call'])} "
            f"(+{gap * 1e3:.1f} ms, want <= {STALL_GAP_MAX_S * 1e3:.0f}); copy "
            + ("-" if copy_rate is None else f"{copy_rate:.1f} GB/s")
            + (f" vs {pinned_gb_per_s:.1f} GB/s pinned ({ratio:.2f}x, want >= {BANDWIDTH_MIN_RATIO})"
               if ratio is not None else " (no pinned reference)")
            + f"; prepare {_s(moc.get('prepare_s'))}")
    if pinned_gb_per_s is None:
        return SKIP, text + "; the pinned reference needs CUDA", metrics
    ok = gap <= STALL_GAP_MAX_S and ratio is not None and ratio >= BANDWIDTH_MIN_RATIO
    return (PASS if ok else FAIL), text, metrics


def check_checkpoint_stall(ctx: Context, cap_s: float) -> CheckResult:
    name = "checkpoint_stall"
    rows, why = run_stall_bench(ctx, name, "stall", stall_flags(ctx.mode), cap_s)
    if rows is None:
        return result(name, FAIL, why)
    status, text, metrics = stall_verdict(rows)
    return result(name, status, text, **metrics)


def pinned_reference(ctx: Context, cap_s: float) -> Optional[float]:
    """GB/s of a copy into torch-pinned memory: snapshot_bandwidth's, else measured here
    (hostcopy_bench.py, 1 GiB); None on CPU or when it fails."""
    if ctx.pinned_gb_per_s is not None or ctx.mode != "cuda":
        return ctx.pinned_gb_per_s
    out = os.path.join(ctx.work, "hostcopy-large.json")
    rc, timed_out, _ = run_capped(
        [ctx.python, "benchmarks/hostcopy_bench.py", "--device", "cuda", "--mib", "1024",
         "--repeats", "3", "--json", out], os.path.join(ctx.work, "checkpoint_stall_large.log"),
        cap_s)
    if rc != 0 or timed_out:
        return None
    copies = {c["what"]: c for c in json.load(open(out))["copies"]}
    pinned = copies.get("reference: torch-pinned memory")
    ctx.pinned_gb_per_s = pinned["gb_per_s"] if pinned else None
    return ctx.pinned_gb_per_s


def check_checkpoint_stall_large(ctx: Context, cap_s: float) -> CheckResult:
    name = "checkpoint_stall_large"
    start = time.monotonic()
    pinned = pinned_reference(ctx, min(40.0, cap_s / 4))
    rows, why = run_stall_bench(ctx, name, "stall-large", large_stall_flags(ctx.mode),
                                cap_s - (time.monotonic() - start))
    if rows is None:
        return result(name, FAIL, why)
    status, text, metrics = large_stall_verdict(rows, pinned)
    return result(name, status, text, **metrics)


CHECKS = [
    # Caps add up to 9 min 20 s: with the install (under a minute on 16 cores) the whole
    # run fits 10 minutes (the first H200 run took 6 min for the first six checks).
    Check("cuda_unit_tests", 45, check_cuda_unit_tests),
    Check("ranks_per_gpu", 30, check_ranks_per_gpu),
    Check("snapshot_bandwidth", 40, check_snapshot_bandwidth),
    Check("memory_recovery", 90, check_memory_recovery),
    Check("exact_replay", 90, check_exact_replay),
    Check("checkpoint_stall", 125, check_checkpoint_stall),
    # Last: it writes tens of GB (27 GB of slots, a 9 GB persist).
    Check("checkpoint_stall_large", 140, check_checkpoint_stall_large),
]


# ----------------------------------------------------------------------------- summary

def _version(package: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(mode: str, commit: str) -> Environment:
    import torch
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    shm = shutil.disk_usage("/dev/shm").free / 2**30 if os.path.isdir("/dev/shm") else None
    return Environment(mode=mode, device=device,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       commit=commit, host=platform.node(), python=platform.python_version(),
                       torch=torch.__version__, cuda=torch.version.cuda, nccl=nccl,
                       deepspeed=_version("deepspeed"), megatron_core=_version("megatron-core"),
                       shm_free_gib=round(shm, 1) if shm is not None else None)


def summary_name(env: Environment) -> str:
    """``<date>-<device>.json``, e.g. ``2026-11-27-nvidia-h100-80gb-hbm3.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", env.device.lower()).strip("-") or "device"
    return f"{env.date[:10]}-{slug}.json"


def write_summary(summary: Summary, paths: List[str]) -> None:
    """Atomically (temp, fsync, rename), so a run killed mid-check leaves the last one whole."""
    text = json.dumps(asdict(summary), indent=1, default=str)
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def line(r: CheckResult) -> str:
    cap = f" of {r.cap_s:.0f}" if r.cap_s else ""
    return f"{r.status} {r.name} ({r.seconds:.1f} s{cap}): {r.reason}"


def verdict(install: CheckResult, checks: List[CheckResult]) -> str:
    statuses = [install.status] + [c.status for c in checks]
    if FAIL in statuses:
        return FAIL
    return PASS if PASS in [c.status for c in checks] else SKIP


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
    paths = [os.path.join(args.summary_dir, summary_name(env))]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], summary_name(env)))
    print(f"[gpu_check] {env.device}; torch {env.torch}, CUDA {env.cuda}, NCCL {env.nccl}, "
          f"deepspeed {env.deepspeed}, megatron-core {env.megatron_core}, Python {env.python}; "
          f"commit {env.commit}; mode {mode}", flush=True)
    print(line(install), flush=True)
    only = {c for c in args.only.split(",") if c}
    unknown = only - {c.name for c in CHECKS}
    if unknown:
        print(f"error: --only: unknown check(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    # On CPU (2 shared cores, no GPU) the same jobs take several times longer.
    scale = CPU_CAP_SCALE if mode == "cpu" else 1
    budget = args.budget_s if args.budget_s is not None else scale * sum(c.cap_s for c in CHECKS)
    ctx = Context(mode="cpu" if mode == "cpu" else "cuda", work=args.work,
                  deadline=time.monotonic() + budget, python=sys.executable)
    results: List[CheckResult] = []
    for check in CHECKS:
        left = ctx.deadline - time.monotonic()
        cap = min(scale * check.cap_s, left)
        if mode == "dry-run":
            r = CheckResult(check.name, SKIP, "dry run")
        elif install.status == FAIL:
            r = CheckResult(check.name, SKIP, "the install failed")
        elif mode == "no-cuda":
            r = CheckResult(check.name, SKIP, "no CUDA device (torch.cuda.is_available() is False)")
        elif only and check.name not in only:
            r = CheckResult(check.name, SKIP, "not in --only")
        elif cap < min(10.0, check.cap_s):
            r = CheckResult(check.name, SKIP, f"out of the time budget ({left:.0f} s left)")
        else:
            t0 = time.monotonic()
            try:
                r = check.run(ctx, cap)
            except Exception as e:  # a check's own bug is its FAIL, not the run's end
                r = CheckResult(check.name, FAIL, f"{type(e).__name__}: {str(e)[:300]}")
            r.seconds = time.monotonic() - t0
        r.cap_s = cap if r.seconds else scale * check.cap_s  # the cap it ran under, else its own
        results.append(r)
        print(line(r), flush=True)
        write_summary(Summary(SCHEMA, env, install, results, time.monotonic() - started,
                              verdict(install, results)), paths)
    total = time.monotonic() - started + install.seconds
    final = verdict(install, results)
    write_summary(Summary(SCHEMA, env, install, results, total, final), paths)
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, FAIL, SKIP)}
    print(f"[gpu_check] {final}: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP "
          f"in {total:.0f} s; summary {' and '.join(paths)}", flush=True)
    logs = os.path.join(os.environ["OUT"], "gpu_check_logs.txt") if os.environ.get("OUT") else None
    if logs and mode not in ("dry-run", "no-cuda"):
        with open(logs, "w") as f:  # every check's log, in one file beside the summary
            for path in sorted(glob.glob(os.path.join(args.work, "*.log"))):
                f.write(f"===== {os.path.basename(path)}\n{tail(path, 400)}\n")
    return 1 if final == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
