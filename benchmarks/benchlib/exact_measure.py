"""What ``exact_bench.py`` reads from a run: its log lines (iteration times, the exact
recovery's and the saves' messages), the bytes its checkpoints and frames hold, and the
figures of each phase (overhead, recovery, ETTR)."""

import json
import os
import re
import statistics

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
    """A clean run's row: iteration times (after ``--warmup``), bytes to memory and to
    storage per iteration, host memory, the loop's stalls, the exact window."""
    row = {"policy": run["name"], "ok": not _failure(run), "wall_s": run["wall_s"],
           "run_dir": run["run_dir"]}
    if not row["ok"]:
        row.update(error=_failure(run), tail=_tail(run))
        return row
    if not _iteration_times(row, run, opts.warmup):
        row.update(ok=False, error="too few iteration lines to time", tail=_tail(run))
        return row
    policy, interval = run["policy"], opts.save_interval
    _bytes_per_iteration(row, run, policy, interval)
    _close_line_figures(row, run, policy)
    if policy in ("pec-dynamic", "two-level-full"):
        every = 1 if policy == "two-level-full" else interval
        saves = [float(m.group(2)) * 1e3 for m in (SAVED_RE.search(l) for _, l in run["lines"])
                 if m and int(m.group(1)) % every == 0]
        if saves:
            row["stall_ms_median"], row["stall_ms_max"] = statistics.median(saves), max(saves)
            row["saves"] = len(saves)
    return row


def _iteration_times(row: dict, run: dict, warmup: int) -> bool:
    """The iteration times after ``warmup`` into ``row``; False if the lines are too few."""
    by_iter = {}
    for t, i, ms in _iteration_lines(run):
        by_iter[i] = (t, ms)
    first = warmup + 1
    timed = [i for i in sorted(by_iter) if i > first and i - 1 in by_iter]
    if not timed or run["iters"] not in by_iter or first not in by_iter:
        return False
    gaps = [by_iter[i][0] - by_iter[i - 1][0] for i in timed]
    row["iter_s_median"] = statistics.median(gaps)
    row["iter_s_mean"] = (by_iter[run["iters"]][0] - by_iter[first][0]) / (run["iters"] - first)
    row["iter_gaps_s"] = gaps
    row["logged_ms_median"] = statistics.median(by_iter[i][1] for i in timed)
    return True


def _bytes_per_iteration(row: dict, run: dict, policy: str, interval: int) -> None:
    """Bytes to host memory and to storage per iteration, all ranks (exact: the frames;
    the others: the periodic checkpoints' manifests, the first and the last not counted)."""
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


def _close_line_figures(row: dict, run: dict, policy: str) -> None:
    """Host memory, the exact frames' stalls and window (the close and choice lines), the
    frame and window sizes, the keeper's snapshot budget."""
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
