"""Run ``pretrain_gpt_moe.py`` (or any script) as N local ranks for tests.

A minimal launcher: it sets the variables torchrun/deepspeed set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and returns every rank's exit
code and output, so a test can assert what *each* rank did. Every job has a timeout:
a hang fails the test instead of hanging the suite.
"""

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from tests import forkserver

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
                        **RANK_STARTUP_ENV)
        rank_env.update(env or {})
        procs.append(start_rank(os.path.join(REPO, script), list(args), rank_env))
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


RANK_STARTUP_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
"""What every rank's environment sets, the fork server's included."""


def start_rank(script: str, args: List[str], env: Dict[str, str]):
    """One rank of ``script``: forked from the session's fork server (``tests.forkserver``)
    when ``env`` agrees with the server's on what an interpreter reads at start-up, else a
    new interpreter; either way a handle with ``subprocess.Popen``'s ``poll``, ``wait``,
    ``kill``, ``communicate``, ``returncode`` and ``pid``, its output the rank's stdout and
    stderr together. ``MOC_TEST_NO_FORKSERVER=1`` starts every rank as a new interpreter."""
    server = None if os.environ.get("MOC_TEST_NO_FORKSERVER") == "1" else _fork_server()
    if server is not None and forkserver.startup_env(env) == server.startup:
        return server.spawn(script, args, env)
    return subprocess.Popen([sys.executable, script, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class _ForkServer:
    """This test process's connection to its ``tests/forkserver.py`` (started on first use)."""

    def __init__(self):
        env = dict(os.environ, **RANK_STARTUP_ENV)
        self.startup = forkserver.startup_env(env)
        self.tmp = tempfile.mkdtemp(prefix="moc-forked-ranks-")
        self.log = os.path.join(self.tmp, "forkserver.log")
        self.proc = subprocess.Popen([sys.executable, forkserver.__file__, self.log], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.exits: Dict[int, int] = {}
        self._pending = b""
        first = self._message(timeout=120)
        if first is None or "ready" not in first:
            self.proc.kill()
            raise RuntimeError(f"tests/forkserver.py did not start ({first}); its log:\n"
                               + open(self.log, errors="replace").read()[-3000:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _message(self, timeout: Optional[float]) -> Optional[dict]:
        """The next line from the server (None: none within ``timeout`` or it ended);
        exits are recorded on the way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if "exited" in message:
                    self.exits[message["exited"]] = message["returncode"]
                return message
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            fd = self.proc.stdout.fileno()
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._pending += chunk

    def pump(self, timeout: float) -> None:
        """Record the exits the server reported within ``timeout`` seconds."""
        self._message(timeout)
        while b"\n" in self._pending:
            self._message(0)

    def spawn(self, script: str, args: List[str], env: Dict[str, str]) -> "ForkedRank":
        fd, output = tempfile.mkstemp(dir=self.tmp, suffix=".out")
        os.close(fd)
        request = {"script": script, "args": args, "env": env, "cwd": REPO,
                   "umask": _current_umask(), "output": output}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            message = self._message(timeout=60)
            if message is None:
                raise RuntimeError("tests/forkserver.py stopped answering")
            if "pid" in message:
                return ForkedRank(self, message["pid"], output)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


_SERVER: Optional[_ForkServer] = None


def _fork_server() -> Optional[_ForkServer]:
    global _SERVER
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


class ForkedRank:
    """A rank forked by the fork server, with the ``subprocess.Popen`` methods
    :func:`run_ranks` uses. Its exit status comes from the server (its parent)."""

    def __init__(self, server: _ForkServer, pid: int, output: str):
        self.server, self.pid, self.output, self.returncode = server, pid, output, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.server.pump(0)
            self.returncode = self.server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self.server.alive():
                raise RuntimeError("tests/forkserver.py ended before its rank")
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["forked rank", str(self.pid)], timeout)
            self.server.pump(min(left, 1.0))
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        self.wait(timeout)
        with open(self.output, errors="replace") as f:
            out = f.read()
        os.unlink(self.output)
        return out, None

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


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
