"""Run ``pretrain_gpt_moe.py`` (or any script) as N local ranks for tests.

A minimal launcher: it sets the variables torchrun/deepspeed set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and returns every rank's exit
code and output, so a test can assert what *each* rank did. Every job has a timeout:
a hang fails the test instead of hanging the suite.
"""

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, args: Sequence[str], script: str = "pretrain_gpt_moe.py",
              timeout: float = 240, env: Optional[dict] = None) -> List[RankResult]:
    """Start ``nproc`` processes of ``script`` with ``args``; wait for all; return results."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                        OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
        rank_env.update(env or {})
        procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, script), *args],
                                      cwd=REPO, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(_hung(procs, results, timeout)) from None
            results.append(RankResult(rank, proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _hung(procs: List[subprocess.Popen], done: List[RankResult], timeout: float) -> str:
    """Kill the ranks still running after ``timeout`` and describe every rank's output:
    which rank hung, and the error a peer printed before it, instead of the subprocess
    module's truncated repr of one rank's output."""
    still = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    results = list(done)
    for rank in range(len(done), len(procs)):
        out, _ = procs[rank].communicate()
        results.append(RankResult(rank, procs[rank].returncode, out))
    return f"rank(s) {still} still running after {timeout:.0f} s, killed\n" + describe(results)


def describe(results: List[RankResult]) -> str:
    """All ranks' output, for assertion messages."""
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in results)


def fresh_python(code: str, timeout: float = 120, args: Sequence[str] = (),
                 memory_limit: Optional[int] = None) -> List[str]:
    """Run ``code`` in a new interpreter with the repository on its path (what a rank
    imports, without this test process's modules); its stdout lines. Fails on an error.

    Args:
        args: its ``sys.argv[1:]``.
        memory_limit: bytes of address space it may use (``RLIMIT_AS``): for code that,
            on a bug, would read until the machine's memory ran out.
    """
    if memory_limit is not None:
        code = (f"import resource\nresource.setrlimit(resource.RLIMIT_AS, "
                f"({memory_limit}, {memory_limit}))\n" + code)
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"),
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()
