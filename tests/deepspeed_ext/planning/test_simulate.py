"""The failure simulator: determinism, hand-computed traces, agreement with the analytic model."""

import statistics

import pytest

from deepspeed_ext.planning.costs import Policy, predict
from deepspeed_ext.planning.simulate import (Failure, confidence_half_width,
                                             exponential_failures, failure_stream, load_trace,
                                             parse_trace, simulate_many, simulate_run,
                                             t_quantile)
from tests.deepspeed_ext.planning.conftest import toy_hardware

approx = pytest.approx


# --- determinism --------------------------------------------------------------------------

def test_same_seed_same_run(model, layout, hw):
    p = Policy("full-async", interval=10)

    def run(seed):
        failures = exponential_failures(300.0, 1e5, 0.3, seed)
        return simulate_run(p, model, layout, hw, 5000, failures, 300.0)

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a.failures > 5
    assert a != c
    assert exponential_failures(300.0, 1e5, 0.3, 7) == exponential_failures(300.0, 1e5, 0.3, 7)
    assert exponential_failures(300.0, 1e5, 0.3, 7) != exponential_failures(300.0, 1e5, 0.3, 8)


def test_simulate_many_is_deterministic(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)
    s1 = simulate_many(p, model, layout, hw, 300.0, 3000, [0, 1, 2], 0.5)
    s2 = simulate_many(p, model, layout, hw, 300.0, 3000, [0, 1, 2], 0.5)
    s3 = simulate_many(p, model, layout, hw, 300.0, 3000, [3, 4, 5], 0.5)
    assert s1 == s2
    assert s1.ettr != s3.ettr
    assert s1.runs == 3
    assert s1.ettr_ci > 0


# --- no failures --------------------------------------------------------------------------

def test_no_failures_ettr_is_the_overhead_factor(model, layout, hw):
    p = Policy("full-sync", interval=10)     # overhead 0.1485 / 10 = 0.01485 s per iteration
    r = simulate_run(p, model, layout, hw, 1000, [], 600.0)
    assert r.ettr == approx(1 / (1 + 0.01485 / 1.0), rel=1e-12)
    assert r.wall_s == approx(1000 * 1.01485, rel=1e-12)
    assert r.failures == 0 and r.redone_iterations == 0 and r.plt == 0
    assert r.useful_iterations == 1000
    assert r.goodput_tokens_s == approx(1000 * 1000 / r.wall_s)
    # no stall at all: exactly 1
    r2 = simulate_run(Policy("full-async", interval=10), model, layout, hw, 1000, [], 600.0)
    assert r2.ettr == 1.0


def test_failure_after_the_end_is_ignored(model, layout, hw):
    r = simulate_run(Policy("full-async", interval=10), model, layout, hw, 100,
                     [Failure(100.0)], 600.0)    # finishes at 100 s exactly
    assert r.failures == 0 and r.wall_s == approx(100.0)


# --- hand-built traces --------------------------------------------------------------------

def test_one_software_failure_full_async(model, layout, hw):
    # full-async every 10: no stall (step 1 s), persist lag 0.135 iterations, downtime
    # 10 + 13.5e6 / 2e8 = 10.0675 s.
    p = Policy("full-async", interval=10)
    r = simulate_run(p, model, layout, hw, 200, [Failure(123.4, "software")], 600.0)
    # progress 123.4 it; durable: floor((123.4 - 0.135) / 10) * 10 = 120; redone 3.4
    # wall: 123.4 + 10.0675 + (200 - 120) * 1 = 213.4675
    assert r.failures == 1
    assert r.redone_iterations == approx(3.4)
    assert r.wall_s == approx(213.4675)
    assert r.ettr == approx(200 / 213.4675)


def test_failure_just_before_a_checkpoint_is_durable(model, layout, hw):
    # 120.1 it: the checkpoint at 120 is durable only at 120.135 -> back to 110
    p = Policy("full-async", interval=10)
    r = simulate_run(p, model, layout, hw, 200, [Failure(120.1)], 600.0)
    assert r.redone_iterations == approx(10.1)
    assert r.wall_s == approx(120.1 + 10.0675 + 90)


def test_one_failure_with_stall_full_sync(model, layout, hw):
    # full-sync every 10: step 1.01485 s; failure after 55 iterations (55.81675 s)
    p = Policy("full-sync", interval=10)
    r = simulate_run(p, model, layout, hw, 200, [Failure(55 * 1.01485)], 600.0)
    # durable: floor(55 / 10) * 10 = 50 (no lag); redone 5; downtime 10.0675
    assert r.redone_iterations == approx(5.0)
    assert r.wall_s == approx(55 * 1.01485 + 10.0675 + 150 * 1.01485)


def test_two_level_software_versus_node_failure(model, layout, hw):
    p = Policy("two-level", interval=1, persist_interval=10)
    soft = simulate_run(p, model, layout, hw, 200, [Failure(123.4, "software")], 600.0)
    # memory: snapshot every iteration, lag 0.0135: floor(123.3865) = 123; redone 0.4
    # downtime 10 + 13.5e6 / 2e9 = 10.00675; wall 123.4 + 10.00675 + 77
    assert soft.redone_iterations == approx(0.4)
    assert soft.wall_s == approx(210.40675)
    node = simulate_run(p, model, layout, hw, 200, [Failure(123.4, "node")], 600.0)
    # storage+memory: the trainer persists the first snapshot (iteration 1), then every
    # 10th: 1, 11, ..., 121 (durable at 121.135): back to 121; downtime 10.0675
    assert node.redone_iterations == approx(2.4)
    assert node.wall_s == approx(123.4 + 10.0675 + 79)


def test_exact_replays_from_the_last_complete_window(model, layout, hw):
    p = Policy("exact", window=4)
    r = simulate_run(p, model, layout, hw, 100, [Failure(10.5)], 600.0)
    # complete windows [0,4), [4,8) (the second complete at 8.0042): the newest one
    # complete is [4,8) -> resume at floor((10.5 - 4 - 0.0042) / 4) * 4 = 4; redone 6.5
    assert r.redone_iterations == approx(6.5)
    # downtime 10 + 4 frames 16.875e6 / 2e9 = 10.0084375
    assert r.wall_s == approx(10.5 + 10.0084375 + 96)


def test_failures_inside_the_downtime(model, layout, hw):
    p = Policy("full-async", interval=10)
    trace = [Failure(123.4), Failure(125.0)]     # the second inside 123.4 .. 133.4675
    again = simulate_run(p, model, layout, hw, 200, trace, 600.0, downtime_failures=True)
    # the recovery starts over at 125: 125 + 10.0675 + 80
    assert again.failures == 2
    assert again.wall_s == approx(215.0675)
    skipped = simulate_run(p, model, layout, hw, 200, trace, 600.0, downtime_failures=False)
    assert skipped.failures == 1
    assert skipped.wall_s == approx(213.4675)


def test_simulate_many_with_trace_runs_once(model, layout, hw):
    p = Policy("full-async", interval=10)
    s = simulate_many(p, model, layout, hw, 600.0, 200, [0, 1, 2], trace=[Failure(123.4)])
    assert s.runs == 1
    assert s.failures == 1
    assert s.ettr == approx(200 / 213.4675)
    assert s.ettr_ci == 0.0


def test_simulate_bad_inputs(model, layout, hw):
    p = Policy("full-async")
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        simulate_run(p, model, layout, hw, 0, [], 600.0)
    with pytest.raises(ValueError, match="at least one seed"):
        simulate_many(p, model, layout, hw, 600.0, 100, [])
    with pytest.raises(ValueError, match="MTBF must be > 0"):
        exponential_failures(0.0, 100.0, 0.0, 0)
    with pytest.raises(ValueError, match="failure time must be a finite number of seconds >= 0"):
        Failure(-1.0)
    with pytest.raises(ValueError, match="failure kind must be one of software, node"):
        Failure(1.0, "disk")


# --- traces ---------------------------------------------------------------------------------

def test_parse_trace():
    text = ("# a trace\n"
            "\n"
            "300.5 node   # a node dies\n"
            "100\n"
            "200, software\n"
            "   # only a comment\n")
    assert parse_trace(text) == [Failure(100.0, "software"), Failure(200.0, "software"),
                                 Failure(300.5, "node")]
    assert parse_trace("") == []


@pytest.mark.parametrize("text,line", [
    ("10\nabc\n", 2),
    ("# c\n\n10 disk\n", 3),
    ("-5 node\n", 1),
])
def test_parse_trace_bad_lines_name_the_line(text, line):
    with pytest.raises(ValueError, match=f"trace line {line}:"):
        parse_trace(text)


# --- exponential failures -----------------------------------------------------------------

def test_exponential_failures_mean_gap_and_kinds():
    failures = exponential_failures(100.0, 1e6, 0.3, seed=1)
    assert 9000 < len(failures) < 11000                    # ~ 1e6 / 100
    times = [f.time_s for f in failures]
    assert times == sorted(times) and times[-1] <= 1e6
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert statistics.mean(gaps) == approx(100.0, rel=0.05)
    node = sum(f.kind == "node" for f in failures) / len(failures)
    assert node == approx(0.3, abs=0.03)
    assert all(f.kind == "software" for f in exponential_failures(100.0, 1e4, 0.0, 2))


# --- agreement with the analytic model ----------------------------------------------------

@pytest.mark.parametrize("policy", [Policy("full-async", interval=10),
                                    Policy("full-sync", interval=10),
                                    Policy("two-level", interval=1, persist_interval=10),
                                    Policy("exact", window=4)])
def test_simulated_ettr_agrees_with_predict(model, layout, hw, policy):
    mtbf, frac = 600.0, 0.3
    s = simulate_many(policy, model, layout, hw, mtbf, 50000, range(8), frac)
    pred = predict(policy, model, layout, hw, mtbf, frac)
    assert s.failures > 50
    assert s.ettr == approx(pred.ettr, rel=0.02)
    assert pred.ettr < 0.99                                # failures do cost something


def test_simulated_plt_agrees_with_predict(model, layout, hw):
    p = Policy("pec", interval=10, k=2)
    s = simulate_many(p, model, layout, hw, 600.0, 50000, range(8))
    pred = predict(p, model, layout, hw, 600.0)
    assert pred.plt == approx(15 / 600)                    # 15 iterations per failure
    assert s.plt == approx(pred.plt, rel=0.1)


# --- pec-dynamic --------------------------------------------------------------------------

def test_pec_dynamic_k_grows_under_frequent_failures(model, layout, hw):
    p = Policy("pec-dynamic", interval=10, k=1)
    failures = exponential_failures(50.0, 1e5, 0.0, seed=3)
    r = simulate_run(p, model, layout, hw, 2000, failures, 50.0)
    assert r.failures > 10
    assert r.final_k == 8                                  # 1 -> 2 -> 4 -> 8


def test_pec_dynamic_k_stays_without_failures(model, layout, hw):
    p = Policy("pec-dynamic", interval=10, k=1)
    r = simulate_run(p, model, layout, hw, 2000, [], 50.0)
    assert r.final_k == 1
    # one failure after 1000 iterations: PLT 35 / 1000 = 0.035 < 0.0375: no doubling
    r = simulate_run(p, model, layout, hw, 2000, [Failure(1000.5)], 50.0)
    assert r.failures == 1 and r.final_k == 1
    # one failure after 900: 35 / 900 = 0.0389 > 0.0375: doubles once
    r = simulate_run(p, model, layout, hw, 2000, [Failure(905.5)], 50.0)
    assert r.final_k == 2



# --- the newest durable persist is state: a node failure may go back past a memory resume ----

def test_node_failure_after_a_memory_resume_goes_back_to_the_durable_persist(model, layout):
    # two-level, a snapshot every iteration, a persist every 100; storage slow enough that a
    # persist takes 33.75 s (13.5e6 B / 4e5 B/s per rank), so the one after the restart is
    # not durable 30 iterations later. t = 1 s, restart 10 s.
    hw = toy_hardware(storage_write_gbps=0.0016)
    p = Policy("two-level", interval=1, persist_interval=100)
    # persists (the first snapshot after each start, then every 100th): 1 (durable at
    # 34.75), 101 (134.75). Software failure at 150.2: back to the snapshot at 150
    # (memory); downtime 10 + 13.5e6 / 2e9 = 10.00675 -> training again at 160.20675.
    # After the restart the trainer persists 151, durable only at 184.75.
    # Node failure 30 iterations later (iteration 180): memory is lost and the newest
    # durable persist is 101, before the point the segment resumed from.
    node_at = 150.2 + 10.00675 + 30
    r = simulate_run(p, model, layout, hw, 200,
                     [Failure(150.2, "software"), Failure(node_at, "node")], 600.0)
    assert r.failures == 2
    assert r.redone_iterations == approx(0.2 + (180 - 101))
    # node downtime 10 + 13.5e6 / 2e8 = 10.0675, then iterations 101 .. 200
    assert r.wall_s == approx(node_at + 10.0675 + 99)


def test_node_failure_after_a_memory_resume_with_fast_storage(model, layout, hw):
    # The same trace with a 0.135 s persist: the trainer persisted the first snapshot after
    # the restart (151, durable at 151.135), so the node failure at 180 goes back to 151.
    p = Policy("two-level", interval=1, persist_interval=100)
    node_at = 150.2 + 10.00675 + 30
    r = simulate_run(p, model, layout, hw, 200,
                     [Failure(150.2, "software"), Failure(node_at, "node")], 600.0)
    assert r.redone_iterations == approx(0.2 + (180 - 151))
    assert r.wall_s == approx(node_at + 10.0675 + 49)


# --- a node failure during a software recovery escalates ------------------------------------

def test_node_failure_during_a_software_recovery_is_a_node_recovery(model, layout):
    hw = toy_hardware(node_replace_s=5.0)
    p = Policy("two-level", interval=1, persist_interval=10)
    # software failure at 123.4: back to the snapshot at 123; its recovery (10.00675 s)
    # is hit by a node failure at 125: the node's memory is gone, so the recovery starts
    # over as a node recovery (10 + 5 replace + 13.5e6 / 2e8 = 15.0675 s) from the newest
    # durable persist, 121 (persists at 1, 11, ..., 121; durable at 121.135).
    r = simulate_run(p, model, layout, hw, 200, [Failure(123.4), Failure(125.0, "node")], 600.0)
    assert r.failures == 2
    assert r.redone_iterations == approx(0.4 + 2)
    assert r.wall_s == approx(125.0 + 15.0675 + (200 - 121))
    # full-async: the resume point is the same (storage), the downtime the node's
    a = simulate_run(Policy("full-async", interval=10), model, layout, hw, 200,
                     [Failure(123.4), Failure(125.0, "node")], 600.0)
    assert a.redone_iterations == approx(3.4)
    assert a.wall_s == approx(125.0 + 15.0675 + 80)
    # a software failure during a node recovery stays a node recovery
    b = simulate_run(Policy("full-async", interval=10), model, layout, hw, 200,
                     [Failure(123.4, "node"), Failure(125.0)], 600.0)
    assert b.wall_s == approx(125.0 + 15.0675 + 80)


# --- failures never run out ------------------------------------------------------------------

def test_failure_stream_has_no_end_and_matches_the_list():
    stream = failure_stream(10.0, 0.3, seed=4)
    first = [next(stream) for _ in range(5000)]
    assert first[-1].time_s > 10.0 * 4000
    assert exponential_failures(10.0, first[99].time_s, 0.3, seed=4) == first[:100]
    with pytest.raises(ValueError, match="MTBF must be > 0 seconds and finite"):
        next(failure_stream(float("inf"), 0.0, 0))


def test_collapsed_ettr_is_not_floored_by_a_failure_horizon(model, layout):
    # A 600 s restart under a 100 s MTBF: a recovery succeeds once in e^6 ~ 400 attempts.
    # Pre-generated failures used to stop at iterations x T x 50 + 10 MTBF = 51,000 s,
    # after which the run finished: ETTR ~ 1000 / 52,600 ~ 0.019 whatever the policy.
    hw = toy_hardware(restart_s=600.0)
    s = simulate_many(Policy("full-async", interval=10), model, layout, hw, 100.0, 1000,
                      [0, 1, 2])
    assert s.ettr < 0.008
    assert s.failures > 2000
    assert s.unfinished == 0


def test_a_run_that_cannot_finish_stops_after_max_failures(model, layout):
    hw = toy_hardware(restart_s=1e6)
    r = simulate_run(Policy("full-async", interval=10), model, layout, hw, 1000,
                     failure_stream(10.0, 0.0, 1), 10.0, max_failures=200)
    assert not r.finished
    assert r.failures == 200
    assert r.ettr < 1e-3


# --- confidence intervals ----------------------------------------------------------------------

def test_t_quantiles():
    assert t_quantile(1) == approx(12.706)
    assert t_quantile(4) == approx(2.776)
    assert t_quantile(30) == approx(2.042)
    assert t_quantile(31) == 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0)


def test_ci_uses_students_t_for_few_seeds(model, layout, hw):
    # five values 1..5: stdev 1.5811, standard error 0.7071; t(4) = 2.776 (not 1.96)
    assert confidence_half_width([1.0, 2.0, 3.0, 4.0, 5.0]) == approx(
        2.776 * statistics.stdev([1, 2, 3, 4, 5]) / 5 ** 0.5)
    p = Policy("full-async", interval=10)
    s = simulate_many(p, model, layout, hw, 300.0, 3000, [0, 1, 2])
    runs = [simulate_run(p, model, layout, hw, 3000, failure_stream(300.0, 0.0, seed), 300.0).ettr
            for seed in (0, 1, 2)]
    assert s.ettr_ci == approx(4.303 * statistics.stdev(runs) / 3 ** 0.5)


# --- the first start's warm-up -------------------------------------------------------------------

def test_failure_during_the_first_warmup_redoes_nothing(model, layout):
    hw = toy_hardware(warmup_s=3.0)
    r = simulate_run(Policy("full-async", interval=10), model, layout, hw, 100,
                     [Failure(1.0)], 600.0)
    assert r.redone_iterations == 0.0
    # the failure at 1 s, a downtime of 10 + 3 warm-up + 13.5e6 / 2e8, then 100 iterations
    assert r.wall_s == approx(1.0 + 13.0675 + 100)


# --- trace files -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,line,match", [
    ("10\nnan node\n", 2, "finite"),
    ("inf\n", 1, "finite"),
    ("1e400 software\n", 1, "finite"),
    ("10 node 3\n", 1, "got 3 fields"),
    ("10, node, extra\n", 1, "got 3 fields"),
    ("10 Node\n", 1, "failure kind must be one of software, node"),
])
def test_parse_trace_rejects_non_finite_times_and_extra_fields(text, line, match):
    with pytest.raises(ValueError, match=f"trace line {line}: .*{match}"):
        parse_trace(text)


def test_load_trace_names_the_file_and_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("# ok\n5 node\nnan\n")
    with pytest.raises(ValueError, match=f"{path} line 3: 'nan': a failure time must be a finite"):
        load_trace(str(path))
    path.write_text("5 node\n7\n")
    assert load_trace(str(path)) == [Failure(5.0, "node"), Failure(7.0)]
    with pytest.raises(ValueError, match=f"{tmp_path / 'none.txt'}: .*No such file"):
        load_trace(str(tmp_path / "none.txt"))
