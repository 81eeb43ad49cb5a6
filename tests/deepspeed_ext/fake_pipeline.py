"""A pipeline engine's stage as MoC reads it (``deepspeed_ext.engine.stages.pipeline_place``),
without processes: DeepSpeed's own topology, a grid answering for one rank, and a module
with a tied embedding. Shared by the tests of the stage's place, the session and the
cross-stage log."""

from types import SimpleNamespace

from torch import nn


class FakeStage(nn.Module):
    """A stage's module as DeepSpeed's ``PipelineModule`` shows it: its parameters (the
    tied embedding's under ``tied_modules``), topology and tie groups (the embedding tied
    between the first and the last stage, over every other axis)."""

    def __init__(self, topo):
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(4, 2)})
        self.mlp = nn.Linear(2, 2)
        self._topo = topo
        ranks = [r for r in range(topo.world_size())
                 if topo.get_coord(r).pipe in (0, topo.get_dim("pipe") - 1)]
        self.tied_comms = {"embed": {"ranks": ranks, "weight_attr": ["weight"]}}

    def topology(self):
        return self._topo


def fake_pipeline_engine(topo, rank: int, module=None):
    """Rank ``rank``'s engine on topology ``topo`` (``module``: a :class:`FakeStage`)."""
    coord = topo.get_coord(rank)
    same_part = {"model": coord.model} if "model" in topo.get_axis_names() else {}
    data_group = topo.filter_match(pipe=coord.pipe, **same_part)
    grid = SimpleNamespace(pipe_parallel_size=topo.get_dim("pipe"),
                           get_stage_id=lambda: coord.pipe, get_global_rank=lambda: rank,
                           get_data_parallel_group_ranks=lambda: data_group)
    return SimpleNamespace(grid=grid, module=module if module is not None else FakeStage(topo))
