"""Sparse snapshot windows: schedules, snapshots per position, window choice, replay."""

import itertools
import math
import random

import pytest

from deepspeed_ext.policy.operators import Operator, index_operators, order_operators
from deepspeed_ext.policy.window import (IterationSnapshot, ReplayStep, Schedule, WindowChoice,
                                         build_schedule, bytes_at, choose_window,
                                         iteration_bytes, last_complete_window,
                                         max_bytes_per_iteration, replay_plan, snapshot_at,
                                         window_host_bytes)
from tests.deepspeed_ext.policy.operator_cases import dense_op, plain_ops, random_model


def _brute_max_bytes(ordered, window):
    """Largest per-position snapshot, summed operator by operator from ``snapshot_at``."""
    schedule = build_schedule(ordered, window)
    by_name = {op.name: op for op in ordered}
    return max(sum(by_name[n].active_bytes for n in snap.active)
               + sum(by_name[n].frozen_bytes for n in snap.frozen)
               for snap in (snapshot_at(schedule, t) for t in range(window)))


# --- schedule -------------------------------------------------------------------------------

def test_build_schedule_minimises_the_largest_group_hand_case():
    ops = plain_ops([(4, 0), (1, 0), (1, 0), (1, 0), (3, 0), (2, 0)])
    # Largest group 5 is optimal: 4 needs a group of its own plus [1,1,1,3,2] in two.
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2", "o3", "o4"), ("o5",))
    assert build_schedule(ops, 1).groups == (tuple(f"o{i}" for i in range(6)),)
    assert build_schedule(ops, 6).groups == tuple((f"o{i}",) for i in range(6))


def test_build_schedule_keeps_every_group_non_empty_with_zero_bytes():
    ops = plain_ops([(0, 0), (0, 0), (0, 0), (0, 0)])
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2",), ("o3",))


def test_build_schedule_opens_trailing_groups_when_items_run_out():
    ops = plain_ops([(5, 0), (5, 0), (5, 0), (5, 0)])
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2",), ("o3",))


@pytest.mark.parametrize("window", [0, 5, -1, 2.0, True, None])
def test_build_schedule_rejects_bad_window_naming_the_flag(window):
    with pytest.raises(ValueError, match="--moc-window"):
        build_schedule(plain_ops([(1, 1)] * 4), window)


def test_build_schedule_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate"):
        build_schedule([dense_op("a"), dense_op("a")], 1)


def _best_split(sizes, window):
    """Brute force: the least largest-group bytes over all consecutive splits."""
    best = math.inf
    for cuts in itertools.combinations(range(1, len(sizes)), window - 1):
        bounds = (0,) + cuts + (len(sizes),)
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_build_schedule_is_an_optimal_partition_of_the_order(seed):
    ops, popularity = random_model(seed)
    ordered = order_operators(ops, popularity)[:9]
    by_name = index_operators(ordered)
    sizes = [op.active_bytes for op in ordered]
    for window in range(1, len(ordered) + 1):
        schedule = build_schedule(ordered, window)
        assert len(schedule.groups) == window and all(schedule.groups)
        # Consecutive in snapshot order, each operator exactly once.
        assert [n for group in schedule.groups for n in group] == [op.name for op in ordered]
        largest = max(sum(by_name[n].active_bytes for n in g) for g in schedule.groups)
        assert largest == _best_split(sizes, window)


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0, "groups": ()}, "--moc-window"),
    ({"window": 2, "groups": (("a",),)}, "1 groups for a window of 2"),
    ({"window": 2, "groups": (("a",), ())}, "group 1 is empty"),
    ({"window": 2, "groups": (("a", "b"), ("b",))}, "'b' is in two"),
])
def test_schedule_rejects_malformed_groups(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_schedule_group_of():
    schedule = Schedule(window=2, groups=(("a", "b"), ("c",)))
    assert [schedule.group_of(n) for n in "abc"] == [0, 0, 1]
    with pytest.raises(ValueError, match="'z' is in no"):
        schedule.group_of("z")


# --- snapshots and bytes --------------------------------------------------------------------

SIZES = {"a": (10, 2), "b": (8, 1), "c": (6, 1), "d": (4, 5)}
HAND = Schedule(window=3, groups=(("a",), ("b", "c"), ("d",)))
HAND_OPS = {name: dense_op(name, a, f) for name, (a, f) in SIZES.items()}


def test_snapshot_at_active_group_and_later_groups_frozen():
    assert snapshot_at(HAND, 0) == IterationSnapshot(0, ("a",), ("b", "c", "d"))
    assert snapshot_at(HAND, 1) == IterationSnapshot(1, ("b", "c"), ("d",))
    assert snapshot_at(HAND, 2) == IterationSnapshot(2, ("d",), ())


@pytest.mark.parametrize("t", [-1, 3, 1.0, True])
def test_snapshot_at_rejects_positions_outside_the_window(t):
    with pytest.raises(ValueError, match=r"window position must be an int in \[0, 3\)"):
        snapshot_at(HAND, t)


def test_bytes_per_position_hand_case():
    # t0: a active 10 + frozen b, c, d 1+1+5; t1: b, c active 14 + frozen d 5; t2: d 4.
    assert [bytes_at(HAND, HAND_OPS, t) for t in range(3)] == [17, 19, 4]
    assert iteration_bytes(HAND, HAND_OPS) == [17, 19, 4]
    assert max_bytes_per_iteration(HAND, HAND_OPS) == 19
    assert window_host_bytes(HAND, HAND_OPS) == 40


def test_bytes_helpers_reject_missing_operators_and_bad_positions():
    partial = {k: v for k, v in HAND_OPS.items() if k != "c"}
    for call in (lambda: bytes_at(HAND, partial, 0), lambda: window_host_bytes(HAND, partial),
                 lambda: max_bytes_per_iteration(HAND, partial)):
        with pytest.raises(ValueError, match="lacks scheduled operator 'c'"):
            call()
    with pytest.raises(ValueError, match="window position"):
        bytes_at(HAND, HAND_OPS, 3)


# --- choosing W -----------------------------------------------------------------------------

# Largest snapshot per W: 110, 120, 100, 150 bytes (goes up, then below W=1, then up).
BUMPY = plain_ops([(20, 0), (0, 50), (50, 30), (40, 50)])


def test_bumpy_case_snapshot_sizes():
    by_name = index_operators(BUMPY)
    assert [max_bytes_per_iteration(build_schedule(BUMPY, w), by_name)
            for w in range(1, 5)] == [110, 120, 100, 150]


def test_choose_window_looks_past_a_larger_window_that_is_worse():
    assert choose_window(BUMPY, 10, 10.0) == WindowChoice(window=3, snapshot_s=10.0, fits=True)
    assert choose_window(BUMPY, 10, 11.0) == WindowChoice(window=1, snapshot_s=11.0, fits=True)


def test_choose_window_none_fits_gives_the_smallest_snapshot():
    assert choose_window(BUMPY, 10, 9.0) == WindowChoice(window=3, snapshot_s=10.0, fits=False)
    # Limited to W <= 2: W=1 (11 s) beats W=2 (12 s).
    assert choose_window(BUMPY, 10, 9.0, max_window=2) == WindowChoice(1, 11.0, False)


def test_choose_window_plateau_and_ties_prefer_smaller_window():
    ops = plain_ops([(100, 10)] * 4)          # largest snapshot per W: 400, 220, 220, 130
    assert choose_window(ops, 100, 2.5) == WindowChoice(2, 2.2, True)
    assert choose_window(ops, 100, 1.5) == WindowChoice(4, 1.3, True)
    assert choose_window(ops, 100, 1.0, max_window=3) == WindowChoice(2, 2.2, False)


@pytest.mark.parametrize("args, match", [
    (([], 1.0, 1.0), "at least one operator"),
    ((BUMPY, 0, 1.0), "copy_bytes_per_s"),
    ((BUMPY, -5.0, 1.0), "copy_bytes_per_s"),
    ((BUMPY, True, 1.0), "copy_bytes_per_s"),
    ((BUMPY, 1.0, -0.1), "fwd_bwd_s"),
    ((BUMPY, 1.0, float("nan")), "fwd_bwd_s"),
    ((BUMPY, 1.0, 1.0, 0), "--moc-window"),
    ((BUMPY, 1.0, 1.0, 5), "--moc-window"),
])
def test_choose_window_rejects_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        choose_window(*args)


@pytest.mark.parametrize("seed", range(10))
def test_choose_window_is_the_smallest_fitting_window_by_brute_force(seed):
    ops, popularity = random_model(seed)
    ordered = order_operators(ops, popularity)
    sizes = {w: _brute_max_bytes(ordered, w) for w in range(1, len(ordered) + 1)}
    rng = random.Random(seed)
    bandwidth = rng.choice([1, 7, 100])
    # Every distinct size as the budget, and one below the smallest (nothing fits).
    budgets = sorted(set(sizes.values())) + [max(0, min(sizes.values()) - 1)]
    for budget in budgets:
        fwd_bwd = budget / bandwidth
        choice = choose_window(ordered, bandwidth, fwd_bwd)
        fitting = [w for w, b in sizes.items() if b / bandwidth <= fwd_bwd]
        if fitting:
            assert choice.fits and choice.window == min(fitting)
        else:
            best = min(sizes.values())
            assert not choice.fits
            assert choice.window == min(w for w, b in sizes.items() if b == best)
        assert choice.snapshot_s == sizes[choice.window] / bandwidth


# --- recovery -------------------------------------------------------------------------------

@pytest.mark.parametrize("failure, expected", [
    (5, None), (10, None), (13, None), (14, 10), (17, 10), (18, 14), (25, 18), (26, 22),
])
def test_last_complete_window(failure, expected):
    assert last_complete_window(4, 10, failure) == expected


@pytest.mark.parametrize("args, match", [
    ((0, 0, 5), "--moc-window"), ((True, 0, 5), "--moc-window"),
    ((2, -1, 5), "first_window_start"), ((2, 0, -1), "failure_iteration"),
    ((2, 0, 5.0), "failure_iteration"),
])
def test_last_complete_window_rejects_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        last_complete_window(*args)


def test_replay_plan_hand_case():
    schedule = Schedule(window=3, groups=(("a",), ("b",), ("c",)))
    assert replay_plan(schedule, 10, 15) == [
        ReplayStep(10, restored=(0,), stepping=(0,), frozen=(1, 2), frozen_from=10),
        ReplayStep(11, restored=(1,), stepping=(0, 1), frozen=(2,), frozen_from=11),
        ReplayStep(12, restored=(2,), stepping=(0, 1, 2), frozen=(), frozen_from=None),
        ReplayStep(13, restored=(), stepping=(0, 1, 2), frozen=(), frozen_from=None),
        ReplayStep(14, restored=(), stepping=(0, 1, 2), frozen=(), frozen_from=None),
    ]
    assert [step.dense for step in replay_plan(schedule, 10, 13)] == [False, False, True]


@pytest.mark.parametrize("seed", range(10))
def test_replay_plan_invariants(seed):
    rng = random.Random(seed)
    window, first = rng.randrange(1, 7), rng.randrange(0, 50)
    schedule = Schedule(window, tuple((f"g{g}",) for g in range(window)))
    failure = first + rng.randrange(window, 5 * window)
    start = last_complete_window(window, first, failure)
    steps = replay_plan(schedule, start, failure)
    # The newest complete window leaves fewer than W dense iterations to replay after it.
    assert window <= len(steps) == failure - start < 2 * window
    assert [s.iteration for s in steps] == list(range(start, failure))
    restored = [g for s in steps for g in s.restored]
    assert restored == list(range(window))                  # each group once, in order
    for j, step in enumerate(steps):
        assert set(step.stepping).isdisjoint(step.frozen)
        assert sorted(step.stepping + step.frozen) == list(range(window))
        assert len(step.frozen) == max(0, window - 1 - j)    # one fewer frozen per step
        assert step.frozen_from == (step.iteration if step.frozen else None)
        if j < window:
            assert step.restored == (j,) and step.iteration == start + j
    assert all(s.dense and not s.restored for s in steps[window:])
    assert steps[window - 1].dense


@pytest.mark.parametrize("start, failure, match", [
    (10, 12, "did not complete before failure_iteration 12"),
    (10, 9, "did not complete"),
    (-1, 5, "window_start_iteration"),
    (10, 13.0, "did not complete"),
])
def test_replay_plan_rejects_incomplete_windows(start, failure, match):
    schedule = Schedule(window=3, groups=(("a",), ("b",), ("c",)))
    with pytest.raises(ValueError, match=match):
        replay_plan(schedule, start, failure)


# --- end to end -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_every_operator_in_exactly_one_group_for_every_window(seed):
    ops, popularity = random_model(seed)
    ordered = order_operators(ops, popularity)
    by_name = index_operators(ordered)
    for window in range(1, len(ordered) + 1):
        schedule = build_schedule(ordered, window)
        names = [n for group in schedule.groups for n in group]
        assert sorted(names) == sorted(by_name) and len(names) == len(set(names))
        # Over a window each operator is copied active once and frozen at its earlier positions.
        snaps = [snapshot_at(schedule, t) for t in range(window)]
        for name in names:
            assert sum(name in s.active for s in snaps) == 1
            assert sum(name in s.frozen for s in snaps) == schedule.group_of(name)
        assert window_host_bytes(schedule, by_name) == sum(
            by_name[n].active_bytes + schedule.group_of(n) * by_name[n].frozen_bytes
            for n in names)


def test_choose_window_for_failures_balances_frame_cost_and_replay():
    from deepspeed_ext.policy.window import choose_window_for_failures
    # 12 equal experts of 100 active bytes, no frozen bytes: W groups of 12/W experts.
    ops = [Operator(f"e{i}", "expert", (0, i), 100, 0) for i in range(12)]
    # CPU (nothing hidden), 100 bytes/s, 1 s iterations: the largest of W balanced groups
    # holds ceil(12/W) experts, so a frame costs ceil(12/W) s; a failure 1.5 W s.
    def cost(w, mtbf):
        return -(-12 // w) + 1.5 * w / mtbf
    for mtbf in (0.5, 2.0, 8.0, 50.0):
        choice = choose_window_for_failures(ops, 100.0, 1.0, 0.0, mtbf)
        expected = min(range(1, 13), key=lambda w: (cost(w, mtbf), w))
        assert choice.window == expected, (mtbf, choice)
        assert choice.snapshot_s == -(-12 // expected) and not choice.fits
    # By hand: MTBF 0.5: W=1 costs 12+3, W=2 6+6, W=3 4+9 -> 2; MTBF 8: W=4 3+0.75,
    # W=6 2+1.125, W=12 1+2.25 -> 6; MTBF 50: W=12 1+0.36 -> 12.
    assert [choose_window_for_failures(ops, 100.0, 1.0, 0.0, m).window
            for m in (0.5, 8.0, 50.0)] == [2, 6, 12]
    # Rare failures: the largest W (smallest frames); frequent ones: W = 1 (short replays).
    assert choose_window_for_failures(ops, 1.0, 1.0, 0.0, 1e9).window == 12
    assert choose_window_for_failures(ops, 1.0, 1.0, 0.0, 1e-6).window == 1
    # On a GPU a frame that hides within the iteration costs nothing: the smallest W wins.
    gpu = choose_window_for_failures(ops, 1e6, 1.0, 1.0, 100.0)
    assert gpu.window == 1 and gpu.fits
    for bad in (dict(iter_s=0.0), dict(mtbf_s=-1.0), dict(hidden_s=-1.0)):
        kwargs = {**dict(iter_s=1.0, hidden_s=0.0, mtbf_s=1.0), **bad}
        with pytest.raises(ValueError):
            choose_window_for_failures(ops, 1.0, **kwargs)


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

def test_choose_window_for_failures_scales_the_frame_cost_by_the_iteration():
    from deepspeed_ext.policy.window import choose_window_for_failures
    # The 12 experts above, 2 s iterations, MTBF 8 s: a frame of ceil(12/W) s costs
    # ceil(12/W) / 2 of the time, a failure 1.5 W * 2 / 8. W=3: 2 + 1.125, W=4: 1.5 + 1.5,
    # W=6: 1 + 2.25 -> 4 (a frame cost times the iteration instead would pick 6).
    ops = [Operator(f"e{i}", "expert", (0, i), 100, 0) for i in range(12)]
    assert choose_window_for_failures(ops, 100.0, 2.0, 0.0, 8.0).window == 4


def test_replay_plan_of_a_window_past_256_iterations():
    # W = 300: positions past 256 are distinct int objects in CPython; compared by
    # identity, the last step would name a frozen snapshot that does not exist.
    ordered = [dense_op(f"o{i:03d}", 1, 1) for i in range(300)]
    steps = replay_plan(build_schedule(ordered, 300), 0, 300)
    assert [s.frozen_from for s in steps[-2:]] == [298, None]
    assert steps[-1].frozen == () and steps[-1].stepping == tuple(range(300))
