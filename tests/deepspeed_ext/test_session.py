"""CheckpointSession's refusal of a pipeline engine whose module does not say how its
stage names the whole model's parameters."""

from types import SimpleNamespace

import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch import nn

from deepspeed_ext.engine.stages import STAGE_NAMING_ATTR, StageNaming
from deepspeed_ext.session import CheckpointSession


class _Stage(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.tied_comms = {}

    def topology(self):
        return PipeDataParallelTopology(num_pp=2, num_dp=1)


def _engine(module):
    grid = SimpleNamespace(pipe_parallel_size=2, get_stage_id=lambda: 0,
                           get_global_rank=lambda: 0, get_data_parallel_group_ranks=lambda: [0])
    return SimpleNamespace(grid=grid, module=module)


def test_a_pipeline_stage_without_its_naming_is_refused_naming_the_attribute():
    """A user's own PipelineModule without ``moc_stage_naming``: its stages would save
    "0.weight" and MoE layer 0 each, overwriting one another's."""
    with pytest.raises(ValueError, match=f"set module.{STAGE_NAMING_ATTR} to a "
                                         "deepspeed_ext.engine.stages.StageNaming"):
        CheckpointSession(_engine(_Stage()))


def test_with_its_naming_the_session_takes_the_stage_naming():
    module = _Stage()
    naming = StageNaming(prefixes=(("", "layers.0."),), first_moe_layer=0, num_moe_layers=0)
    setattr(module, STAGE_NAMING_ATTR, naming)
    session = CheckpointSession(_engine(module))
    assert session.naming.stage == naming
    assert session.naming.global_name("weight") == "layers.0.weight"
