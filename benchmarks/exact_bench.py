#!/usr/bin/env python
"""Exact recovery (``--moc-mode exact``) against MoC's PEC and two-level checkpointing, on
the real trainer: per-iteration overhead, one crash's recovery, and ETTR under random
failures, all in ONE invocation (the machine is shared and noisy: quote only ratios of
rows measured by the same invocation).

    python benchmarks/exact_bench.py                      # the full run (about 10-11 min here)
    python benchmarks/exact_bench.py --quick --out /tmp/exb --json /tmp/exb.json --plot /tmp/exb.png
    python benchmarks/exact_bench.py --iters 60 --rounds 2 --ettr-iters 100 --mtbf 11 --seed 1 \\
                                     --phases overhead,recovery,ettr --out runs/exact_bench

Every run is one training job of ``pretrain_gpt_moe.py`` under torchrun's elastic agent
(``scripts/run_elastic.sh NPROC RESTARTS``) with ``configs/small.yaml`` (2.7 M parameters,
8 experts every 2nd layer, ZeRO-2, expert-parallel 2) on ``--nproc`` (2) CPU ranks, trained
on the quickstart's corpus (the Python standard library's sources, byte-level tokens;
prepared by ``experiments/accuracy.py``'s ``prepare_data`` if missing), ``--log-interval 1``
and no evaluation. (``two_level_bench.py`` drives its own engine with
``checkpoint_bench.py``'s synthetic model on 4 ranks; faults and restarts need the real
trainer, so this uses the model and data of ``experiments/accuracy.py`` and the
quickstart.) The script reads rank 0's output line by line as it comes and stamps
each line with the wall clock (``OUT/<phase>/<policy>/log.txt`` keeps the stamps), and
reads the run's metrics file, event file (``<save>/moc-events.jsonl``), manifests and
exact-recovery frames afterwards. Nothing is asserted about the numbers.

Policies (every one with ``--moc-checkpoint``):

- ``none``: no checkpoint during the run (``--save-interval`` larger than the run);
- ``exact``: ``--moc-mode exact``, window chosen automatically (a sparse frame of one group
  of operators' fp32 state plus the later groups' compute weights, every iteration, copied
  in the background into the node keeper's shared memory, from where it is written to
  ``<save>/exact``); no periodic checkpoint;
- ``exact-w4``: the same with ``--moc-window 4`` (overhead phase only, by default);
- ``pec-dynamic``: ``--moc-pec-k 1 --moc-dynamic-k``, a checkpoint every ``--save-interval``
  (10) iterations;
- ``two-level-full``: ``--moc-two-level --moc-snapshot-interval 1 --moc-persist-interval
  10`` with every expert (a snapshot into the node keeper's shared memory every iteration,
  every 10th persisted).

Phases (``--phases``):

1. ``overhead``: every policy of ``--policies`` for ``--iters`` iterations without failures,
   ``--rounds`` (2) times in alternating order (none, exact, ..., two-level-full, then
   back); each policy's row is its fastest run, since other work on the machine only ever
   slows a run down (every run's figures are in the JSON, ``rounds``).
2. ``recovery``: every policy of ``--fault-policies`` once more with ``--moc-fault
   crash@N:rank=1`` (``--crash-at``; default the middle of a save interval near the middle
   of the run, 35 for 60 iterations) and up to 2 restarts.
3. ``ettr``: every policy of ``--fault-policies`` for ``--ettr-iters`` iterations with
   ``--moc-fault-mtbf S --moc-fault-seed K`` (the same S and K for all; S from ``--mtbf``,
   default: 2 x ``--ettr-iters`` x phase 1's ``none`` iteration time / ``--target-failures``
   (4), e.g. 11 s for 100 iterations of 225 ms) and up to ``--max-restarts`` restarts. The
   fault schedule runs on the job's wall clock from its first fault injector; crashes due
   while no process of the job has an injector (start-up, restarts) are skipped, so the
   policies see different counts. The factor 2: the fault clock also runs during re-done
   iterations, each restart's load and its slower first iterations; measured here, the
   training loops of a faulted run ran about twice the clean run's time. With
   ``--ettr-reference ITERS`` a clean ``none`` run of ITERS iterations goes right before
   each ETTR run (``<policy>-ref``), and the row's ``ettr_ref`` uses its iteration time:
   this machine's speed drifts by 5 % or more over the minutes between the phases.

Columns of the overhead table:

- ``iter med (ms)``: median of the wall-clock gaps between consecutive iteration lines
  (iterations after ``--warmup``); a gap covers the whole iteration: forward, backward,
  step, the frame copy wait, snapshot and save calls.
- ``iter mean (ms)``: (time of the last iteration line - time of the line of iteration
  ``--warmup`` + 1) / iterations between them: the steady-state iteration time, which
  includes the periodic saves a median hides.
- ``overhead``: ``iter mean`` / ``none``'s ``iter mean`` - 1.
- ``to memory MiB/it``: bytes copied into host memory per iteration, all ranks (exact: the
  mean frame of the last complete window from the frame records; pec: the checkpoint's
  bytes / its interval, since an asynchronous save copies the state to a host buffer
  first; two-level: the persisted snapshot's bytes / snapshot interval (K_snapshot = all).
- ``to storage MiB/it``: bytes written to storage per iteration, all ranks (exact: the
  frame, written every iteration; pec: mean bytes of the periodic checkpoints in the
  manifests / interval (PEC's first checkpoint, which holds every expert, and the save at
  the end of the run not counted); two-level: the same for the persisted snapshots).
- ``host mem/rank (MiB)``: exact: the close line's host memory of rank 0 (two frames in
  flight); two-level: the keeper's snapshot memory budget per rank ("up to", 3 slots);
  others ``-``.
- ``stall med/max (ms)``: exact: the close line's waits of the training loop for a frame
  copy or write (rank 0); pec and two-level: the save calls ("saved checkpoint ... in X s",
  1 ms resolution); ``-``: no save in the loop.
- ``W``: the exact window (from the close line).

Columns of the recovery table (one crash, ``crash@N:rank=1``):

- ``source``: where the restart loaded from (event ``source``: storage, memory, exact
  replay from memory / storage).
- ``resumed at``: the iteration training resumed from (event ``iteration``).
- ``redone``: iterations the failed run had finished beyond it (event ``iterations_lost``):
  re-run by every policy; lost updates only where PLT > 0 (exact replays them bit for bit).
- ``PLT``: this recovery's proportion of lost tokens; ``K after``: experts per checkpoint
  from then on (dynamic K).
- ``restart (s)``: from the fault (the crashing rank's event) to the restarted job's load
  start (event time - ``load_s``): detection, teardown, relaunch, model build.
- ``load (s)``: event ``load_s``; ``replay (s)``: from the end of the load until the job is
  back at iteration N-1, the last one finished before the crash (0 when it resumed there).
- ``crash->back (s)``: the sum: the failure's cost in wall-clock time.

Columns of the ETTR table:

- ``failures``: faults injected (events of kind ``fault``); ``recoveries``, ``redone``
  (sum of ``iterations_lost``), ``K final`` and ``PLT acc.`` (accumulated) from the events.
- ``wall (s)``: from the first "training from iteration" line to the last iteration line:
  the initial start-up is not counted, every restart is.
- ``ETTR``: useful iterations x T_iter(none) / wall, with T_iter(none) the ``iter mean``
  of the fault-free ``none`` run of phase 1 (the MoEvement paper's effective training time
  ratio: the share of wall-clock time that advanced training at full speed).
- ``ETTR own``: the same with the policy's own fault-free ``iter mean``: the failure
  factor alone.
- ``E[R] (s)``: measured cost per failure = (wall - iterations x own T_iter) / failures.
- ``ETTR model``: DESIGN.md section 3's formula, ETTR = [1 / (1 + T_ckpt / (T_iter *
  interval))] x [1 / (1 + E[R] / MTBF)], with the first factor measured as T_iter(none) /
  own T_iter (phase 1) and E[R] the recovery phase's crash->back seconds, MTBF = S.

Output: the tables (printed and written to ``OUT/table.md``), ``OUT/results.json`` and
``--json FILE`` (every run's figures and raw measurements), ``--plot FILE.png`` (iteration
time and overhead, the recovery breakdown and ETTR per policy; needs matplotlib). A run
that fails is a row marked FAILED, with its exit code and the tail of its log under the
table; the script then exits with 1. MoC keepers this script's runs leave behind are shut
down and their ``/dev/shm`` directories removed; each run's checkpoint directory is deleted
once measured (``--keep-checkpoints`` keeps them), its event and fault files are kept.
"""

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))
from accuracy import prepare_data  # noqa: E402  (the quickstart's corpus)

NEVER = 10 ** 6
"""--save-interval / --eval-interval that a run never reaches."""
MARKER = ".exact_bench"
"""File in --out saying this script made it (so replacing it is safe)."""
PHASES = ("overhead", "recovery", "ettr")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/exact_bench",
                   help="Directory of the runs (replaced if this script made it).")
    p.add_argument("--json", metavar="FILE", help="Also write the results here.")
    p.add_argument("--plot", metavar="FILE", help="PNG of the results (needs matplotlib).")
    p.add_argument("--quick", action="store_true",
                   help="Smoke run: --iters 20 --rounds 1 --warmup 3 --ettr-iters 30 --target-failures 2.")
    p.add_argument("--phases", default=",".join(PHASES), help="Comma list of phases to run.")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="Policies of the overhead phase (comma list).")
    p.add_argument("--fault-policies", default="exact,pec-dynamic,two-level-full",
                   help="Policies of the recovery and ETTR phases (comma list).")
    p.add_argument("--iters", type=int, default=None,
                   help="Iterations of each overhead and recovery run (default 60; quick 20).")
    p.add_argument("--rounds", type=int, default=None,
                   help="Overhead phase: run every policy this many times, in alternating "
                        "order, and keep each policy's fastest run (other work on the machine "
                        "only ever slows a run down) (default 2; quick 1).")
    p.add_argument("--warmup", type=int, default=None,
                   help="First iterations left out of the iteration times (default 5; quick 3).")
    p.add_argument("--save-interval", type=int, default=10,
                   help="pec-dynamic: checkpoint every N iterations; two-level: persist every N.")
    p.add_argument("--crash-at", type=int, default=None,
                   help="Recovery phase: crash@N:rank=1 (default: the middle of the save "
                        "interval nearest the middle of the run, 35 for 60 iterations).")
    p.add_argument("--ettr-iters", type=int, default=None,
                   help="Iterations of each ETTR run (default 100; quick 30).")
    p.add_argument("--mtbf", default=None,
                   help="--moc-fault-mtbf seconds, or several comma-separated (each policy "
                        "runs at each) (default: 2 x --ettr-iters x none's iteration time / "
                        "--target-failures).")
    p.add_argument("--target-failures", type=float, default=None,
                   help="Failures an ETTR run should see on average, for the automatic "
                        "--mtbf (default 4; quick 2).")
    p.add_argument("--seed", default="1",
                   help="--moc-fault-seed (every policy), or several comma-separated: the ETTR "
                        "phase runs each policy at each MTBF once per seed.")
    p.add_argument("--ettr-reference", type=int, default=0, metavar="ITERS",
                   help="ETTR phase: before each run, a clean none run of this many iterations "
                        "(0: none); its iteration time is the run's ETTR reference (ettr_ref), "
                        "so a machine that got slower between the phases does not count as "
                        "the policy's loss.")
    p.add_argument("--max-restarts", type=int, default=20, help="ETTR runs: torchrun restarts.")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (expert-parallel 2).")
    p.add_argument("--config", default="configs/small.yaml", help="Model config.")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    p.add_argument("--timeout", type=float, default=600, help="Seconds a run may take.")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="Keep every run's checkpoint directory (a full run writes about 2 GB); "
                        "by default only its event and fault files are kept, beside the log.")
    return p


def finish_options(opts) -> None:
    defaults = {"iters": (60, 20), "warmup": (5, 3), "ettr_iters": (100, 30), "rounds": (2, 1),
                "target_failures": (4.0, 2.0)}
    for key, (full, quick) in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, quick if opts.quick else full)
    try:
        opts.seeds = [int(x) for x in str(opts.seed).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --seed: expected integers, got {opts.seed!r}")
    if not opts.seeds:
        raise SystemExit("error: --seed: at least one")
    opts.seed = opts.seeds[0]
    if opts.mtbf is not None:
        try:
            opts.mtbf = [float(m) for m in str(opts.mtbf).split(",") if m.strip()]
        except ValueError:
            raise SystemExit(f"error: --mtbf: expected seconds, got {opts.mtbf!r}")
        if not opts.mtbf or min(opts.mtbf) <= 0:
            raise SystemExit("error: --mtbf must be > 0 seconds")
    if opts.crash_at is None:
        k = opts.save_interval
        opts.crash_at = max(2, (opts.iters // 2 // k) * k + k // 2)


def _list(text: str) -> list:
    return [x.strip() for x in text.split(",") if x.strip()]


# =============================================================================== runs

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


# ============================================================================ parsing

ITER_RE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \| .*elapsed time per iteration \(ms\): ([0-9.]+)")
START_RE = re.compile(r"training from iteration (\d+) to (\d+)")
CLOSE_RE = re.compile(r"\[moc\] exact recovery: (\d+) frames \(W = (\d+)\), ([0-9.]+) MiB per frame "
                      r"on rank (\d+) \(max ([0-9.]+)\), copy ([0-9.]+) ms, training waited "
                      r"([0-9.]+) ms median, ([0-9.]+) ms max; host memory ([0-9.]+) MiB")
CHOICE_RE = re.compile(r"\[moc\] exact recovery: window W = (\d+) \(iteration (\d+) ms, "
                       r"largest frame copy ([0-9.]+) ms")
WINDOW_LOADED_RE = re.compile(r"\[moc\] exact recovery: window of (\d+) frames at iteration (\d+) "
                              r"loaded in ([0-9.]+) s")
REPLAY_DONE_RE = re.compile(r"\[moc\] exact recovery: replay done at iteration (\d+)")
WINDOW_BYTES_RE = re.compile(r"\[moc\] exact recovery: W = (\d+); per rank at most ([0-9.]+) MiB "
                             r"per frame, ([0-9.]+) MiB per window")
SHM_BUDGET_RE = re.compile(r"up to ([0-9.]+) MiB of snapshot memory per rank")
SAVED_RE = re.compile(r"saved checkpoint at iteration\s+(\d+) to \S+ in ([0-9.]+) s")


CAUSE_RE = re.compile(r"death signal|^(\[rank\d+\]: )?[\w.]+(Error|Exception|Fault): |^error: ")


def _tail(run: dict, n: int = 8) -> str:
    """The last lines of a run's output that say something (not the per-iteration ones),
    after the last few lines that look like a cause (exceptions, signals)."""
    keep = [line for _, line in run["lines"] if line.strip() and not ITER_RE.match(line)]
    causes = [line for line in keep[:-n] if CAUSE_RE.search(line)][-3:]
    return "\n".join(causes + (["..."] if causes else []) + keep[-n:])


def _failure(run: dict) -> str:
    if run["timed_out"]:
        return f"timed out after {run['wall_s']:.0f} s"
    if run["rc"] != 0:
        outside = any("Received 15 death signal" in line for _, line in run["lines"])
        return f"exit {run['rc']}" + ("; the torchrun agent got SIGTERM (from outside the job)"
                                      if outside else "")
    return ""


def _events(run: dict) -> list:
    path = os.path.join(run["ckpt"], "moc-events.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _iteration_lines(run: dict) -> list:
    """``(time, iteration, logged ms)`` of every iteration line, in order."""
    out = []
    for t, line in run["lines"]:
        m = ITER_RE.match(line)
        if m:
            out.append((t, int(m.group(1)), float(m.group(2))))
    return out


def _last(regex, run: dict):
    found = None
    for _, line in run["lines"]:
        m = regex.search(line)
        if m:
            found = m
    return found


def _manifest_bytes(ckpt: str) -> dict:
    """``{step: bytes of every rank's files}`` of the checkpoints under ``ckpt``."""
    out = {}
    if not os.path.isdir(ckpt):
        return out
    for tag in os.listdir(ckpt):
        path = os.path.join(ckpt, tag, "manifest.json")
        if os.path.exists(path):
            try:
                m = json.load(open(path))
                out[int(m["step"])] = sum(f["nbytes"] for f in m["files"].values())
            except (ValueError, KeyError, OSError):
                continue
    return out


def _frame_bytes_per_iter(ckpt: str):
    """Exact frames: bytes per iteration over all ranks, the mean frame of the newest
    window whose frames every rank recorded (a window cycles through every group once)."""
    root = os.path.join(ckpt, "exact")
    if not os.path.isdir(root):
        return None
    windows = {}
    for name in os.listdir(root):
        m = re.match(r"^frame(\d+)$", name)
        if not m:
            continue
        for rec_name in os.listdir(os.path.join(root, name)):
            if not rec_name.endswith(".json"):
                continue
            try:
                rec = json.load(open(os.path.join(root, name, rec_name)))
            except (ValueError, OSError):
                continue
            w = windows.setdefault((rec["window_start"], rec["window"], rec["world_size"]), {})
            w.setdefault(rec["frame"], []).append(rec.get("nbytes", 0))
    complete = [(key, frames) for key, frames in windows.items()
                if len(frames) == key[1] and all(len(v) == key[2] for v in frames.values())]
    if not complete:
        return None
    (start, window, _), frames = max(complete)
    return sum(sum(v) for v in frames.values()) / window


def measure_overhead(run: dict, opts) -> dict:
    row = {"policy": run["name"], "ok": not _failure(run), "wall_s": run["wall_s"],
           "run_dir": run["run_dir"]}
    if not row["ok"]:
        row.update(error=_failure(run), tail=_tail(run))
        return row
    its = _iteration_lines(run)
    by_iter = {}
    for t, i, ms in its:
        by_iter[i] = (t, ms)
    first = opts.warmup + 1
    timed = [i for i in sorted(by_iter) if i > first and i - 1 in by_iter]
    if not timed or run["iters"] not in by_iter or first not in by_iter:
        row.update(ok=False, error="too few iteration lines to time", tail=_tail(run))
        return row
    gaps = [by_iter[i][0] - by_iter[i - 1][0] for i in timed]
    row["iter_s_median"] = statistics.median(gaps)
    row["iter_s_mean"] = (by_iter[run["iters"]][0] - by_iter[first][0]) / (run["iters"] - first)
    row["iter_gaps_s"] = gaps
    row["logged_ms_median"] = statistics.median(by_iter[i][1] for i in timed)
    policy, interval = run["policy"], opts.save_interval
    # Bytes.
    row["mem_bytes_per_iter"] = row["storage_bytes_per_iter"] = None
    if policy.startswith("exact"):
        per_iter = _frame_bytes_per_iter(run["ckpt"])
        row["mem_bytes_per_iter"] = row["storage_bytes_per_iter"] = per_iter
    elif policy == "none":
        row["mem_bytes_per_iter"] = row["storage_bytes_per_iter"] = 0.0
    else:
        sizes = _manifest_bytes(run["ckpt"])
        row["checkpoint_bytes"] = {str(k): v for k, v in sorted(sizes.items())}
        periodic = sorted(s for s in sizes if s < run["iters"]
                          or (policy == "pec-dynamic" and s % interval == 0))
        steady = periodic[1:] if len(periodic) > 1 else periodic
        if steady:
            mean = statistics.mean(sizes[s] for s in steady)
            row["storage_bytes_per_iter"] = mean / interval
            row["mem_bytes_per_iter"] = mean if policy == "two-level-full" else mean / interval
    # Host memory, stalls, window.
    row["host_mib_per_rank"] = row["stall_ms_median"] = row["stall_ms_max"] = None
    row["window"] = None
    close = _last(CLOSE_RE, run)
    if close:
        row.update(frames=int(close.group(1)), window=int(close.group(2)),
                   frame_mib_rank0=float(close.group(3)), frame_mib_rank0_max=float(close.group(5)),
                   copy_ms_median=float(close.group(6)), stall_ms_median=float(close.group(7)),
                   stall_ms_max=float(close.group(8)), host_mib_per_rank=float(close.group(9)))
    elif policy.startswith("exact"):
        row["note"] = "no exact-recovery close line in the log"
    choice = _last(CHOICE_RE, run)
    if choice:
        row.update(window_chosen=int(choice.group(1)), probe_iter_ms=int(choice.group(2)),
                   probe_copy_ms=float(choice.group(3)))
    sizes = _last(WINDOW_BYTES_RE, run)
    if sizes:
        row.update(frame_mib_max_rank=float(sizes.group(2)),
                   window_mib_max_rank=float(sizes.group(3)))
    budget = _last(SHM_BUDGET_RE, run)
    if budget:
        row["host_mib_per_rank"] = float(budget.group(1))
    if policy in ("pec-dynamic", "two-level-full"):
        every = 1 if policy == "two-level-full" else interval
        saves = [float(m.group(2)) * 1e3 for m in (SAVED_RE.search(l) for _, l in run["lines"])
                 if m and int(m.group(1)) % every == 0]
        if saves:
            row["stall_ms_median"], row["stall_ms_max"] = statistics.median(saves), max(saves)
            row["saves"] = len(saves)
    return row


def combine_rounds(per_policy: dict) -> list:
    """One row per policy: its fastest successful run (by ``iter mean``; the median is
    the smallest of the runs' medians), with every run's figures under ``rounds``; a
    failed run is a row of its own."""
    rows = []
    for name, runs in per_policy.items():
        ok = [r for r in runs if r["ok"]]
        if ok:
            best = dict(min(ok, key=lambda r: r["iter_s_mean"]))
            best["iter_s_median"] = min(r["iter_s_median"] for r in ok)
            best["rounds"] = [{k: r.get(k) for k in ("round", "iter_s_mean", "iter_s_median",
                                                     "run_dir", "loadavg_after")} for r in ok]
            rows.append(best)
        for r in runs:
            if not r["ok"]:
                rows.append(dict(r, policy=f"{name} (round {r['round']})"))
    return rows


def _back_times(run: dict, events: list) -> list:
    """Per fault: ``{fault time, iteration, back time}``; back: the first moment after the
    fault when the job has finished iteration ``iteration - 1`` again (an iteration line,
    or a resume at or past it)."""
    faults = [e for e in events if e.get("kind") == "fault"]
    marks, starts = [], []  # (time, iterations finished); times of "training from" lines
    for t, line in run["lines"]:
        m = ITER_RE.match(line)
        if m:
            marks.append((t, int(m.group(1))))
            continue
        m = START_RE.search(line)
        if m:
            marks.append((t, int(m.group(1))))
            starts.append(t)
    out = []
    for n, fault in enumerate(faults):
        target = int(fault["iteration"]) - 1
        next_fault = faults[n + 1]["time"] if n + 1 < len(faults) else float("inf")
        # Only the restarted job's lines count: the failed job's last line may reach this
        # process after the fault's time stamp.
        restart = next((t for t in starts if t > fault["time"]), None)
        back = None if restart is None else next(
            (t for t, i in marks if t >= restart and i >= target), None)
        if back is not None and back > next_fault:
            back = None  # failed again before it got back
        out.append({"fault_time": fault["time"], "iteration": int(fault["iteration"]),
                    "rank": fault.get("rank"), "back_time": back})
    return out


def measure_recovery(run: dict, opts) -> dict:
    row = {"policy": run["name"], "ok": not _failure(run), "crash_at": opts.crash_at,
           "wall_s": run["wall_s"], "run_dir": run["run_dir"]}
    events = _events(run)
    recoveries = [e for e in events if e.get("kind") == "recovery"]
    if row["ok"] and not recoveries:
        row.update(ok=False, error="no recovery event (did the fault fire?)")
    if not row["ok"]:
        row.update(error=row.get("error") or _failure(run), tail=_tail(run))
        return row
    ev = recoveries[0]
    back = _back_times(run, events)
    row.update(source=ev.get("source"), resumed_at=ev.get("iteration"),
               redone=ev.get("iterations_lost"), plt=ev.get("plt"), k_after=ev.get("k"),
               load_s=ev.get("load_s"), seconds_since_progress=ev.get("seconds_since_progress"),
               failure=ev.get("failure"))
    if back:
        fault_t, back_t = back[0]["fault_time"], back[0]["back_time"]
        load_start = ev["time"] - (ev.get("load_s") or 0.0)
        row["restart_s"] = load_start - fault_t
        row["replay_s"] = None if back_t is None else max(0.0, back_t - ev["time"])
        row["crash_to_back_s"] = None if back_t is None else back_t - fault_t
    loaded = _last(WINDOW_LOADED_RE, run)
    done = _last(REPLAY_DONE_RE, run)
    if loaded:
        row["window_loaded"] = {"window": int(loaded.group(1)), "start": int(loaded.group(2)),
                                "load_s": float(loaded.group(3))}
    if done:
        row["replay_done_at"] = int(done.group(1))
    return row


def measure_ettr(run: dict, opts, mtbf: float, clean: dict, seed: int) -> dict:
    row = {"policy": run["name"], "ok": not _failure(run), "mtbf_s": mtbf, "seed": seed,
           "iters": run["iters"], "wall_s": run["wall_s"], "run_dir": run["run_dir"]}
    events = _events(run)
    faults = [e for e in events if e.get("kind") == "fault"]
    recoveries = [e for e in events if e.get("kind") == "recovery"]
    row.update(failures=len(faults), recoveries=len(recoveries),
               sources=[e.get("source") for e in recoveries],
               redone=sum(e.get("iterations_lost") or 0 for e in recoveries),
               k_final=recoveries[-1].get("k") if recoveries else None,
               cumulative_plt=recoveries[-1].get("cumulative_plt") if recoveries else 0.0,
               fault_iterations=[e.get("iteration") for e in faults])
    if not row["ok"]:
        row.update(error=_failure(run), tail=_tail(run))
        return row
    starts = [t for t, line in run["lines"] if START_RE.search(line)]
    its = [(t, i) for t, i, _ in _iteration_lines(run) if i == run["iters"]]
    if not starts or not its:
        row.update(ok=False, error="no training start or last iteration line", tail=_tail(run))
        return row
    wall = its[-1][0] - starts[0]
    row["train_wall_s"] = wall
    # When each crash fired, from the first training start: a trace for moc-plan simulate.
    row["fault_times_s"] = [e["time"] - starts[0] for e in faults if e.get("time")]
    backs = [b["back_time"] - b["fault_time"] for b in _back_times(run, events)
             if b["back_time"] is not None]
    row["crash_to_back_s"] = backs
    none_t = (clean.get("none") or {}).get("iter_s_mean")
    own_t = (clean.get(run["name"]) or {}).get("iter_s_mean")
    row["ettr"] = run["iters"] * none_t / wall if none_t else None
    row["ettr_own"] = run["iters"] * own_t / wall if own_t else None
    row["e_r_s"] = (wall - run["iters"] * own_t) / len(faults) if own_t and faults else None
    return row


def add_reference(row: dict, ref: dict) -> None:
    """Put the clean ``none`` run taken just before an ETTR run into its row: ``ref_iter_s``
    and ``ettr_ref`` = iterations x ref_iter_s / wall (None when the reference failed)."""
    row["ref_run_dir"] = ref.get("run_dir")
    row["ref_iter_s"] = ref.get("iter_s_mean") if ref.get("ok") else None
    wall = row.get("train_wall_s")
    row["ettr_ref"] = row["iters"] * row["ref_iter_s"] / wall if row["ref_iter_s"] and wall else None


def ettr_model(policy: str, clean: dict, recovery: dict, mtbf: float):
    none_t = (clean.get("none") or {}).get("iter_s_mean")
    own_t = (clean.get(policy) or {}).get("iter_s_mean")
    e_r = (recovery.get(policy) or {}).get("crash_to_back_s")
    if not (none_t and own_t and e_r):
        return None
    return (none_t / own_t) * 1.0 / (1.0 + e_r / mtbf)


# ============================================================================= output

def _f(value, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(int(value), spec) if spec.endswith("d") else format(value / scale, spec)


def _md(head: list, rows: list) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _failed_cells(r: dict, width: int) -> list:
    return [r["policy"], f"FAILED ({r.get('error', '?')})"] + ["-"] * (width - 2)


def tables(results: dict) -> str:
    mib = 2.0 ** 20
    parts = []
    clean = {r["policy"]: r for r in results.get("overhead", [])}
    base = (clean.get("none") or {}).get("iter_s_mean") if clean.get("none", {}).get("ok") else None
    if results.get("overhead"):
        head = ["policy", "W", "iter med (ms)", "iter mean (ms)", "overhead", "to memory MiB/it",
                "to storage MiB/it", "host mem/rank (MiB)", "stall med (ms)", "stall max (ms)"]
        rows = []
        for r in results["overhead"]:
            if not r["ok"]:
                rows.append(_failed_cells(r, len(head)))
                continue
            over = "-" if not base else f"{100 * (r['iter_s_mean'] / base - 1):+.1f} %"
            rows.append([r["policy"], _f(r.get("window"), "d"), _f(r["iter_s_median"], ".1f", 1e-3),
                         _f(r["iter_s_mean"], ".1f", 1e-3), over,
                         _f(r["mem_bytes_per_iter"], ".2f", mib),
                         _f(r["storage_bytes_per_iter"], ".2f", mib),
                         _f(r["host_mib_per_rank"], ".1f"), _f(r["stall_ms_median"], ".1f"),
                         _f(r["stall_ms_max"], ".1f")])
        o = results["options"]
        parts.append(f"### Overhead without failures ({o['iters']} iterations, the first "
                     f"{o['warmup']} + 1 not timed; fastest of {o['rounds']} run(s) per policy; "
                     f"overhead of iter mean vs none)\n\n"
                     + _md(head, rows) + "\n\niter: wall-clock gaps between rank 0's iteration "
                     "lines (everything in the loop); MiB/it: all ranks; host mem: per rank (exact: "
                     "two frames in flight; two-level: the keeper's snapshot budget); stall: exact: "
                     "the loop's waits for a frame (close line), pec/two-level: the save calls.")
    if results.get("recovery"):
        head = ["policy", "crash", "source", "resumed at", "redone", "PLT", "K after",
                "restart (s)", "load (s)", "replay (s)", "crash->back (s)"]
        rows = []
        for r in results["recovery"]:
            if not r["ok"]:
                rows.append(_failed_cells(r, len(head)))
                continue
            rows.append([r["policy"], f"crash@{r['crash_at']}:rank=1", str(r.get("source")),
                         _f(r.get("resumed_at"), "d"), _f(r.get("redone"), "d"),
                         "-" if r.get("plt") is None else f"{100 * r['plt']:.2f} %",
                         _f(r.get("k_after"), "d"), _f(r.get("restart_s"), ".2f"),
                         _f(r.get("load_s"), ".2f"), _f(r.get("replay_s"), ".2f"),
                         _f(r.get("crash_to_back_s"), ".2f")])
        parts.append("### Recovery from one crash\n\n" + _md(head, rows) + "\n\nredone: "
                     "iterations the failed run had finished past the resume point (events' "
                     "iterations_lost; exact replays them to the original bytes); restart: fault "
                     "-> load start; replay: load end -> back at the last iteration finished "
                     "before the crash; crash->back: the sum.")
    if results.get("ettr"):
        head = ["policy", "MTBF (s)", "seed", "failures", "recoveries", "redone", "K final", "PLT acc.",
                "wall (s)", "ETTR", "ETTR ref", "ETTR own", "E[R] (s)", "ETTR model"]
        rows = []
        for r in results["ettr"]:
            if not r["ok"]:
                rows.append(_failed_cells(r, len(head)))
                continue
            rows.append([r["policy"], f"{r['mtbf_s']:.1f}", str(r["seed"]), str(r["failures"]),
                         str(r["recoveries"]),
                         str(r["redone"]), _f(r.get("k_final"), "d"),
                         f"{100 * (r.get('cumulative_plt') or 0.0):.2f} %",
                         _f(r.get("train_wall_s"), ".1f"), _f(r.get("ettr"), ".3f"),
                         _f(r.get("ettr_ref"), ".3f"), _f(r.get("ettr_own"), ".3f"), _f(r.get("e_r_s"), ".2f"),
                         _f(r.get("ettr_model"), ".3f")])
        e = results["ettr"][0]
        mtbfs = ", ".join(f"{m:g}" for m in dict.fromkeys(r["mtbf_s"] for r in results["ettr"]))
        seeds = ", ".join(str(x) for x in dict.fromkeys(r["seed"] for r in results["ettr"]))
        parts.append(f"### ETTR under random crashes (--moc-fault-mtbf {mtbfs} "
                     f"--moc-fault-seed {seeds}, {e['iters']} iterations; ETTR = iterations "
                     f"x T_iter(none) / wall)\n\n" + _md(head, rows) + "\n\nwall: first "
                     "training start -> last iteration (restarts included); ETTR ref: with the "
                     "T_iter of the clean none run just before (--ettr-reference); ETTR own: with the "
                     "policy's own fault-free T_iter; E[R]: (wall - iterations x own T_iter) / "
                     "failures; ETTR model: T_iter(none)/own T_iter x 1/(1 + E[R]/MTBF) with E[R] "
                     "= the recovery table's crash->back (assumes one failure per MTBF of useful "
                     "time; failures also fall in restarts' loads, re-done and slow first "
                     "iterations, so it is optimistic).")
    return "\n\n".join(parts)


def failure_notes(results: dict) -> str:
    out = []
    for phase in PHASES:
        for r in results.get(phase, []):
            if not r["ok"]:
                out.append(f"{phase} / {r['policy']}: FAILED ({r.get('error')}); see "
                           f"{r['run_dir']}/log.txt; last lines:\n" +
                           "\n".join("    " + line for line in (r.get("tail") or "").splitlines()))
            elif r.get("note"):
                out.append(f"{phase} / {r['policy']}: note: {r['note']}")
            if r.get("leftover"):
                out.append(f"{phase} / {r['policy']}: left behind by the run, removed: "
                           + ", ".join(r["leftover"]))
    return "\n".join(out)


def plot(results: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot: matplotlib is not importable here; {path} not written"
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    ok = [r for r in results.get("overhead", []) if r["ok"]]
    base = next((r["iter_s_mean"] for r in ok if r["policy"] == "none"), None)
    if ok:
        names = [r["policy"] for r in ok]
        means = [1e3 * r["iter_s_mean"] for r in ok]
        meds = [1e3 * r["iter_s_median"] for r in ok]
        xs = range(len(ok))
        ax.bar([x - 0.2 for x in xs], means, 0.4, label="mean")
        ax.bar([x + 0.2 for x in xs], meds, 0.4, label="median")
        for x, r, m in zip(xs, ok, means):
            if base:
                ax.text(x - 0.2, m, f"{100 * (r['iter_s_mean'] / base - 1):+.1f}%",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax.legend(fontsize=8)
    ax.set(title="iteration time without failures (overhead vs none)", ylabel="ms")
    ax = axes[1]
    rec = [r for r in results.get("recovery", []) if r["ok"]]
    if rec:
        names = [r["policy"] for r in rec]
        bottom = [0.0] * len(rec)
        for key, label in (("restart_s", "restart"), ("load_s", "load"), ("replay_s", "replay")):
            vals = [r.get(key) or 0.0 for r in rec]
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    ax.set(title="one crash: from the fault to back at the pre-crash iteration", ylabel="s")
    ax = axes[2]
    et = [r for r in results.get("ettr", []) if r["ok"]]
    if et:
        xs = range(len(et))
        for off, key, label in ((-0.27, "ettr", "measured"), (0.0, "ettr_own", "measured, own T_iter"),
                                (0.27, "ettr_model", "model (DESIGN.md 3)")):
            ax.bar([x + off for x in xs], [r.get(key) or 0.0 for r in et], 0.27, label=label)
        ax.set_xticks(list(xs), [f"{r['policy']}\nMTBF {r['mtbf_s']:g}: {r['failures']} failures"
                                 for r in et], fontsize=7)
        ax.set_ylim(0, max([1.05] + [1.05 * (r.get(k) or 0.0) for r in et
                                     for k in ("ettr", "ettr_own", "ettr_model")]))
        ax.legend(fontsize=8)
        ax.set_title(f"ETTR, MTBF {', '.join(f'{m:g}' for m in dict.fromkeys(r['mtbf_s'] for r in et))}"
                     f" s, seed {et[0]['seed']}")
    else:
        ax.set_title("ETTR (not measured)")
    failed = [f"{p}/{r['policy']}" for p in PHASES for r in results.get(p, []) if not r["ok"]]
    fig.suptitle(results["command"] + (f"\nFAILED (not plotted): {', '.join(failed)}" if failed else ""),
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# =============================================================================== main

def prepare_out(out: str) -> None:
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, MARKER)):
            raise SystemExit(f"error: --out {out} exists, is not empty and was not made by this "
                             f"script (no {MARKER}); choose another directory")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, MARKER), "w").close()


def main() -> int:
    opts = build_parser().parse_args()
    finish_options(opts)
    phases, policies, fault_policies = _list(opts.phases), _list(opts.policies), _list(opts.fault_policies)
    bad = [p for p in phases if p not in PHASES] + [p for p in policies + fault_policies
                                                    if p not in POLICIES]
    if bad:
        print(f"error: unknown phase or policy: {', '.join(bad)} (phases: {', '.join(PHASES)}; "
              f"policies: {', '.join(POLICIES)})", file=sys.stderr)
        return 2
    if (opts.iters <= opts.warmup + 2 or not 1 < opts.crash_at <= opts.iters
            or opts.ettr_iters < 2 or opts.rounds < 1
            or (opts.ettr_reference and opts.ettr_reference <= opts.warmup + 2)):
        print("error: need --iters > --warmup + 2, 1 < --crash-at <= --iters, --ettr-iters >= 2, "
              "--rounds >= 1, --ettr-reference 0 or > --warmup + 2", file=sys.stderr)
        return 2
    out = os.path.abspath(opts.out)
    prepare_out(out)
    data = prepare_data(os.path.join(REPO, opts.data_prefix))
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    results = {"command": command, "options": vars(opts),
               "machine": f"{os.cpu_count()} CPU cores, {platform.platform()}",
               "loadavg_before": os.getloadavg()[0]}
    print(f"exact-recovery benchmark\ncommand: {command}\nmachine: {results['machine']}; "
          f"load average {results['loadavg_before']:.1f} (other work on the machine skews "
          f"every figure: compare rows of one invocation)\nruns under {out}", flush=True)
    began = time.time()

    def progress(phase, row, run):
        row["loadavg_after"] = os.getloadavg()[0]
        if run["leftover"]:
            row["leftover"] = run["leftover"]
        if not opts.keep_checkpoints:  # measured: keep what says what happened, not the bytes
            for name in ("moc-events.jsonl", "moc-faults.json"):
                if os.path.exists(os.path.join(run["ckpt"], name)):
                    shutil.copy(os.path.join(run["ckpt"], name), run["run_dir"])
            shutil.rmtree(run["ckpt"], ignore_errors=True)
        brief = {k: v for k, v in row.items() if k not in ("tail", "iter_gaps_s", "run_dir",
                                                            "checkpoint_bytes")}
        print(f"[exact_bench {time.time() - began:6.0f} s] {phase} / {row['policy']}: "
              f"{json.dumps(brief, default=str)}", flush=True)

    clean = {}
    if "overhead" in phases:
        per_policy = {name: [] for name in policies}
        for k in range(opts.rounds):
            for name in policies if k % 2 == 0 else list(reversed(policies)):
                label = name if opts.rounds == 1 else f"{name}-r{k + 1}"
                run = run_job(name, name, opts, data, os.path.join(out, "overhead", label),
                              restarts=0, extra=[], iters=opts.iters)
                row = measure_overhead(run, opts)
                row["round"] = k + 1
                per_policy[name].append(row)
                progress("overhead", row, run)
        results["overhead"] = combine_rounds(per_policy)
        clean = {r["policy"]: r for r in results["overhead"] if r["ok"]}
    recovery = {}
    if "recovery" in phases:
        results["recovery"] = []
        for name in fault_policies:
            run = run_job(name, name, opts, data, os.path.join(out, "recovery", name), restarts=2,
                          extra=["--moc-fault", f"crash@{opts.crash_at}:rank=1"], iters=opts.iters)
            row = measure_recovery(run, opts)
            results["recovery"].append(row)
            progress("recovery", row, run)
        recovery = {r["policy"]: r for r in results["recovery"] if r["ok"]}
    if "ettr" in phases:
        mtbfs = opts.mtbf
        if mtbfs is None:
            t = (clean.get("none") or {}).get("iter_s_mean")
            mtbfs = [round(2 * opts.ettr_iters * t / opts.target_failures, 1) if t else 10.0]
            results["mtbf_note"] = ("from none's iteration time" if t else
                                    "none's iteration time not measured: 10 s")
        results["ettr"] = []
        for seed in opts.seeds:
            for mtbf in mtbfs:
                for name in fault_policies:
                    where = name + ("" if len(mtbfs) == 1 else f"-mtbf{mtbf:g}") \
                        + ("" if len(opts.seeds) == 1 else f"-seed{seed}")
                    if opts.ettr_reference:
                        ref_run = run_job("none", "none", opts, data,
                                          os.path.join(out, "ettr", where + "-ref"), restarts=0,
                                          extra=[], iters=opts.ettr_reference)
                        ref = measure_overhead(ref_run, opts)
                        progress("ettr reference", ref, ref_run)
                    run = run_job(name, name, opts, data, os.path.join(out, "ettr", where),
                                  restarts=opts.max_restarts, iters=opts.ettr_iters,
                                  extra=["--moc-fault-mtbf", str(mtbf), "--moc-fault-seed",
                                         str(seed)])
                    row = measure_ettr(run, opts, mtbf, clean, seed)
                    if opts.ettr_reference:
                        add_reference(row, ref)
                    row["ettr_model"] = ettr_model(name, clean, recovery, mtbf)
                    results["ettr"].append(row)
                    progress("ettr", row, run)
    results["total_s"] = time.time() - began

    text = tables(results)
    notes = failure_notes(results)
    print()
    print(text)
    if notes:
        print("\n" + notes)
    print(f"\nall runs: {results['total_s']:.0f} s (1-minute load average {results['loadavg_before']:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after); logs, metrics and events under "
          f"{out}/<phase>/<policy>/")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n" + (f"\n```\n{notes}\n```\n" if notes else ""))
    for path in [os.path.join(out, "results.json")] + ([opts.json] if opts.json else []):
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"wrote {os.path.join(out, 'table.md')}, {os.path.join(out, 'results.json')}"
          + (f", {opts.json}" if opts.json else ""))
    if opts.plot:
        print(plot(results, opts.plot))
    failed = any(not r["ok"] for p in PHASES for r in results.get(p, []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
