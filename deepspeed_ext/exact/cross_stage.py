"""The results of a pipeline step's collectives that span stages, kept so that one stage
can replay its steps alone (MoEtion's localized recovery).

Besides the activations and gradients it exchanges with its neighbours
(:mod:`deepspeed_ext.exact.upstream`), a stage of DeepSpeed's pipeline engine takes part
in collectives with the other stages in two places of every step: the tied weights'
gradient all-reduce (``ReduceTiedGrads``: first and last stage) and ZeRO's optimizer step
(the gradient norm, and the overflow check, all-reduced over the model-parallel group of
every stage). A stage replaying alone cannot run them, but it needs their results: every
member of an all-reduce gets the same one. :class:`CrossStageLog` keeps, on every rank,
the result of each such all-reduce in call order, per step and group, and during a replay
(:meth:`CrossStageLog.replaying`) hands the replaying rank the results a surviving member
of each group kept instead of communicating.

Every rank of a pipeline engine creates one and calls :meth:`CrossStageLog.attach`, on
the training's thread; no collectives of its own.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

GroupKey = Tuple[int, ...]
"""The global ranks of a process group, sorted."""

_ACTIVE: List["CrossStageLog"] = []  # the log recording or replaying now (at most one)
_ORIGINAL = {}  # deepspeed.comm's all_reduce, before the first attach


class CrossStageLog:
    """A rank's results of the all-reduces it shares with other pipeline stages.

    Args:
        engine: a DeepSpeed ``PipelineEngine`` with more than one stage.
        retain_iterations: steps kept (as the upstream log's).
    """

    def __init__(self, engine, retain_iterations: int):
        from deepspeed_ext.engine.stages import pipeline_place
        self.engine = engine
        # Every rank of the stage, its tensor-parallel ranks too: a group among them (an
        # expert-parallel pair, say) replays with this rank; taken for one across stages,
        # its all-reduce would be looked up in logs no other stage keeps.
        self.stage_ranks = frozenset(pipeline_place(engine).stage_ranks)
        self.retain_iterations = retain_iterations
        self.entries: Dict[Tuple[int, GroupKey], List[torch.Tensor]] = {}
        """(step, group) -> that step's all-reduce results over the group, in call order."""
        self._iteration: Optional[int] = None
        self._replay: Optional[Dict[Tuple[int, GroupKey], List[torch.Tensor]]] = None
        self._cursor: Dict[GroupKey, int] = {}
        self._groups: Dict[int, GroupKey] = {}

    def attach(self) -> None:
        """Every rank, once, after ``deepspeed.initialize``: record around the engine's
        tied-gradient reduction and optimizer step (its per-engine instruction table, as
        :meth:`deepspeed_ext.exact.upstream.UpstreamLog.attach` makes one)."""
        from deepspeed.runtime.pipe import schedule
        engine = self.engine
        if "_INSTRUCTION_MAP" not in vars(engine):
            engine._INSTRUCTION_MAP = dict(type(engine)._INSTRUCTION_MAP)
        table = engine._INSTRUCTION_MAP
        for instruction in (schedule.ReduceTiedGrads, schedule.OptimizerStep):
            table[instruction] = self._recording(table[instruction])
        _install()

    def _recording(self, run):
        log = self

        def recorded(eng, *args, **kwargs):
            log._iteration = eng.global_steps + 1  # before the step counts itself
            _ACTIVE.append(log)
            try:
                return run(eng, *args, **kwargs)
            finally:
                _ACTIVE.remove(log)
                log._iteration = None
        return recorded

    # -- inside deepspeed.comm.all_reduce ------------------------------------------------

    def group_key(self, group) -> GroupKey:
        """The ranks of ``group`` (None: the world), cached per group object."""
        import torch.distributed as dist
        key = self._groups.get(id(group))
        if key is None:
            ranks = (range(dist.get_world_size()) if group is None
                     else dist.get_process_group_ranks(group))
            key = self._groups[id(group)] = tuple(sorted(ranks))
        return key

    def spans_stages(self, key: GroupKey) -> bool:
        """Whether a group reaches ranks outside this rank's stage."""
        return not self.stage_ranks.issuperset(key)

    def all_reduce(self, tensor: torch.Tensor, group, run) -> object:
        """``deepspeed.comm.all_reduce`` while this log is active: recorded (a collective
        across stages), or answered from the replay's results, or run plainly."""
        key = self.group_key(group)
        if not self.spans_stages(key):
            return run()
        slot = (self._iteration, key)
        if self._replay is not None:
            n = self._cursor.get(key, 0)
            self._cursor[key] = n + 1
            results = self._replay.get(slot, [])
            if n >= len(results):
                raise RuntimeError(f"local replay of step {self._iteration}: all-reduce #{n} over "
                                   f"ranks {list(key)} was not logged by the other stages")
            tensor.copy_(results[n].to(tensor.device))
            return None
        out = run()
        self.entries.setdefault(slot, []).append(tensor.detach().to("cpu", copy=True))
        return out

    # -- reading, replaying, freeing --------------------------------------------------

    @contextlib.contextmanager
    def replaying(self, results: Dict[Tuple[int, GroupKey], List[torch.Tensor]],
                  iteration: int) -> Iterator[None]:
        """While replaying step ``iteration`` on this rank: answer the all-reduces across
        stages from ``results`` (gathered from surviving members of each group), and keep
        them as this rank's own record of the step."""
        self._replay, self._cursor = results, {}
        try:
            yield
        finally:
            self._replay = None
            for slot, values in results.items():
                if slot[0] == iteration:
                    self.entries[slot] = list(values)

    def clear(self) -> None:
        """Drop every entry (the log is lost with its rank's state)."""
        self.entries.clear()

    def adopt(self, entries: Dict[Tuple[int, GroupKey], List[torch.Tensor]],
              retain_iterations: int) -> None:
        """Take a failed run's entries as this log's (as ``UpstreamLog.adopt``); the
        group keys are global ranks, which an in-job round keeps."""
        self.entries = {k: list(v) for k, v in entries.items()}
        if retain_iterations:
            self.retain_iterations = retain_iterations

    def free_before(self, iteration: int) -> None:
        """Drop every step before ``iteration``."""
        for slot in [s for s in self.entries if s[0] < iteration]:
            del self.entries[slot]

    def end_step(self) -> None:
        """After a step: free the steps older than the retained ones."""
        self.free_before(self.engine.global_steps - self.retain_iterations + 1)


def _install() -> None:
    """Route ``deepspeed.comm.all_reduce`` through the active log (once per process)."""
    import deepspeed.comm as ds_comm
    if "all_reduce" in _ORIGINAL:
        return
    original = _ORIGINAL["all_reduce"] = ds_comm.all_reduce

    def all_reduce(tensor, op=None, group=None, async_op=False, **kwargs):
        def run():
            if op is None:
                return original(tensor, group=group, async_op=async_op, **kwargs)
            return original(tensor, op=op, group=group, async_op=async_op, **kwargs)
        if not _ACTIVE:
            return run()
        if async_op:
            raise RuntimeError("cross-stage log: an asynchronous all-reduce inside a logged "
                               "pipeline instruction is not supported")
        return _ACTIVE[-1].all_reduce(tensor, group, run)

    ds_comm.all_reduce = all_reduce
