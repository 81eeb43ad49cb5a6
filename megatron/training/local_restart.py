"""Localized recovery after a real crash (``--moc-restart in-job``, a pipeline, exact mode,
``--moc-upstream-logging``): only the failed rank's stage replays; the other stages
continue from the state their processes kept.

Under a relaunch every process is new, so every stage replays its exact-mode window
(global). Under an in-job restart the survivors keep their processes: each keeps, from
its failed run, the state after the last iteration it finished and its upstream logs
(:mod:`deepspeed_ext.exact.survivor`), in this module's holder, until its next run. That
run (every rank, in its load phase) calls :func:`resume_localized`:

1. every rank says which stage it is and which iteration its kept state is at (none: a
   spare, or a survivor whose optimizer step of the failed iteration had begun;
   one ``all_gather_object``), and every rank decides the same with :func:`plan`: the
   ranks without state are all of one stage F, and the others stopped at one iteration
   R;
2. the newest complete window of frames ``[s, s + W)`` ends by R; the survivors put
   their logs into the new engine's and hand F's ranks those of steps ``s+1 .. R``;
3. F's ranks (the spare and F's survivors) restore the window from the node's memory
   and replay ``s+1 .. R`` alone (:class:`~megatron.training.stage_replay.StageReplayer`),
   then take their random generators' state at R (a survivor its kept one, the spare
   the failed rank's frame R: the replay does not draw what evaluations drew), while
   the other stages restore their kept state into their new engines;
4. training resumes at R + 1 on every rank, and the exact-mode window grid goes on.

When any step says no (the reason is logged once), every rank returns None and loads
as before: the global replay of the window, which is always exact. The decision is
taken before any rank's engine is touched, so the fallback starts from a clean engine.
"""

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.exact import survivor
from megatron.training.log import print_rank_0


def applies(args: argparse.Namespace) -> bool:
    """Whether this job's in-job recoveries try the localized one."""
    return (getattr(args, "moc_restart", "relaunch") == "in-job"
            and getattr(args, "pipeline_model_parallel_size", 1) > 1
            and getattr(args, "moc_mode", "pec") == "exact"
            and getattr(args, "moc_upstream_logging", False))


@dataclass
class LoopMark:
    """The trainer's position after an iteration it finished (this rank)."""

    step: survivor.StepMark
    iteration: int
    consumed_train_samples: int
    scheduler: Dict
    rng: Dict
    popularity: Dict = field(default_factory=dict)


@dataclass
class Kept:
    """What a survivor kept from its failed run for the next run of the same process."""

    state: survivor.SurvivorState
    mark: LoopMark


_KEPT: List[Kept] = []  # at most one: this process's, between two runs


def keep(engine, exact, mark: Optional[LoopMark]) -> Optional[str]:
    """This rank, after its run failed, before the run's engine is freed (no collective):
    keep its state for the next run. Returns why nothing was kept (None: kept)."""
    _KEPT.clear()
    if mark is None:
        return "no iteration finished in the failed run"
    why = survivor.moved_past(engine, mark.step)
    if why is not None:
        return why
    state = survivor.capture(engine, exact.naming, mark.step,
                             getattr(engine, "moc_upstream", None),
                             getattr(engine, "moc_cross", None))
    _KEPT.append(Kept(state, mark))
    return None


def take() -> Optional[Kept]:
    """This process's kept state, removed from the holder (a later run never sees it)."""
    return _KEPT.pop() if _KEPT else None


@dataclass(frozen=True)
class LocalPlan:
    """Every rank's same decision (:func:`plan`)."""

    failed_stage: int = -1
    iteration: int = -1
    """R: the iteration the other stages finished last."""
    popularity_from: int = -1
    """The rank whose expert popularity every rank takes."""
    consumed_train_samples: int = 0
    why: str = ""
    """Why the recovery is global instead ('' when localized)."""


def plan(every: List[Tuple[int, Optional[int], int]]) -> LocalPlan:
    """From every rank's ``(stage, kept iteration or None, consumed samples)`` (in rank
    order): the stage that replays and the iteration the others resume at."""
    lacking = sorted({stage for stage, it, _ in every if it is None})
    if not lacking:
        return LocalPlan(why="every rank kept its state: no stage to replay")
    if len(lacking) > 1:
        return LocalPlan(why=f"ranks of stages {lacking} kept no state: a stage's neighbour "
                             f"has no log to give")
    failed = lacking[0]
    others = [(rank, it, consumed) for rank, (stage, it, consumed) in enumerate(every)
              if stage != failed]
    if not others:
        return LocalPlan(why="no other stage kept its state")
    iterations = sorted({it for _, it, _ in others})
    if len(iterations) != 1:
        return LocalPlan(why=f"the other stages stopped at iterations {iterations}")
    rank, it, consumed = others[0]
    return LocalPlan(failed, it, rank, consumed)


def resume_localized(args: argparse.Namespace, engine, scheduler, exact, batches_from):
    """Every rank, in the load phase of a run under :func:`applies` (see the module
    docstring for the steps and their collectives).

    Returns:
        The :class:`~megatron.training.checkpointing.ResumeState` at R, or None: load as
        before (round 0, or the recovery is global: the reason logged).

    Raises:
        RuntimeError: on every rank, when the failed stage's frames or a survivor's kept
            state cannot be used after every rank agreed they could (a bug).
    """
    from deepspeed_ext.runtime import rounds
    kept = take()
    if int(os.environ.get(rounds.ROUND_ENV, "0")) == 0:
        return None  # the job's first run: nothing failed (the same on every rank)
    began = time.perf_counter()
    decided, found, inputs, frames = _agree(args, engine, scheduler, exact, batches_from, kept)
    if decided.why:
        print_rank_0(f"[moc] in-job recovery: every stage replays its window (global): "
                     f"{decided.why}")
        return None
    return _recover(args, engine, scheduler, exact, batches_from, kept, decided, found,
                    inputs, frames, began)


def _gather(value) -> List:
    from deepspeed_ext.runtime.groups import metadata_group
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, value, group=metadata_group())
    return every


def _agree(args, engine, scheduler, exact, batches_from, kept):
    """Every rank, the same collectives in the same order until the first 'no':
    ``(plan, window, this rank's replay inputs, (its frames, its generators' state at R))``
    (the last two None off the failed stage's ranks); the plan's ``why`` says no."""
    from dataclasses import replace
    from deepspeed_ext.exact.local_replay import newest_window
    from megatron.training.pipeline import check_upstream_log
    from megatron.training.stage_replay import StageReplayer
    mark = kept.mark if kept is not None else None
    decided = plan(_gather((engine.stage_id, mark.iteration if mark else None,
                            mark.consumed_train_samples if mark else 0)))
    if decided.why:
        return decided, None, None, None
    found = newest_window(exact)
    if found is None or found.start + found.window - 1 > decided.iteration:
        return replace(decided, why=f"no complete window of frames ends by iteration "
                                    f"{decided.iteration}"), None, None, None
    check_upstream_log(engine.moc_upstream, args, found.window)  # two windows kept
    engine.moc_upstream_window = found.window
    if kept is not None:
        survivor.adopt_logs(kept.state, engine.moc_upstream, engine.moc_cross)
    replayer = StageReplayer(engine, exact, batches_from, scheduler, args)
    steps = list(range(found.start + 1, decided.iteration + 1))
    inputs, why = replayer.inputs([decided.failed_stage], steps)
    replaying = engine.stage_id == decided.failed_stage
    end_rng = None
    if not why:
        if replaying:
            end_rng, misfit = generators_after(exact, decided.iteration, kept)
        else:
            misfit = survivor.misfit(engine, exact.index, kept.state)
        why = next((f"rank {r}: {m}" for r, m in enumerate(_gather(misfit)) if m), "")
    if why:
        return replace(decided, why=why), None, None, None
    try:
        frames = replayer.load_agreed(found, replaying, what="the localized in-job recovery")
    except RuntimeError as e:  # raised on every rank alike
        return replace(decided, why=str(e)), None, None, None
    return decided, found, inputs, (frames, end_rng)


def generators_after(exact, iteration: int, kept) -> Tuple[Optional[Dict], Optional[str]]:
    """A replaying rank, alone: its random generators' state at the end of ``iteration``
    (its kept state's, or its frame of that iteration's: a spare reads the failed rank's),
    or why it is unknown (:meth:`StageReplayer.replay` ends at it: the replay does not
    draw what the evaluations between its steps drew)."""
    from deepspeed_ext.exact.replay import load_frame
    if kept is not None:
        return kept.mark.rng, None
    held = exact.recovery.available_frames(exact.save_dir)
    if iteration not in held:
        return None, f"holds no frame {iteration}, which has its generators' state then"
    try:
        return load_frame(held[iteration][1], iteration, exact.rank)[1]["rng"], None
    except Exception as e:  # noqa: BLE001  (a damaged frame: the recovery is global)
        return None, f"its frame {iteration} cannot be read ({type(e).__name__}: {e})"


def _recover(args, engine, scheduler, exact, batches_from, kept, decided, found, inputs,
             frames, began):
    """Every rank, once they agreed: the failed stage replays, the others restore; the
    window grid goes on; rank 0 logs and records the recovery."""
    from deepspeed_ext.runtime.groups import metadata_group
    from megatron.training.checkpointing import ResumeState
    from megatron.training.recovery import account_recovery
    from megatron.training.stage_replay import StageReplayer
    failed, it = decided.failed_stage, decided.iteration
    popularity = [kept.mark.popularity if kept is not None else None]
    dist.broadcast_object_list(popularity, src=decided.popularity_from, group=metadata_group())
    frames, end_rng = frames
    if engine.stage_id == failed:
        StageReplayer(engine, exact, batches_from, scheduler, args).replay(
            found, frames, list(range(found.start + 1, it + 1)), inputs, end_rng)
        rng = end_rng
    else:
        survivor.restore(engine, exact.index, kept.state)
        scheduler.num_steps = 0  # megatron.core's scheduler loads by stepping from where it is
        scheduler.load_state_dict(kept.mark.scheduler)
        rng = kept.mark.rng
    dist.barrier(group=metadata_group())  # the other stages wait for the replay here
    exact.continue_grid(found, popularity[0])
    seconds = time.perf_counter() - began
    engine.moc.mark_exact_replay(f"memory, localized to stage {failed}")
    print_rank_0(f"[moc] recovered in {seconds:.2f} s, localized in-job: stage {failed} replayed "
                 f"iterations {found.start + 1}..{it} from its neighbours' upstream logs; the "
                 f"other stages kept their state and resume at iteration {it + 1}")
    state = ResumeState(iteration=it, consumed_train_samples=decided.consumed_train_samples,
                        rng_state=None if args.no_load_rng else rng)
    state.recovery = account_recovery(engine, args, it, seconds)
    return state
