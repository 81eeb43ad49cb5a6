"""``moc-plan``: predict what each checkpoint policy does on a cluster, from measured costs.

    moc-plan recommend --config configs/gpt-350m-16e.yaml --gpus 16 --mtbf 3600 \\
        --iteration-time 1.2 [--hardware hw.json] [--node-failure-fraction 0.3] \\
        [--max-spare-nodes 16] [--repair-s 3600] [--in-job-engine-s 2.5 ...]
    moc-plan simulate --config configs/moe-250b.yaml --gpus 4096 --mtbf 600,1800,3600 \\
        --iteration-time 6 --seeds 5 --json out.json --plot out.png \\
        [--restart in-job --spares 16 --repair-s 3600 --in-job-engine-s 2.5 ...]
    moc-plan calibrate --dir /path/to/checkpoints --out hw.json \\
        [--config configs/tiny.yaml --data-path data/x_text_document] [--from-json bench.json]
    moc-plan pipeline --stages 8,16 --micro-batches 32 --window 8 --iteration-time 6 \\
        --mtbf 600,3600 [--restore-time 2] [--downtime 30] [--log-overhead 0]

Exit codes: 0 done, 2 bad input (the message names the flag or file), or a calibration
run or an output file that failed.
"""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, fields, replace
from typing import List, Optional

from deepspeed_ext.cli.entry_point import ENTRY_POINT, ask_entry_point, find_entry_point
from deepspeed_ext.planning import costs as cm
from deepspeed_ext.planning import restart_cli as rc
from deepspeed_ext.planning.restart import RestartPlan
from deepspeed_ext.planning.search import (Constraints, recommend, recommend_restart,
                                           restart_plans)
from deepspeed_ext.planning.simulate import load_trace, simulate_many
from deepspeed_ext.planning.tables import (describe, plot_sweep, print_policies,
                                           print_simulation)

MODEL_SHAPE = "--model-shape"
"""The entry point's only argument when moc-plan asks it for a model's shape (the
trainer's ``pretrain_gpt_moe.MODEL_SHAPE``; a test checks they agree)."""

MODEL_SHAPE_TIMEOUT_S = 300.0
"""How long the entry point may take to answer (it imports torch: seconds); a hung file
system does not hang moc-plan."""


class PlanError(ValueError):
    """Bad input; the message names the flag or file."""


def model_from_config(path: str, ep_override: int = 0, gpus: int = 0) -> cm.ModelShape:
    """The model of a training YAML config, as the trainer reads it (its own parser and
    parameter count): runs this project's ``python pretrain_gpt_moe.py --model-shape`` in
    the current directory with the request ``{"config", "ep", "gpus"}`` on its stdin and
    reads its last stdout line, the ModelShape's fields (exit status 0) or ``{"error":
    message}`` (exit status 2; ``megatron.training.model_shape`` defines the answer).

    Args:
        gpus: the data-parallel size (every rank); 0: not checked, and an unset global
            batch is one micro-batch.

    Raises:
        PlanError: the file is missing or is not a model config, or its batch does not
            split over ``gpus`` ranks (the trainer's message); or the entry point is
            missing or gave no valid answer (naming it).
    """
    if not os.path.isfile(path):  # no process started for a mistyped path
        raise PlanError(f"--config: file not found: {path}")
    script = _entry_point()
    what = f"{script} {MODEL_SHAPE}"
    request = {"config": path, "ep": ep_override, "gpus": gpus}
    try:
        done = ask_entry_point(script, MODEL_SHAPE, request, MODEL_SHAPE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PlanError(f"{what} could not read --config {path} ({err})") from None
    if done.error is not None:
        raise PlanError(done.error)
    model = _typed_shape(done.reply) if done.status == 0 else None
    if model is None:
        raise PlanError(f"{what} gave no model shape for --config {path} (exit status "
                        f"{done.status}){': ' + done.tail if done.tail else ''}")
    return model


def _entry_point() -> str:
    """This project's ``pretrain_gpt_moe.py``, which reads a config for moc-plan.

    Raises:
        PlanError: it is not there.
    """
    return find_entry_point(ENTRY_POINT, "reads --config for moc-plan", PlanError)


def _typed_shape(reply: object) -> Optional[cm.ModelShape]:
    """``reply`` as a ModelShape; None unless it has exactly its fields, of their types
    and within its bounds."""
    names = [f.name for f in fields(cm.ModelShape)]
    if not (isinstance(reply, dict) and sorted(reply) == sorted(names)
            and isinstance(reply["name"], str)
            and all(type(reply[n]) is int for n in names if n != "name")):
        return None
    try:
        return cm.ModelShape(**reply)
    except ValueError:
        return None


def _hardware(opts) -> cm.Hardware:
    from deepspeed_ext.planning.calibrate import hardware_from_json
    if opts.hardware:
        base = hardware_from_json(opts.hardware)
    elif opts.iteration_time is None:
        raise PlanError("give --iteration-time SECONDS (one training iteration on the target "
                        "cluster) or --hardware FILE (from moc-plan calibrate)")
    else:
        base = cm.Hardware(iteration_s=opts.iteration_time)
    given = {f.name: getattr(opts, f.name) for f in fields(cm.Hardware)
             if getattr(opts, f.name, None) is not None}
    if opts.iteration_time is not None:
        given["iteration_s"] = opts.iteration_time
    try:
        return replace(base, **given)
    except ValueError as err:
        raise PlanError(str(err)) from None


def _cluster(opts):
    try:
        layout = cm.Layout(opts.gpus, opts.gpus_per_node, opts.ep)
    except ValueError as err:
        raise PlanError(str(err)) from None
    model = model_from_config(opts.config, gpus=opts.gpus)
    try:
        layout.expert_parallel(model)
    except ValueError as err:
        raise PlanError(str(err)) from None
    return model, layout, _hardware(opts)


def _constraints(opts) -> Constraints:
    unknown = [k for k in opts.policies.split(",") if k not in cm.POLICIES]
    if unknown:
        raise PlanError(f"--policies: unknown {unknown}; choose from {', '.join(cm.POLICIES)}")
    try:
        return Constraints(opts.plt_limit, opts.host_memory_gb, opts.node_failure_fraction)
    except ValueError as err:
        raise PlanError(str(err)) from None


def _mtbfs(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"--mtbf: expected seconds, comma-separated, got {text!r}") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise PlanError(f"--mtbf must be > 0 seconds and finite, got {text!r}")
    return values


def _check_output(flag: str, path: Optional[str]) -> None:
    """Before any work: an output file's directory exists and the path is no directory.

    Raises:
        PlanError: naming the flag and the path.
    """
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PlanError(f"{flag} {path}: is a directory, not a file")
    if not os.path.isdir(parent):
        raise PlanError(f"{flag} {path}: the directory {parent} does not exist")


def _write_json(flag: str, path: str, data) -> None:
    """Write ``data`` to ``path``; an OSError becomes a PlanError naming the flag."""
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as err:
        raise PlanError(f"{flag} {path}: {err}") from None


def cmd_recommend(opts) -> int:
    _check_output("--json", opts.json)
    model, layout, hw = _cluster(opts)
    constraints = _constraints(opts)
    mtbf = _mtbfs(opts.mtbf)
    if len(mtbf) != 1:
        raise PlanError("recommend takes one --mtbf")
    kinds = opts.policies.split(",")
    plans = restart_plans(layout, opts.max_spare_nodes, rc.in_job_phases_of(opts),
                          opts.repair_s)
    ranked = recommend_restart(model, layout, hw, mtbf[0], constraints, kinds, plans)
    chosen, node = ranked[0], min(layout.gpus, layout.gpus_per_node)
    print(describe(model, layout, hw))
    print(f"MTBF {mtbf[0]:g} s, {constraints.node_fraction:.0%} of failures lose a node's "
          f"memory; PLT limit {constraints.plt_limit:.2%}; policies under the chosen "
          f"restart: {chosen.plan.label(node)}\n")
    rows = print_policies(chosen.choices)
    print()
    restart_rows = rc.print_restart_table(ranked, layout)
    best = chosen.best
    if best is not None:
        p = best.costs.policy
        print(f"\nrecommended: {p.label()} (predicted ETTR {best.ettr:.3f})")
        print("  restart: " + rc.verdict(ranked, layout))
        in_job = rc.chosen_in_job(ranked)
        if in_job is not None:
            print("  " + rc.in_job_line(in_job, model, layout, hw, chosen.plan.in_job))
        print("  trainer flags: " + " ".join(training_flags(p) + rc.restart_flags(chosen.plan)))
        if chosen.plan.in_job:
            print("  " + rc.launch_line(chosen.plan, node))
    if opts.json:
        _write_json("--json", opts.json, {
            "model": asdict(model), "layout": asdict(layout), "hardware": asdict(hw),
            "mtbf_s": mtbf[0], "constraints": asdict(constraints), "rows": rows,
            "restart": restart_rows, "recommended_restart": asdict(chosen.plan)})
    return 0


def training_flags(p: cm.Policy) -> List[str]:
    """The ``pretrain_gpt_moe.py`` flags of a policy."""
    flags = ["--moc-checkpoint"]
    if p.kind == "full-sync":
        return flags + ["--save-interval", str(p.interval), "--moc-sync-save"]
    if p.kind == "full-async":
        return flags + ["--save-interval", str(p.interval)]
    if p.kind in ("pec", "pec-dynamic"):
        flags += ["--save-interval", str(p.interval), "--moc-pec-k", str(p.k)]
        if p.kind == "pec-dynamic":
            flags += ["--moc-dynamic-k", "--moc-plt-threshold", f"{p.plt_threshold:g}"]
        return flags
    if p.kind == "exact":
        return flags + ["--moc-mode", "exact", "--moc-window", str(p.window)]
    flags += ["--moc-two-level", "--moc-snapshot-interval", str(p.interval),
              "--moc-persist-interval", str(p.persist_interval)]
    if p.k_snapshot:
        flags += ["--moc-k-snapshot", str(p.k_snapshot)]
    if p.k:
        flags += ["--moc-k-persist", str(p.k)]
    if p.redundancy != "none":
        flags += ["--moc-redundancy", p.redundancy]
        if p.redundancy == "erasure":
            flags += ["--moc-ec-data", str(p.ec_data)]
    return flags


def parse_policy(text: str) -> cm.Policy:
    """``KIND[:key=value,...]``, e.g. ``two-level:interval=1,k=1,persist_interval=100``."""
    kind, _, rest = text.partition(":")
    values = {}
    names = {f.name: f.type for f in fields(cm.Policy)}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in names or key == "kind":
            raise PlanError(f"--policy {text}: unknown setting {key!r}; known: "
                            f"{', '.join(n for n in names if n != 'kind')}")
        try:
            values[key] = value if key == "redundancy" else (
                float(value) if key == "plt_threshold" else int(value))
        except ValueError:
            raise PlanError(f"--policy {text}: {key} must be a number, got {value!r}") from None
    try:
        return cm.Policy(kind.strip(), **values)
    except ValueError as err:
        raise PlanError(f"--policy {text}: {err}") from None


def _simulate_policies(opts, model, layout, hw, mtbf: float, plan: RestartPlan):
    """The policies to simulate: each ``--policy`` (checked: the trainer must accept it,
    with the restart too), else the best setting of each family under ``plan``.

    Raises:
        PlanError: naming the ``--policy`` or ``--policies`` the trainer refuses.
    """
    kinds = opts.policies.split(",")
    explicit = [parse_policy(p) for p in opts.policy or []]
    for text, p in zip(opts.policy or [], explicit):
        try:
            cm.policy_costs(p, model, layout, hw, mtbf)
        except ValueError as err:
            raise PlanError(f"--policy {text}: {err}") from None
    return explicit, kinds


def _simulate_rows(opts, model, layout, hw, mtbfs, constraints, plan, trace, seeds):
    """One row per MTBF and policy: simulated and analytic figures."""
    explicit, kinds = _simulate_policies(opts, model, layout, hw, mtbfs[0], plan)
    table = []
    for mtbf in mtbfs:
        policies = explicit or [c.best.costs.policy for c in recommend(
            model, layout, hw, mtbf, constraints, kinds, plan) if c.best]
        for p in policies:
            s = simulate_many(p, model, layout, hw, mtbf, opts.iterations, seeds,
                              constraints.node_fraction, trace, restart=plan)
            pred = cm.predict(p, model, layout, hw, mtbf, constraints.node_fraction, plan)
            table.append({"mtbf_s": mtbf, "policy": p.kind, "label": p.label(),
                          "settings": asdict(p), "ettr": s.ettr, "ettr_ci": s.ettr_ci,
                          "ettr_model": pred.ettr, "plt": s.plt, "plt_ci": s.plt_ci,
                          "goodput_tokens_s": s.goodput_tokens_s, "failures": s.failures,
                          "final_k": s.final_k, "runs": s.runs, "unfinished": s.unfinished,
                          "in_place": s.in_place})
    return table


def cmd_simulate(opts) -> int:
    _check_output("--json", opts.json)
    _check_output("--plot", opts.plot)
    model, layout, hw = _cluster(opts)
    mtbfs = _mtbfs(opts.mtbf)
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        # Checked before the simulation, not after it.
        raise PlanError("--plot needs matplotlib: pip install -e .[bench]")
    trace = None
    if opts.trace:
        try:
            trace = load_trace(opts.trace)
        except ValueError as err:
            raise PlanError(f"--trace {err}") from None
    constraints = _constraints(opts)
    plan = rc.simulate_plan(opts, layout, constraints.node_fraction)
    seeds = list(range(opts.seed, opts.seed + opts.seeds))
    table = _simulate_rows(opts, model, layout, hw, mtbfs, constraints, plan, trace, seeds)
    print(describe(model, layout, hw))
    print(f"{opts.iterations} iterations per run, {len(seeds)} seed(s), "
          f"{constraints.node_fraction:.0%} node failures"
          + (f", trace {opts.trace}" if trace else "") + "\n")
    if plan.in_job:
        print(rc.in_job_line(plan, model, layout, hw) + "\n")
    print_simulation(table, plan.in_job)
    if opts.json:
        _write_json("--json", opts.json, {
            "model": asdict(model), "layout": asdict(layout), "hardware": asdict(hw),
            "iterations": opts.iterations, "seeds": seeds, "restart": asdict(plan),
            "rows": table})
    if opts.plot:
        try:
            plot_sweep(table, opts.plot, f"{model.name} on {layout.gpus} GPUs")
        except OSError as err:
            raise PlanError(f"--plot {opts.plot}: {err}") from None
        print(f"plot: {opts.plot}")
    return 0


def cmd_calibrate(opts) -> int:
    from deepspeed_ext.planning.calibrate import calibrate
    _check_output("--out", opts.out)
    base = None
    if opts.iteration_time is not None:
        base = cm.Hardware(iteration_s=opts.iteration_time)
    for path in opts.from_json or []:
        if not os.path.isfile(path):
            raise PlanError(f"--from-json: file not found: {path}")
    if opts.nproc < 1 or opts.iters < 1:
        raise PlanError(f"--nproc and --iters must be >= 1, got {opts.nproc} and {opts.iters}")
    try:
        result = calibrate(opts.dir, opts.config, opts.data_path, opts.nproc, opts.iters,
                           opts.with_restart, opts.from_json or [], base)
    except ValueError as err:
        raise PlanError(str(err)) from None
    for name, value in result["hardware"].items():
        print(f"{name:<20} {value:>12.4g}   ({result['sources'][name]})")
    for name, value in result.get("in_job", {}).items():
        print(f"in_job.{name:<13} {value:>12.4g}   ({result['sources']['in_job.' + name]})")
    _write_json("--out", opts.out, result)
    print(f"written: {opts.out} (use it with --hardware)")
    return 0


def cmd_pipeline(opts) -> int:
    """Localized against global recovery of a pipeline stage, per stage count and MTBF."""
    from deepspeed_ext.planning import pipeline as pm
    try:
        stages = [int(v) for v in opts.stages.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"--stages: expected integers, comma-separated, got {opts.stages!r}") from None
    table = []
    print(f"pipeline of P stages, {opts.micro_batches} micro-batches per step, W = {opts.window}, "
          f"iteration {opts.iteration_time:g} s, restore {opts.restore_time:g} s, downtime "
          f"{opts.downtime:g} s, log overhead {opts.log_overhead:g} s per step; "
          f"{pm.REPLAYED_WINDOWS * opts.window:g} steps replayed per failure on average")
    print(f"{'P':>4} {'MTBF s':>8} {'localized s':>12} {'global s':>10} {'speedup':>8} "
          f"{'ETTR localized':>15} {'ETTR global':>12}")
    for p in stages:
        shape = pm.PipelineRecovery(p, opts.micro_batches, opts.window, opts.iteration_time,
                                    opts.restore_time, opts.downtime, opts.log_overhead)
        for mtbf in _mtbfs(opts.mtbf):
            row = dict(stages=p, mtbf_s=mtbf, **pm.compare(shape, mtbf))
            table.append(row)
            print(f"{p:>4} {mtbf:>8g} {row['localized_s']:>12.1f} {row['global_s']:>10.1f} "
                  f"{row['speedup']:>7.2f}x {row['ettr_localized']:>15.4f} {row['ettr_global']:>12.4f}")
    if opts.json:
        _write_json("--json", opts.json, table)
    return 0


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--config", required=True, help="The training YAML config (the model).")
    g.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) of the job.")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node.")
    g.add_argument("--ep", type=int, default=0, help="Expert-parallel size; 0: gcd(GPUs, experts).")
    g.add_argument("--mtbf", required=True,
                   help="Mean time between failures of the whole job, seconds (simulate: "
                        "comma-separated list).")
    g.add_argument("--node-failure-fraction", type=float, default=0.0,
                   help="Share of failures that lose a node's memory (the rest are software "
                        "failures: processes die, host memory survives).")
    g.add_argument("--plt-limit", type=float, default=0.0375,
                   help="Accumulated proportion of lost tokens a policy may reach.")
    g.add_argument("--host-memory-gb", type=float, default=0.0,
                   help="Host memory per rank for snapshots, frames and redundancy, in GiB "
                        "(2**30 bytes, the unit of the trainer's --moc-host-memory-gb); "
                        "0: unlimited.")
    g.add_argument("--policies", default=",".join(cm.POLICIES),
                   help="Policy families to consider, comma-separated.")
    g = p.add_argument_group(
        "hardware (defaults: --hardware file, else the model's defaults); bandwidths in "
        "decimal GB/s (1 GB/s = 1e9 bytes/s, not gigabits)")
    g.add_argument("--hardware", help="A JSON file from moc-plan calibrate.")
    g.add_argument("--iteration-time", type=float,
                   help="Seconds per training iteration without checkpointing, on the "
                        "target cluster.")
    for f in fields(cm.Hardware):
        if f.name == "iteration_s":
            continue
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=float, default=None,
                       help=f"{HARDWARE_HELP[f.name].rstrip('.')} (default {f.default:g}).")


HARDWARE_HELP = {
    "d2h_gbps": "Device-to-host copy bandwidth (the snapshot copy), GB/s = 1e9 bytes/s, "
                "per rank.",
    "h2d_gbps": "Host-to-device bandwidth (a restore from host memory), GB/s = 1e9 "
                "bytes/s, per rank.",
    "storage_write_gbps": "Write bandwidth to checkpoint storage, GB/s = 1e9 bytes/s, per "
                          "node (its ranks share it).",
    "storage_read_gbps": "Read bandwidth from checkpoint storage, GB/s = 1e9 bytes/s, per "
                         "node (its ranks share it).",
    "storage_total_gbps": "The storage system's aggregate bandwidth over all nodes, GB/s = "
                          "1e9 bytes/s; 0: no limit beyond the nodes' own.",
    "network_gbps": "Bandwidth between nodes (snapshot redundancy and its rebuild), GB/s = "
                    "1e9 bytes/s, per node (its ranks share it).",
    "fwd_bwd_fraction": "Share of an iteration a snapshot copy can hide behind (forward "
                        "and backward), in (0, 1].",
    "restart_s": "Seconds from a failure to training again, before loading (detection, "
                 "restart, initialisation, rendezvous), per failure.",
    "node_replace_s": "Extra seconds a node failure costs (a replacement node joining), "
                      "per node failure.",
    "warmup_s": "Extra seconds the first iterations of every (re)start take.",
    "background_s_per_gb": "Seconds the training loop loses per GB (1e9 bytes) a rank "
                           "copies or writes in the background; 0 where copies are DMA.",
    "snapshot_call_s": "Seconds of the training loop per two-level snapshot call, per rank.",
    "persist_call_s": "Extra seconds of a two-level snapshot that is due for storage.",
    "save_call_s": "Seconds of the training loop per save that goes to storage, besides "
                   "its copy.",
}
"""``--help`` of each hardware flag: its unit and scope (per rank, per node, aggregate)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moc-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("recommend", help="The best policy and settings, with each "
                                         "alternative's predicted ETTR.")
    _add_cluster(r)
    rc.add_restart_flags(r, "recommend")
    r.add_argument("--json", help="Also write the table here.")
    s = sub.add_parser("simulate", help="Simulate failures over long runs: ETTR against MTBF.")
    _add_cluster(s)
    rc.add_restart_flags(s, "simulate")
    s.add_argument("--policy", action="append",
                   help="A policy to simulate, KIND[:key=value,...] (repeatable); default: the "
                        "best setting of each family at each MTBF.")
    s.add_argument("--iterations", type=int, default=20000, help="Useful iterations per run.")
    s.add_argument("--seeds", type=int, default=5, help="Runs (failure schedules) per policy.")
    s.add_argument("--seed", type=int, default=0, help="The first seed.")
    s.add_argument("--trace", help="Replay a failure trace instead: 'SECONDS [software|node]' "
                                   "per line.")
    s.add_argument("--json", help="Write the table here.")
    s.add_argument("--plot", help="Write ETTR against MTBF per policy here (PNG).")
    c = sub.add_parser("calibrate", help="Measure the hardware figures on this machine.")
    c.add_argument("--dir", required=True, help="A directory on the checkpoint storage.")
    c.add_argument("--out", required=True, help="The hardware JSON to write.")
    c.add_argument("--config", help="Also time a short training run of this config.")
    c.add_argument("--data-path", help="The dataset prefix for --config.")
    c.add_argument("--nproc", type=int, default=2, help="Ranks of the training run.")
    c.add_argument("--iters", type=int, default=12, help="Iterations of the training run.")
    c.add_argument("--with-restart", action="store_true",
                   help="Inject one crash into the run to time a restart.")
    c.add_argument("--from-json", action="append",
                   help="A benchmark JSON to read figures from (repeatable).")
    c.add_argument("--iteration-time", type=float,
                   help="The iteration time, when not measured or read.")
    q = sub.add_parser("pipeline", help="Localized against global recovery of a pipeline "
                                        "stage (upstream logs): seconds per failure, ETTR.")
    q.add_argument("--stages", default="8,16", help="Pipeline stages, comma-separated.")
    q.add_argument("--micro-batches", type=int, required=True, help="Micro-batches per step.")
    q.add_argument("--window", type=int, required=True, help="Exact mode's frames per window.")
    q.add_argument("--iteration-time", type=float, required=True, help="Seconds per step.")
    q.add_argument("--mtbf", required=True, help="Seconds between failures, comma-separated.")
    q.add_argument("--restore-time", type=float, default=0.0,
                   help="Seconds to restore a window of frames.")
    q.add_argument("--downtime", type=float, default=0.0,
                   help="Seconds before the replay starts (detection, a replacement device).")
    q.add_argument("--log-overhead", type=float, default=0.0,
                   help="Seconds the upstream logs add to a step.")
    q.add_argument("--json", help="Also write the table here.")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        if opts.command in ("recommend", "simulate"):
            for name in ("iterations", "seeds"):
                if getattr(opts, name, 1) < 1:
                    raise PlanError(f"--{name} must be >= 1")
        return {"recommend": cmd_recommend, "simulate": cmd_simulate,
                "calibrate": cmd_calibrate, "pipeline": cmd_pipeline}[opts.command](opts)
    except (PlanError, ValueError, OSError, RuntimeError) as err:
        # OSError: a file or directory that cannot be read or written; RuntimeError: the
        # calibration's training run failed (its message carries the log's tail).
        print(f"moc-plan: error: {err}", file=sys.stderr)
        return 2


def main_cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_cli()
