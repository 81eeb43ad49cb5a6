"""The output of ``exact_bench.py``: its Markdown tables, the notes on failed runs, and
its plot."""

PHASES = ("overhead", "recovery", "ettr")


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
    """The Markdown tables of the phases that ran (overhead, recovery, ETTR), each with
    its heading and the note under it."""
    parts = []
    if results.get("overhead"):
        parts.append(_overhead_table(results))
    if results.get("recovery"):
        parts.append(_recovery_table(results["recovery"]))
    if results.get("ettr"):
        parts.append(_ettr_table(results["ettr"]))
    return "\n\n".join(parts)


def _overhead_table(results: dict) -> str:
    mib = 2.0 ** 20
    clean = {r["policy"]: r for r in results.get("overhead", [])}
    base = (clean.get("none") or {}).get("iter_s_mean") if clean.get("none", {}).get("ok") else None
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
    return (f"### Overhead without failures ({o['iters']} iterations, the first "
            f"{o['warmup']} + 1 not timed; fastest of {o['rounds']} run(s) per policy; "
            f"overhead of iter mean vs none)\n\n"
            + _md(head, rows) + "\n\niter: wall-clock gaps between rank 0's iteration "
            "lines (everything in the loop); MiB/it: all ranks; host mem: per rank (exact: "
            "two frames in flight; two-level: the keeper's snapshot budget); stall: exact: "
            "the loop's waits for a frame (close line), pec/two-level: the save calls.")


def _recovery_table(recovery: list) -> str:
    head = ["policy", "crash", "source", "resumed at", "redone", "PLT", "K after",
            "restart (s)", "load (s)", "replay (s)", "crash->back (s)"]
    rows = []
    for r in recovery:
        if not r["ok"]:
            rows.append(_failed_cells(r, len(head)))
            continue
        rows.append([r["policy"], f"crash@{r['crash_at']}:rank=1", str(r.get("source")),
                     _f(r.get("resumed_at"), "d"), _f(r.get("redone"), "d"),
                     "-" if r.get("plt") is None else f"{100 * r['plt']:.2f} %",
                     _f(r.get("k_after"), "d"), _f(r.get("restart_s"), ".2f"),
                     _f(r.get("load_s"), ".2f"), _f(r.get("replay_s"), ".2f"),
                     _f(r.get("crash_to_back_s"), ".2f")])
    return ("### Recovery from one crash\n\n" + _md(head, rows) + "\n\nredone: "
            "iterations the failed run had finished past the resume point (events' "
            "iterations_lost; exact replays them to the original bytes); restart: fault "
            "-> load start; replay: load end -> back at the last iteration finished "
            "before the crash; crash->back: the sum.")


def _ettr_table(ettr: list) -> str:
    head = ["policy", "MTBF (s)", "seed", "failures", "recoveries", "redone", "K final", "PLT acc.",
            "wall (s)", "ETTR", "ETTR ref", "ETTR own", "E[R] (s)", "ETTR model"]
    rows = []
    for r in ettr:
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
    e = ettr[0]
    mtbfs = ", ".join(f"{m:g}" for m in dict.fromkeys(r["mtbf_s"] for r in ettr))
    seeds = ", ".join(str(x) for x in dict.fromkeys(r["seed"] for r in ettr))
    return (f"### ETTR under random crashes (--moc-fault-mtbf {mtbfs} "
            f"--moc-fault-seed {seeds}, {e['iters']} iterations; ETTR = iterations "
            f"x T_iter(none) / wall)\n\n" + _md(head, rows) + "\n\nwall: first "
            "training start -> last iteration (restarts included); ETTR ref: with the "
            "T_iter of the clean none run just before (--ettr-reference); ETTR own: with the "
            "policy's own fault-free T_iter; E[R]: (wall - iterations x own T_iter) / "
            "failures; ETTR model: T_iter(none)/own T_iter x 1/(1 + E[R]/MTBF) with E[R] "
            "= the recovery table's crash->back (assumes one failure per MTBF of useful "
            "time; failures also fall in restarts' loads, re-done and slow first "
            "iterations, so it is optimistic).")


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
