#!/usr/bin/env python
"""MoE schedule benchmark: one MoE layer's forward + backward under DeepSpeed 0.19's own
schedule, Parm's S1 and S2 (``megatron/model/moe_schedules.py``), side by side in one run,
over a grid of layer configurations; and how well ``--moe-schedule auto``'s cost model
(``megatron/model/moe_cost.py``, calibrated at start as the trainer does) predicts them.

One run starts ``--nproc`` local ranks (gloo on CPU): tensor-parallel size ``--tp`` with
experts split over it, expert-parallel size ``nproc / tp``. For every configuration
(tokens per rank, hidden size, experts per rank, top-k) it builds DeepSpeed's MoE layer
with this project's expert MLP, and times ``--iters`` forward + backward passes of every
schedule after ``--warmup`` untimed ones. The schedules take turns pass by pass, and every
pass starts at a barrier. A pass's time is the slowest rank's; the table shows medians.
The script prints a table (``--json FILE`` writes the rows, ``--plot FILE`` a PNG; it
needs matplotlib) and asserts nothing about the numbers.

    python benchmarks/moe_schedule_bench.py [--nproc 4 --tp 2] [--tokens 256 1024]
        [--hidden 64 256] [--experts-per-rank 1 2] [--topk 1 2] [--iters 7] [--json FILE]
        [--plot FILE]
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.ranks import (finish_out_dir, print_failed_rank_logs,  # noqa: E402
                            read_results, run_rank_processes, run_worker, write_results)
from benchlib.tables import fmt, print_aligned  # noqa: E402

SCHEDULES = ("deepspeed", "parm-s1", "parm-s2")
GRID_FLAGS = ("tokens", "hidden", "experts_per_rank", "topk")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Time one MoE layer's forward + backward under "
                                            "DeepSpeed's, Parm's S1 and S2 schedules.")
    p.add_argument("--nproc", type=int, default=4, help="Local ranks to start.")
    p.add_argument("--tp", type=int, default=2, help="Tensor-parallel size (experts split over it).")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024],
                   help="Tokens per rank (micro-batch x sequence).")
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256], help="Hidden sizes.")
    p.add_argument("--experts-per-rank", type=int, nargs="+", default=[1, 2],
                   help="Experts per expert-parallel rank.")
    p.add_argument("--topk", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2, help="Untimed passes per schedule.")
    p.add_argument("--iters", type=int, default=7, help="Timed passes per schedule.")
    p.add_argument("--json", metavar="FILE", help="Also write the rows here as JSON.")
    p.add_argument("--plot", metavar="FILE", help="PNG of the speedups (needs matplotlib).")
    p.add_argument("--out-dir", metavar="DIR", help="Rank logs and results (default: a new "
                                                    "temporary directory, deleted at the end).")
    p.add_argument("--keep", action="store_true", help="Keep --out-dir.")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------------- ranks

def _init(opts):
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups
    dist.init_process_group("gloo")
    from megatron.training import jit_ops
    # as the trainer: no JIT build of DeepSpeed's shm op (a cold build held the ranks
    # 25-35 s, and every checkout of a venv rebuilt it)
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron.data.compat import quiet_core_import
    with quiet_core_import():
        from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=opts.tp)
    from megatron.training.mpu import CoreMPU
    groups.mpu = CoreMPU()
    from megatron.model.tensor_parallel import allow_flat_gathers_on_gloo
    allow_flat_gathers_on_gloo()  # DeepSpeed's token gathers on gloo (as the model does)


def _layer(opts, tokens, hidden, per_rank, topk):
    """DeepSpeed's MoE layer with this project's expert MLP, in a module of its own."""
    import torch
    from deepspeed.moe.layer import MoE
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import MLP
    ep = opts.nproc // opts.tp
    config = GPTMoEConfig(num_layers=1, hidden_size=hidden, num_attention_heads=opts.tp, vocab_size=64,
                          max_position_embeddings=16, num_experts=ep * per_rank,
                          moe_expert_parallel_size=ep, topk=topk, tensor_model_parallel_size=opts.tp,
                          enable_expert_tensor_parallelism=True)
    torch.manual_seed(1)
    moe = MoE(hidden_size=hidden, expert=MLP(config, opts.tp), num_experts=config.num_experts,
              ep_size=ep, k=topk, capacity_factor=opts.capacity_factor, min_capacity=4,
              drop_tokens=True, use_rts=False, enable_expert_tensor_parallelism=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.set_deepspeed_parallelism()
    return torch.nn.ModuleDict({"moe": moe})


def _timed_pass(module, x, probe) -> float:
    """One forward + backward; the slowest rank's seconds (every rank starts at a barrier)."""
    import torch
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    module.zero_grad(set_to_none=True)
    dist.barrier(group=metadata_group())
    start = time.perf_counter()
    out, l_aux, _ = module["moe"](x)
    ((out * probe).sum() + 0.01 * l_aux).backward()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=metadata_group())
    return took.item()


def _worker(opts, rank, world):
    import torch
    from megatron.model.moe_cost import LayerShape, capacity_of, choose
    from megatron.model.moe_schedules import install_schedules
    from megatron.training.moe_schedule_setup import measure_links
    _init(opts)
    results = {"rows": [], "links": None}
    dp_rank = rank // opts.tp
    links = None
    for tokens, hidden, per_rank, topk in itertools.product(
            opts.tokens, opts.hidden, opts.experts_per_rank, opts.topk):
        module = _layer(opts, tokens, hidden, per_rank, topk)
        gen = torch.Generator().manual_seed(100 + dp_rank)  # the pair holds the same tokens
        x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
        probe = torch.randn(tokens, hidden, generator=gen)
        ep = world // opts.tp
        installed = {}
        for schedule in SCHEDULES:
            def pick(index, groups, schedule=schedule):
                installed["groups"] = groups
                return schedule
            install_schedules(module, pick)
            installed[schedule] = module["moe"].deepspeed_moe.__dict__.get("forward")
        if links is None:
            links = measure_links(installed["groups"])
            results["links"] = links.to_record()
        times = {s: [] for s in SCHEDULES}
        for step in range(opts.warmup + opts.iters):
            for schedule in SCHEDULES:  # take turns: drift hits every schedule alike
                layer = module["moe"].deepspeed_moe
                layer.__dict__.pop("forward", None)
                if installed[schedule] is not None:
                    layer.forward = installed[schedule]
                seconds = _timed_pass(module, x, probe)
                if step >= opts.warmup:
                    times[schedule].append(seconds)
        shape = LayerShape(experts=ep * per_rank,
                           capacity=capacity_of(tokens, ep * per_rank, topk, opts.capacity_factor,
                                                4, True),
                           hidden=hidden, ep=ep, tp=opts.tp)
        best, predicted = choose(shape, links)
        results["rows"].append({
            "tokens": tokens, "hidden": hidden, "experts_per_rank": per_rank, "topk": topk,
            "experts": ep * per_rank, "capacity": shape.capacity, "volume_bytes": shape.volume,
            "measured_s": {s: statistics.median(v) for s, v in times.items()},
            "measured_all_s": times, "predicted_comm_s": predicted, "auto": best})
        if rank == 0:
            write_results(opts.out_dir, results)
    results["complete"] = True
    if rank == 0:
        write_results(opts.out_dir, results)
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    dist.barrier(group=metadata_group())
    dist.destroy_process_group()


def worker_main(opts) -> None:
    run_worker(opts, _worker)


# ---------------------------------------------------------------------------- launcher

def _summarise(rows):
    """Per row: speedups, the fastest schedule, auto's pick, and the error of the
    predicted saving against the measured one (fraction of DeepSpeed's measured time: the
    model predicts communication only, and the schedules share the compute)."""
    for row in rows:
        m, pr = row["measured_s"], row["predicted_comm_s"]
        row["speedup"] = {s: m["deepspeed"] / m[s] for s in SCHEDULES}
        row["fastest"] = min(SCHEDULES, key=lambda s: m[s])
        row["saving_error"] = {s: abs((pr["deepspeed"] - pr[s]) - (m["deepspeed"] - m[s]))
                               / m["deepspeed"] for s in SCHEDULES[1:]}
        # auto's pick against the fastest, in the measured time it gives up
        row["auto_loss"] = m[row["auto"]] / m[row["fastest"]] - 1
    return rows


def _print(rows, links, command):
    launch.print_header("MoE schedule benchmark", command)
    print(f"links (calibrated at start; alpha s, beta s/byte): {json.dumps(links)}")
    table = [["tokens", "hidden", "E", "k", "C", "deepspeed ms", "parm-s1 ms", "parm-s2 ms",
              "s1 speedup", "s2 speedup", "fastest", "auto", "auto loss", "s1 err", "s2 err"]]
    for r in rows:
        m = r["measured_s"]
        table.append([r["tokens"], r["hidden"], r["experts"], r["topk"], r["capacity"],
                      fmt(m["deepspeed"] * 1e3, ".2f"), fmt(m["parm-s1"] * 1e3, ".2f"),
                      fmt(m["parm-s2"] * 1e3, ".2f"), fmt(r["speedup"]["parm-s1"], ".3f"),
                      fmt(r["speedup"]["parm-s2"], ".3f"), r["fastest"], r["auto"],
                      f"{100 * r['auto_loss']:.1f} %", f"{100 * r['saving_error']['parm-s1']:.1f} %",
                      f"{100 * r['saving_error']['parm-s2']:.1f} %"])
    print_aligned([[str(c) for c in row] for row in table])
    hits = sum(r["auto"] == r["fastest"] for r in rows)
    print(f"\nauto picked the measured fastest in {hits} of {len(rows)} configurations; "
          f"median time given up where it did not: "
          f"{100 * statistics.median([r['auto_loss'] for r in rows if r['auto_loss'] > 0] or [0]):.1f} %")
    for s in SCHEDULES[1:]:
        sp = [r["speedup"][s] for r in rows]
        err = [r["saving_error"][s] for r in rows]
        print(f"{s}: speedup over deepspeed median {statistics.median(sp):.3f} "
              f"(min {min(sp):.3f}, max {max(sp):.3f}); predicted-saving error median "
              f"{100 * statistics.median(err):.1f} % of deepspeed's time")
    print("times: one forward + backward of the layer, the slowest rank's, median of the "
          "timed passes; err: |predicted saving - measured saving| / deepspeed's time (the "
          "model predicts communication; compute is the same for every schedule).")


def _plot(rows, path, layout: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"S{r['tokens']} M{r['hidden']}\nE{r['experts']} k{r['topk']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.95), 4))
    width = 0.38
    for i, s in enumerate(SCHEDULES[1:]):
        ax.bar([x + (i - 0.5) * width for x in xs], [r["speedup"][s] for r in rows], width, label=s)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=6.5)
    ax.set_ylabel("speedup over DeepSpeed 0.19 (fwd+bwd)")
    ax.set_title(f"One MoE layer, {layout} on gloo/CPU: Parm's schedules vs DeepSpeed 0.19")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launcher_main(opts) -> int:
    if opts.tp < 2 or opts.nproc % opts.tp:
        print("error: --tp must be >= 2 and divide --nproc (the schedules rearrange the "
              "collectives of experts split over the tensor-parallel ranks)", file=sys.stderr)
        return 2
    prepared = launch.out_dir_or_error(opts.out_dir, "moc-moe-schedule-bench-")
    if prepared is None:
        return 2
    out_dir, created = prepared
    command = launch.command_line()
    argv = launch.worker_argv(__file__, out_dir, opts,
                              ("nproc", "tp", "capacity_factor", "warmup", "iters"))
    for flag in GRID_FLAGS:
        argv += ["--" + flag.replace("_", "-")] + [str(v) for v in getattr(opts, flag)]
    codes, timed_out = run_rank_processes(argv, opts.nproc, out_dir, opts.timeout)
    results, launch_error = read_results(out_dir, codes, timed_out, opts.timeout)
    rows = _summarise((results or {}).get("rows", []))
    if rows:
        _print(rows, results["links"], command)
    if launch_error:
        print(f"FAILED: {launch_error}")
        print_failed_rank_logs(out_dir, codes, launch_error)
    if opts.json and rows:
        with open(opts.json, "w") as f:
            json.dump({"command": command, "links": results["links"], "rows": rows}, f, indent=1)
    if opts.plot and rows:
        _plot(rows, opts.plot, f"T {opts.tp} x EP {opts.nproc // opts.tp} ({opts.nproc} ranks)")
        print(f"wrote {opts.plot}")
    finish_out_dir(out_dir, created, opts.keep)
    return 1 if launch_error else 0


def main(argv=None) -> int:
    return launch.launcher_or_worker(build_parser().parse_args(argv), worker_main, launcher_main)


if __name__ == "__main__":
    sys.exit(main())
