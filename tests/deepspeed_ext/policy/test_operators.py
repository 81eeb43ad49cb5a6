"""Operators of exact recovery: their checks, the snapshot order, re-ordering."""

import itertools
import random

import pytest

from deepspeed_ext.policy.operators import (Operator, index_operators, order_operators,
                                            popularity_shift, should_reorder)
from tests.deepspeed_ext.policy.operator_cases import dense_op, expert_op, random_model


# --- operators ------------------------------------------------------------------------------

def test_operator_normalises_expert_id_to_a_tuple_of_ints():
    op = Operator("e", "expert", [1, 2], 10, 3)
    assert op.expert == (1, 2) and isinstance(op.expert, tuple)
    assert dense_op("d").expert is None


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
    a, b = dense_op("a"), dense_op("b")
    assert index_operators([b, a]) == {"a": a, "b": b}
    with pytest.raises(ValueError, match="duplicate operator name 'a'"):
        index_operators([a, b, dense_op("a", 1, 1)])


# --- order ----------------------------------------------------------------------------------

def _small_model():
    return [expert_op("e0.0", 0, 0), expert_op("e0.1", 0, 1), dense_op("b_attn"),
            expert_op("e1.0", 1, 0), dense_op("a_gate", kind="gate"), expert_op("e1.1", 1, 1)]


def test_order_non_expert_by_name_then_experts_least_popular_first():
    popularity = {(0, 0): 5, (0, 1): 1, (1, 1): 1}            # (1, 0) missing: counts as 0
    names = [op.name for op in order_operators(_small_model(), popularity)]
    assert names == ["a_gate", "b_attn", "e1.0", "e0.1", "e1.1", "e0.0"]


def test_order_without_popularity_is_by_layer_then_expert():
    names = [op.name for op in order_operators(_small_model(), {})]
    assert names == ["a_gate", "b_attn", "e0.0", "e0.1", "e1.0", "e1.1"]


def test_order_ties_within_one_expert_by_name():
    ops = [expert_op("e0.0.w2", 0, 0), expert_op("e0.1", 0, 1), expert_op("e0.0.w1", 0, 0)]
    names = [op.name for op in order_operators(ops, {(0, 0): 2, (0, 1): 3})]
    assert names == ["e0.0.w1", "e0.0.w2", "e0.1"]


@pytest.mark.parametrize("seed", range(5))
def test_order_is_the_same_for_any_input_order(seed):
    ops, popularity = random_model(seed)
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
        order_operators(_small_model() + [expert_op("e0.0", 3, 3)], {})


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


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

def test_an_expert_missing_from_popularity_ties_with_a_count_of_zero():
    # (1, 1) has no count: it ranks as 0, after (0, 0)'s explicit 0 by expert id.
    popularity = {(0, 0): 0, (0, 1): 5, (1, 0): 5}
    names = [op.name for op in order_operators(_small_model(), popularity)]
    assert names == ["a_gate", "b_attn", "e0.0", "e1.1", "e0.1", "e1.0"]


def test_popularity_shift_of_more_operators_than_small_int_cache():
    # 300 operators (a rank of 300 expert shards): lengths past 256 are distinct int
    # objects in CPython, so an identity test in place of == would refuse them.
    names = [f"e{i}" for i in range(300)]
    assert popularity_shift(names, names) == 0.0
    assert popularity_shift(names, names[::-1]) == 1.0
