"""The in-job restart's pure model: phases, the group cost, the spares pool and its
long-run blocking, and the cost model's mix of in-place and relaunched recoveries.
Every figure is computed by hand in the comments."""

import random

import pytest

from deepspeed_ext.planning.costs import Hardware, Policy, in_job_costs, policy_costs, predict
from deepspeed_ext.planning.restart import (PHASES, InJobPhases, RestartPlan, SparePool,
                                            blocked, in_job_hardware, in_job_phases,
                                            phase_flag, refill, spares_needed, take)
from deepspeed_ext.supervisor.children import POLL_S

approx = pytest.approx

# detection 0.1 + leave 0.2 + teardown 0.3 + rendezvous 0.4 + groups (0.5 + 0.01 x 100
# ranks = 1.5) + engine 2 = 4.5 s before the state; first step 0.7 s.
PHASES_A = InJobPhases(detection_s=0.1, leave_s=0.2, teardown_s=0.3, rendezvous_s=0.4,
                       groups_s=0.5, groups_per_rank_s=0.01, engine_s=2.0, first_step_s=0.7)


# --- phases ---------------------------------------------------------------------------------

def test_the_phases_sum_to_the_restart():
    # state: 6e9 bytes per rank at 2 GB/s = 3 s; total 4.5 + 3 + 0.7 = 8.2 s
    times = in_job_phases(PHASES_A, 100, 6e9, 2.0)
    assert times.items() == [("detection", 0.1), ("leave", 0.2), ("teardown", 0.3),
                             ("rendezvous", 0.4), ("groups", approx(1.5)), ("engine", 2.0),
                             ("state", approx(3.0)), ("first step", 0.7)]
    assert [name for name, _ in times.items()] == list(PHASES)
    assert times.total == approx(8.2)
    assert times.largest() == ("state", approx(3.0))
    assert PHASES_A.before_state(100) == approx(4.5)
    # a smaller snapshot: the engine dominates (2 s against 1 s)
    assert in_job_phases(PHASES_A, 100, 2e9, 2.0).largest() == ("engine", 2.0)


def test_forming_the_groups_grows_linearly_with_the_ranks():
    p = InJobPhases()
    assert p.groups(8) == approx(0.07 + 0.0005 * 8)
    assert p.groups(4096) == approx(0.07 + 0.0005 * 4096)       # 2.118 s
    assert p.groups(8192) - p.groups(4096) == approx(0.0005 * 4096)
    assert p.groups(4096) > p.groups(512) > p.groups(8)
    # the whole restart grows with it, by the same amount
    assert p.before_state(4096) - p.before_state(8) == approx(0.0005 * 4088)


def test_the_defaults_are_what_is_known_on_cpu():
    p = InJobPhases()
    assert p.detection_s == POLL_S == 0.1            # the supervisor's poll
    assert p.leave_s == 0.1                          # in_job.py's poll of the round
    assert p.groups_s == 0.07                        # survivors re-formed gloo in ~70 ms
    assert 1.5 <= p.engine_s <= 3.5                  # DeepSpeed reset + initialize
    # 0.1 + 0.1 + 0 + 0 + 2.118 + 2.5 = 4.818 s before the state at 4,096 ranks
    assert p.before_state(4096) == approx(4.818)


def test_in_job_hardware_replaces_the_restart_only():
    hw = Hardware(iteration_s=8.0, restart_s=120.0, warmup_s=5.0, node_replace_s=300.0)
    got = in_job_hardware(hw, PHASES_A, 100)
    assert got.restart_s == approx(4.5)
    assert got.warmup_s == 0.7
    assert got.node_replace_s == 0.0                 # the spare node is already there
    assert got.iteration_s == 8.0 and got.h2d_gbps == hw.h2d_gbps


@pytest.mark.parametrize("name", ["detection_s", "groups_per_rank_s", "engine_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_phase_names_its_flag(name, value):
    with pytest.raises(ValueError, match=f"{phase_flag(name)} must be a finite number"):
        InJobPhases(**{name: value})
    assert phase_flag("first_step_s") == "--in-job-first-step-s"


def test_in_job_phases_refuses_bad_sizes():
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        in_job_phases(PHASES_A, 0, 1.0, 1.0)
    with pytest.raises(ValueError):
        in_job_phases(PHASES_A, 8, 1.0, 0.0)


# --- the plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    (dict(mode="in-job", spares=-1), "--spares must be an integer >= 0, got -1"),
    (dict(mode="relaunch", spares=8), "--spares needs --restart in-job"),
    (dict(mode="restart"), "--restart must be one of relaunch, in-job"),
    (dict(mode="in-job", repair_s=-1.0), "--repair-s must be a finite number"),
    (dict(mode="in-job", repair_s=float("nan")), "--repair-s must be a finite number"),
])
def test_the_plan_refuses_bad_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        RestartPlan(**kwargs)


def test_labels_and_spares_needed():
    assert RestartPlan().label(8) == "relaunch"
    assert RestartPlan("in-job", 16).label(8) == "in-job, 16 spares (2 nodes)"
    assert RestartPlan("in-job", 8).label(8) == "in-job, 8 spares (1 node)"
    assert spares_needed("software", 8) == 8  # a crash moves its node to a spare node
    assert spares_needed("node", 8) == 8
    with pytest.raises(ValueError, match="software or node"):
        spares_needed("disk", 8)


# --- the pool ---------------------------------------------------------------------------------

def test_spares_run_out_then_come_back_after_the_repair():
    pool = SparePool(1)
    ok, pool = take(pool, 0.0, 1, 100.0)
    assert ok and pool == SparePool(0, ((100.0, 1),))
    ok, pool = take(pool, 50.0, 1, 100.0)             # none free: a relaunch, takes none
    assert not ok and pool == SparePool(0, ((100.0, 1),))
    ok, pool = take(pool, 100.0, 1, 100.0)            # back at 100 s exactly
    assert ok and pool == SparePool(0, ((200.0, 1),))
    assert refill(pool, 199.9) == pool
    assert refill(pool, 200.0) == SparePool(1)


def test_a_node_failure_takes_a_node_of_spares_or_none():
    ok, pool = take(SparePool(7), 0.0, 8, 10.0)      # 7 < 8: relaunched
    assert not ok and pool.free == 7
    ok, pool = take(SparePool(9), 0.0, 8, 10.0)
    assert ok and pool == SparePool(1, ((10.0, 8),))
    ok, pool = take(pool, 1.0, 1, 10.0)                # a software failure takes the last
    assert ok and pool == SparePool(0, ((10.0, 8), (11.0, 1)))
    assert refill(pool, 10.5) == SparePool(8, ((11.0, 1),))


# --- long-run blocking (Kaufman-Roberts) --------------------------------------------------

def test_blocking_by_hand():
    # no spares, or a relaunch: every failure relaunches
    assert blocked(RestartPlan("in-job", 0), 600, 0.2, 8) == (1.0, 1.0)
    assert blocked(RestartPlan(), 600, 0.2, 8) == (1.0, 1.0)
    # fewer spares than a node: every failure relaunches, of either kind
    assert blocked(RestartPlan("in-job", 3, 100.0), 100.0, 0.0, 4) == (1.0, 1.0)
    # one spare node (nodes of 1 GPU), software only, load a = 100 / 100 = 1: Erlang B
    # = a / (1 + a) = 0.5, for a node failure as for a software one
    assert blocked(RestartPlan("in-job", 1, 100.0), 100.0, 0.0, 1) == (approx(0.5),) * 2
    # two spare nodes, a = 1: (a^2 / 2) / (1 + a + a^2 / 2) = 0.5 / 2.5 = 0.2
    assert blocked(RestartPlan("in-job", 2, 100.0), 100.0, 0.0, 1)[0] == approx(0.2)
    # one spare node of 2 GPUs, half the failures each kind, MTBF 1 s, repair 2 s: loads
    # 1 and 1, each holding 2 places; q0 = 1, q1 = 0, q2 = (1 x 2 x 1 + 1 x 2 x 1) / 2 =
    # 2, total 3: both kinds refused in states 1 and 2, 2 / 3 (Erlang B(1, 2) = 2 / 3)
    soft, node = blocked(RestartPlan("in-job", 2, 2.0), 1.0, 0.5, 2)
    assert soft == approx(2 / 3) and node == approx(2 / 3)
    # an instant repair: never refused when a node fits
    assert blocked(RestartPlan("in-job", 8, 0.0), 600, 0.2, 8) == (0.0, 0.0)
    # a repair so long the floats would overflow: still a share
    soft, node = blocked(RestartPlan("in-job", 64, 1e9), 600, 0.2, 8)
    assert 0.99 < soft <= 1 and node == approx(soft)  # both hold a whole spare node


def test_blocking_is_what_the_pool_does_failure_by_failure():
    plan = RestartPlan("in-job", 16, 3600.0)
    rng, t, pool = random.Random(3), 0.0, SparePool(16)
    counts = {"software": [0, 0], "node": [0, 0]}
    for _ in range(40_000):
        t += rng.expovariate(1 / 600)
        kind = "node" if rng.random() < 0.2 else "software"
        ok, pool = take(pool, t, spares_needed(kind, 8), plan.repair_s)
        counts[kind][0] += 1
        counts[kind][1] += not ok
    soft, node = blocked(plan, 600, 0.2, 8)  # 2 spare nodes at load 6: 18 / 25 = 0.72
    assert counts["software"][1] / counts["software"][0] == approx(soft, abs=0.015)
    assert counts["node"][1] / counts["node"][0] == approx(node, abs=0.04)


# --- the cost model's mix ------------------------------------------------------------------

def test_no_spares_costs_a_relaunch(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)
    relaunch = predict(p, model, layout, hw, 600.0, 0.3)
    none = predict(p, model, layout, hw, 600.0, 0.3, RestartPlan("in-job", 0))
    assert none.ettr == relaunch.ettr
    assert none.expected_downtime_s == relaunch.expected_downtime_s
    assert none.in_place == 0.0 == relaunch.in_place


def test_an_in_place_recovery_costs_the_phases_and_the_policys_load(model, layout, hw):
    # full-async: a software failure loads 13.5e6 B from storage at 2e8 B/s = 0.0675 s;
    # relaunched 10 + 0.0675 s; in place (PHASES_A at 8 ranks) 0.1 + 0.2 + 0.3 + 0.4 +
    # (0.5 + 0.01 x 8) + 2 = 3.58 s, + 0.7 first step + 0.0675 load
    p = Policy("full-async", interval=10)
    plan = RestartPlan("in-job", 4, 0.0, PHASES_A)
    assert policy_costs(p, model, layout, hw).software.downtime_s == approx(10.0675)
    costs = in_job_costs(p, model, layout, hw, plan)
    assert costs.software.downtime_s == approx(3.58 + 0.7 + 0.0675)
    assert costs.node.downtime_s == approx(3.58 + 0.7 + 0.0675)   # no node_replace_s
    # an instant repair with a node's worth of spares: every failure in place
    pred = predict(p, model, layout, hw, 600.0, 0.5, plan)
    assert pred.in_place == 1.0
    assert pred.expected_downtime_s == approx(4.3475)
    relaunch = predict(p, model, layout, hw, 600.0, 0.5)
    assert pred.ettr > relaunch.ettr
    assert pred.expected_lost_iterations == relaunch.expected_lost_iterations


def test_the_mix_weighs_each_kind_by_its_refusals(model, layout, hw):
    # one spare node of 4: software and node failures each arrive at 0.5 / 600 per
    # second and hold the spare node 1200 s: load 1 each, 2 in all; Erlang B(1, 2) = 2 / 3
    # of either kind relaunch
    p = Policy("full-async", interval=10)
    plan = RestartPlan("in-job", 4, 1200.0, PHASES_A)
    pred = predict(p, model, layout, hw, 600.0, 0.5, plan)
    relaunch = policy_costs(p, model, layout, hw)
    in_place = in_job_costs(p, model, layout, hw, plan)
    soft = 2 / 3 * relaunch.software.downtime_s + 1 / 3 * in_place.software.downtime_s
    node = 2 / 3 * relaunch.node.downtime_s + 1 / 3 * in_place.node.downtime_s
    assert pred.expected_downtime_s == approx(0.5 * soft + 0.5 * node)
    assert pred.in_place == approx(1 / 3)
