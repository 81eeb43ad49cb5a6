"""One job of a benchmark run as a command in its own session, its output lines stamped
with their arrival times (the phases of a recovery are read from them), killed whole
after a timeout; the job's keepers and shared memory are cleaned up afterwards
(:func:`cleanup_run`). Used by exact_bench and restart_bench."""

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class StampedRun:
    """What :func:`run_stamped` saw of one job."""

    rc: int
    timed_out: bool
    start: float
    """``time.time()`` when the job started."""
    wall_s: float
    lines: List[Tuple[float, str]] = field(default_factory=list)
    """Each output line with its arrival time (``time.time()``)."""
    leftover: list = field(default_factory=list)
    """What the clean-up found still there (keepers, shared memory)."""


def _read(proc, start: float, lines: list, log_path: str, on_line=None) -> None:
    """The reader thread: each line of ``proc``'s output with its arrival time, and the
    same into ``log_path`` with the seconds since the start; ``on_line(time, text)``
    (optional) sees each line as it arrives."""
    with open(log_path, "w") as log:
        for line in proc.stdout:
            now = time.time()
            lines.append((now, line.rstrip("\n")))
            log.write(f"[{now - start:9.3f}] {line}")
            log.flush()
            if on_line is not None:
                on_line(now, line.rstrip("\n"))


def run_stamped(cmd: Sequence[str], log_path: str, shm: str, timeout: float,
                env_extra: dict = None, on_line=None) -> StampedRun:
    """Run ``cmd`` from the repository root (stdout and stderr together, a line at a
    time), kill its whole session after ``timeout`` seconds, then clean up the job's
    shared memory ``shm`` and whatever DeepSpeed buffers it left. ``on_line(time, text)``
    is called on the reader thread for each line (a fault injector reacts to them)."""
    shm_before, lines = _deepspeed_shm_files(), []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    start = time.time()
    proc = subprocess.Popen(list(cmd), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True,
                            errors="replace", bufsize=1, env=env)
    reader = threading.Thread(target=_read, daemon=True,
                              args=(proc, start, lines, log_path, on_line))
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: only what it started
        rc = proc.wait()
    reader.join(timeout=30)
    wall = time.time() - start
    return StampedRun(rc, timed_out, start, wall, lines, cleanup_run(shm, shm_before))


def _deepspeed_shm_files() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_")}
    except OSError:
        return set()


def _mapped_shm_files() -> set:
    """/dev/shm files some live process maps (in use: never ours to remove)."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        used.add(os.path.basename(line.split("/dev/shm/", 1)[1].split()[0]))
        except OSError:
            continue
    return used


def _keeper_pids(shm: str) -> list:
    """MoC keepers serving ``shm`` (started by this script's run: the path is ours)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"deepspeed_ext.keeper" in argv and any(a.decode(errors="replace").startswith(shm)
                                                   for a in argv):
            pids.append(int(pid))
    return pids


def cleanup_run(shm: str, shm_before: set) -> list:
    """Shut down the run's keepers, remove its shared memory and DeepSpeed's buffers a
    killed rank left behind (new since the run began and mapped by no process)."""
    left = []
    if os.path.isdir(shm):
        for name in sorted(os.listdir(shm)):
            left.append(os.path.join(shm, name))
            try:
                from deepspeed_ext.keeper import shutdown_keeper
                shutdown_keeper(os.path.join(shm, name), timeout_s=30)
            except Exception:
                pass
    for pid in _keeper_pids(shm):
        left.append(f"keeper pid {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(shm, ignore_errors=True)
    stale = (_deepspeed_shm_files() - shm_before) - _mapped_shm_files()
    for name in stale:
        try:
            os.remove(os.path.join("/dev/shm", name))
            left.append("/dev/shm/" + name)
        except OSError:
            pass
    return left
