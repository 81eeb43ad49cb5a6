"""Hardware figures for the cost model, measured here or read from a benchmark's JSON.

``moc-plan calibrate`` calls :func:`calibrate`: it times a device-to-host copy (into
shared memory, as a snapshot does; on a GPU from device memory into pinned memory),
a durable write and a cold read of a file under ``--dir`` (the checkpoint storage), and
runs ``pretrain_gpt_moe.py`` for a few iterations of ``--config`` to take the iteration
time, optionally with one injected crash under ``scripts/run_elastic.sh`` to take the
restart time. ``--from-json`` reads instead what the benchmarks measured:
``two_level_bench.py`` (iteration time, memory and storage load times),
``redundancy_bench.py`` (the peers' bandwidth), ``exact_bench.py`` (iteration time,
restart time) and ``restart_bench.py`` (the relaunch's restart time and the in-job
restart's phases: :func:`restart_bench_figures`). The result is a JSON file of
:class:`~deepspeed_ext.planning.costs.Hardware` fields plus what each came from, and an
``in_job`` object of :class:`~deepspeed_ext.planning.restart.InJobPhases` fields when a
benchmark measured them (``--hardware`` reads both: :func:`in_job_from_json`).
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from typing import Any, Dict, List, Optional

from deepspeed_ext.planning.costs import GB, Hardware
from deepspeed_ext.planning.restart import InJobPhases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hardware_file(path: str):
    """The JSON in the hardware file ``path``.

    Raises:
        ValueError: naming the file: unreadable, or not JSON.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--hardware {path}: {err}") from None


def hardware_from_json(path: str) -> Hardware:
    """A hardware file written by ``moc-plan calibrate`` (or by hand).

    Raises:
        ValueError: naming the file and the bad or unknown field.
    """
    data = _hardware_file(path)
    known = {f.name for f in fields(Hardware)}
    values = data.get("hardware", data) if isinstance(data, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"--hardware {path}: expected a JSON object of hardware figures "
                         f"(what moc-plan calibrate writes)")
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--hardware {path}: unknown field(s) {unknown}; known: {sorted(known)}")
    try:
        return Hardware(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--hardware {path}: {err}") from None


def in_job_from_json(path: str) -> Dict[str, float]:
    """The ``in_job`` object of a hardware file (``InJobPhases`` fields; what ``moc-plan
    calibrate`` wrote from ``restart_bench.py``); {} when it has none.

    Raises:
        ValueError: naming the file and the unknown or bad field.
    """
    data = _hardware_file(path)
    values = data.get("in_job", {}) if isinstance(data, dict) else {}
    known = {f.name for f in fields(InJobPhases)}
    if not isinstance(values, dict) or set(values) - known:
        raise ValueError(f"--hardware {path}: in_job must be an object of {sorted(known)}, "
                         f"got {values!r}")
    try:
        InJobPhases(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--hardware {path}: in_job: {err}") from None
    return values


def measure_copy_gbps(mbytes: int = 256, repeats: int = 3) -> float:
    """Device-to-host copy bandwidth: CUDA into pinned memory, else RAM into a shared
    memory mapping (what a snapshot copy does)."""
    import torch
    n = mbytes << 20
    if torch.cuda.is_available():
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return n / min(times) / GB
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.NamedTemporaryFile(dir=root, prefix="moc-calibrate-") as f:
        os.ftruncate(f.fileno(), n)
        dst = torch.from_file(f.name, shared=True, size=n, dtype=torch.uint8)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        del dst
    return n / min(times) / GB


def measure_storage_gbps(directory: str, mbytes: int = 256) -> Dict[str, float]:
    """Durable write (write + fsync) and cold read (page cache dropped) of one file."""
    os.makedirs(directory, exist_ok=True)
    data = os.urandom(1 << 20) * mbytes
    fd, path = tempfile.mkstemp(dir=directory, prefix="moc-calibrate-")
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write = time.perf_counter() - start
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
        read = time.perf_counter() - start
    finally:
        os.remove(path)
    return {"write_gbps": len(data) / write / GB, "read_gbps": len(data) / read / GB}


ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
RESTART = re.compile(r"([0-9.]+) s since the last finished iteration")


def measure_training(config: str, data_path: str, nproc: int, iters: int,
                     with_restart: bool, out_dir: str) -> Dict[str, float]:
    """Iteration time (median of the logged iterations after the first two) of a short
    run, and with ``with_restart`` the restart time of one injected crash (from the
    recovery line: seconds from the last finished iteration to training again)."""
    save = os.path.join(out_dir, "ckpt")
    argv = ["--config", config, "--data-path", data_path, "--train-iters", str(iters),
            "--log-interval", "1", "--eval-iters", "0", "--save", save, "--load", save,
            "--moc-checkpoint", "--save-interval", str(max(1, iters // 4))]
    if with_restart:
        argv += ["--moc-fault", f"crash@{iters // 2 + 1}:rank={nproc - 1}"]
    cmd = ["bash", os.path.join(REPO, "scripts", "run_elastic.sh"), str(nproc),
           "1" if with_restart else "0"] + argv
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    if result.returncode:
        tail = "\n".join(output.splitlines()[-20:])
        raise RuntimeError(f"the calibration run failed ({result.returncode}):\n{tail}")
    times = [float(m) / 1000 for m in ITER_MS.findall(output)]
    if not times:
        raise RuntimeError(f"the calibration run logged no iteration times ({' '.join(cmd)})")
    out = {"iteration_s": statistics.median(times[2:] or times)}
    restarts = [float(m) for m in RESTART.findall(output)]
    if with_restart and restarts:
        out["restart_s"] = restarts[0]
    return out


def _rows_of(data) -> List[Dict[str, Any]]:
    """The result rows of a benchmark JSON: its ``rows``, or every object in its
    top-level lists (``exact_bench.py`` keeps one list per phase)."""
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict)]
    if isinstance(data.get("rows"), list):
        return [r for r in data["rows"] if isinstance(r, dict)]
    return [r for v in data.values() if isinstance(v, list) for r in v if isinstance(r, dict)]


def _read_benchmark(path: str):
    """A benchmark's JSON: an object or a list of rows.

    Raises:
        ValueError: naming ``--from-json`` and the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--from-json {path}: {err}") from None
    if not isinstance(data, (dict, list)):
        raise ValueError(f"--from-json {path}: expected a benchmark's JSON object or list of "
                         f"rows, got {type(data).__name__}")
    return data


def _figure(path: str, row: Dict[str, Any], key: str) -> Optional[float]:
    """``row[key]`` as a positive number; None when absent, null or 0 (not measured).

    Raises:
        ValueError: naming the file, the row and the field.
    """
    value = row.get(key)
    if value is None or (isinstance(value, (int, float)) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        name = row.get("system") or row.get("mode") or row.get("policy")
        raise ValueError(f"--from-json {path}: row {name!r}: {key} must be a positive "
                         f"number, got {value!r}")
    return float(value)


def _ranks_per_node(path: str, data) -> int:
    """The benchmark's ranks per node (``config.ranks_per_node``; 1 when absent)."""
    config = data.get("config") if isinstance(data, dict) else None
    value = (config if isinstance(config, dict) else {}).get("ranks_per_node", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--from-json {path}: config.ranks_per_node must be an integer >= 1, "
                         f"got {value!r}")
    return value


def _figures_of(path: str, data, restarts: List[tuple]) -> Dict[str, Any]:
    """One benchmark's figures, ``{field: (value, source)}``; its restarts go to
    ``restarts``."""
    found: Dict[str, Any] = {}
    for row in _rows_of(data):
        system = row.get("system") or row.get("mode") or row.get("policy")
        iter_s, bandwidth = _figure(path, row, "iter_s_mean"), _figure(path, row, "bandwidth_mib_s")
        restart, stall = _figure(path, row, "restart_s"), _figure(path, row, "stall_ms_median")
        if system == "no-checkpoint" and iter_s:
            found["iteration_s"] = (iter_s, f"{path}: no-checkpoint iterations")
        if system in ("replicate", "erasure") and bandwidth:
            # Each rank's share of its node's link: times the ranks per node.
            found["network_gbps"] = (bandwidth * 2**20 * _ranks_per_node(path, data) / GB,
                                     f"{path}: {system} protection bandwidth")
        if system == "none" and iter_s:
            found["iteration_s"] = (iter_s, f"{path}: none iterations")
        if restart:
            restarts.append((restart, f"{path}: {system}"))
        # exact_bench: pec-dynamic's median save call (storage-bound, asynchronous)
        if system == "pec-dynamic" and stall:
            found["save_call_s"] = (stall / 1000, f"{path}: pec-dynamic median save call")
    if isinstance(data, dict) and isinstance(data.get("overhead"), list):
        try:
            figures = exact_bench_figures(data)
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"--from-json {path}: its overhead rows cannot be read "
                             f"({type(err).__name__}: {err})") from None
        found.update({k: (v, f"{path}: {why}") for k, (v, why) in figures.items()})
    return found


RESTART_BENCH_MARKS = ("round written", "survivors left", "survivors torn down",
                       "every process in round 1", "model being built", "state restored",
                       "first iteration done")
"""``restart_bench.py``'s in-job ``phases_s`` (seconds after the fault line, the slowest
process's), in order; each in-job phase is the gap between two of them."""


def _marks(rows: List[Dict[str, Any]], names) -> Dict[str, float]:
    """Each of ``names`` as the median over ``rows``' ``phases_s`` that have it, and
    ``load`` the median ``recovery.load_s``."""
    out = {}
    for name in names:
        values = [r["phases_s"][name] for r in rows
                  if isinstance(r.get("phases_s"), dict) and name in r["phases_s"]]
        if values:
            out[name] = statistics.median(values)
    loads = [(r.get("recovery") or {}).get("load_s") for r in rows]
    out["load"] = statistics.median([v for v in loads if v is not None] or [0.0])
    return out


def restart_bench_figures(data: Dict[str, Any]) -> Dict[str, Any]:
    """From a ``restart_bench.py`` JSON, medians over its repeats' successful jobs: the
    relaunch's ``restart_s`` (the fault to the state restored, less the load) and the
    in-job phases, keyed ``in_job.<field>``: detection to the round written, leave to
    the survivors out of the run, teardown to their groups gone, rendezvous to every
    process in the round, groups to the model being built (less ``groups_per_rank_s`` x
    its ranks, the default's), engine to the state restored (less the load), first step
    to the first iteration done (one steady iteration included). Overlapping marks count
    0. Returns ``{field: (value, why)}``."""
    repeats = [r for r in data.get("repeats") or [] if isinstance(r, dict)]
    out: Dict[str, Any] = {}
    relaunch = [r["relaunch"] for r in repeats if (r.get("relaunch") or {}).get("ok")]
    marks = _marks(relaunch, ["state restored"])
    if "state restored" in marks:
        out["restart_s"] = (max(0.0, marks["state restored"] - marks["load"]),
                            "relaunch: fault to state restored, less the load")
    in_job = [r["in-job"] for r in repeats if (r.get("in-job") or {}).get("ok")]
    marks = _marks(in_job, RESTART_BENCH_MARKS)
    if not all(m in marks for m in RESTART_BENCH_MARKS):
        return out
    times = [marks[m] for m in RESTART_BENCH_MARKS]
    gaps = dict(zip(("detection_s", "leave_s", "teardown_s", "rendezvous_s", "groups_s",
                     "engine_s", "first_step_s"),
                    (b - a for a, b in zip([0.0] + times, times))))
    ranks = int((data.get("options") or {}).get("ranks") or 1)
    gaps["groups_s"] -= InJobPhases().groups_per_rank_s * ranks
    gaps["engine_s"] -= marks["load"]
    for name, value in gaps.items():
        out[f"in_job.{name}"] = (max(0.0, value), f"in-job phase of {len(in_job)} run(s), "
                                                  f"{ranks} ranks")
    return out


def from_benchmark_json(paths: List[str]) -> Dict[str, Any]:
    """Figures from benchmark JSON files (any of ``two_level_bench.py``,
    ``redundancy_bench.py``, ``exact_bench.py``, ``restart_bench.py``: its in-job phases
    keyed ``in_job.<field>``); returns ``{field: (value, source)}``.

    Raises:
        ValueError: a file that cannot be read or holds a malformed figure, naming it.
    """
    found: Dict[str, Any] = {}
    restarts: List[tuple] = []
    for path in paths:
        data = _read_benchmark(path)
        found.update(_figures_of(path, data, restarts))
        if isinstance(data, dict) and isinstance(data.get("repeats"), list):
            try:
                figures = restart_bench_figures(data)
            except (AttributeError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"--from-json {path}: its repeats cannot be read "
                                 f"({type(err).__name__}: {err})") from None
            for name, (value, why) in figures.items():
                if name == "restart_s":
                    restarts.append((value, f"{path}: {why}"))
                else:
                    found[name] = (value, f"{path}: {why}")
    if restarts:
        found["restart_s"] = (statistics.median(v for v, _ in restarts),
                              "median restart of " + ", ".join(w for _, w in restarts))
    return found


START = re.compile(r"^\[\s*([0-9.]+)\] .*training from iteration \d+ to")
ITERATION = re.compile(r"^\[\s*([0-9.]+)\]  iteration\s+(\d+)/")


def warmup_from_log(path: str) -> Optional[float]:
    """Extra seconds of a start's first iterations in one stamped run log (exact_bench's
    ``log.txt``): the training start to the 5th iteration, beyond 5 steady iterations
    (the 6th to the 10th)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    start = next((float(m.group(1)) for line in lines if (m := START.match(line))), None)
    its = [float(m.group(1)) for line in lines if (m := ITERATION.match(line))]
    if start is None or len(its) < 10:
        return None
    return max(0.0, (its[4] - start) - (its[9] - its[4]))


def _mean_iter_s(row: Dict[str, Any]) -> float:
    """Mean ``iter_s_mean`` over an exact_bench overhead row's successful rounds (the
    row's own when it has none)."""
    rounds = [r["iter_s_mean"] for r in row.get("rounds") or []
              if r.get("ok") and r.get("iter_s_mean") is not None]
    return statistics.mean(rounds) if rounds else row["iter_s_mean"]


def exact_bench_figures(data: Dict[str, Any]) -> Dict[str, Any]:
    """From an ``exact_bench.py`` JSON's clean (overhead) runs: ``warmup_s`` (median over
    the ``none`` runs' logs, where they are still on disk) and ``background_s_per_gb``
    (how much slower the two-level runs' iterations were than none's, both the mean
    over their rounds, beyond the persisted snapshots' save calls, per GB a rank copied
    and wrote per iteration).
    Returns ``{field: (value, why)}``."""
    out: Dict[str, Any] = {}
    clean = {r.get("policy"): r for r in data.get("overhead", []) if r.get("ok")}
    none, two = clean.get("none"), clean.get("two-level-full")
    if none is not None:
        runs = none.get("rounds") or [none]
        warm = [w for r in runs if r.get("run_dir")
                for w in [warmup_from_log(os.path.join(r["run_dir"], "log.txt"))] if w is not None]
        if warm:
            out["warmup_s"] = (statistics.median(warm), "first iterations of the clean none runs")
    options = data.get("options") or {}
    if none is not None and two is not None and options.get("nproc"):
        moved = ((two.get("mem_bytes_per_iter") or 0) + (two.get("storage_bytes_per_iter") or 0)) \
            / int(options["nproc"])
        pec = clean.get("pec-dynamic") or {}
        calls = (pec.get("stall_ms_median") or 0) / 1000 / int(options.get("save_interval") or 10)
        # Every round, not the fastest: a round that the machine slowed down says as much
        # about the background work as one it did not, and the fastest of each policy
        # may come from different minutes of a machine whose speed drifts.
        slower = _mean_iter_s(two) - _mean_iter_s(none) - calls
        if moved > 0:
            out["background_s_per_gb"] = (max(0.0, slower) / (moved / GB),
                                          "clean two-level runs' slowdown per GB moved (mean over rounds)")
    return out


def calibrate(storage_dir: str, config: Optional[str], data_path: Optional[str], nproc: int,
              iters: int, with_restart: bool, json_paths: List[str],
              base: Optional[Hardware] = None) -> Dict[str, Any]:
    """Measure (or read) the figures; returns ``{"hardware": {...}, "sources": {...}}``.

    Figures neither measured nor read keep ``base``'s (or the defaults), and their
    source says so. The inputs (the benchmark files, the run's flags) are checked before
    anything is measured.

    Raises:
        ValueError: a bad input, naming its flag or file.
        RuntimeError: the training run failed.
    """
    if config and not data_path:
        raise ValueError("--config needs --data-path (a prepared dataset prefix)")
    read = from_benchmark_json(json_paths)
    if "iteration_s" not in read and not config and base is None:
        raise ValueError("no iteration time: give --config and --data-path (a short run), "
                         "a benchmark --from-json, or --iteration-time")
    measured: Dict[str, Any] = {}
    copy = measure_copy_gbps()
    measured["d2h_gbps"] = (copy, "copy into pinned/shared host memory")
    measured["h2d_gbps"] = (copy, "same copy, the other way assumed symmetric")
    storage = measure_storage_gbps(storage_dir)
    measured["storage_write_gbps"] = (storage["write_gbps"], f"write+fsync under {storage_dir}")
    measured["storage_read_gbps"] = (storage["read_gbps"], f"cold read under {storage_dir}")
    if config:
        with tempfile.TemporaryDirectory(prefix="moc-calibrate-run-") as out:
            run = measure_training(config, data_path, nproc, iters, with_restart, out)
        measured["iteration_s"] = (run["iteration_s"], f"{iters} iterations of {config} on "
                                                       f"{nproc} ranks")
        if "restart_s" in run:
            measured["restart_s"] = (run["restart_s"], "one injected crash under torchrun")
    measured.update(read)
    values = asdict(base) if base is not None else {}
    values.update({k: v for k, (v, _) in measured.items() if not k.startswith("in_job.")})
    hardware = Hardware(**values)
    sources = {k: s for k, (_, s) in measured.items()}
    for name in asdict(hardware):
        sources.setdefault(name, "given" if base is not None else "default")
    out = {"hardware": asdict(hardware), "sources": sources,
           "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    in_job = {k.split(".", 1)[1]: v for k, (v, _) in measured.items() if k.startswith("in_job.")}
    if in_job:
        out["in_job"] = in_job
    return out
