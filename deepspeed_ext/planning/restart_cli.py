"""``moc-plan``'s in-job restart: its flags, the plan they give, and what it prints.

``simulate`` takes ``--restart {relaunch,in-job}``, ``--spares N`` and ``--repair-s S``;
``recommend`` takes ``--max-spare-nodes K`` and ``--repair-s S`` and weighs a relaunch
against an in-job restart with 1 .. K spare nodes (:func:`~deepspeed_ext.planning.search.
recommend_restart`). Both take the phases' flags ``--in-job-<phase>-s`` (over the
``in_job`` object of a ``--hardware`` file, over the defaults of
:class:`~deepspeed_ext.planning.restart.InJobPhases`).
"""

import argparse
from dataclasses import asdict, fields
from typing import Dict, List, Optional

from deepspeed_ext.planning import costs as cm
from deepspeed_ext.planning.restart import (REPAIR_S, RESTART_MODES, InJobPhases,
                                            RestartPlan, in_job_phases, phase_flag)
from deepspeed_ext.planning.search import RestartChoice

PHASE_HELP = {
    "detection_s": "the supervisor notices a death",
    "leave_s": "the survivors leave the failed step and see the new round",
    "teardown_s": "the survivors destroy their process groups and DeepSpeed's",
    "rendezvous_s": "every process joins the new round in the store",
    "groups_s": "forming the round's groups, the fixed part a of a + b x ranks",
    "groups_per_rank_s": "forming the round's groups, the part b per rank of a + b x ranks",
    "engine_s": "rebuilding DeepSpeed's engine in the same process",
    "first_step_s": "the first step's extra time over a steady one",
}
"""``--help`` of each phase flag (its source: the field's documentation)."""


def add_restart_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The in-job restart's flags of ``simulate`` or ``recommend``."""
    g = p.add_argument_group(
        "in-job restart (a hot spare takes a failed rank; the survivors keep their "
        "processes); phases in seconds, defaults measured on CPU (docs/planning.md)")
    if command == "simulate":
        g.add_argument("--restart", choices=RESTART_MODES, default="relaunch",
                       help="How a failure comes back: relaunch every process (restart-s), "
                            "or in-job while a spare is free.")
        g.add_argument("--spares", type=int, default=0,
                       help="Spare GPUs of the job, --restart in-job, as whole spare nodes "
                            "(a multiple of --gpus-per-node): any failure takes a node's.")
    else:
        g.add_argument("--max-spare-nodes", type=int, default=16,
                       help="Weigh a relaunch against an in-job restart with 1 .. this many "
                            "whole spare nodes (0: relaunch only).")
    g.add_argument("--repair-s", type=float, default=REPAIR_S,
                   help=f"Seconds until a failure's spares are back (a node repaired or "
                        f"replaced), per failure (default {REPAIR_S:g}).")
    for f in fields(InJobPhases):
        g.add_argument(phase_flag(f.name), dest="in_job_" + f.name, type=float, default=None,
                       help=f"Seconds: {PHASE_HELP[f.name]} (default {f.default:g}).")


def in_job_phases_of(opts) -> InJobPhases:
    """The phases: the defaults, then a ``--hardware`` file's ``in_job`` object, then the
    flags.

    Raises:
        ValueError: a bad value, naming its flag or the file.
    """
    from deepspeed_ext.planning.calibrate import in_job_from_json
    values: Dict[str, float] = in_job_from_json(opts.hardware) if opts.hardware else {}
    values.update({f.name: getattr(opts, "in_job_" + f.name) for f in fields(InJobPhases)
                   if getattr(opts, "in_job_" + f.name) is not None})
    return InJobPhases(**values)


def simulate_plan(opts, layout: cm.Layout, node_fraction: float) -> RestartPlan:
    """``simulate``'s plan from ``--restart``, ``--spares``, ``--repair-s`` and the phases.

    Raises:
        ValueError: what :class:`RestartPlan` refuses, or spares that are not whole spare
            nodes (naming the flags).
    """
    plan = RestartPlan(opts.restart, opts.spares, opts.repair_s, in_job_phases_of(opts))
    node = min(layout.gpus, layout.gpus_per_node)
    if plan.in_job and plan.spares % node:
        raise ValueError(f"--spares {plan.spares}: spares are whole spare nodes, a multiple "
                         f"of {node} (--gpus-per-node): every failure moves a node's ranks")
    return plan


def in_job_line(plan: RestartPlan, model: cm.ModelShape, layout: cm.Layout,
                hw: cm.Hardware, spares: bool = True) -> str:
    """One in-job restart's phases with a full snapshot restored from host memory, the
    phase that dominates, against the relaunch; with ``spares``, the plan's spares."""
    times = in_job_phases(plan.phases, layout.gpus, cm.full_state_bytes(model, layout),
                          hw.h2d_gbps)
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in times.items())
    name, largest = times.largest()
    node = min(layout.gpus, layout.gpus_per_node)
    return (f"in-job restart: {times.total:.2f} s with a spare ({parts}; groups at "
            f"{layout.gpus} ranks, state: a full snapshot from host memory); largest phase: "
            f"{name} {largest:.2f} s ({largest / times.total:.0%}); a relaunch: restart "
            f"{hw.restart_s:g} s + the load"
            + (f"; {plan.spares} spare GPUs ({plan.spares / node:g} node(s) of {node}), each "
               f"failure's back after {plan.repair_s:g} s" if spares else ""))


def restart_flags(plan: RestartPlan) -> List[str]:
    """The trainer's flags of a plan (no spare process inside a node: its spares are
    spare nodes, :func:`launch_line`)."""
    return ["--moc-restart", "in-job", "--moc-spares", "0"] if plan.in_job else []


def launch_line(plan: RestartPlan, node_size: int) -> str:
    """How the launch gets a plan's spares (whole spare nodes); "" for a relaunch."""
    if not plan.in_job:
        return ""
    nodes = plan.spares // node_size
    return (f"launch: SPARE_NODES={nodes} (scripts/run_elastic.sh on {nodes} more node(s), "
            "each waiting whole to take a failed node's ranks)")


def print_restart_table(ranked: List[RestartChoice], layout: cm.Layout) -> List[dict]:
    """Each plan's best policy, ETTR and effective throughput, fewest spares first, the
    chosen one (the first of ``ranked``) marked; returns the JSON rows."""
    node = min(layout.gpus, layout.gpus_per_node)
    head = (f"{'restart':<32} {'spare GPUs':>10} {'ETTR':>6} {'effective':>9} "
            f"{'in place':>8}  policy")
    print(head)
    print("-" * (len(head) + 40))
    rows = []
    for c in sorted(ranked, key=lambda c: (c.plan.in_job, c.plan.spares)):
        best = c.best
        label = ("* " if c is ranked[0] else "  ") + c.plan.label(node)
        if best is None:
            print(f"{label:<32} {c.plan.spares:>10} {'-':>6} {'-':>9} {'-':>8}  none admissible")
        else:
            place = f"{best.in_place:.0%}" if c.plan.in_job else "-"
            print(f"{label:<32} {c.plan.spares:>10} {best.ettr:>6.3f} {c.effective:>9.3f} "
                  f"{place:>8}  {best.costs.policy.label()}")
        rows.append({"restart": c.plan.label(node), "chosen": c is ranked[0],
                     "plan": asdict(c.plan), "spare_gpus": c.plan.spares,
                     "ettr": best.ettr if best else None, "effective": c.effective,
                     "in_place": best.in_place if best else None,
                     "policy": best.costs.policy.label() if best else None})
    return rows


def verdict(ranked: List[RestartChoice], layout: cm.Layout) -> str:
    """Why the first plan of ``ranked`` (the best effective throughput) is the choice:
    whether spares pay, in the figures that decide it."""
    node = min(layout.gpus, layout.gpus_per_node)
    chosen = ranked[0]
    relaunch = next((c for c in ranked if not c.plan.in_job), None)
    others = [c for c in ranked if c.plan.in_job and c.best is not None]
    if relaunch is None or relaunch.best is None:
        return f"{chosen.plan.label(node)}: the only plan with an admissible policy"
    if not others:
        return "relaunch (no in-job plan considered: --max-spare-nodes 0)"
    base = relaunch.best.ettr
    if chosen.plan.in_job:
        most = max(c.plan.spares for c in others) == chosen.plan.spares
        return (f"{chosen.plan.label(node)}: the spares pay: effective throughput "
                f"{chosen.effective:.3f} = ETTR {chosen.best.ettr:.3f} x {layout.gpus} / "
                f"{layout.gpus + chosen.plan.spares}, against {base:.3f} relaunched (ETTR "
                f"{chosen.best.ettr / base - 1:+.1%} for {chosen.plan.spares / layout.gpus:.1%}"
                f" more GPUs)" + ("; the most spares weighed: raise --max-spare-nodes to "
                                  "weigh more" if most else ""))
    best = max(others, key=lambda c: c.effective)
    return (f"relaunch: spares do not pay here: the best in-job plan "
            f"({best.plan.label(node)}) reaches ETTR {best.best.ettr:.3f} "
            f"({best.best.ettr / base - 1:+.1%}) but holds back "
            f"{best.plan.spares / layout.gpus:.1%} more GPUs: effective {best.effective:.3f} "
            f"against {base:.3f}")


def chosen_in_job(ranked: List[RestartChoice]) -> Optional[RestartPlan]:
    """The in-job plan whose phases the output describes: the chosen one, else the
    first in-job one considered; None when only a relaunch was."""
    return next((c.plan for c in ranked if c.plan.in_job), None)
