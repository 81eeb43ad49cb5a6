"""Sparse snapshot windows: operator order, schedules, window choice, re-ordering, replay."""

import itertools
import math
import random

import pytest

from deepspeed_ext.window import (IterationSnapshot, Operator, ReplayStep, Schedule,
                                  WindowChoice, build_schedule, bytes_at, choose_window,
                                  index_operators, iteration_bytes, last_complete_window,
                                  max_bytes_per_iteration, order_operators, popularity_shift,
                                  replay_plan, should_reorder, snapshot_at, window_host_bytes)


def _expert(name, layer, expert, active=12, frozen=2):
    return Operator(name, "expert", (layer, expert), active, frozen)


def _dense(name, active=12, frozen=2, kind="dense"):
    return Operator(name, kind, None, active, frozen)


def _plain(sizes):
    """Dense operators o0, o1, ... with ``(active_bytes, frozen_bytes)`` from ``sizes``."""
    return [_dense(f"o{i}", a, f) for i, (a, f) in enumerate(sizes)]


def _random_model(seed):
    """A random rank: a few dense blocks and gates plus experts, and a random popularity."""
    rng = random.Random(seed)
    ops = [_dense(f"dense{i}", rng.randrange(0, 500), rng.randrange(0, 100))
           for i in range(rng.randrange(0, 4))]
    ops += [_dense(f"gate{i}", rng.randrange(0, 50), rng.randrange(0, 10), kind="gate")
            for i in range(rng.randrange(0, 3))]
    layers, experts = rng.randrange(1, 4), rng.randrange(1, 5)
    ops += [_expert(f"e{layer}.{e}", layer, e, rng.randrange(0, 300), rng.randrange(0, 60))
            for layer in range(layers) for e in range(experts)]
    popularity = {(layer, e): rng.randrange(0, 5) for layer in range(layers)
                  for e in range(experts) if rng.random() < 0.8}
    rng.shuffle(ops)
    return ops, popularity


def _brute_max_bytes(ordered, window):
    """Largest per-position snapshot, summed operator by operator from ``snapshot_at``."""
    schedule = build_schedule(ordered, window)
    by_name = {op.name: op for op in ordered}
    return max(sum(by_name[n].active_bytes for n in snap.active)
               + sum(by_name[n].frozen_bytes for n in snap.frozen)
               for snap in (snapshot_at(schedule, t) for t in range(window)))


# --- operators ------------------------------------------------------------------------------

def test_operator_normalises_expert_id_to_a_tuple_of_ints():
    op = Operator("e", "expert", [1, 2], 10, 3)
    assert op.expert == (1, 2) and isinstance(op.expert, tuple)
    assert _dense("d").expert is None


@pytest.mark.parametrize("kwargs, match", [
    ({"name": ""}, "name"),
    ({"name": 3}, "name"),
    ({"kind": "router"}, "kind"),
    ({"active_bytes": -1}, "active_bytes"),
    ({"active_bytes": 1.5}, "active_bytes"),
    ({"frozen_bytes": True}, "frozen_bytes"),
    ({"frozen_bytes": -2}, "frozen_bytes"),
    ({"expert": None}, "expert must be set"),
    ({"kind": "dense"}, "expert must be set"),
    ({"kind": "gate"}, "expert must be set"),
    ({"expert": (1,)}, "not a .moe_layer, expert. pair"),
    ({"expert": "ab"}, "not a .moe_layer, expert. pair"),
    ({"expert": (0, -1)}, "negative"),
])
def test_operator_rejects_bad_fields_by_name(kwargs, match):
    fields = {"name": "e", "kind": "expert", "expert": (0, 0), "active_bytes": 1,
              "frozen_bytes": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        Operator(**fields)


def test_index_operators_maps_names_and_rejects_duplicates():
    a, b = _dense("a"), _dense("b")
    assert index_operators([b, a]) == {"a": a, "b": b}
    with pytest.raises(ValueError, match="duplicate operator name 'a'"):
        index_operators([a, b, _dense("a", 1, 1)])


# --- order ----------------------------------------------------------------------------------

def _small_model():
    return [_expert("e0.0", 0, 0), _expert("e0.1", 0, 1), _dense("b_attn"),
            _expert("e1.0", 1, 0), _dense("a_gate", kind="gate"), _expert("e1.1", 1, 1)]


def test_order_non_expert_by_name_then_experts_least_popular_first():
    popularity = {(0, 0): 5, (0, 1): 1, (1, 1): 1}            # (1, 0) missing: counts as 0
    names = [op.name for op in order_operators(_small_model(), popularity)]
    assert names == ["a_gate", "b_attn", "e1.0", "e0.1", "e1.1", "e0.0"]


def test_order_without_popularity_is_by_layer_then_expert():
    names = [op.name for op in order_operators(_small_model(), {})]
    assert names == ["a_gate", "b_attn", "e0.0", "e0.1", "e1.0", "e1.1"]


def test_order_ties_within_one_expert_by_name():
    ops = [_expert("e0.0.w2", 0, 0), _expert("e0.1", 0, 1), _expert("e0.0.w1", 0, 0)]
    names = [op.name for op in order_operators(ops, {(0, 0): 2, (0, 1): 3})]
    assert names == ["e0.0.w1", "e0.0.w2", "e0.1"]


@pytest.mark.parametrize("seed", range(5))
def test_order_is_the_same_for_any_input_order(seed):
    ops, popularity = _random_model(seed)
    expected = order_operators(ops, popularity)
    rng = random.Random(seed)
    for _ in range(5):
        shuffled = list(ops)
        rng.shuffle(shuffled)
        items = list(popularity.items())
        rng.shuffle(items)
        assert order_operators(shuffled, dict(items)) == expected
    assert sorted(op.name for op in expected) == sorted(op.name for op in ops)


@pytest.mark.parametrize("popularity, match", [
    ({(2, 0): 1}, r"expert \(2, 0\) that no operator holds"),
    ({(0, 0): -1}, r"popularity of expert \(0, 0\)"),
    ({(0, 0): 1.5}, r"popularity of expert \(0, 0\)"),
    ({"x": 1}, "not a .moe_layer, expert. pair"),
])
def test_order_rejects_bad_popularity(popularity, match):
    with pytest.raises(ValueError, match=match):
        order_operators(_small_model(), popularity)


def test_order_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate operator name 'e0.0'"):
        order_operators(_small_model() + [_expert("e0.0", 3, 3)], {})


# --- schedule -------------------------------------------------------------------------------

def test_build_schedule_minimises_the_largest_group_hand_case():
    ops = _plain([(4, 0), (1, 0), (1, 0), (1, 0), (3, 0), (2, 0)])
    # Largest group 5 is optimal: 4 needs a group of its own plus [1,1,1,3,2] in two.
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2", "o3", "o4"), ("o5",))
    assert build_schedule(ops, 1).groups == (tuple(f"o{i}" for i in range(6)),)
    assert build_schedule(ops, 6).groups == tuple((f"o{i}",) for i in range(6))


def test_build_schedule_keeps_every_group_non_empty_with_zero_bytes():
    ops = _plain([(0, 0), (0, 0), (0, 0), (0, 0)])
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2",), ("o3",))


def test_build_schedule_opens_trailing_groups_when_items_run_out():
    ops = _plain([(5, 0), (5, 0), (5, 0), (5, 0)])
    assert build_schedule(ops, 3).groups == (("o0", "o1"), ("o2",), ("o3",))


@pytest.mark.parametrize("window", [0, 5, -1, 2.0, True, None])
def test_build_schedule_rejects_bad_window_naming_the_flag(window):
    with pytest.raises(ValueError, match="--moc-window"):
        build_schedule(_plain([(1, 1)] * 4), window)


def test_build_schedule_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate"):
        build_schedule([_dense("a"), _dense("a")], 1)


def _best_split(sizes, window):
    """Brute force: the least largest-group bytes over all consecutive splits."""
    best = math.inf
    for cuts in itertools.combinations(range(1, len(sizes)), window - 1):
        bounds = (0,) + cuts + (len(sizes),)
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_build_schedule_is_an_optimal_partition_of_the_order(seed):
    ops, popularity = _random_model(seed)
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
HAND_OPS = {name: _dense(name, a, f) for name, (a, f) in SIZES.items()}


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
BUMPY = _plain([(20, 0), (0, 50), (50, 30), (40, 50)])


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
    ops = _plain([(100, 10)] * 4)          # largest snapshot per W: 400, 220, 220, 130
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
    ops, popularity = _random_model(seed)
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


# --- re-ordering ----------------------------------------------------------------------------

def test_popularity_shift_hand_cases():
    order = ["a", "b", "c", "d"]
    assert popularity_shift(order, order) == 0.0
    assert popularity_shift(order, order[::-1]) == 1.0
    assert popularity_shift(order, ["b", "a", "c", "d"]) == pytest.approx(1 / 6)
    assert popularity_shift(order, ["d", "a", "b", "c"]) == pytest.approx(3 / 6)
    assert popularity_shift(["a"], ["a"]) == 0.0
    assert popularity_shift([], []) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_popularity_shift_is_the_fraction_of_discordant_pairs(seed):
    rng = random.Random(seed)
    old = [f"n{i}" for i in range(rng.randrange(2, 40))]
    new = rng.sample(old, len(old))
    pos = {name: i for i, name in enumerate(new)}
    discordant = sum(pos[x] > pos[y] for x, y in itertools.combinations(old, 2))
    pairs = len(old) * (len(old) - 1) / 2
    assert popularity_shift(old, new) == pytest.approx(discordant / pairs)
    assert popularity_shift(new, old) == pytest.approx(discordant / pairs)


@pytest.mark.parametrize("old, new", [(["a", "b"], ["a", "c"]), (["a", "b"], ["a"]),
                                      (["a", "a"], ["a", "a"])])
def test_popularity_shift_needs_the_same_unique_names(old, new):
    with pytest.raises(ValueError, match="same unique operator names"):
        popularity_shift(old, new)


def test_should_reorder_only_above_the_threshold():
    assert should_reorder(0.2, 0.1) is True
    assert should_reorder(0.1, 0.1) is False
    assert should_reorder(0.0, 0.0) is False
    assert should_reorder(1.0, 0.99) is True


@pytest.mark.parametrize("shift, threshold, match", [
    (0.5, 1.5, "reorder threshold"), (0.5, -0.1, "reorder threshold"),
    (0.5, float("nan"), "reorder threshold"), (1.2, 0.5, "shift"), (0.5, None, "threshold"),
])
def test_should_reorder_rejects_out_of_range(shift, threshold, match):
    with pytest.raises(ValueError, match=match):
        should_reorder(shift, threshold)


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
    ops, popularity = _random_model(seed)
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
    from deepspeed_ext.window import choose_window_for_failures
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
