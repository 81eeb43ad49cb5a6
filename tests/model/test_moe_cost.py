"""The alpha-beta cost model of the MoE schedules (megatron/model/moe_cost.py)."""

import itertools

import pytest
import torch

from megatron.model.moe_cost import (GroupLinks, LayerShape, Link, capacity_of, choose,
                                     predict)

SHAPE = LayerShape(experts=8, capacity=16, hidden=256, ep=4, tp=2)  # V = 8*16*256*4 = 131072 B


def test_collective_terms():
    link = Link(alpha=1e-3, beta=1e-9)
    assert link.all_to_all(4, 4000) == pytest.approx(3e-3 + 1e-9 * 4000 * 3 / 4)
    assert link.all_reduce(2, 1000) == pytest.approx(2 * (1e-3 + 1e-9 * 500))
    assert link.all_to_all(1, 1e9) == 0.0


def test_predictions_follow_the_derivation():
    """The per-pass formulas of docs/moe-schedules.md, term by term."""
    v = SHAPE.volume
    assert v == 131072
    ep, tp, comb = Link(1e-4, 1e-9), Link(2e-5, 2e-10), Link(5e-5, 5e-10)
    links = GroupLinks(ep=ep, tp=tp, combined=comb)
    a2a, ag, ar = ep.all_to_all(4, v / 2), tp.all_to_all(2, v), tp.all_reduce(2, v)
    assert predict("deepspeed", SHAPE, links) == pytest.approx(4 * a2a + 4 * ag + 2 * ar)
    assert predict("parm-s1", SHAPE, links) == pytest.approx(4 * comb.all_to_all(8, v) + 2 * ag)
    overlapped = max(a2a, ag * 3 / 4) + ag / 4
    assert predict("parm-s2", SHAPE, links) == pytest.approx(
        2 * overlapped + 2 * a2a + 2 * ag + 2 * ar)
    # S2 never predicts more than DeepSpeed: the overlap only hides time
    assert predict("parm-s2", SHAPE, links) <= predict("deepspeed", SHAPE, links)
    with pytest.raises(ValueError, match="unknown MoE schedule"):
        predict("parm-s3", SHAPE, links)


def test_auto_picks_s1_only_where_the_tensor_parallel_bytes_dominate():
    """S1 moves 6 V (T-1)/T fewer bytes over the tensor-parallel links but takes more
    latency steps (pairwise all-to-alls over P x T ranks) and sends each chunk T times
    over the expert-parallel links."""
    big = LayerShape(experts=8, capacity=512, hidden=4096, ep=4, tp=2)
    # tensor-parallel links 100x slower per byte than the others: S1 wins
    slow_tp = GroupLinks(ep=Link(1e-6, 1e-10), tp=Link(1e-6, 1e-8), combined=Link(1e-6, 1e-10))
    assert choose(big, slow_tp)[0] == "parm-s1"
    # every link alike and latency-bound: S1's 4 x (P T - 1) steps lose
    flat = Link(1e-3, 1e-10)
    best, times = choose(SHAPE, GroupLinks(flat, flat, flat))
    assert best == "parm-s2" and times["parm-s1"] > times["deepspeed"]
    # expert-parallel links slow per byte (across nodes): S1 loses again
    slow_ep = GroupLinks(ep=Link(1e-5, 1e-8), tp=Link(1e-6, 1e-10), combined=Link(1e-5, 1e-8))
    best, times = choose(big, slow_ep)
    assert best == "parm-s2" and times["parm-s1"] > 2 * times["deepspeed"]


def test_links_record_round_trip_and_errors():
    links = GroupLinks(Link(1.0, 2.0), Link(3.0, 4.0), Link(5.0, 6.0))
    assert GroupLinks.from_record(links.to_record()) == links
    with pytest.raises(ValueError, match="combined"):
        GroupLinks.from_record({"ep": {"alpha": 1, "beta": 1}, "tp": {"alpha": 1, "beta": 1}})
    with pytest.raises(ValueError, match="tp.beta"):
        GroupLinks.from_record({"ep": {"alpha": 1, "beta": 1}, "tp": {"alpha": 1, "beta": -1},
                                "combined": {"alpha": 1, "beta": 1}})


def test_capacity_as_deepspeeds_gate_sizes_it():
    # 64 tokens, 8 experts: top-1 cf 1.0 -> 8; top-2 doubles; the minimum wins when larger
    assert capacity_of(64, 8, 1, 1.0, 4, True) == 8
    assert capacity_of(64, 8, 2, 1.0, 4, True) == 16
    assert capacity_of(64, 8, 1, 0.25, 4, True) == 4
    assert capacity_of(64, 8, 2, 1.0, 4, False) == 16  # no dropping: the mean count


def test_capacity_is_what_the_padded_gate_returns():
    """With token dropping, capacity_of is the capacity DeepSpeed 0.19's gate returns on
    the model's padding (megatron/model/moe_capacity.py), float32 rounding included (25
    tokens, 2 experts, factor 1.2: 16, where float64 gives 15), for T = 1, 2 and 4."""
    from deepspeed.moe.sharded_moe import TopKGate

    from megatron.model.moe_capacity import pad_capacity
    assert capacity_of(25, 2, 1, 1.2, 4, True) == 16
    assert capacity_of(64, 8, 2, 1.0, 4, False, 4) == 16 and capacity_of(72, 8, 1, 1.0, 4, False, 2) == 10
    checked = 0
    for experts, topk, factor, tp in itertools.product((2, 4, 8), (1, 2), (1.0, 1.2, 1.3), (1, 2, 4)):
        gate = TopKGate(16, experts, k=topk, capacity_factor=factor, min_capacity=4,
                        drop_tokens=True, use_rts=False)
        pad_capacity(gate, tp)
        for tokens in (25, 45, 64, 72):
            got = int(gate(torch.randn(tokens, 16), None, True, False)[1])
            assert capacity_of(tokens, experts, topk, factor, 4, True, tp) == got, \
                (tokens, experts, topk, factor, tp, got)
            checked += got % 2 == 1
    assert checked > 0  # odd capacities among them (T = 1)
