"""Which all-reduces the cross-stage log takes for collectives across stages: those whose
group reaches beyond every rank of this rank's stage, its tensor-parallel ranks included."""

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from deepspeed_ext.exact.cross_stage import CrossStageLog
from tests.deepspeed_ext.fake_pipeline import fake_pipeline_engine


def test_a_group_inside_the_stage_is_not_across_stages_with_tensor_parallelism():
    """PP 2 x DP 1 x TP 2, rank 3 (stage 1 is ranks 2 and 3, its data-parallel group rank 3
    alone): the pair's own group (an expert-parallel group of experts replicated over it)
    runs again in a replay; the gradient norm's group over both stages (ranks 1 and 3) is
    answered from the other stage's log. Had the stage been its data-parallel group alone,
    the pair's group would count as across stages, and no other stage keeps its results."""
    log = CrossStageLog(fake_pipeline_engine(
        PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1), 3), retain_iterations=2)
    assert not log.spans_stages((2, 3)) and not log.spans_stages((3,))
    assert log.spans_stages((1, 3)) and log.spans_stages((0, 1, 2, 3))
