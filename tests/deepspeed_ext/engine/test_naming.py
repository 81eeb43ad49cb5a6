"""ExpertNaming with and without a pipeline stage's StageNaming: local parameter names and
MoE layers mapped to the whole model's."""

import pytest
from torch import nn

from deepspeed_ext.engine.naming import ExpertNaming
from deepspeed_ext.engine.stages import STAGE_NAMING_ATTR, StageNaming, stage_naming

EXPERT = "mlp.deepspeed_moe.experts.deepspeed_experts.{}.dense_h_to_4h.weight"

# stage 1 of 2: spec index 3 is decoder layer 2, 4 is layer 3, 5 the final norm
STAGE = StageNaming(prefixes=(("3.", "layers.2."), ("4.", "layers.3."),
                              ("5.norm.", "final_layernorm."), ("tied_modules.embed.", "")),
                    first_moe_layer=1, num_moe_layers=2)


def test_without_a_stage_names_change_only_in_the_expert_index():
    naming = ExpertNaming(("layers.1.mlp",), (2,), (4,))
    assert naming.global_name("layers.1." + EXPERT.format(1)) == "layers.1." + EXPERT.format(3)
    assert naming.expert_of("layers.1." + EXPERT.format(1)) == (0, 3)
    assert naming.global_name("layers.0.input_layernorm.weight") == "layers.0.input_layernorm.weight"
    assert naming.num_moe_layers == 1 and naming.first_expert_of(0) == 2


def test_a_stage_renames_its_parameters_and_numbers_its_moe_layers_after_the_earlier_stages():
    # only layer 3 is MoE here (layer 1, on stage 0, is the whole model's MoE layer 0)
    naming = ExpertNaming(("4.mlp",), (2,), (4,), STAGE)
    assert naming.global_name("4." + EXPERT.format(0)) == "layers.3." + EXPERT.format(2)
    assert naming.expert_of("4." + EXPERT.format(1)) == (1, 3)
    assert naming.global_name("3.input_layernorm.bias") == "layers.2.input_layernorm.bias"
    assert naming.global_name("5.norm.weight") == "final_layernorm.weight"
    assert naming.global_name("tied_modules.embed.word_embeddings.weight") == "word_embeddings.weight"
    assert naming.num_moe_layers == 2 and naming.layer_offset == 1
    assert naming.first_expert_of(1) == 2 and naming.experts_in(1) == 4


def test_a_stage_naming_that_loses_the_expert_index_is_refused():
    bad = StageNaming(prefixes=(("4.mlp.deepspeed_moe.experts.deepspeed_experts.", "layers.3.e"),),
                      first_moe_layer=0, num_moe_layers=1)
    naming = ExpertNaming(("4.mlp",), (0,), (4,), bad)
    with pytest.raises(ValueError, match="names no expert"):
        naming.global_name("4." + EXPERT.format(0))


def test_the_module_attribute_must_hold_a_stage_naming():
    module = nn.Linear(2, 2)
    assert stage_naming(module) is None
    setattr(module, STAGE_NAMING_ATTR, STAGE)
    assert stage_naming(module) is STAGE
    setattr(module, STAGE_NAMING_ATTR, {"prefixes": []})
    with pytest.raises(TypeError, match="must be a deepspeed_ext.engine.stages.StageNaming"):
        stage_naming(module)
