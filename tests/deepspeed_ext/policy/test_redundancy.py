"""Snapshot redundancy: spec/topology checks, replica placement, XOR parity, rebuild plans."""

import random

import pytest
import torch

from deepspeed_ext.policy.redundancy import (Holdings, RebuildPlan, RedundancySpec, Topology,
                                             Transfer, check_layout, chunk_size, chunk_span,
                                             decode_image, encode_parity, extra_bytes,
                                             padded_chunk, parity_holder, parity_inputs,
                                             plan_rebuild, rebuild_transfers, replica_sources,
                                             replica_targets, stripe_of, xor_into)


def _image(rng, size):
    return torch.tensor([rng.randrange(256) for _ in range(size)], dtype=torch.uint8)


def _fs(*steps):
    return frozenset(steps)


# --- RedundancySpec / Topology / check_layout ---------------------------------------------

def test_spec_defaults_and_describe():
    spec = RedundancySpec()
    assert (spec.mode, spec.replicas, spec.ec_data, spec.ec_parity) == ("none", 1, 2, 1)
    assert spec.enabled is False
    assert spec.describe() == "none"
    assert RedundancySpec("replicate").enabled is True
    assert RedundancySpec("replicate", replicas=1).describe() == "replicate (1 replica)"
    assert RedundancySpec("replicate", replicas=3).describe() == "replicate (3 replicas)"
    assert RedundancySpec("erasure", ec_data=4).describe() == "erasure (4 data + 1 XOR parity)"


@pytest.mark.parametrize("kwargs, flag", [
    ({"mode": "mirror"}, "--moc-redundancy"),
    ({"mode": ""}, "--moc-redundancy"),
    ({"mode": "Replicate"}, "--moc-redundancy"),
    ({"mode": "replicate", "replicas": 0}, "--moc-replicas"),
    ({"mode": "replicate", "replicas": -2}, "--moc-replicas"),
    ({"mode": "erasure", "ec_data": 0}, "--moc-ec-data"),
    ({"mode": "erasure", "ec_parity": 2}, "--moc-ec-parity"),
    ({"mode": "erasure", "ec_parity": 0}, "--moc-ec-parity"),
])
def test_spec_rejects_bad_values(kwargs, flag):
    with pytest.raises(ValueError) as err:
        RedundancySpec(**kwargs)
    assert flag in str(err.value)


def test_spec_bad_mode_lists_modes():
    with pytest.raises(ValueError, match="none, replicate, erasure"):
        RedundancySpec("raid")


def test_spec_bad_parity_names_value_and_flag():
    with pytest.raises(ValueError) as err:
        RedundancySpec("erasure", ec_parity=2)
    msg = str(err.value)
    assert "--moc-ec-parity 2" in msg
    assert "--moc-ec-parity 1" in msg


def test_topology_basics():
    topo = Topology(12, 4)
    assert topo.nodes == 3
    assert [topo.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [topo.local_of(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert topo.rank_at(1, 2) == 6
    assert topo.rank_at(3, 1) == 1      # node wraps
    assert topo.rank_at(-1, 0) == 8     # negative node wraps
    assert Topology(1, 1).nodes == 1


@pytest.mark.parametrize("world, per_node", [(6, 4), (5, 2), (7, 3)])
def test_topology_rejects_uneven_split(world, per_node):
    with pytest.raises(ValueError, match="--moc-ranks-per-node") as err:
        Topology(world, per_node)
    assert f"{world} ranks" in str(err.value)


@pytest.mark.parametrize("world, per_node", [(0, 1), (4, 0), (-4, 2)])
def test_topology_rejects_non_positive(world, per_node):
    with pytest.raises(ValueError, match="must be >= 1"):
        Topology(world, per_node)


def test_check_layout_replicate_needs_enough_nodes():
    topo = Topology(4, 2)   # 2 nodes
    assert check_layout(RedundancySpec("replicate", replicas=1), topo) is None
    with pytest.raises(ValueError) as err:
        check_layout(RedundancySpec("replicate", replicas=2), topo)
    msg = str(err.value)
    assert "--moc-replicas 2" in msg and "at least 3 nodes" in msg and "has 2" in msg
    assert "--moc-ranks-per-node" in msg
    with pytest.raises(ValueError, match="--moc-replicas 1"):
        check_layout(RedundancySpec("replicate", replicas=1), Topology(4, 4))   # 1 node
    assert check_layout(RedundancySpec("replicate", replicas=3), Topology(8, 2)) is None


def test_check_layout_erasure_needs_whole_groups():
    spec = RedundancySpec("erasure", ec_data=2)
    assert check_layout(spec, Topology(6, 2)) is None    # 3 nodes
    assert check_layout(spec, Topology(12, 2)) is None   # 6 nodes
    for world, per_node in [(4, 2), (8, 2), (2, 1), (4, 1)]:
        with pytest.raises(ValueError) as err:
            check_layout(spec, Topology(world, per_node))
        msg = str(err.value)
        assert "--moc-ec-data 2" in msg and "groups nodes by 3" in msg
        assert f"{world // per_node} node(s)" in msg
    assert check_layout(RedundancySpec("erasure", ec_data=1), Topology(4, 1)) is None
    with pytest.raises(ValueError, match="groups nodes by 2"):
        check_layout(RedundancySpec("erasure", ec_data=1), Topology(3, 1))


def test_check_layout_none_accepts_anything():
    assert check_layout(RedundancySpec("none"), Topology(1, 1)) is None
    assert check_layout(RedundancySpec("none", replicas=5), Topology(5, 1)) is None


# --- replicate placement ------------------------------------------------------------------

def test_replica_targets_next_nodes_same_local():
    topo = Topology(8, 2)   # 4 nodes
    assert replica_targets(0, topo, 1) == [2]
    assert replica_targets(1, topo, 2) == [3, 5]
    assert replica_targets(3, topo, 3) == [5, 7, 1]   # wraps to node 0
    assert replica_targets(6, topo, 1) == [0]         # last node -> first
    assert replica_targets(7, topo, 2) == [1, 3]


def test_replica_sources_previous_nodes_same_local():
    topo = Topology(8, 2)
    assert replica_sources(2, topo, 1) == [0]
    assert replica_sources(0, topo, 2) == [6, 4]      # wraps backward
    assert replica_sources(5, topo, 3) == [3, 1, 7]


@pytest.mark.parametrize("world, per_node, replicas",
                         [(8, 2, 3), (6, 1, 5), (12, 3, 2), (4, 2, 1), (10, 2, 4)])
def test_replica_placement_properties(world, per_node, replicas):
    topo = Topology(world, per_node)
    for r in range(world):
        targets = replica_targets(r, topo, replicas)
        assert len(targets) == replicas
        assert len(set(targets)) == replicas
        nodes = [topo.node_of(t) for t in targets]
        assert topo.node_of(r) not in nodes
        assert nodes == [(topo.node_of(r) + k) % topo.nodes for k in range(1, replicas + 1)]
        assert all(topo.local_of(t) == topo.local_of(r) for t in targets)
        for k, t in enumerate(targets):
            assert replica_sources(t, topo, replicas)[k] == r
        sources = replica_sources(r, topo, replicas)
        for k, s in enumerate(sources):
            assert replica_targets(s, topo, replicas)[k] == r


# --- stripes and chunks ---------------------------------------------------------------------

def test_stripe_of_single_group():
    topo = Topology(6, 2)   # 3 nodes, D=2 -> one group
    assert stripe_of(0, topo, 2) == [0, 2, 4]
    assert stripe_of(2, topo, 2) == [0, 2, 4]
    assert stripe_of(4, topo, 2) == [0, 2, 4]
    assert stripe_of(3, topo, 2) == [1, 3, 5]
    assert stripe_of(5, topo, 2).index(5) == 2


def test_stripe_of_multiple_groups():
    topo = Topology(12, 2)  # 6 nodes, D=2 -> groups {0,1,2} and {3,4,5}
    assert stripe_of(0, topo, 2) == [0, 2, 4]
    assert stripe_of(5, topo, 2) == [1, 3, 5]
    assert stripe_of(6, topo, 2) == [6, 8, 10]
    assert stripe_of(11, topo, 2) == [7, 9, 11]
    assert stripe_of(9, topo, 2) == [7, 9, 11]
    stripes = {tuple(stripe_of(r, topo, 2)) for r in range(12)}
    assert len(stripes) == 4
    assert sorted(r for s in stripes for r in s) == list(range(12))
    for r in range(12):
        stripe = stripe_of(r, topo, 2)
        assert r in stripe
        assert len({topo.node_of(x) for x in stripe}) == 3
        assert {topo.local_of(x) for x in stripe} == {topo.local_of(r)}
        assert {topo.node_of(x) // 3 for x in stripe} == {topo.node_of(r) // 3}


def test_stripe_of_d1_pairs_nodes():
    topo = Topology(4, 1)
    assert stripe_of(0, topo, 1) == [0, 1]
    assert stripe_of(3, topo, 1) == [2, 3]


@pytest.mark.parametrize("sizes, data, expected", [
    ([10, 7, 3], 2, 5),
    ([11, 7], 2, 6),
    ([11], 3, 4),
    ([12], 3, 4),
    ([12, 12, 12], 4, 3),
    ([0, 0, 0], 2, 1),
    ([], 3, 1),
    ([1], 4, 1),
    ([3, 2], 4, 1),
    ([5], 1, 5),
    ([0, 9], 2, 5),
])
def test_chunk_size(sizes, data, expected):
    assert chunk_size(sizes, data) == expected
    assert chunk_size(iter(sizes), data) == expected   # any iterable


def test_chunk_span():
    # size 11, chunk 4: [0,4) [4,8) [8,11) [11,11)
    assert [chunk_span(11, 4, m) for m in range(4)] == [(0, 4), (4, 8), (8, 11), (11, 11)]
    assert [chunk_span(12, 4, m) for m in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert [chunk_span(0, 1, m) for m in range(3)] == [(0, 0)] * 3
    # size smaller than D: 2 bytes, chunk 1, D = 4
    assert [chunk_span(2, 1, m) for m in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    # a smaller image in a stripe with a larger chunk
    assert [chunk_span(3, 5, m) for m in range(2)] == [(0, 3), (3, 3)]


def test_padded_chunk():
    image = torch.arange(11, dtype=torch.uint8)
    assert padded_chunk(image, 4, 0).tolist() == [0, 1, 2, 3]
    assert padded_chunk(image, 4, 2).tolist() == [8, 9, 10, 0]
    assert padded_chunk(image, 4, 3).tolist() == [0, 0, 0, 0]
    assert padded_chunk(image, 6, 1).tolist() == [6, 7, 8, 9, 10, 0]
    empty = torch.zeros(0, dtype=torch.uint8)
    assert padded_chunk(empty, 1, 0).tolist() == [0]
    assert padded_chunk(empty, 3, 2).tolist() == [0, 0, 0]
    for m in range(4):
        assert padded_chunk(image, 4, m).dtype == torch.uint8
        assert padded_chunk(image, 4, m).numel() == 4


def test_padded_chunk_full_is_view_padded_is_copy():
    image = torch.arange(12, dtype=torch.uint8)
    full = padded_chunk(image, 4, 1)
    full[0] = 200
    assert image[4].item() == 200            # a view: writes go through
    short = torch.arange(10, dtype=torch.uint8)
    padded = padded_chunk(short, 4, 2)
    padded[0] = 200
    assert short[8].item() == 8              # a copy: the image is untouched


def test_xor_into():
    acc = torch.tensor([0b1010, 0xFF, 0], dtype=torch.uint8)
    out = xor_into(acc, torch.tensor([0b0110, 0x0F, 7], dtype=torch.uint8))
    assert out is acc
    assert acc.tolist() == [0b1100, 0xF0, 7]


@pytest.mark.parametrize("a, b", [(3, 4), (4, 3), (0, 1), (1, 0)])
def test_xor_into_length_mismatch(a, b):
    acc = torch.zeros(a, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{a} and {b} bytes"):
        xor_into(acc, torch.zeros(b, dtype=torch.uint8))


# --- parity layout ------------------------------------------------------------------------

def test_parity_inputs_and_holder_concrete():
    # D = 2, group 3: P_0 = c0(pos1) ^ c1(pos2), P_1 = c0(pos2) ^ c1(pos0), ...
    assert parity_inputs(0, 2) == [(1, 0), (2, 1)]
    assert parity_inputs(1, 2) == [(2, 0), (0, 1)]
    assert parity_inputs(2, 2) == [(0, 0), (1, 1)]
    assert parity_inputs(0, 1) == [(1, 0)]
    assert parity_inputs(3, 3) == [(0, 0), (1, 1), (2, 2)]
    assert parity_holder(1, 0, 2) == 0
    assert parity_holder(1, 1, 2) == 2
    assert parity_holder(0, 0, 2) == 2
    assert parity_holder(0, 0, 1) == 1
    assert parity_holder(1, 0, 1) == 0


@pytest.mark.parametrize("data", [1, 2, 3, 4, 5, 7])
def test_every_chunk_in_exactly_one_foreign_parity(data):
    group = data + 1
    seen = {}
    for holder in range(group):
        inputs = parity_inputs(holder, data)
        assert len(inputs) == data
        assert len({pos for pos, _ in inputs}) == data      # one chunk per other position
        for pos, m in inputs:
            assert pos != holder
            assert 0 <= m < data
            assert (pos, m) not in seen
            seen[(pos, m)] = holder
    assert set(seen) == {(p, m) for p in range(group) for m in range(data)}
    for pos in range(group):
        for m in range(data):
            holder = parity_holder(pos, m, data)
            assert holder == seen[(pos, m)]
            assert holder != pos
            assert (pos, m) in parity_inputs(holder, data)


# --- erasure round trips ------------------------------------------------------------------

def _roundtrip(images, data):
    group = data + 1
    assert len(images) == group
    parities = {i: encode_parity(images, i, data) for i in range(group)}
    chunk = chunk_size([im.numel() for im in images], data)
    for p in parities.values():
        assert p.numel() == chunk and p.dtype == torch.uint8
    for lost in range(group):
        others_p = {i: p for i, p in parities.items() if i != lost}
        others_i = {i: im for i, im in enumerate(images) if i != lost}
        got = decode_image(lost, images[lost].numel(), others_p, others_i, data)
        assert got.dtype == torch.uint8
        assert torch.equal(got, images[lost]), (data, lost, [im.numel() for im in images])


@pytest.mark.parametrize("data", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_erasure_roundtrip_random(data, seed):
    rng = random.Random(1000 * data + seed)
    pool = [0, 1, 2, 3, 5, 7, 13, 31, 97, 101, 257]
    sizes = [rng.choice(pool + [rng.randrange(0, 300)]) for _ in range(data + 1)]
    _roundtrip([_image(rng, s) for s in sizes], data)


@pytest.mark.parametrize("data", [1, 2, 3, 4])
@pytest.mark.parametrize("sizes_fn", [
    lambda d: [0] * (d + 1),                     # all empty
    lambda d: [1] * (d + 1),                     # smaller than D
    lambda d: [d * 8] * (d + 1),                 # exact multiples, equal
    lambda d: [d * 8 + 1] + [0] * d,             # one big, others empty
    lambda d: [0] * d + [d * 5 + 3],             # big image last
    lambda d: list(range(d + 1)),                # 0, 1, ..., D
    lambda d: [97, 2, 13, 53, 7][:d + 1],        # odd primes, unequal
])
def test_erasure_roundtrip_edge_sizes(data, sizes_fn):
    rng = random.Random(data)
    _roundtrip([_image(rng, s) for s in sizes_fn(data)], data)


def test_encode_parity_concrete_values():
    # D = 2, chunk = ceil(5 / 2) = 3
    a = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    b = torch.tensor([16, 32, 64], dtype=torch.uint8)
    c = torch.tensor([7], dtype=torch.uint8)
    images = [a, b, c]
    # P_0 = chunk0(b) ^ chunk1(c) = [16,32,64] ^ [0,0,0]
    assert encode_parity(images, 0, 2).tolist() == [16, 32, 64]
    # P_1 = chunk0(c) ^ chunk1(a) = [7,0,0] ^ [4,5,0]
    assert encode_parity(images, 1, 2).tolist() == [3, 5, 0]
    # P_2 = chunk0(a) ^ chunk1(b) = [1,2,3] ^ [0,0,0]
    assert encode_parity(images, 2, 2).tolist() == [1, 2, 3]
    # inputs untouched
    assert a.tolist() == [1, 2, 3, 4, 5] and b.tolist() == [16, 32, 64] and c.tolist() == [7]


def test_decode_does_not_modify_parities_or_images():
    rng = random.Random(7)
    images = [_image(rng, s) for s in (9, 14, 3)]
    parities = {i: encode_parity(images, i, 2) for i in range(3)}
    saved_p = {i: p.clone() for i, p in parities.items()}
    saved_i = [im.clone() for im in images]
    decode_image(0, 9, {1: parities[1], 2: parities[2]}, {1: images[1], 2: images[2]}, 2)
    assert all(torch.equal(parities[i], saved_p[i]) for i in range(3))
    assert all(torch.equal(images[i], saved_i[i]) for i in range(3))


# --- rebuild plans ------------------------------------------------------------------------

def test_plan_everyone_has_newest_step():
    topo = Topology(4, 2)
    for spec in (RedundancySpec("none"), RedundancySpec("replicate"),
                 RedundancySpec("erasure", ec_data=1)):
        holdings = Holdings(own={r: _fs(3, 4, 5) for r in range(4)},
                            replicas={0: {2: _fs(4, 5)}}, parities={1: _fs(5)})
        plan = plan_rebuild(holdings, topo, spec)
        assert plan == RebuildPlan(5, (), (), "")


def test_plan_picks_newest_common_own_step_without_redundancy():
    topo = Topology(2, 1)
    holdings = Holdings(own={0: _fs(3, 4, 5), 1: _fs(3, 4)})
    plan = plan_rebuild(holdings, topo, RedundancySpec("none"))
    assert plan.step == 4 and plan.transfers == () and plan.rebuilt == ()
    assert "step 5" in plan.why


def test_plan_replicate_node_lost():
    topo = Topology(4, 2)
    spec = RedundancySpec("replicate", replicas=1)
    holdings = Holdings(own={0: _fs(2, 3), 1: _fs(2, 3), 2: _fs(), 3: _fs()},
                        replicas={0: {2: _fs(2, 3)}, 1: {3: _fs(2, 3)}})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 3
    assert plan.rebuilt == (2, 3)
    assert plan.transfers == (
        Transfer(0, 2, 3, "meta", source=2), Transfer(0, 2, 3, "replica", source=2),
        Transfer(1, 3, 3, "meta", source=3), Transfer(1, 3, 3, "replica", source=3))
    assert plan.why == ""


def test_plan_replicate_lost_ranks_absent_from_own():
    # Lost ranks need not appear in ``own`` at all.
    topo = Topology(4, 2)
    holdings = Holdings(own={0: _fs(7), 1: _fs(7)},
                        replicas={0: {2: _fs(7)}, 1: {3: _fs(7)}})
    plan = plan_rebuild(holdings, topo, RedundancySpec("replicate"))
    assert plan.step == 7 and plan.rebuilt == (2, 3) and len(plan.transfers) == 4


def test_plan_replicate_only_older_replicas():
    topo = Topology(4, 2)
    spec = RedundancySpec("replicate", replicas=1)
    holdings = Holdings(own={0: _fs(2, 3), 1: _fs(2, 3), 2: _fs(), 3: _fs()},
                        replicas={0: {2: _fs(2)}, 1: {3: _fs(2, 3)}})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 2
    assert plan.rebuilt == (2, 3)
    assert plan.transfers == (
        Transfer(0, 2, 2, "meta", source=2), Transfer(0, 2, 2, "replica", source=2),
        Transfer(1, 3, 2, "meta", source=3), Transfer(1, 3, 2, "replica", source=3))
    assert "step 3" in plan.why


def test_plan_replicate_ignores_copy_on_same_node():
    # A "replica" held on the lost rank's own node is in the same failure domain.
    topo = Topology(4, 2)
    holdings = Holdings(own={0: _fs(5), 1: _fs(5), 3: _fs(5)}, replicas={3: {2: _fs(5)}})
    assert rebuild_transfers(2, 5, holdings, topo, RedundancySpec("replicate")) is None
    plan = plan_rebuild(holdings, topo, RedundancySpec("replicate"))
    assert plan.step is None


def test_plan_replicate_picks_lowest_holder():
    topo = Topology(3, 1)
    spec = RedundancySpec("replicate", replicas=2)
    holdings = Holdings(own={1: _fs(4), 2: _fs(4)}, replicas={2: {0: _fs(4)}, 1: {0: _fs(4)}})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 4 and plan.rebuilt == (0,)
    assert plan.transfers == (Transfer(1, 0, 4, "meta", source=0),
                              Transfer(1, 0, 4, "replica", source=0))


def test_plan_replicate_two_nodes_lost_of_three():
    topo = Topology(3, 1)
    spec = RedundancySpec("replicate", replicas=1)
    # rank 0 survives and holds the copy of rank 2 (its replica source); rank 1 is gone.
    holdings = Holdings(own={0: _fs(5, 6), 1: _fs(), 2: _fs()}, replicas={0: {2: _fs(5, 6)}})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step is None
    assert plan.rebuilt == () and plan.transfers == ()
    assert "[1, 2]" in plan.why            # ranks and nodes (1 rank per node)
    assert "node(s) [1, 2]" in plan.why
    assert "replicate" in plan.why and "1 replica" in plan.why


def test_plan_replicate_two_nodes_lost_names_ranks_and_nodes():
    topo = Topology(6, 2)
    spec = RedundancySpec("replicate", replicas=1)
    holdings = Holdings(own={0: _fs(1), 1: _fs(1)}, replicas={0: {4: _fs(1)}, 1: {5: _fs(1)}})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step is None
    assert "rank(s) [2, 3, 4, 5]" in plan.why
    assert "node(s) [1, 2]" in plan.why
    assert "replicate" in plan.why


def test_plan_none_mode_lost_rank():
    topo = Topology(4, 2)
    holdings = Holdings(own={0: _fs(1, 2), 1: _fs(1, 2), 2: _fs(1, 2), 3: _fs()},
                        replicas={1: {3: _fs(2)}})   # ignored in mode none
    plan = plan_rebuild(holdings, topo, RedundancySpec("none"))
    assert plan.step is None
    assert "rank(s) [3]" in plan.why and "node(s) [1]" in plan.why
    assert "none" in plan.why
    assert rebuild_transfers(3, 2, holdings, topo, RedundancySpec("none")) is None
    assert rebuild_transfers(2, 2, holdings, topo, RedundancySpec("none")) == []


def test_plan_no_common_step():
    topo = Topology(2, 1)
    plan = plan_rebuild(Holdings(own={0: _fs(1), 1: _fs(2)}), topo, RedundancySpec("none"))
    assert plan.step is None
    assert plan.why == "the ranks hold no step in common"


def test_plan_empty_holdings():
    topo = Topology(2, 1)
    plan = plan_rebuild(Holdings(own={}), topo, RedundancySpec("erasure", ec_data=1))
    assert plan.step is None
    assert "rank(s) [0, 1]" in plan.why and "erasure" in plan.why


def _erasure_expected(lost_rank, topo, data, step):
    stripe = stripe_of(lost_rank, topo, data)
    lost = stripe.index(lost_rank)
    out = []
    for m in range(data):
        holder = parity_holder(lost, m, data)
        if m == 0:
            out.append(Transfer(stripe[holder], lost_rank, step, "meta"))
        out.append(Transfer(stripe[holder], lost_rank, step, "parity", part=m))
        for pos, n in parity_inputs(holder, data):
            if pos != lost:
                out.append(Transfer(stripe[pos], lost_rank, step, "chunk", part=m, chunk=n))
    return out


def test_plan_erasure_node_lost_transfers():
    topo = Topology(6, 2)
    spec = RedundancySpec("erasure", ec_data=2)
    live = (0, 1, 4, 5)
    holdings = Holdings(own={r: _fs(8, 9) for r in live},
                        parities={r: _fs(8, 9) for r in live})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 9
    assert plan.rebuilt == (2, 3)
    assert plan.why == ""
    # Rank 2 is position 1 of stripe [0, 2, 4]: part 0 from P_0 (rank 0) with chunk 1 of
    # position 2 (rank 4); part 1 from P_2 (rank 4) with chunk 0 of position 0 (rank 0).
    assert plan.transfers[:5] == (
        Transfer(0, 2, 9, "meta"),
        Transfer(0, 2, 9, "parity", part=0),
        Transfer(4, 2, 9, "chunk", part=0, chunk=1),
        Transfer(4, 2, 9, "parity", part=1),
        Transfer(0, 2, 9, "chunk", part=1, chunk=0))
    assert plan.transfers == tuple(_erasure_expected(2, topo, 2, 9)
                                   + _erasure_expected(3, topo, 2, 9))
    for t in plan.transfers:
        assert topo.node_of(t.src) != 1
        assert topo.local_of(t.src) == topo.local_of(t.dst)


@pytest.mark.parametrize("seed", range(4))
def test_plan_erasure_simulated_rebuild_d2(seed):
    topo = Topology(6, 2)
    spec = RedundancySpec("erasure", ec_data=2)
    rng = random.Random(seed)
    full = {r: _image(rng, rng.choice([0, 1, 2, 5, 17, rng.randrange(0, 200)]))
            for r in range(6)}
    live = (0, 1, 4, 5)
    holdings = Holdings(own={r: _fs(9) for r in live}, parities={r: _fs(9) for r in live})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 9 and plan.rebuilt == (2, 3)
    rebuilt = _simulate(plan, full, set(live), topo, 2)
    for r in (2, 3):
        assert torch.equal(rebuilt[r], full[r])


def _simulate(plan, full, survivors, topo, data):
    """Execute ``plan``'s transfers in order and return the rebuilt images (rank -> tensor).

    Parities come from the full stripes (as encoded before the loss); the transfers may only
    read from ``survivors`` and only deliver to the others."""
    stripes = {tuple(stripe_of(r, topo, data)) for r in range(topo.world)}
    parity_of = {}
    for stripe in stripes:
        images = [full[r] for r in stripe]
        for pos, r in enumerate(stripe):
            parity_of[r] = encode_parity(images, pos, data)
    meta, acc = {}, {}
    for t in plan.transfers:
        assert t.step == plan.step
        assert t.src in survivors and t.dst not in survivors, t
        if t.kind == "meta":
            meta[t.dst] = full[t.dst].numel()      # metadata: the lost image's size
        elif t.kind == "parity":
            assert t.dst in meta and (t.dst, t.part) not in acc
            acc[(t.dst, t.part)] = parity_of[t.src].clone()
        elif t.kind == "chunk":
            part = acc[(t.dst, t.part)]             # KeyError if the parity came later
            xor_into(part, padded_chunk(full[t.src], part.numel(), t.chunk))
        else:
            raise AssertionError(f"unexpected transfer {t}")
    out = {}
    for r in plan.rebuilt:
        chunk = acc[(r, 0)].numel()
        img = torch.full((meta[r],), 0xAB, dtype=torch.uint8)
        for m in range(data):
            start, stop = chunk_span(meta[r], chunk, m)
            img[start:stop] = acc[(r, m)][:stop - start]
        out[r] = img
    return out


@pytest.mark.parametrize("data", [1, 2, 3, 4])
def test_plan_erasure_simulated_rebuild_any_d_two_groups(data):
    # Two groups of D+1 nodes, 2 ranks per node; lose one node in each group.
    per_node = 2
    nodes = 2 * (data + 1)
    topo = Topology(nodes * per_node, per_node)
    spec = RedundancySpec("erasure", ec_data=data)
    check_layout(spec, topo)
    rng = random.Random(data)
    full = {r: _image(rng, rng.choice([0, 1, 3, 7, 29, 64])) for r in range(topo.world)}
    lost_nodes = {data, data + 1}          # last of group 0, first of group 1
    live = tuple(r for r in range(topo.world) if topo.node_of(r) not in lost_nodes)
    holdings = Holdings(own={r: _fs(1, 2) for r in live}, parities={r: _fs(1, 2) for r in live})
    plan = plan_rebuild(holdings, topo, spec)
    lost = tuple(r for r in range(topo.world) if topo.node_of(r) in lost_nodes)
    assert plan.step == 2 and plan.rebuilt == lost
    rebuilt = _simulate(plan, full, set(live), topo, data)
    assert set(rebuilt) == set(lost)
    for r in lost:
        assert torch.equal(rebuilt[r], full[r]), r
    # per lost rank: 1 meta + D parities + D*(D-1) chunks
    assert len(plan.transfers) == len(lost) * (1 + data + data * (data - 1))


def test_plan_erasure_missing_parity_falls_back_to_older_step():
    topo = Topology(6, 2)
    spec = RedundancySpec("erasure", ec_data=2)
    live = (0, 1, 4, 5)
    parities = {r: _fs(8, 9) for r in live}
    parities[4] = _fs(8)          # rank 4's parity of step 9 never completed
    holdings = Holdings(own={r: _fs(8, 9) for r in live}, parities=parities)
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 8
    assert plan.rebuilt == (2, 3)
    assert "step 9" in plan.why
    assert plan.transfers == tuple(_erasure_expected(2, topo, 2, 8)
                                   + _erasure_expected(3, topo, 2, 8))
    assert rebuild_transfers(2, 9, holdings, topo, spec) is None
    # rank 3's stripe [1, 3, 5] is unaffected at step 9
    assert rebuild_transfers(3, 9, holdings, topo, spec) == _erasure_expected(3, topo, 2, 9)


def test_plan_erasure_missing_parity_no_older_step():
    topo = Topology(6, 2)
    spec = RedundancySpec("erasure", ec_data=2)
    live = (0, 1, 4, 5)
    parities = {r: _fs(9) for r in live}
    del parities[1]
    holdings = Holdings(own={r: _fs(9) for r in live}, parities=parities)
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step is None
    assert plan.transfers == ()
    assert "rank(s) [2, 3]" in plan.why and "node(s) [1]" in plan.why
    assert "erasure" in plan.why and "2 data + 1 parity" in plan.why


def test_plan_erasure_missing_chunk_source_step():
    # Parities complete, but a surviving position lacks its own image of the step.
    topo = Topology(3, 1)
    spec = RedundancySpec("erasure", ec_data=2)
    holdings = Holdings(own={0: _fs(4, 5), 2: _fs(4)}, parities={0: _fs(4, 5), 2: _fs(4, 5)})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 4 and plan.rebuilt == (1,)
    assert "step 5" in plan.why


def test_plan_erasure_two_nodes_of_one_group_lost():
    topo = Topology(3, 1)
    spec = RedundancySpec("erasure", ec_data=2)
    holdings = Holdings(own={0: _fs(3)}, parities={0: _fs(3)})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step is None
    assert "rank(s) [1, 2]" in plan.why and "erasure" in plan.why


def test_plan_erasure_survivor_without_step_is_rebuilt_too():
    # A surviving rank whose own snapshot of the step is missing is decoded like a lost one.
    topo = Topology(3, 1)
    spec = RedundancySpec("erasure", ec_data=2)
    holdings = Holdings(own={0: _fs(6), 1: _fs(5), 2: _fs(6)},
                        parities={0: _fs(6), 2: _fs(6)})
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 6 and plan.rebuilt == (1,)
    assert plan.transfers == tuple(_erasure_expected(1, topo, 2, 6))



def test_plan_erasure_never_decodes_from_a_stripe_mate_without_its_image():
    # Every parity of step 5 survives, but two positions of the stripe [0, 1, 2] lack
    # their own image of it (ranks 1 and 2: evicted, or never completed). One XOR parity
    # decodes one missing position: rebuilding rank 1 would XOR in chunks of rank 2's
    # image that no longer exist, and rank 2's from rank 1's; garbage loaded as weights.
    topo = Topology(3, 1)
    spec = RedundancySpec("erasure", ec_data=2)
    holdings = Holdings(own={0: _fs(4, 5), 1: _fs(4), 2: _fs(4)},
                        parities={r: _fs(4, 5) for r in range(3)})
    assert rebuild_transfers(1, 5, holdings, topo, spec) is None
    assert rebuild_transfers(2, 5, holdings, topo, spec) is None
    plan = plan_rebuild(holdings, topo, spec)
    assert plan.step == 4 and plan.rebuilt == () and plan.transfers == ()
    assert "step 5" in plan.why

# --- extra_bytes ----------------------------------------------------------------------------

def test_extra_bytes():
    assert extra_bytes(RedundancySpec("none"), 1000, 3) == 0
    assert extra_bytes(RedundancySpec("replicate", replicas=1), 1000, 1) == 1000
    assert extra_bytes(RedundancySpec("replicate", replicas=2), 1000, 3) == 6000
    assert extra_bytes(RedundancySpec("erasure", ec_data=2), 1000, 1) == 500
    assert extra_bytes(RedundancySpec("erasure", ec_data=3), 1000, 2) == 2 * 334
    assert extra_bytes(RedundancySpec("erasure", ec_data=4), 10, 5) == 5 * 3
    assert extra_bytes(RedundancySpec("erasure", ec_data=2), 0, 2) == 2   # 1-byte parity
    assert extra_bytes(RedundancySpec("replicate", replicas=2), 1000, 0) == 0


def test_moc_config_checks_the_redundancy_flags():
    from deepspeed_ext.config import MoCConfig
    with pytest.raises(ValueError, match="add --moc-two-level"):
        MoCConfig(redundancy="replicate")
    with pytest.raises(ValueError, match="--moc-redundancy must be one of"):
        MoCConfig(two_level=True, shm_dir="x", redundancy="mirror")
    with pytest.raises(ValueError, match="--moc-redundancy-interval must be >= 1"):
        MoCConfig(two_level=True, shm_dir="x", redundancy="erasure", redundancy_interval=0)
    spec = MoCConfig(two_level=True, shm_dir="x", redundancy="erasure", ec_data=3).redundancy_spec()
    assert (spec.mode, spec.ec_data, spec.ec_parity) == ("erasure", 3, 1)


# --- boundaries found by mutation testing (docs/testing.md) --------------------------------

def test_describe_a_mode_parsed_from_the_command_line():
    # A flag's value is a new str object, not the interned literal: compared by identity
    # ("is") it would describe erasure as none.
    mode = "".join(["eras", "ure"])
    assert RedundancySpec(mode, ec_data=3).describe() == "erasure (3 data + 1 XOR parity)"


def test_check_layout_replicate_names_the_nodes_needed_for_odd_replicas():
    with pytest.raises(ValueError, match="--moc-replicas 3 needs at least 4 nodes"):
        check_layout(RedundancySpec("replicate", replicas=3), Topology(3, 1))


def test_padded_chunk_of_a_full_chunk_past_256_bytes_is_a_view():
    # Sizes past 256 are distinct int objects in CPython: compared by identity, a full
    # chunk would be copied (twice the memory traffic of every parity).
    image = torch.zeros(600, dtype=torch.uint8)
    full = padded_chunk(image, 300, 1)
    full[0] = 7
    assert image[300].item() == 7


def test_plan_replicate_step_newer_than_every_own_step_gives_no_reason():
    # Both ranks rebuild step 5 from the other's copy; no newer own step is given up.
    topo = Topology(2, 1)
    holdings = Holdings(own={0: _fs(4), 1: _fs(4)},
                        replicas={1: {0: _fs(5)}, 0: {1: _fs(5)}})
    plan = plan_rebuild(holdings, topo, RedundancySpec("replicate"))
    assert plan.step == 5 and plan.rebuilt == (0, 1) and plan.why == ""


def test_plan_erasure_why_names_the_group_size():
    topo = Topology(3, 1)
    holdings = Holdings(own={0: _fs(3)}, parities={0: _fs(3)})
    plan = plan_rebuild(holdings, topo, RedundancySpec("erasure", ec_data=2))
    assert "covers one lost node per group of 3" in plan.why


def test_erasure_every_nth_snapshot_keeps_one_own_slot_more():
    from deepspeed_ext.policy.redundancy import extra_own_slots
    erasure = RedundancySpec("erasure", ec_data=2)
    assert extra_own_slots(erasure, 1) == 0   # every snapshot protected: the newest is it
    assert extra_own_slots(erasure, 2) == 1   # the smallest interval that keeps one back
    assert extra_own_slots(erasure, 4) == 1
    for other in (RedundancySpec("replicate", replicas=1), RedundancySpec("none")):
        assert extra_own_slots(other, 2) == 0   # replicas hold whole images of every step
