"""How a rank's engine names its experts: local parameter names and MoE layers mapped to
the whole model's (global expert indices; on a pipeline stage, the stage's names and MoE
layer ordinals too, :mod:`deepspeed_ext.engine.stages`). No collectives."""

import re
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from deepspeed_ext.engine.stages import StageNaming, stage_naming

ExpertId = Tuple[int, int]
"""(MoE layer ordinal in the whole model, global expert index)."""

_EXPERT_RE = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<local>\d+)(?P<tail>\..*)$")


@dataclass(frozen=True)
class ExpertNaming:
    """Maps local parameter names to global ones for ``deepspeed.moe`` layers.

    ``moe_prefixes[i]`` is the module path of this rank's i-th MoE layer;
    ``first_expert[i]`` the global index of this rank's local expert 0 in that layer. On
    a pipeline stage, ``stage`` renames the stage's parameters as the whole model names
    them, and its MoE layers are numbered from ``stage.first_moe_layer`` on, so that the
    stages' expert ids differ (:mod:`deepspeed_ext.engine.stages`).
    """

    moe_prefixes: Tuple[str, ...]
    first_expert: Tuple[int, ...]
    num_experts: Tuple[int, ...]
    stage: Optional[StageNaming] = None

    @property
    def layer_offset(self) -> int:
        """Whole-model ordinal of this rank's first MoE layer (0 without a pipeline)."""
        return self.stage.first_moe_layer if self.stage is not None else 0

    @property
    def num_moe_layers(self) -> int:
        """MoE layers of the whole model (of this module, without a pipeline)."""
        return self.stage.num_moe_layers if self.stage is not None else len(self.moe_prefixes)

    def first_expert_of(self, layer: int) -> int:
        """Global index of this rank's local expert 0 in MoE layer ``layer`` (an ordinal
        of the whole model's, held by this rank)."""
        return self.first_expert[layer - self.layer_offset]

    def experts_in(self, layer: int) -> int:
        """Experts of MoE layer ``layer`` (held by this rank)."""
        return self.num_experts[layer - self.layer_offset]

    def expert_of(self, name: str) -> Optional[ExpertId]:
        """(layer, global expert) of an expert parameter's local name, None for others."""
        match = _EXPERT_RE.match(name)
        if match is None:
            return None
        for layer, prefix in enumerate(self.moe_prefixes):
            if name.startswith(prefix + "."):
                return self.layer_offset + layer, self.first_expert[layer] + int(match.group("local"))
        raise ValueError(f"expert parameter {name} belongs to no known MoE layer")

    def global_name(self, name: str) -> str:
        """The whole model's name of local parameter ``name``: renamed as its stage says,
        its local expert index replaced by the global one."""
        expert = self.expert_of(name)
        whole = self.stage.global_name(name) if self.stage is not None else name
        if expert is None:
            return whole
        match = _EXPERT_RE.match(whole)
        if match is None:
            raise ValueError(f"{self.stage} renames expert parameter {name} to {whole}, "
                             "which names no expert")
        return f"{match.group('head')}{expert[1]}{match.group('tail')}"


def expert_naming(module: torch.nn.Module) -> ExpertNaming:
    """Find the ``deepspeed.moe.layer.MoE`` layers of ``module`` and this rank's experts
    (and the stage's naming a pipeline model set, :func:`deepspeed_ext.engine.stages.stage_naming`).

    Called after ``deepspeed.initialize`` (expert groups exist then).
    """
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    prefixes, firsts, counts = [], [], []
    for path, sub in module.named_modules():
        if isinstance(sub, MoE):
            ep_rank = groups._get_expert_parallel_rank(sub.expert_group_name)
            prefixes.append(path)
            firsts.append(ep_rank * sub.num_local_experts)
            counts.append(sub.num_experts)
    return ExpertNaming(tuple(prefixes), tuple(firsts), tuple(counts), stage_naming(module))
