"""Partial experts checkpointing: layouts, the sequential and load-aware policies, state."""

import json
import random
from collections import Counter

import pytest

from deepspeed_ext.policy.pec import (ExpertLayout, LoadAwarePolicy, SequentialPolicy,
                                      expert_order, make_policy, per_rank_counts)

# Paper Fig. 4: 3 EP ranks, MoE layers 1, 3, 5, 7 of the model (0..3 here), one expert per rank.
FIG4 = ExpertLayout(num_moe_layers=4, num_experts=3, ep_size=3)


def _saved_everything(policy, step=0):
    policy.mark_saved(policy.layout.all_experts(), step)
    return policy


# --- layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["num_moe_layers", "num_experts", "ep_size"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_layout_rejects_non_positive_fields_by_name(field, bad):
    kwargs = {"num_moe_layers": 2, "num_experts": 4, "ep_size": 2, field: bad}
    with pytest.raises(ValueError, match=field):
        ExpertLayout(**kwargs)


def test_layout_needs_ep_size_dividing_experts():
    with pytest.raises(ValueError, match="ep_size"):
        ExpertLayout(num_moe_layers=2, num_experts=6, ep_size=4)


def test_ep_rank_of_blocks_of_local_experts():
    layout = ExpertLayout(num_moe_layers=1, num_experts=8, ep_size=4)
    assert [layout.ep_rank_of(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="expert 8"):
        layout.ep_rank_of(8)


def test_per_rank_counts_and_bad_ids():
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    assert per_rank_counts({(0, 0), (0, 1), (1, 3)}, layout) == [2, 1]
    with pytest.raises(ValueError, match="outside"):
        per_rank_counts({(2, 0)}, layout)
    with pytest.raises(ValueError, match="pair"):
        per_rank_counts([(0, 1, 2)], layout)


# --- sequential ---------------------------------------------------------------------------

def test_expert_order_interleaves_ep_ranks():
    layout = ExpertLayout(num_moe_layers=1, num_experts=8, ep_size=2)
    order = expert_order(layout)
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    assert [layout.ep_rank_of(e) for e in order] == [0, 1] * 4


def test_sequential_reproduces_paper_fig4():
    policy = SequentialPolicy(FIG4, k=1)
    # Checkpoint 1: expert 0 of layers 1 and 7 (rank 0), 1 of layer 3 (rank 1), 2 of layer 5.
    assert policy.scheduled(0) == {(0, 0), (1, 1), (2, 2), (3, 0)}
    assert per_rank_counts(policy.scheduled(0), FIG4) == [2, 1, 1]
    # The next checkpoint moves every layer on by one expert.
    assert policy.scheduled(1) == {(0, 1), (1, 2), (2, 0), (3, 1)}
    assert policy.scheduled(2) == {(0, 2), (1, 0), (2, 1), (3, 2)}
    assert policy.scheduled(3) == policy.scheduled(0)


def test_sequential_covers_each_expert_exactly_once_per_round():
    policy = SequentialPolicy(FIG4, k=1)
    saved = Counter(x for c in range(FIG4.num_experts) for x in policy.scheduled(c))
    assert set(saved) == FIG4.all_experts()
    assert set(saved.values()) == {1}


@pytest.mark.parametrize("experts,ep,layers,k", [(16, 4, 12, 1), (8, 2, 4, 2), (16, 4, 12, 4)])
def test_sequential_round_of_n_over_k_checkpoints_saves_each_once(experts, ep, layers, k):
    layout = ExpertLayout(num_moe_layers=layers, num_experts=experts, ep_size=ep)
    policy = SequentialPolicy(layout, k=k)
    saved = Counter(x for c in range(experts // k) for x in policy.scheduled(c))
    assert set(saved) == layout.all_experts()
    assert set(saved.values()) == {1}


@pytest.mark.parametrize("experts,ep,layers,k,per_rank", [
    (16, 4, 12, 1, 3), (8, 2, 4, 1, 2), (16, 4, 12, 2, 6), (8, 8, 6, 4, 3)])
def test_sequential_balances_ep_ranks_every_checkpoint(experts, ep, layers, k, per_rank):
    layout = ExpertLayout(num_moe_layers=layers, num_experts=experts, ep_size=ep)
    policy = _saved_everything(SequentialPolicy(layout, k=k))
    for step in range(1, 2 * experts + 1):
        selection = policy.select()
        assert len(selection) == layers * k
        assert per_rank_counts(selection, layout) == [per_rank] * ep
        policy.mark_saved(selection, step)


def test_sequential_select_first_is_complete_then_rotates_as_fig4():
    policy = SequentialPolicy(FIG4, k=1)
    assert policy.select() == FIG4.all_experts()          # nothing saved yet
    assert policy.select() == FIG4.all_experts()          # select alone changes nothing
    policy.mark_saved(policy.select(), step=10)
    assert policy.checkpoints == 1
    assert policy.select() == {(0, 1), (1, 2), (2, 0), (3, 1)}
    policy.mark_saved(policy.select(), step=20)
    assert policy.select() == {(0, 2), (1, 0), (2, 1), (3, 2)}
    policy.mark_saved(policy.select(), step=30)
    assert policy.select() == {(0, 0), (1, 1), (2, 2), (3, 0)}
    assert policy.last_saved_steps() == [[10, 20, 30], [30, 10, 20], [20, 30, 10], [10, 20, 30]]


def test_never_saved_experts_are_always_included():
    policy = SequentialPolicy(FIG4, k=1)
    policy.mark_saved({(0, 0), (0, 1), (0, 2), (1, 0)}, step=5)
    # Rotation slot 1 plus the seven experts that have no saved version yet.
    expected = policy.scheduled(1) | (FIG4.all_experts() - {(0, 0), (0, 1), (0, 2), (1, 0)})
    assert policy.select() == expected
    assert (1, 0) not in expected


@pytest.mark.parametrize("name", ["sequential", "load-aware"])
def test_k_equal_to_num_experts_selects_everything(name):
    layout = ExpertLayout(num_moe_layers=3, num_experts=4, ep_size=2)
    policy = _saved_everything(make_policy(name, layout, k=4))
    assert policy.select() == layout.all_experts()


@pytest.mark.parametrize("name", ["sequential", "load-aware"])
@pytest.mark.parametrize("bad", [0, 5, -1, 1.0, True])
def test_k_out_of_range_names_the_flag(name, bad):
    layout = ExpertLayout(num_moe_layers=1, num_experts=4, ep_size=1)
    with pytest.raises(ValueError, match="--moc-pec-k"):
        make_policy(name, layout, k=bad)
    policy = make_policy(name, layout, k=1)
    with pytest.raises(ValueError, match="--moc-pec-k"):
        policy.k = bad
    assert policy.k == 1


def test_unknown_policy_names_the_flag():
    with pytest.raises(ValueError, match="--moc-pec-policy"):
        make_policy("random", FIG4, 1)
    assert isinstance(make_policy("sequential", FIG4, 1), SequentialPolicy)
    assert isinstance(make_policy("load-aware", FIG4, 1), LoadAwarePolicy)


# --- load-aware ---------------------------------------------------------------------------

def test_load_aware_picks_most_unsaved_tokens_per_layer():
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    policy = _saved_everything(LoadAwarePolicy(layout, k=2))
    policy.observe_tokens([[5, 1, 7, 0], [0, 9, 2, 3]])
    policy.observe_tokens([[0, 3, 1, 0], [4, 0, 2, 0]])
    assert policy.unsaved_tokens() == [[5, 4, 8, 0], [4, 9, 4, 3]]
    # Layer 1: experts 0 and 2 tie at 4 tokens and were saved at the same step -> lower index.
    assert policy.select() == {(0, 2), (0, 0), (1, 1), (1, 0)}
    policy.mark_saved(policy.select(), step=7)
    assert policy.unsaved_tokens() == [[0, 4, 0, 0], [0, 0, 4, 3]]
    assert policy.last_saved_steps() == [[7, 0, 7, 0], [7, 7, 0, 0]]


def test_load_aware_ties_prefer_the_older_saved_version():
    layout = ExpertLayout(num_moe_layers=1, num_experts=4, ep_size=1)
    policy = LoadAwarePolicy(layout, k=1)
    policy.mark_saved({(0, 2)}, step=4)
    policy.mark_saved({(0, 0), (0, 1), (0, 3)}, step=8)
    policy.mark_saved({(0, 1)}, step=9)
    policy.observe_tokens([[3, 3, 3, 3]])
    # All tie on tokens; last saved steps are 8, 9, 4, 8 -> expert 2 (oldest) goes first.
    assert policy.select() == {(0, 2)}
    policy.mark_saved({(0, 2)}, step=10)
    # Now 8, 9, 10, 8 and tokens 3, 3, 0, 3 -> experts 0 and 3 tie on both; lower index wins.
    assert policy.select() == {(0, 0)}


def test_load_aware_still_saves_experts_without_tokens():
    layout = ExpertLayout(num_moe_layers=1, num_experts=3, ep_size=1)
    policy = _saved_everything(LoadAwarePolicy(layout, k=2))
    policy.observe_tokens([[0, 0, 6]])
    assert policy.select() == {(0, 2), (0, 0)}


@pytest.mark.parametrize("counts,match", [
    ([[1, 2, 3, 4]], "1 MoE layers"),
    ([[1, 2, 3, 4], [1, 2, 3]], "MoE layer 1 have 3 experts"),
    ([[1, 2, 3, 4], [1, -2, 3, 4]], "negative"),
    ([[1, 2, 3, 4], [1, 2.5, 3, 4]], "not ints"),
])
def test_observe_tokens_checks_shape_and_values_atomically(counts, match):
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    policy = LoadAwarePolicy(layout, k=1)
    with pytest.raises(ValueError, match=match):
        policy.observe_tokens(counts)
    assert policy.unsaved_tokens() == [[0] * 4, [0] * 4]


def test_sequential_tracks_tokens_too():
    policy = _saved_everything(SequentialPolicy(FIG4, k=1))
    policy.observe_tokens([[1, 2, 3]] * 4)
    policy.mark_saved(policy.select(), step=3)
    assert policy.unsaved_tokens() == [[1, 0, 3], [1, 2, 0], [0, 2, 3], [1, 0, 3]]


def test_mark_saved_rejects_going_back_and_changes_nothing():
    policy = SequentialPolicy(FIG4, k=1)
    policy.mark_saved({(0, 0)}, step=5)
    policy.observe_tokens([[1, 1, 1]] * 4)
    with pytest.raises(ValueError, match=r"\(0, 0\) was already saved at step 5"):
        policy.mark_saved({(1, 1), (0, 0)}, step=4)
    with pytest.raises(ValueError, match="outside"):
        policy.mark_saved({(1, 1), (0, 3)}, step=6)
    with pytest.raises(ValueError, match="step"):
        policy.mark_saved({(1, 1)}, step=-1)
    assert policy.checkpoints == 1
    assert policy.last_saved_steps()[1] == [None, None, None]
    assert policy.unsaved_tokens()[1] == [1, 1, 1]


# --- state --------------------------------------------------------------------------------

def _drive(policy, rng, steps, start=0):
    """``steps`` iterations from ``start`` with random gate counts, saving every other one."""
    layout = policy.layout
    selections = []
    for step in range(start, start + steps):
        policy.observe_tokens([[rng.randrange(50) for _ in range(layout.num_experts)]
                               for _ in range(layout.num_moe_layers)])
        if step % 2 == 0:
            selections.append(policy.select())
            policy.mark_saved(selections[-1], step)
    return selections


@pytest.mark.parametrize("name", ["sequential", "load-aware"])
def test_state_dict_round_trip_gives_the_same_next_selections(name):
    layout = ExpertLayout(num_moe_layers=3, num_experts=8, ep_size=4)
    original = make_policy(name, layout, k=2)
    _drive(original, random.Random(0), 9)
    restored = make_policy(name, layout, k=1)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.k == 2
    assert restored.state_dict() == original.state_dict()
    assert _drive(restored, random.Random(1), 12, start=10) == \
        _drive(original, random.Random(1), 12, start=10)


def test_state_of_one_policy_loads_into_the_other():
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    sequential = SequentialPolicy(layout, k=1)
    _drive(sequential, random.Random(3), 5)
    load_aware = LoadAwarePolicy(layout, k=1)
    load_aware.load_state_dict(sequential.state_dict())
    assert load_aware.last_saved_steps() == sequential.last_saved_steps()
    assert load_aware.unsaved_tokens() == sequential.unsaved_tokens()
    assert load_aware.state_dict()["policy"] == "load-aware"


@pytest.mark.parametrize("change,match", [
    ({"layout": {"num_moe_layers": 2, "num_experts": 8, "ep_size": 2}}, "num_experts=8"),
    ({"layout": {"num_moe_layers": 3, "num_experts": 4, "ep_size": 2}}, "num_moe_layers=3"),
    ({"layout": {"num_moe_layers": 2, "num_experts": 4, "ep_size": 4}}, "ep_size=4"),
    ({"k": 9}, "--moc-pec-k"),
    ({"policy": "random"}, "unknown policy"),
    ({"checkpoints": -1}, "checkpoint count"),
    ({"last_saved_step": [[0, 0, 0, 0]]}, "last_saved_step"),
    ({"last_saved_step": [[0, 0, 0, 0], [0, 0, 0, -3]]}, "last saved step"),
    ({"unsaved_tokens": [[0, 0, 0], [0, 0, 0, 0]]}, "3 experts"),
])
def test_load_state_dict_rejects_mismatches_and_changes_nothing(change, match):
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    source = _saved_everything(SequentialPolicy(layout, k=1), step=4)
    target = SequentialPolicy(layout, k=1)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict({**source.state_dict(), **change})
    assert target.state_dict() == before


def test_load_state_dict_rejects_missing_keys():
    policy = SequentialPolicy(FIG4, k=1)
    state = policy.state_dict()
    del state["unsaved_tokens"]
    with pytest.raises(ValueError, match="unsaved_tokens"):
        policy.load_state_dict(state)


def test_parts_and_scopes():
    from deepspeed_ext.policy.pec import check_scope, part_of_kind, partial_parts
    assert [part_of_kind(k) for k in ("fp32", "exp_avg", "exp_avg_sq")] == ["w", "o", "o"]
    assert partial_parts("wo") == ("w", "o")
    assert partial_parts("w") == ("w",) and partial_parts("o") == ("o",)
    assert check_scope("o") == "o"
    for bad in ("", "ow", "W", None):
        with pytest.raises(ValueError, match="--moc-pec-scope must be one of wo, w, o"):
            check_scope(bad)


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

@pytest.mark.parametrize("expert_id", [(-1, 0), (3, 0), (0, -1), (0, 5)])
def test_expert_ids_one_or_more_past_either_end_are_refused(expert_id):
    layout = ExpertLayout(num_moe_layers=2, num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="outside"):
        layout.check_expert(expert_id)


def test_token_counts_of_more_experts_than_small_int_cache():
    # 300 experts per layer: lengths past 256 are distinct int objects in CPython, so an
    # identity test in place of != would refuse every row.
    layout = ExpertLayout(num_moe_layers=1, num_experts=300, ep_size=1)
    policy = LoadAwarePolicy(layout, k=1)
    policy.observe_tokens([[1] * 300])
    assert policy.unsaved_tokens() == [[1] * 300]


@pytest.mark.parametrize("step", [True, 1.5, "3"])
def test_mark_saved_refuses_a_step_that_is_not_an_int(step):
    policy = SequentialPolicy(FIG4, k=1)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        policy.mark_saved({(0, 0)}, step)
    assert policy.checkpoints == 0 and policy.last_saved_steps()[0] == [None, None, None]


def test_mark_saved_again_at_the_same_step_is_allowed():
    # A save retried at the step it failed at records the same version again.
    policy = SequentialPolicy(FIG4, k=1)
    policy.mark_saved({(0, 0)}, step=5)
    policy.mark_saved({(0, 0)}, step=5)
    assert policy.checkpoints == 2 and policy.last_saved_steps()[0][0] == 5
