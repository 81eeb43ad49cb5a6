"""The tensor x data x expert layout (a pure plan) against DeepSpeed's own rank lists,
and the mpu adapter under DeepSpeed's real group creation on 4 gloo ranks."""

import json

import pytest

from megatron.training.parallel_layout import RankPlace, build_layout
from tests.launch import describe, run_ranks


def test_places_and_groups_of_eight_ranks():
    layout = build_layout(8, tp=2, ep=2)
    assert layout.dp == 4
    assert layout.place(5) == RankPlace(tp_rank=1, dp_rank=2, ep_rank=0)
    assert layout.tensor_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.data_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout.expert_groups() == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert layout.expert_data_groups() == [(0, 4), (2, 6), (1, 5), (3, 7)]
    # Each rank's expert-parallel rank is its index in its expert group.
    for group in layout.expert_groups():
        assert [layout.place(r).ep_rank for r in group] == list(range(layout.ep))


@pytest.mark.parametrize("world, tp, ep", [(4, 1, 2), (4, 2, 2), (8, 2, 4), (8, 4, 2), (16, 2, 2)])
def test_expert_groups_are_deepspeeds(world, tp, ep):
    """DeepSpeed 0.19 computes its expert groups with a pure function; ours must agree
    (the layout is what checkpoints and the trainer's batch sharding rely on)."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks
    ep_ranks, ep_dp_ranks = _get_expert_parallel_ranks(world, tp, ep)
    layout = build_layout(world, tp, ep)
    assert sorted(map(tuple, ep_ranks)) == sorted(layout.expert_groups())
    assert sorted(map(tuple, ep_dp_ranks)) == sorted(layout.expert_data_groups())


@pytest.mark.parametrize("world, tp, ep, needle", [
    (6, 4, 1, "world size \\(6\\) must be divisible by --tensor-model-parallel-size \\(4\\)"),
    (4, 2, 4, "the data-parallel size \\(2 = world size 4 / --tensor-model-parallel-size 2\\) "
              "must be divisible by --moe-expert-parallel-size \\(4\\)"),
    (6, 1, 4, "world size \\(6\\) must be divisible by --moe-expert-parallel-size \\(4\\)"),
])
def test_a_layout_that_does_not_fit_names_the_flag(world, tp, ep, needle):
    with pytest.raises(ValueError, match=needle):
        build_layout(world, tp, ep)


def test_the_mpu_gives_deepspeed_the_layouts_groups(tmp_path):
    """4 ranks, T = 2, E = 2: megatron-core's groups through the adapter, and the expert
    groups DeepSpeed creates from it with expert tensor parallelism, are the layout's."""
    results = run_ranks(4, [str(tmp_path)], script="tests/training/mpu_worker.py", timeout=180)
    assert all(r.returncode == 0 for r in results), describe(results)
    layout = build_layout(4, tp=2, ep=2)
    for rank in range(4):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        place = layout.place(rank)
        assert (got["tp_rank"], got["dp_rank"]) == (place.tp_rank, place.dp_rank)
        assert got["tp_size"] == 2 and got["dp_size"] == 2 and got["pp_size"] == 1
        assert tuple(got["tp_group"]) in layout.tensor_groups() and rank in got["tp_group"]
        assert tuple(got["dp_group"]) in layout.data_groups() and rank in got["dp_group"]
        assert tuple(got["ep_group"]) in layout.expert_groups() and rank in got["ep_group"]
        assert tuple(got["ep_dp_group"]) in layout.expert_data_groups()
        assert got["ep_group"].index(rank) == place.ep_rank


def test_replicated_experts_follow_deepspeeds_world_ordered_groups():
    """Without expert tensor parallelism DeepSpeed 0.19 builds its expert groups over the
    world (``_create_expert_and_data_parallel`` without ``mp_size``: E consecutive ranks,
    and the ranks E apart); each expert group holds whole tensor-parallel pairs."""
    layout = build_layout(8, tp=2, ep=4, expert_tp=False)
    assert layout.dp == 4 and layout.tensor_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.expert_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.expert_data_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.place(5) == RankPlace(tp_rank=1, dp_rank=2, ep_rank=1)
    for group in layout.expert_groups():
        assert [layout.place(r).ep_rank for r in group] == list(range(layout.ep))
        assert all(tp in layout.tensor_groups() for tp in zip(group[::2], group[1::2]))
    # at T = 1 the flag is moot: the same layout either way
    assert build_layout(4, 1, 2, expert_tp=False).expert_groups() == build_layout(4, 1, 2).expert_groups()


@pytest.mark.parametrize("world, tp, ep", [(4, 2, 1), (8, 4, 2), (12, 2, 8)])
def test_replicated_experts_need_whole_tensor_parallel_groups_per_expert_group(world, tp, ep):
    """An expert group that splits a tensor-parallel pair would serve only part of a data
    shard's capacity and average its gradient over too many ranks."""
    with pytest.raises(ValueError, match="--moe-expert-parallel-size .* multiple of "
                                         "--tensor-model-parallel-size"):
        build_layout(world, tp, ep, expert_tp=False)
