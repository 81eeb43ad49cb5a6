"""The training jobs of ``exact_bench.py``: one job under ``scripts/run_elastic.sh``
(:func:`run_job`) and the cleanup of what its MoC keepers leave in ``/dev/shm``
(:func:`cleanup_run`)."""

import os
import shlex
import shutil
import signal
import subprocess
import threading
import time

from benchlib.ranks import REPO

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
    shm_before = _deepspeed_shm_files()
    lines = []
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace", bufsize=1,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))

    def read():
        with open(os.path.join(run_dir, "log.txt"), "w") as log:
            for line in proc.stdout:
                t = time.time()
                lines.append((t, line.rstrip("\n")))
                log.write(f"[{t - start:9.3f}] {line}")
                log.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    reader.join(timeout=30)
    wall = time.time() - start
    leftover = cleanup_run(shm, shm_before)
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    return {"name": name, "policy": policy, "rc": rc, "timed_out": timed_out, "wall_s": wall,
            "start": start, "lines": lines, "run_dir": run_dir, "ckpt": ckpt, "iters": iters,
            "command": shlex.join(cmd), "leftover": leftover}


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
