"""Ranks per node from the flag or from whichever launcher started the job."""

import pytest

from deepspeed_ext.node_layout import launcher_ranks_per_node, ranks_per_node


@pytest.mark.parametrize("environ, expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, 4),                       # torchrun
    ({"LOCAL_SIZE": "8", "WORLD_SIZE": "16"}, 8),         # DeepSpeed's launcher: no LOCAL_WORLD_SIZE
    ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8),              # srun, two nodes of 8
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "2"}, 2),     # an empty one is skipped
    ({"LOCAL_WORLD_SIZE": "x", "LOCAL_SIZE": "0"}, None),
    ({}, None),
])
def test_the_launchers_count(environ, expected):
    assert launcher_ranks_per_node(environ) == expected


def test_the_flag_wins_and_one_node_is_the_last_resort():
    assert ranks_per_node(2, 16, {"LOCAL_SIZE": "8"}) == 2
    assert ranks_per_node(0, 16, {"LOCAL_SIZE": "8"}) == 8
    assert ranks_per_node(0, 16, {}) == 16


def test_each_nodes_first_rank_and_node_of_every_rank():
    from deepspeed_ext.node_layout import first_of_node, node_of
    assert [node_of(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [r for r in range(12) if first_of_node(r, 4)] == [0, 4, 8]
    assert [r for r in range(3) if first_of_node(r, 1)] == [0, 1, 2]  # a rank per node
    assert [r for r in range(6) if first_of_node(r, 6)] == [0]        # one node
