"""A pipeline stage's state in the whole model's terms: names, MoE layer ordinals, the
ranks that hold each parameter, and which tied copies another stage saves.

A DeepSpeed ``PipelineModule`` holds the layers of one stage under its own names
(``"3.mlp..."``: the layer's index in the module's spec list; ``"tied_modules.embed..."``:
a module shared by several stages), and its MoE layers are numbered from 0 on every
stage. A checkpoint names everything as the whole model does, so that it loads under
another number of stages, or none, and two stages' "MoE layer 0" are not the same
expert ids. The model says how, by setting :class:`StageNaming` on the module it gives
``deepspeed.initialize`` (``module.moc_stage_naming``): MoC cannot infer it, since a
stage does not know the layers of the others.

:func:`pipeline_place` reads the engine's grid: the ranks of the stage that hold the same
layers (the stage's data-parallel group) and the parameters of tied modules that this
rank holds only as a replica (DeepSpeed marks them ``ds_pipe_replicated``; the first
stage holding the module saves it). No collectives.
"""

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

STAGE_NAMING_ATTR = "moc_stage_naming"
"""The module attribute holding a stage's :class:`StageNaming`."""


@dataclass(frozen=True)
class StageNaming:
    """How one pipeline stage's module names its state in the whole model."""

    prefixes: Tuple[Tuple[str, str], ...]
    """``(local prefix, whole-model prefix)`` pairs: a parameter name starting with the
    local prefix is renamed (the first pair that matches wins); other names are kept."""
    first_moe_layer: int
    """Ordinal, among the whole model's MoE layers, of this stage's first MoE layer (the
    stage's layers are consecutive, in the whole model's order)."""
    num_moe_layers: int
    """MoE layers of the whole model."""

    def global_name(self, name: str) -> str:
        """``name`` (local to the stage) as the whole model names it."""
        for local, whole in self.prefixes:
            if name.startswith(local):
                return whole + name[len(local):]
        return name


@dataclass(frozen=True)
class PipelinePlace:
    """This rank's place in a pipeline (from the engine's grid)."""

    stage: int
    """This rank's stage."""
    stages: int
    """Pipeline stages P (> 1)."""
    data_group: Tuple[int, ...]
    """Global ranks of the stage that hold the same layers (its data-parallel group)."""
    stage_ranks: Tuple[int, ...]
    """Every global rank of the stage (its data-parallel group times its tensor-parallel
    ranks)."""
    replicated: FrozenSet[str]
    """Local names of the parameters this rank holds as a replica of an earlier stage's
    (a tied module's copy on a later stage): that stage saves them."""
    tied: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    """Local name of each tied weight (kept equal on every stage holding it: DeepSpeed
    sums its gradients over them) -> every rank of those stages with this rank's
    tensor-parallel rank (the word embedding is split by vocabulary over the
    tensor-parallel ranks). Its fp32 weights can be read for a save from any of them,
    which spreads the writes over the stages."""


def pipeline_place(engine) -> Optional[PipelinePlace]:
    """This rank's :class:`PipelinePlace`; None for an engine without a pipeline (or with
    one stage). No collectives."""
    grid = getattr(engine, "grid", None)
    if grid is None or getattr(grid, "pipe_parallel_size", 1) <= 1:
        return None
    module = engine.module
    replicated = frozenset(name for name, p in module.named_parameters()
                           if getattr(p, "ds_pipe_replicated", False))
    topo = module.topology()
    # Under tensor parallelism only the same tensor-parallel rank of another stage holds
    # the same part of a tied weight (DeepSpeed ties each "model" coordinate apart).
    same_part = ({"model": topo.get_coord(grid.get_global_rank()).model}
                 if "model" in topo.get_axis_names() else {})
    tied: Dict[str, Tuple[int, ...]] = {}
    for key, comm in getattr(module, "tied_comms", {}).items():
        stages = {topo.get_coord(r).pipe for r in comm["ranks"]}
        holders = tuple(sorted(r for s in stages for r in topo.filter_match(pipe=s, **same_part)))
        for attr in comm["weight_attr"]:  # only these are kept equal (the rest of the
            tied[f"tied_modules.{key}.{attr}"] = holders  # module gets no gradient there)
    stage = grid.get_stage_id()
    return PipelinePlace(stage=stage, stages=grid.pipe_parallel_size,
                         data_group=tuple(sorted(grid.get_data_parallel_group_ranks())),
                         stage_ranks=tuple(sorted(topo.filter_match(pipe=stage))),
                         replicated=replicated, tied=tied)


def stage_naming(module) -> Optional[StageNaming]:
    """The :class:`StageNaming` a model set on ``module`` (None: none).

    Raises:
        TypeError: the attribute holds something else.
    """
    naming = getattr(module, STAGE_NAMING_ATTR, None)
    if naming is not None and not isinstance(naming, StageNaming):
        raise TypeError(f"{type(module).__name__}.{STAGE_NAMING_ATTR} must be a "
                        f"deepspeed_ext.engine.stages.StageNaming, not {type(naming).__name__}")
    return naming
