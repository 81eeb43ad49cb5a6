"""pipeline_place on a fake engine with DeepSpeed's own topologies: which ranks hold a
stage's parameters and the tied word embedding, with and without tensor parallelism."""

from types import SimpleNamespace

from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology,
                                             PipeModelDataParallelTopology)
from torch import nn

from deepspeed_ext.engine.stages import pipeline_place
from tests.deepspeed_ext.fake_pipeline import fake_pipeline_engine


def test_a_stage_without_tensor_parallelism_is_its_data_parallel_ranks():
    # PP 2 x DP 2: stage 1 is ranks 2 and 3
    place = pipeline_place(fake_pipeline_engine(PipeDataParallelTopology(num_pp=2, num_dp=2), 3))
    assert (place.stage, place.stages) == (1, 2)
    assert place.data_group == place.stage_ranks == (2, 3)
    assert place.tied == {"tied_modules.embed.weight": (0, 1, 2, 3)}


def test_with_tensor_parallelism_a_tied_part_is_held_by_the_same_tensor_parallel_rank():
    """PP 2 x DP 2 x TP 2: stage 1 is ranks 4-7, ranks 5 and 7 its data-parallel group of
    tensor-parallel rank 1; the word embedding is split by vocabulary, so only the ranks of
    tensor-parallel rank 1 on both stages hold rank 5's part (a write plan that gave it to
    rank 4 would store the other half of the vocabulary under rank 5's offsets)."""
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    place = pipeline_place(fake_pipeline_engine(topo, 5))
    assert place.stage == 1 and place.data_group == (5, 7)
    assert place.stage_ranks == (4, 5, 6, 7)
    assert place.tied == {"tied_modules.embed.weight": (1, 3, 5, 7)}


def test_no_pipeline_no_place():
    assert pipeline_place(fake_pipeline_engine(PipeDataParallelTopology(num_pp=1, num_dp=2), 0)) is None
    assert pipeline_place(SimpleNamespace(module=nn.Linear(1, 1))) is None
