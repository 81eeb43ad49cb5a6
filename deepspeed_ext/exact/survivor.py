"""A surviving pipeline rank's training state carried from a failed run into the next
run of the same process (``--moc-restart in-job``), so that only the failed stage
replays (MoEtion's localized recovery after a real crash).

An in-job restart rebuilds every rank's engine in the same process: the process groups
of the failed run cannot be reused. A rank of a stage that did not fail still holds,
in its old engine, the state after the last step it finished, and its upstream and
cross-stage logs (:mod:`~deepspeed_ext.exact.upstream`,
:mod:`~deepspeed_ext.exact.cross_stage`), which the failed stage replays from. This
module moves them from the old engine to the new one:

1. every rank, after each iteration: :func:`mark` (the step count and the optimizer's
   scalars: a few numbers);
2. every rank whose run failed, before its engine is freed: :func:`capture`, which
   returns None when the engine moved past the mark (the optimizer step of the failed
   iteration ran, on some or all of the parameter groups: the fp32 state is then not
   the mark's, and only a replay can rebuild it);
3. the next run, once its engine exists and the ranks agreed on a localized recovery:
   :func:`adopt_logs` (every survivor: its logs into the new engine's, so that the
   failed stage can be handed them), :func:`misfit` (each survivor outside the failed
   stage checks that the new engine takes its state; the ranks agree on the outcomes)
   and :func:`restore` (those survivors; ZeRO's all-gather inside their stage).

No collective but the one in :func:`restore`; nothing is read from a file.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class StepMark:
    """What a rank's engine looked like after its last finished iteration."""

    global_steps: int
    """The engine's step counter then."""
    optimizer_scalars: Tuple[Tuple[Tuple[str, Any], ...], ...]
    """Per parameter group, the optimizer's scalars (``step``), sorted by name."""


@dataclass
class SurvivorState:
    """One rank's training state after its last finished step, off its failed engine
    (host copies: nothing of the failed run's engine or groups is referenced)."""

    objects: Dict[str, Any]
    """Engine counters (their ``global_steps``: the steps the state is after), optimizer
    scalars and loss scaler, as a frame's objects."""
    fragments: Dict[str, torch.Tensor]
    """This rank's fp32 master and moment fragments by key (host copies)."""
    upstream: Dict[Any, Tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """The upstream log's entries of the finished steps."""
    cross: Dict[Tuple[int, Tuple[int, ...]], List[torch.Tensor]] = field(default_factory=dict)
    """The cross-stage log's entries of the finished steps."""
    retain_iterations: int = 0
    """How many steps the logs kept (two exact-mode windows)."""


def _scalars(engine) -> Tuple[Tuple[Tuple[str, Any], ...], ...]:
    from deepspeed_ext.state import optimizer_scalars
    return tuple(tuple(sorted(group.items())) for group in optimizer_scalars(engine))


def mark(engine) -> StepMark:
    """Every rank, after each finished iteration (no collective)."""
    return StepMark(engine.global_steps, _scalars(engine))


def moved_past(engine, at: StepMark) -> Optional[str]:
    """Why ``engine``'s state is no longer the one ``at`` marked (None: it is). The
    optimizer's step counters move as its update runs, before ZeRO's all-gather that a
    dead peer can fail: a rank that updated its partition and then failed is caught here."""
    if engine.global_steps != at.global_steps:
        return f"the engine counted {engine.global_steps} steps, the loop finished {at.global_steps}"
    if _scalars(engine) != at.optimizer_scalars:
        return "the optimizer's update of the failed iteration ran"
    return None


def capture(engine, naming, at: StepMark, upstream=None, cross=None) -> SurvivorState:
    """This rank, after its run failed and before the engine is freed (no collective):
    host copies of its fp32 fragments and moments, counters and logs, as of ``at``.
    The caller checks :func:`moved_past` first.

    Args:
        naming: the engine's expert naming (``ExactSnapshots.naming``).
        upstream, cross: the engine's upstream and cross-stage logs (None: none);
            entries of the failed iteration (after ``at``) are left out.
    """
    from deepspeed_ext.exact.operators import ENGINE_COUNTERS
    from deepspeed_ext.state import (describe_local_state, loss_scaler_state,
                                     optimizer_scalars)
    objects = {"engine": {k: getattr(engine, k) for k in ENGINE_COUNTERS},
               "optimizer_scalars": optimizer_scalars(engine),
               "loss_scaler": loss_scaler_state(engine)}
    with torch.no_grad():
        fragments = {f.key: f.tensor.detach().to("cpu", copy=True)
                     for f in describe_local_state(engine, naming)}
    done = at.global_steps
    out = SurvivorState(objects, fragments)
    if upstream is not None:
        upstream.sync()
        out.upstream = {k: v for k, v in upstream.entries.items() if k.iteration <= done}
        out.retain_iterations = upstream.retain_iterations
    if cross is not None:
        out.cross = {k: list(v) for k, v in cross.entries.items() if k[0] <= done}
    return out


def adopt_logs(state: SurvivorState, upstream, cross) -> None:
    """This rank, in the next run, before the failed stage is handed the logs: the
    carried entries into the new engine's logs (no collective)."""
    if upstream is not None:
        upstream.adopt(state.upstream, state.retain_iterations)
    if cross is not None:
        cross.adopt(state.cross, state.retain_iterations)


def misfit(engine, index, state: SurvivorState) -> Optional[str]:
    """This rank alone (no collective), before the ranks agree to restore: why the new
    engine cannot take ``state`` (a fragment it lacks, or of another size: a layout the
    state was not taken on), or None. Creates the optimizer's moments if the new engine
    has none yet, as a restore would.

    Args:
        index: the run's :class:`~deepspeed_ext.exact.operators.OperatorIndex`.
    """
    from deepspeed_ext.state import ensure_optimizer_state
    ensure_optimizer_state(engine)
    index.forget_fragments()
    for group in index.fragments_by_op().values():
        for frag in group:
            held = state.fragments.get(frag.key)
            if held is None or held.numel() != frag.tensor.numel():
                return f"the carried state lacks {frag.key} as this engine holds it"
    return None


def restore(engine, index, state: SurvivorState) -> None:
    """The ranks of a stage that did not fail, together (ZeRO's all-gather of the
    compute weights inside the stage), once every rank's :func:`misfit` was None: the
    new engine takes ``state``; its compute weights are rebuilt from the fp32 masters,
    as after a step."""
    from deepspeed_ext.exact.replay import restore_objects
    from deepspeed_ext.state import refresh_compute_weights
    restore_objects(engine, state.objects)
    index.forget_fragments()
    with torch.no_grad():
        for group in index.fragments_by_op().values():
            for frag in group:
                frag.tensor.copy_(state.fragments[frag.key].view_as(frag.tensor))
    refresh_compute_weights(engine)
