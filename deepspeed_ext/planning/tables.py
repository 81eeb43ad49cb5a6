"""``moc-plan``'s printed output: the cluster's line, the policy and simulation tables,
and the ETTR-against-MTBF plot (``simulate --plot``)."""

from dataclasses import asdict
from typing import List, Sequence

from deepspeed_ext.planning import costs as cm
from deepspeed_ext.planning.search import Choice
from deepspeed_ext.planning.simulate import MAX_FAILURES


def describe(model: cm.ModelShape, layout: cm.Layout, hw: cm.Hardware) -> str:
    """The first line of ``recommend`` and ``simulate``: the model, layout and figures."""
    return (f"{model.name}: {model.params_total / 1e9:.2f}B parameters "
            f"({model.params_expert / 1e9:.2f}B in {model.num_experts} experts x "
            f"{model.num_moe_layers} MoE layers) on {layout.gpus} GPUs ({layout.nodes} node(s) of "
            f"{min(layout.gpus, layout.gpus_per_node)}, EP {layout.expert_parallel(model)}); "
            f"iteration {hw.iteration_s:g} s, restart {hw.restart_s:g} s, storage "
            f"{hw.storage_write_gbps:g}/{hw.storage_read_gbps:g} GB/s per node (write/read), "
            f"device-to-host {hw.d2h_gbps:g} GB/s, network {hw.network_gbps:g} GB/s per node")


def fmt_bytes(n: float) -> str:
    """Binary units, as ``--host-memory-gb`` (GiB) and the trainer's memory figures."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def print_policies(choices: Sequence[Choice]) -> List[dict]:
    """The policy table (one line per family); returns its JSON rows."""
    head = (f"{'policy':<12} {'ETTR':>6} {'PLT':>7} {'stall/ckpt':>10} {'lost it':>8} "
            f"{'downtime':>9} {'host/rank':>11}  settings")
    print(head)
    print("-" * (len(head) + 30))
    rows = []
    for c in choices:
        if c.best is None:
            print(f"{c.kind:<12} {'-':>6} {'-':>7} {'-':>10} {'-':>8} {'-':>9} {'-':>11}  "
                  f"none admissible ({c.why_none})")
            rows.append({"policy": c.kind, "best": None, "why": c.why_none})
            continue
        b = c.best
        print(f"{c.kind:<12} {b.ettr:>6.3f} {b.plt:>7.2%} {b.costs.stall_s:>9.3f}s "
              f"{b.expected_lost_iterations:>8.1f} {b.expected_downtime_s:>8.1f}s "
              f"{fmt_bytes(b.costs.host_bytes_per_rank):>11}  {b.costs.policy.label()}"
              + (f"  [{'; '.join(b.costs.notes)}]" if b.costs.notes else ""))
        rows.append({"policy": c.kind, "settings": asdict(b.costs.policy), "label":
                     b.costs.policy.label(), "ettr": b.ettr, "plt": b.plt,
                     "stall_s": b.costs.stall_s, "lost_iterations": b.expected_lost_iterations,
                     "downtime_s": b.expected_downtime_s,
                     "host_bytes_per_rank": b.costs.host_bytes_per_rank,
                     "notes": list(b.costs.notes)})
    return rows


def print_simulation(table, in_job: bool) -> None:
    place = f" {'in place':>8}" if in_job else ""
    head = (f"{'MTBF s':>8} {'policy':<12} {'ETTR (sim)':>16} {'ETTR (model)':>12} "
            f"{'PLT':>8} {'failures':>8} {'goodput tok/s':>14}{place}  settings")
    print(head)
    print("-" * (len(head) + 30))
    for r in table:
        place = f" {r['in_place']:>8.0%}" if in_job else ""
        print(f"{r['mtbf_s']:>8g} {r['policy']:<12} {r['ettr']:>9.3f} ±{r['ettr_ci']:.3f} "
              f"{r['ettr_model']:>12.3f} {r['plt']:>8.2%} {r['failures']:>8.1f} "
              f"{r['goodput_tokens_s']:>14.0f}{place}  {r['label']}"
              + (f"  [{r['unfinished']} run(s) unfinished after {MAX_FAILURES} failures]"
                 if r["unfinished"] else ""))


def plot_sweep(table, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in dict.fromkeys(r["policy"] for r in table):
        rows = sorted((r for r in table if r["policy"] == kind), key=lambda r: r["mtbf_s"])
        x = [r["mtbf_s"] / 60 for r in rows]
        ax.errorbar(x, [r["ettr"] for r in rows], yerr=[r["ettr_ci"] for r in rows],
                    marker="o", capsize=3, label=kind)
    ax.set_xscale("log")
    ax.set_xlabel("MTBF (minutes)")
    ax.set_ylabel("ETTR (simulated, 95% CI)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
