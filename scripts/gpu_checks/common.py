"""What every check of ``scripts/gpu_check.py`` uses: the result and context records, a
command run under a cap in a process group of its own, the training jobs' environment,
their losses and events, and the corpus the training checks share."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY_POINT = os.path.join(REPO, "scripts", "gpu_check.py")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--moe-expert-parallel-size", "1"]
BANDWIDTH_MIN_RATIO = 0.8


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
    """One check: its name, its cap on a GPU (times CPU_CAP_SCALE on CPU), its function."""
    name: str
    cap_s: float
    run: Callable[[Context, float], CheckResult]


def result(name: str, status: str, reason: str, **metrics) -> CheckResult:
    """A check's result with its metrics as keywords (the runner sets the times)."""
    return CheckResult(name, status, reason, metrics=metrics)


def child_env(extra: Optional[dict] = None) -> dict:
    """This process's environment with the repository first on ``PYTHONPATH``, warnings
    off and unbuffered output (a killed job's log still has its last lines), plus ``extra``."""
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
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=out,
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


def outcome(rc: int, timed_out: bool) -> str:
    """``timed out`` or ``exit N``, for a reason line."""
    return "timed out" if timed_out else f"exit {rc}"


def tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a log ("" when it cannot be read)."""
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
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env(ctx: Context) -> dict:
    """The variables a launcher sets for a job of one rank."""
    return child_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
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
    """The records of ``<ckpt>/moc-events.jsonl`` (none when it does not exist)."""
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
