"""The simulator with an in-job restart: hand-built traces (in place while a spare is
free, relaunched when none is, spares back after the repair, a node's worth for any
failure, failures during a recovery), and seeded runs against the analytic model.

The toy cluster (conftest.py): full-async every 10 on it loads 13.5e6 B at 2e8 B/s =
0.0675 s, so a relaunch costs 10 + 0.0675 s; with :data:`PHASES` an in-job restart costs
1 + 0.5 + 0.0625 x 8 ranks + 1 = 3 s before the load: 3.0675 s.
"""

import pytest

from deepspeed_ext.planning.costs import Policy, predict
from deepspeed_ext.planning.restart import InJobPhases, RestartPlan
from deepspeed_ext.planning.simulate import (Failure, failure_stream, simulate_many,
                                             simulate_run)
from tests.deepspeed_ext.planning.conftest import toy_hardware

approx = pytest.approx
PHASES = InJobPhases(detection_s=1.0, leave_s=0.0, teardown_s=0.0, rendezvous_s=0.0,
                     groups_s=0.5, groups_per_rank_s=0.0625, engine_s=1.0, first_step_s=0.0)
ASYNC = Policy("full-async", interval=10)


def _in_job(spares, repair_s=1000.0):
    return RestartPlan("in-job", spares, repair_s, PHASES)


def test_one_failure_in_place(model, layout, hw):
    # progress 123.4 it, back to the durable 120 (redone 3.4); 3.0675 s down; 80 more
    for uptime_clock in (False, True):
        r = simulate_run(ASYNC, model, layout, hw, 200, [Failure(123.4)], 600.0,
                         uptime_clock=uptime_clock, restart=_in_job(4))
        assert r.wall_s == approx(123.4 + 3.0675 + 80)
        assert r.in_place == 1 and r.failures == 1
        assert r.redone_iterations == approx(3.4)
    relaunched = simulate_run(ASYNC, model, layout, hw, 200, [Failure(123.4)], 600.0)
    assert relaunched.wall_s == approx(123.4 + 10.0675 + 80)
    assert relaunched.in_place == 0


def test_the_spare_is_gone_until_its_repair(model, layout, hw):
    # First failure at 123.4 in place: resumed at it 120 at 126.4675 s. Second at 300 s:
    # 173.5325 it later, the newest durable checkpoint 120 + 170 = 290 (lag 0.135 it),
    # redone 3.5325; then 400 - 290 = 110 iterations.
    failures = [Failure(123.4), Failure(300.0)]
    slow = simulate_run(ASYNC, model, layout, hw, 400, failures, 600.0,
                        restart=_in_job(4, repair_s=1000.0))
    assert slow.in_place == 1                        # the spare is back only at 1123.4 s
    assert slow.wall_s == approx(300.0 + 10.0675 + 110)
    fast = simulate_run(ASYNC, model, layout, hw, 400, failures, 600.0,
                        restart=_in_job(4, repair_s=100.0))
    assert fast.in_place == 2                        # back at 223.4 s, before the second
    assert fast.wall_s == approx(300.0 + 3.0675 + 110)
    assert slow.redone_iterations == approx(fast.redone_iterations) == approx(3.4 + 3.5325)


def test_a_failure_needs_a_node_of_spares(model, layout):
    # nodes of 4 ranks; a relaunched node failure also waits 20 s for a replacement node
    hw = toy_hardware(node_replace_s=20.0)
    trace = [Failure(123.4, "node")]
    three = simulate_run(ASYNC, model, layout, hw, 200, trace, 600.0, restart=_in_job(3))
    assert three.in_place == 0
    assert three.wall_s == approx(123.4 + 30.0675 + 80)
    soft = simulate_run(ASYNC, model, layout, hw, 200, [Failure(123.4)], 600.0,
                        restart=_in_job(3))
    assert soft.in_place == 0  # a crash moves its node whole: 4 spares, not 1
    four = simulate_run(ASYNC, model, layout, hw, 200, trace, 600.0, restart=_in_job(4))
    assert four.in_place == 1
    assert four.wall_s == approx(123.4 + 3.0675 + 80)


def test_a_failure_during_an_in_job_recovery_takes_its_own_spare(model, layout, hw):
    # The first recovery runs 123.4 .. 126.4675 s; a second failure at 125 s starts it
    # over: in place with a second spare (3.0675 s), else relaunched (10.0675 s).
    failures = [Failure(123.4), Failure(125.0)]
    one = simulate_run(ASYNC, model, layout, hw, 200, failures, 600.0, restart=_in_job(4))
    assert (one.failures, one.in_place) == (2, 1)
    assert one.wall_s == approx(125.0 + 10.0675 + 80)
    two = simulate_run(ASYNC, model, layout, hw, 200, failures, 600.0, restart=_in_job(8))
    assert (two.failures, two.in_place) == (2, 2)
    assert two.wall_s == approx(125.0 + 3.0675 + 80)


def test_each_failure_during_a_recovery_needs_a_spare_node_whatever_its_kind(model, layout,
                                                                            hw):
    # Five spares, nodes of 4: a node failure at 123.4 s takes 4; a software failure at
    # 125 s during its recovery needs a whole spare node too, and the one spare left is
    # not one: relaunched. With eight, both in place.
    trace = [Failure(123.4, "node"), Failure(125.0, "software")]
    five = simulate_run(ASYNC, model, layout, hw, 200, trace, 600.0, restart=_in_job(5))
    assert (five.failures, five.in_place) == (2, 1)
    assert five.wall_s == approx(125.0 + 10.0675 + 80)
    eight = simulate_run(ASYNC, model, layout, hw, 200, trace, 600.0, restart=_in_job(8))
    assert (eight.failures, eight.in_place) == (2, 2)
    assert eight.wall_s == approx(125.0 + 3.0675 + 80)


def test_no_spares_is_exactly_a_relaunch(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)

    def run(plan):
        return simulate_run(p, model, layout, hw, 5000, failure_stream(300.0, 0.3, 7),
                            300.0, restart=plan)

    assert run(RestartPlan("in-job", 0, 1.0, PHASES)) == run(RestartPlan())
    with_spares = run(_in_job(8, repair_s=300.0))
    assert with_spares.in_place > 0
    assert with_spares.ettr > run(RestartPlan()).ettr


def test_seeded_runs_agree_with_the_model(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)
    plan = RestartPlan("in-job", 4, 600.0, PHASES)
    seeds = list(range(12))
    s = simulate_many(p, model, layout, hw, 300.0, 8000, seeds, 0.3, restart=plan)
    again = simulate_many(p, model, layout, hw, 300.0, 8000, seeds, 0.3, restart=plan)
    assert s == again                                # deterministic for the seeds
    pred = predict(p, model, layout, hw, 300.0, 0.3, plan)
    assert 0.3 < pred.in_place < 0.9                 # the spares run out at times
    assert s.in_place == approx(pred.in_place, abs=0.05)
    assert s.ettr == approx(pred.ettr, abs=0.01)
    relaunch = simulate_many(p, model, layout, hw, 300.0, 8000, seeds, 0.3)
    assert relaunch.in_place == 0.0 and s.ettr > relaunch.ettr


def test_pec_dynamic_recovers_in_place_as_its_k_grows(model, layout, hw):
    # failures on the training clock: each at the same point of its segment whatever
    # the downtimes, so the runs differ only by them
    p = Policy("pec-dynamic", interval=10, k=1, plt_threshold=0.001)
    failures = [Failure(100.0 * i) for i in range(1, 20)]
    r = simulate_run(p, model, layout, hw, 3000, failures, 100.0, uptime_clock=True,
                     restart=_in_job(64, repair_s=0.0))
    assert r.final_k > 1                             # K doubled on the way
    assert r.in_place == r.failures == 19
    relaunched = simulate_run(p, model, layout, hw, 3000, failures, 100.0, uptime_clock=True)
    # each of the 19 recoveries 7 s shorter (3 s of phases against a 10 s restart)
    assert relaunched.final_k == r.final_k
    assert relaunched.wall_s - r.wall_s == approx(19 * 7.0)
