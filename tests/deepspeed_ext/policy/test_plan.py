"""Fully sharded write plans: balance, forced owners, PEC skipping, determinism, errors."""

import random

import pytest

from deepspeed_ext.policy.pec import ExpertLayout, SequentialPolicy
from deepspeed_ext.policy.plan import (Piece, WritePlan, build_write_plan, parse_chunk_key,
                                       split_piece)

ALL4 = (0, 1, 2, 3)


def _random_replicated(seed, count=200, holders=ALL4):
    rng = random.Random(seed)
    return [Piece(f"w{i:03d}", rng.randrange(1, 1_000_000), holders) for i in range(count)]


def _round_robin_max(pieces, world_size):
    """Busiest rank when the i-th piece (by key) goes to holder i mod len(holders)."""
    load = [0] * world_size
    for i, piece in enumerate(sorted(pieces, key=lambda p: p.key)):
        load[piece.holders[i % len(piece.holders)]] += piece.nbytes
    return max(load)


# --- balance ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_replicated_pieces_spread_evenly(seed):
    pieces = _random_replicated(seed)
    plan = build_write_plan(pieces, world_size=4)
    total = sum(p.nbytes for p in pieces)
    assert sum(plan.bytes_per_rank) == total
    assert plan.max_over_mean() < 1.01
    # Greedy bound: the busiest rank's last piece went to a rank at or below the mean.
    assert max(plan.bytes_per_rank) <= total / 4 + max(p.nbytes for p in pieces)
    assert max(plan.bytes_per_rank) <= _round_robin_max(pieces, 4)
    assert sorted(plan.writer) == sorted(p.key for p in pieces)


def test_bytes_per_rank_match_the_written_keys():
    pieces = _random_replicated(7, count=30) + [Piece("opt.0", 5, (0,)), Piece("opt.3", 9, (3,))]
    plan = build_write_plan(pieces, world_size=4)
    sizes = {p.key: p.nbytes for p in pieces}
    for rank in range(4):
        keys = plan.keys_for(rank)
        assert keys == sorted(keys)
        assert sum(sizes[k] for k in keys) == plan.bytes_per_rank[rank]
    assert sum(len(plan.keys_for(r)) for r in range(4)) == len(pieces)


def test_small_example_exact_placement():
    pieces = [Piece("a", 10, (0, 1)), Piece("b", 7, (0, 1)), Piece("c", 5, (0, 1)),
              Piece("d", 3, (0, 1))]
    plan = build_write_plan(pieces, world_size=2)
    # a->0 (10), b->1 (7), c->1 (12), d->0 (13).
    assert plan.writer == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert plan.bytes_per_rank == [13, 12]
    assert plan.max_over_mean() == pytest.approx(13 / 12.5)


def test_single_holder_pieces_go_to_their_holder_however_loaded():
    pieces = [Piece(f"zero.{i}", 1000, (3,)) for i in range(4)] + [Piece("w", 10, ALL4)]
    plan = build_write_plan(pieces, world_size=4)
    assert plan.keys_for(3) == ["zero.0", "zero.1", "zero.2", "zero.3"]
    assert plan.writer["w"] == 0
    assert plan.bytes_per_rank == [10, 0, 0, 4000]


def test_replicated_expert_pieces_are_placed_before_non_expert_ones():
    # Expert pieces may only go to their expert-data-parallel group {0, 1}; the larger
    # non-expert piece is placed after them and lands on a free rank. Plain largest-first
    # would put it on rank 0 and stack an expert piece on top (190 bytes there).
    pieces = [Piece("dense", 100, ALL4), Piece("e1", 90, (0, 1), expert=(0, 0)),
              Piece("e2", 90, (0, 1), expert=(0, 1))]
    plan = build_write_plan(pieces, world_size=4)
    assert plan.writer == {"e1": 0, "e2": 1, "dense": 2}
    assert plan.bytes_per_rank == [90, 90, 100, 0]


def test_split_piece_lets_a_large_tensor_balance():
    big = Piece("embedding", 1000, ALL4)
    assert build_write_plan([big], 4).bytes_per_rank == [1000, 0, 0, 0]
    plan = build_write_plan(split_piece(big, 250), 4)
    assert plan.bytes_per_rank == [250, 250, 250, 250]
    assert plan.max_over_mean() == 1.0


# --- PEC ----------------------------------------------------------------------------------

def test_unselected_expert_pieces_are_skipped_non_expert_always_written():
    pieces = [Piece("dense", 8, (0, 1)), Piece("zero.1", 4, (1,)),
              Piece("l0.e0", 5, (0,), expert=(0, 0)), Piece("l0.e1", 5, (1,), expert=(0, 1)),
              Piece("l1.e0", 5, (0,), expert=(1, 0)), Piece("l1.e1", 5, (1,), expert=(1, 1))]
    plan = build_write_plan(pieces, 2, selected={(0, 1), (1, 0)})
    assert set(plan.writer) == {"dense", "zero.1", "l0.e1", "l1.e0"}
    assert plan.skipped == ("l0.e0", "l1.e1")
    assert sum(plan.bytes_per_rank) == 8 + 4 + 5 + 5
    everything = build_write_plan(pieces, 2)
    assert everything.skipped == ()
    assert len(everything.writer) == 6
    nothing = build_write_plan(pieces, 2, selected=set())
    assert set(nothing.writer) == {"dense", "zero.1"}


@pytest.mark.parametrize("scope, skipped", [
    ("wo", ("e0.m", "e0.w")),  # both parts of the unselected expert left out
    ("w", ("e0.w",)),          # weights partial: every expert's optimizer state written
    ("o", ("e0.m",)),          # optimizer state partial: every expert's weights written
])
def test_scope_decides_which_part_of_an_unselected_expert_is_skipped(scope, skipped):
    pieces = [Piece("dense", 8, (0, 1)),
              Piece("e0.w", 4, (0,), expert=(0, 0), part="w"),
              Piece("e0.m", 8, (0,), expert=(0, 0), part="o"),
              Piece("e1.w", 4, (1,), expert=(0, 1), part="w"),
              Piece("e1.m", 8, (1,), expert=(0, 1), part="o")]
    plan = build_write_plan(pieces, 2, selected={(0, 1)}, scope=scope)
    assert plan.skipped == skipped
    assert set(plan.writer) == {p.key for p in pieces} - set(skipped)
    assert build_write_plan(pieces, 2, scope=scope).skipped == ()  # no PEC: all written


def test_scope_errors():
    unknown_part = [Piece("e0", 4, (0,), expert=(0, 0))]
    assert build_write_plan(unknown_part, 1, selected=set()).skipped == ("e0",)
    with pytest.raises(ValueError, match="'e0' has part ''"):
        build_write_plan(unknown_part, 1, selected=set(), scope="w")
    with pytest.raises(ValueError, match="--moc-pec-scope"):
        build_write_plan([], 1, scope="wx")
    chunks = split_piece(Piece("e", 10, (0,), expert=(0, 0), part="o"), 4)
    assert {c.part for c in chunks} == {"o"}


@pytest.mark.parametrize("checkpoint", [0, 1, 2])
def test_fig4_non_expert_pieces_fill_ranks_saving_fewer_experts(checkpoint):
    layout = ExpertLayout(num_moe_layers=4, num_experts=3, ep_size=3)
    selected = SequentialPolicy(layout, k=1).scheduled(checkpoint)
    experts = [Piece(f"layer{layer}.expert{e}", 100, (layout.ep_rank_of(e),), expert=(layer, e))
               for layer in range(4) for e in range(3)]
    dense = [Piece(f"dense{i}", 50, (0, 1, 2)) for i in range(4)]
    plan = build_write_plan(dense + experts, world_size=3, selected=selected)
    assert len(plan.skipped) == 8
    # One rank saves two experts (200 bytes), the others one; the four 50-byte non-expert
    # pieces all go to the two lighter ranks and even them out. Megatron-DeepSpeed's rank 0
    # would write all of them: 400 bytes on the busiest rank instead of 200.
    busy = [r for r in range(3) if sum(layout.ep_rank_of(e) == r for _, e in selected) == 2]
    assert len(busy) == 1
    assert not any(k.startswith("dense") for k in plan.keys_for(busy[0]))
    assert plan.bytes_per_rank == [200, 200, 200]


def test_fig4_first_checkpoint_after_complete_save_uses_policy_selection():
    layout = ExpertLayout(num_moe_layers=4, num_experts=3, ep_size=3)
    policy = SequentialPolicy(layout, k=1)
    policy.mark_saved(policy.select(), step=0)
    experts = [Piece(f"l{layer}.e{e}", 100, (e,), expert=(layer, e))
               for layer in range(4) for e in range(3)]
    dense = [Piece(f"dense{i}", 50, (0, 1, 2)) for i in range(4)]
    plan = build_write_plan(experts + dense, world_size=3, selected=policy.select())
    # Paper checkpoint 2: experts (0,1), (1,2), (2,0), (3,1) -> rank 1 saves two.
    assert plan.keys_for(1) == ["l0.e1", "l3.e1"]
    assert plan.keys_for(0) == ["dense0", "dense2", "l2.e0"]
    assert plan.keys_for(2) == ["dense1", "dense3", "l1.e2"]


# --- determinism --------------------------------------------------------------------------

def test_plan_does_not_depend_on_input_order():
    experts = [Piece(f"e{e}", 300, (e // 2 * 2, e // 2 * 2 + 1), expert=(0, e)) for e in range(4)]
    pieces = (_random_replicated(11, count=60)
              + [Piece(f"same{i}", 500, ALL4) for i in range(9)]  # equal sizes: key decides
              + [Piece(f"zero.{r}", 700, (r,)) for r in range(4)] + experts)
    reference = build_write_plan(pieces, 4, selected={(0, 1), (0, 2)})
    rng = random.Random(5)
    for _ in range(5):
        shuffled = pieces[:]
        rng.shuffle(shuffled)
        plan = build_write_plan(shuffled, 4, selected=[(0, 2), (0, 1)])
        assert plan == reference


# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("pieces,match", [
    ([Piece("a", 1, (0,)), Piece("a", 2, (1,))], "duplicate piece key 'a'"),
    ([Piece("b", 1, ())], "'b' has no holders"),
    ([Piece("c", 1, (0, 4))], "'c' has holder 4"),
    ([Piece("d", 1, (-1,))], "'d' has holder -1"),
    ([Piece("e", -1, (0,))], "'e' has bad nbytes"),
    ([Piece("f", 1.5, (0,))], "'f' has bad nbytes"),
    ([Piece("g", 1, (1, 1))], "'g' lists a holder twice"),
])
def test_bad_pieces_raise_naming_the_key(pieces, match):
    with pytest.raises(ValueError, match=match):
        build_write_plan(pieces, world_size=4)


def test_bad_world_size_and_rank():
    with pytest.raises(ValueError, match="world_size"):
        build_write_plan([], world_size=0)
    plan = build_write_plan([], world_size=2)
    assert plan == WritePlan(writer={}, bytes_per_rank=[0, 0], skipped=())
    assert plan.max_over_mean() == 1.0
    with pytest.raises(ValueError, match="rank 2"):
        plan.keys_for(2)


# --- split_piece --------------------------------------------------------------------------

def test_split_piece_keys_sizes_and_offsets():
    piece = Piece("model#layer.w", 1000, (0, 2), expert=(1, 3))
    chunks = split_piece(piece, 300)
    assert [c.key for c in chunks] == [f"model#layer.w#{i}" for i in range(4)]
    assert [c.nbytes for c in chunks] == [300, 300, 300, 100]
    assert {(c.holders, c.expert) for c in chunks} == {((0, 2), (1, 3))}
    assert [parse_chunk_key(c.key, 300) for c in chunks] == [
        ("model#layer.w", 0), ("model#layer.w", 300), ("model#layer.w", 600),
        ("model#layer.w", 900)]


def test_split_piece_small_and_empty_pieces_give_one_chunk():
    assert split_piece(Piece("s", 40, (0,)), 300) == [Piece("s#0", 40, (0,))]
    assert split_piece(Piece("z", 0, (0,)), 300) == [Piece("z#0", 0, (0,))]
    assert [c.nbytes for c in split_piece(Piece("x", 600, (0,)), 300)] == [300, 300]


def test_split_piece_and_parse_errors():
    with pytest.raises(ValueError, match="chunk_bytes"):
        split_piece(Piece("a", 10, (0,)), 0)
    with pytest.raises(ValueError, match="'a' has bad nbytes"):
        split_piece(Piece("a", -10, (0,)), 4)
    with pytest.raises(ValueError, match="not a chunk key"):
        parse_chunk_key("weights", 4)
    with pytest.raises(ValueError, match="not a chunk key"):
        parse_chunk_key("weights#x", 4)


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

@pytest.mark.parametrize("holder", [True, 1.5])
def test_a_holder_that_is_not_an_int_rank_is_refused(holder):
    # True would pass a range check as rank 1; 1.5 would index the load list.
    with pytest.raises(ValueError, match="has holder"):
        build_write_plan([Piece("a", 1, (0, holder))], 2)
