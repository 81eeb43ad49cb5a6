"""CheckpointSession's refusal of a pipeline engine whose module does not say how its
stage names the whole model's parameters."""

import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from deepspeed_ext.engine.stages import STAGE_NAMING_ATTR, StageNaming
from deepspeed_ext.session import CheckpointSession
from tests.deepspeed_ext.fake_pipeline import FakeStage, fake_pipeline_engine

TOPO = PipeDataParallelTopology(num_pp=2, num_dp=1)


def test_a_pipeline_stage_without_its_naming_is_refused_naming_the_attribute():
    """A user's own PipelineModule without ``moc_stage_naming``: its stages would save
    "0.weight" and MoE layer 0 each, overwriting one another's."""
    with pytest.raises(ValueError, match=f"set module.{STAGE_NAMING_ATTR} to a "
                                         "deepspeed_ext.engine.stages.StageNaming"):
        CheckpointSession(fake_pipeline_engine(TOPO, 0))


def test_with_its_naming_the_session_takes_the_stage_naming():
    module = FakeStage(TOPO)
    naming = StageNaming(prefixes=(("mlp.", "layers.0.mlp."),), first_moe_layer=0,
                         num_moe_layers=0)
    setattr(module, STAGE_NAMING_ATTR, naming)
    session = CheckpointSession(fake_pipeline_engine(TOPO, 0, module))
    assert session.naming.stage == naming
    assert session.naming.global_name("mlp.weight") == "layers.0.mlp.weight"
