"""The results of ``two_level_bench.py``: one row per (system, interval), the printed
table, its notes and checks, and the plot of the stalls."""

import statistics

from benchlib.ranks import group_errors
from benchlib.tables import fmt, print_aligned
from benchlib.two_level_peers import (ASYNC_PEERS, BASELINE, parse_intervals, parse_systems,
                                      timed_iters)


def _max_per_index(lists: list) -> list:
    """Per position, the maximum over ranks (lists of equal length; shorter ones cut)."""
    n = min((len(x) for x in lists), default=0)
    return [max(x[i] for x in lists) for i in range(n)]


# MoC's snapshot stages: (name in the rows, field of deepspeed_ext.two_level.records.SnapshotTiming).
STAGES = (("save_call", "save_s"), ("slot_wait", "slot_wait_s"), ("host_wait", "host_wait_s"),
          ("device_wait", "device_wait_s"), ("copy", "copy_s"), ("checksum", "checksum_s"),
          ("publish", "publish_s"))
STAGE_MEDIANS = tuple(name for name, _ in STAGES) + ("copies", "copy_gb_s", "checksum_gb_s",
                                                       "checksum_threads")


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _slowest_rate(timings: list, field: str):
    """GB/s of the slowest rank (``nbytes / field``); None unless every rank has both."""
    rates = [t["nbytes"] / t[field] / 1e9 for t in timings if t.get(field) and t.get("nbytes")]
    return min(rates) if rates and len(rates) == len(timings) else None


def save_stages(timings: list):
    """One save's stages over the ranks, from each rank's ``timing`` (a SnapshotTiming as a
    dict): seconds the max over ranks (None where a rank has none: the device wait on
    CPU), ``copies`` the most of any rank, GB/s the slowest rank's, ``persist`` rank 0's
    (every rank decides it alike). None when a rank has no timing (a tree that records
    none, or a snapshot never sealed)."""
    if not timings or any(t is None for t in timings):
        return None
    out = {}
    for name, field in STAGES:
        values = [t.get(field) for t in timings]
        out[name] = None if any(v is None for v in values) else max(values)
    out["copies"] = max(int(t.get("copies") or 0) for t in timings)
    out["nbytes"] = sum(int(t.get("nbytes") or 0) for t in timings)
    out["copy_gb_s"] = _slowest_rate(timings, "copy_s")
    out["checksum_gb_s"] = _slowest_rate(timings, "checksum_s")
    out["checksum_threads"] = max(int(t.get("checksum_threads") or 0) for t in timings)
    out["persist"] = bool(timings[0].get("persist"))
    return out


def stage_medians(saves: list):
    """Median of each stage over ``saves`` (:func:`save_stages` dicts); None if none."""
    saves = [s for s in saves if s is not None]
    if not saves:
        return None
    return {key: _median([s[key] for s in saves]) for key in STAGE_MEDIANS}


def _reference(row: dict, per_rank: list) -> None:
    """The turn's references (A/B/A): the mean of the max over ranks before it and after
    it; the overhead's reference is the mean of the two (the one there is, if only one)."""
    means = {}
    for when, key in (("before", "ref_iter_s"), ("after", "ref_after_iter_s")):
        times = _max_per_index([out.get(key) or [] for out in per_rank])
        row[f"ref_iter_s_{when}"] = times
        means[when] = statistics.mean(times) if times else None
        row[f"ref_iter_s_mean_{when}"] = means[when]
    known = [m for m in means.values() if m is not None]
    if known:
        row["ref_iter_s_mean"] = statistics.mean(known)


def _startup_and_warmup(row: dict, per_rank: list) -> None:
    """The system's setup (max over ranks; each rank's too) and the warm-up saves' stalls,
    each the max over ranks, in order, and their stages."""
    for key in ("setup_s", "prepare_s"):
        values = [(out.get("startup") or {}).get(key) for out in per_rank]
        if any(v is not None for v in values):
            row[f"{key}_per_rank"] = values
            row[key] = max(v for v in values if v is not None)
    warm = [out.get("warmup_records") or [] for out in per_rank]
    n = min((len(w) for w in warm), default=0)
    if n:
        row["warmup_stalls_s"] = [max(w[i]["call_s"] + (w[i]["wait_s"] or 0.0) for w in warm)
                                  for i in range(n)]
        row["warmup_stall_s"] = max(row["warmup_stalls_s"])
        row["warmup_save_stages"] = [save_stages([w[i].get("timing") for w in warm])
                                     for i in range(n)]
        if row["newest_step"] is None:
            row["newest_step"] = warm[0][n - 1]["step"]


def _split_by_persist(row: dict, records: list, stalls: list, iter_s: list) -> None:
    """Every save's stages (``save_stages``, raw per rank in ``save_timings``), their
    medians, and the saves whose snapshot persisted apart from the memory-only ones:
    stall and stage medians, and the mean time of the iterations they touch (the one that
    saved and the next, whose step waits for the copy)."""
    n = len(stalls)
    row["save_timings"] = [[rec[i].get("timing") for rec in records] for i in range(n)]
    row["save_stages"] = [save_stages(per) for per in row["save_timings"]]
    row["stages_median"] = stage_medians(row["save_stages"])
    if not row["stages_median"]:
        return
    touched = set()
    for i, stages in enumerate(row["save_stages"]):
        if stages is not None and stages["persist"] and records[0][i].get("iteration") is not None:
            touched.update({records[0][i]["iteration"], records[0][i]["iteration"] + 1})
    for label, want in (("persist", True), ("memory_only", False)):
        picked = [i for i, s in enumerate(row["save_stages"]) if s is not None and s["persist"] == want]
        row[f"saves_{label}"] = len(picked)
        row[f"stall_s_median_{label}"] = _median([stalls[i] for i in picked])
        row[f"stages_median_{label}"] = stage_medians([row["save_stages"][i] for i in picked])
        times = [t for j, t in enumerate(iter_s) if (j in touched) == want]
        row[f"iter_s_mean_{label}"] = statistics.mean(times) if times else None


def table_rows(results: dict, launch_error: str, opts) -> list:
    """The no-checkpoint reference row, then one row per (system, interval), failed
    ones included with their error."""
    rows = [_baseline_row(results, launch_error)]
    done = {(p["system"], p["interval"]): p for p in results.get("phases", [])}
    current = results.get("current") or {}
    for interval in parse_intervals(opts.intervals):
        for system in parse_systems(opts.systems):
            row = _empty_row(system, interval)
            phase = done.get((system, interval))
            if phase is None:
                if launch_error and current.get("system") == system and current.get("interval") == interval:
                    row["error"] = f"{launch_error}, during this turn"
                else:
                    row["error"] = f"not measured: {launch_error}" if launch_error else "no result"
            else:
                _turn_row(row, phase, timed_iters(opts, interval, system))
            rows.append(row)
    return rows


def _baseline_row(results: dict, launch_error: str) -> dict:
    """The no-checkpoint row: the iterations before the first turn and after the last."""
    baseline = [_max_per_index(v) for v in results.get("baseline", {}).values()]
    base_times = [t for part in baseline for t in part]
    base_mean = statistics.mean(base_times) if base_times else None
    row = {"system": BASELINE, "interval": None, "iter_s_mean": base_mean,
           "iter_s_mean_before": statistics.mean(baseline[0]) if baseline and baseline[0] else None,
           "iter_s_mean_after": (statistics.mean(baseline[1])
                                 if len(baseline) > 1 and baseline[1] else None),
           "iter_s": base_times}
    if launch_error and (results.get("current") or {}).get("system") == BASELINE:
        row["error"] = launch_error
    return row


def _empty_row(system: str, interval: int) -> dict:
    """A (system, interval) row before anything of its turn is known."""
    return {"system": system, "interval": interval, "checkpoints": 0,
            "stall_s_median": None, "stall_s_max": None, "stall_s_mean": None,
            "save_call_s_median": None, "wait_s_median": None, "iter_s_mean": None,
            "iter_overhead": None, "recovery_s": None, "recovery_memory_s": None,
            "recovery_storage_s": None, "recovered_step": None, "newest_step": None,
            "recovered_step_storage": None, "load_source": None,
            "bytes_persisted": None, "persists": None, "host_mem_bytes": None,
            "drain_s": None, "error": None}


def _turn_row(row: dict, phase: dict, timed: int) -> None:
    """Fill ``row`` from one turn's per-rank results (``timed``: its timed iterations)."""
    per_rank = phase["per_rank"]
    errors = [(r, e) for r, out in enumerate(per_rank) for e in out["errors"]]
    if errors:
        row["error"] = group_errors(errors)
    records = [out["records"] for out in per_rank]
    stalls, n = _save_stalls(row, records)
    iter_s = _max_per_index([out["iter_s"] for out in per_rank])
    _reference(row, per_rank)
    if len(iter_s) == timed:
        row["iter_s_mean"] = statistics.mean(iter_s)
        row["iter_s"] = iter_s
        if row.get("ref_iter_s_mean"):
            row["iter_overhead"] = row["iter_s_mean"] / row["ref_iter_s_mean"] - 1
    _startup_and_warmup(row, per_rank)
    if stalls and row["system"].startswith("moc"):
        _split_by_persist(row, [rec[:n] for rec in records], stalls, iter_s)
    if not stalls and not errors:
        row["note"] = (f"no checkpoint within the {timed} timed "
                       f"iterations; recovery "
                       "loaded the warm-up's")
    drains = [out["drain_s"] for out in per_rank if out.get("drain_s") is not None]
    row["drain_s"] = max(drains) if drains else None
    row["turn_s"] = max(out.get("turn_s") or 0.0 for out in per_rank)
    _recovery(row, per_rank)
    _storage_and_notes(row, phase, per_rank, stalls)


def _save_stalls(row: dict, records: list) -> tuple:
    """Each timed save's stall, call and wait (the max over ranks; a wait of None, never
    reported, counts as 0) and their medians into ``row``; returns (stalls, saves that
    every rank recorded)."""
    n = min(len(r) for r in records)
    stalls, calls, waits = [], [], []
    for i in range(n):
        per = [(rec[i]["call_s"], rec[i]["wait_s"] or 0.0) for rec in records]
        stalls.append(max(c + w for c, w in per))
        calls.append(max(c for c, _ in per))
        waits.append(max(w for _, w in per))
    if stalls:
        row.update(checkpoints=n, stall_s_median=statistics.median(stalls),
                   stall_s_max=max(stalls), stall_s_mean=statistics.mean(stalls),
                   save_call_s_median=statistics.median(calls),
                   wait_s_median=statistics.median(waits), stall_s=stalls,
                   newest_step=records[0][n - 1]["step"],
                   # Each rank's own median: against the median of the max over
                   # ranks, it shows what waiting for the slowest rank adds.
                   save_call_s_median_per_rank=[
                       statistics.median(rec[i]["call_s"] for i in range(n))
                       for rec in records])
    return stalls, n


def _recovery(row: dict, per_rank: list) -> None:
    """The recovery loads (the max over ranks; what rank 0 loaded) and the host memory."""
    recs = [out.get("recovery") for out in per_rank]
    if all(recs):
        for key in ("recovery_s", "recovery_memory_s", "recovery_storage_s"):
            values = [r.get(key) for r in recs]
            row[key] = max(values) if all(v is not None for v in values) else None
        row["recovered_step"] = recs[0].get("recovered_step")
        row["recovered_step_storage"] = recs[0].get("recovered_step_storage")
        row["load_source"] = recs[0].get("load_source")
        if recs[0].get("storage_source") is not None:
            row["storage_load_source"] = recs[0]["storage_source"]
    hosts = [out.get("host_mem_bytes") for out in per_rank]
    if hosts and all(h is not None for h in hosts):
        row["host_mem_bytes"] = sum(hosts)


def _storage_and_notes(row: dict, phase: dict, per_rank: list, stalls: list) -> None:
    """The bytes the timed saves persisted (rank 0's count) and the peers' notes."""
    storage = phase.get("storage") or {}
    if storage.get("bytes_per_tag") is not None and stalls:
        row["bytes_persisted"] = sum(storage["bytes_per_tag"].values())
        row["persists"] = int(len(storage["bytes_per_tag"]))
        row["bytes_per_tag"] = storage["bytes_per_tag"]
        row["uncounted_files"] = storage.get("uncounted")
    notes = [out["note"] for out in per_rank if out.get("note")]
    if notes:
        row["note"] = (row["note"] + "; " if row.get("note") else "") + notes[0]


def print_table(rows: list) -> None:
    mib = float(2 ** 20)
    header = ["system", "every", "ckpts", "stall med (s)", "stall max (s)", "iter mean (s)",
              "ref iter (s)", "iter overhead", "persisted (MiB)", "persists", "host mem (MiB)",
              "recovery (s)", "from memory (s)", "from storage (s)", "loaded step / newest"]
    table = [header]
    for r in rows:
        if r["system"] == BASELINE:
            table.append([BASELINE, "-", "0", "-", "-", fmt(r["iter_s_mean"], ".3f"), "-", "-"]
                         + ["-"] * (len(header) - 8))
            continue
        if r["stall_s_median"] is None and r["iter_s_mean"] is None:
            table.append([r["system"], str(r["interval"]), "FAILED"] + ["-"] * (len(header) - 3))
            continue
        steps = "-"
        if r["recovered_step"] is not None:
            steps = f"{r['recovered_step']} / {r['newest_step']}"
            if r.get("recovered_step_storage") is not None:
                steps += (f"; storage: {r['recovered_step_storage']}"
                          f" ({r.get('storage_load_source') or '?'})")
        overhead = "-" if r["iter_overhead"] is None else f"{100 * r['iter_overhead']:+.1f} %"
        table.append([r["system"], str(r["interval"]), str(r["checkpoints"]),
                      fmt(r["stall_s_median"], ".4f"), fmt(r["stall_s_max"], ".4f"),
                      fmt(r["iter_s_mean"], ".3f"), fmt(r.get("ref_iter_s_mean"), ".3f"), overhead,
                      fmt(r["bytes_persisted"], ".1f", mib), "-" if r["persists"] is None else str(r["persists"]),
                      fmt(r["host_mem_bytes"], ".1f", mib), fmt(r["recovery_s"], ".3f"),
                      fmt(r["recovery_memory_s"], ".3f"), fmt(r["recovery_storage_s"], ".3f"),
                      steps])
    print_aligned(table)
    for r in rows:
        label = r["system"] + (f" every {r['interval']}" if r.get("interval") else "")
        if r.get("error"):
            failed = r["system"] != BASELINE and r["stall_s_median"] is None and r["iter_s_mean"] is None
            lines = r["error"].splitlines()
            print(f"{label}: {'FAILED' if failed else 'error'}: {lines[0]}"
                  + (" [...] (whole message in --json)" if len(lines) > 1 else ""))
        if r.get("note"):
            print(f"{label}: note: {r['note']}")


def _ms(value) -> str:
    return fmt(value, ".1f", 1e-3)


def _stage_cells(stages) -> list:
    """The stage columns of one row (``-`` where not measured)."""
    if not stages:
        return ["-"] * 10
    threads = stages.get("checksum_threads")
    rate = fmt(stages.get("checksum_gb_s"), ".2f")
    return [_ms(stages["save_call"]), fmt(stages["copies"], ".0f"), _ms(stages["slot_wait"]),
            _ms(stages["host_wait"]), _ms(stages["device_wait"]), _ms(stages["copy"]),
            fmt(stages["copy_gb_s"], ".2f"), _ms(stages["checksum"]),
            rate + (f" ({threads:.0f})" if threads else ""), _ms(stages["publish"])]


def print_stage_table(rows: list) -> None:
    """MoC's rows: start-up, warm-up stalls, and the median of each snapshot stage over
    the timed saves (ms), memory-only and persisting saves' stalls apart."""
    mocs = [r for r in rows if r["system"].startswith("moc") and r["checkpoints"]]
    if not mocs:
        return
    header = ["system", "every", "saves mem/persist", "setup (s)", "prepare (s)",
              "warm-up stalls (ms)", "save call", "copies", "slot wait", "host wait",
              "device wait", "copy", "copy GB/s", "checksum", "checksum GB/s (threads)",
              "publish", "stall mem-only", "stall persist"]
    table = [header]
    for r in mocs:
        split = "-"
        if r.get("saves_memory_only") is not None:
            split = f"{r['saves_memory_only']} / {r['saves_persist']}"
        warm = ", ".join(_ms(v) for v in r.get("warmup_stalls_s") or []) or "-"
        table.append([r["system"], str(r["interval"]), split, fmt(r.get("setup_s"), ".2f"),
                      fmt(r.get("prepare_s"), ".2f"), warm] + _stage_cells(r.get("stages_median"))
                     + [_ms(r.get("stall_s_median_memory_only")),
                        _ms(r.get("stall_s_median_persist"))])
    print()
    print("MoC snapshot stages: medians over the timed saves, ms (each save: the max over ranks; "
          "GB/s: the slowest rank's)")
    print_aligned(table)


def _ratio_text(a, b, spec=".3f") -> str:
    return "-" if a is None or not b else format(a / b, spec)


def print_notes_and_checks(rows: list, opts) -> None:
    """What the columns measure, then the checks the design expects (measured, not
    asserted): MoC's stall against DeepSpeed's and the asynchronous peers', its
    iteration overhead at interval 1, and its recovery from memory against DeepSpeed's."""
    by_key = {(r["system"], r["interval"]): r for r in rows}
    intervals = parse_intervals(opts.intervals)
    systems = parse_systems(opts.systems)
    _print_notes(by_key.get((BASELINE, None)))
    print()
    print("checks (measured here, not asserted):")
    mocs = [s for s in ("moc-full", "moc-pec") if s in systems]
    _check_sync_stall(by_key, intervals, mocs)
    _check_async_stall(by_key, intervals, mocs, systems)
    _check_overhead(by_key, intervals, mocs)
    _check_recovery(by_key, intervals, mocs)


def _print_notes(base) -> None:
    """The notes under the tables; ``base``: the no-checkpoint row (or None)."""
    print()
    print("stall: per checkpoint, max over ranks of the save call plus the waits the system "
          "imposes before the next optimizer step or save")
    print("       (deepspeed*: the save call; deepspeed-decoupled: + the commit inside the next "
          "engine.step(); dcp-async: + waiting for the staging")
    print("       before the next step and for the previous upload before the next save; moc-*: "
          "+ moc.stall_s). The warm-up saves of each turn are excluded.")
    print("iter:  mean over the timed iterations of the max over ranks (forward, backward, step, "
          "save); overhead against the turn's own reference (A/B/A):")
    print("       the mean of as many iterations without checkpoints right before the turn and "
          "right after it (the no-checkpoint row: before the first turn and after the last).")
    print("stages (MoC): setup = the checkpointer's construction, prepare = its slot preparation "
          "(both outside the timed iterations); warm-up stalls: the")
    print("       --warmup saves, not in any median; save call (slot wait: its part waiting for a "
          "slot); host/device wait: the optimizer step's wait for")
    print("       the copy (device: CUDA events, - on CPU); copy, checksum, publish: the snapshot's "
          "stages off the step's path; stall mem-only / persist:")
    print("       medians of the saves kept in memory and of those also persisted.")
    print("bytes: files under the timed checkpoints' directories once everything is on storage "
          "(`latest`, warm-up and DeepSpeed's zero_to_*.py copies not counted).")
    print("recovery: max over ranks of loading the newest checkpoint into the engine; storage "
          "loads after os.sync() and posix_fadvise(DONTNEED) on the files.")
    if base and base.get("iter_s_mean_before") is not None and base.get("iter_s_mean_after") is not None:
        print(f"reference iteration: {base['iter_s_mean_before']:.3f} s before the turns, "
              f"{base['iter_s_mean_after']:.3f} s after them")


def _failed(row):
    """Why a check cannot use ``row`` (not run, failed, no timed checkpoint), or None."""
    if row is None:
        return "not run"
    if row["stall_s_median"] is None:
        return "FAILED" if row.get("error") else "no timed checkpoint"
    return None


def _check_sync_stall(by_key: dict, intervals: list, mocs: list) -> None:
    """1. MoC's median stall against DeepSpeed's synchronous one; each rank's own save call."""
    line = []
    for interval in intervals:
        ds = by_key.get(("deepspeed", interval))
        for moc in mocs:
            m = by_key.get((moc, interval))
            why = _failed(m) or _failed(ds)
            line.append(f"{moc} every {interval}: "
                        + (why or f"{100 * m['stall_s_median'] / ds['stall_s_median']:.2f} % "
                                   f"({m['stall_s_median']:.4f} s vs {ds['stall_s_median']:.4f} s)"))
    print("  1. MoC stall / deepspeed sync stall (medians; expected <= 2 %): "
          + ("; ".join(line) if line else "no MoC system run"))
    own = []
    for interval in intervals:
        for moc in mocs:
            m = by_key.get((moc, interval))
            if m and m.get("save_call_s_median_per_rank"):
                ranks = ", ".join(f"{1000 * c:.1f}" for c in m["save_call_s_median_per_rank"])
                own.append(f"{moc} every {interval}: {ranks} ms (max over ranks: "
                           f"{1000 * m['save_call_s_median']:.1f} ms)")
    if own:
        print("     each rank's own median save call, per rank: " + "; ".join(own))


def _check_async_stall(by_key: dict, intervals: list, mocs: list, systems: list) -> None:
    """2. MoC's median stall against each asynchronous peer's that ran."""
    line = []
    for interval in intervals:
        for moc in mocs:
            m = by_key.get((moc, interval))
            for peer in ASYNC_PEERS:
                if peer not in systems:
                    continue
                p = by_key.get((peer, interval))
                why = _failed(m) or (f"{peer} {_failed(p)}" if _failed(p) else None)
                line.append(f"{moc}/{peer} every {interval}: "
                            + (why or _ratio_text(m["stall_s_median"], p["stall_s_median"])))
    print("  2. MoC stall / async peer's stall (medians; expected <= 0.5): "
          + ("; ".join(line) if line else "not measured"))


def _check_overhead(by_key: dict, intervals: list, mocs: list) -> None:
    """3. MoC's iteration overhead when it checkpoints every iteration."""
    line = []
    for moc in mocs:
        m = by_key.get((moc, 1))
        if 1 not in intervals:
            line.append(f"{moc}: interval 1 not run")
        elif _failed(m) or m["iter_overhead"] is None:
            line.append(f"{moc}: {_failed(m) or 'not measured'}")
        else:
            line.append(f"{moc}: {100 * m['iter_overhead']:+.1f} %")
    print("  3. iteration overhead of MoC checkpointing every iteration (expected <= 10 %): "
          + ("; ".join(line) if line else "no MoC system run"))


def _check_recovery(by_key: dict, intervals: list, mocs: list) -> None:
    """4. DeepSpeed's load time against MoC's recovery from memory."""
    line = []
    for interval in intervals:
        ds = by_key.get(("deepspeed", interval))
        for moc in mocs:
            m = by_key.get((moc, interval))
            if ds is None or ds["recovery_s"] is None:
                line.append(f"every {interval}: deepspeed recovery not measured")
                break
            if m is None or m["recovery_memory_s"] is None:
                line.append(f"{moc} every {interval}: memory recovery not measured")
                continue
            line.append(f"{moc} every {interval}: {ds['recovery_s'] / m['recovery_memory_s']:.1f}x "
                        f"({ds['recovery_s']:.3f} s vs {m['recovery_memory_s']:.3f} s)")
    print("  4. deepspeed load time / MoC recovery time from memory (expected >= 5x): "
          + ("; ".join(line) if line else "not measured"))


def plot_stalls(rows: list, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nplot: matplotlib is not importable here; {path} not written "
              "(pip install matplotlib, then rerun)")
        return
    measured = [r for r in rows if r.get("stall_s")]
    if not measured:
        print(f"\nplot: no system measured a stall; {path} not written")
        return
    intervals = sorted({r["interval"] for r in measured})
    fig, axes = plt.subplots(1, len(intervals), figsize=(6 * len(intervals), 4.5), squeeze=False)
    from matplotlib.ticker import MaxNLocator
    for ax, interval in zip(axes[0], intervals):
        for r in measured:
            if r["interval"] != interval:
                continue
            xs = list(range(1, len(r["stall_s"]) + 1))
            ax.plot(xs, r["stall_s"], marker="o", markersize=3, label=r["system"])
        failed = [r["system"] for r in rows if r.get("interval") == interval
                  and r.get("error") and not r.get("stall_s")]
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"checkpoint (one every {interval} iteration{'s' if interval > 1 else ''})")
        ax.set_ylabel("stall per checkpoint (s, max over ranks)")
        ax.set_title(f"training-loop stall, checkpoint every {interval}"
                     + (f"\nFAILED (not plotted): {', '.join(failed)}" if failed else ""),
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}")
