"""The run's fault tolerance as one component the training loop calls: MoC
checkpointing, exact-mode frames and upstream logs, injected faults and stage loss, the
``--moc-monitor`` loop watch, rank 0's progress record and the ETTR report.

Every rank, in this order (:mod:`megatron.training.train_loop` makes the loop's calls)::

    ft = FaultTolerance.setup(args, engine, scheduler, datasets)  # after deepspeed.initialize
    state = load_checkpoint(engine, args, scheduler, exact=ft.exact); ft.after_load()
    ft.start(state)                      # before the first iteration
    for each iteration:
        top = ft.before_iteration(n)     # faults, stage loss, heartbeat; the iteration's start
        ... the step ...
        ft.after_step(n, stats)          # expert-token all-reduce, policy, replay, progress
        ... logs, evaluation ...
        ft.after_iteration(state)        # the exact-mode frame; then the loop's save unless
                                         # ft.replaying
    if ft.end_loop(state): final save    # heartbeat stopped, upstream log, frames closed
    ft.close(state)                      # MoC shut down, ETTR; the writer still open

:meth:`FaultTolerance.abort` replaces the last two when the loop raised.
"""

import argparse
import functools
import os
import sys
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from megatron.errors import ConfigError
from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.exact.survivor import mark as survivor_mark
from megatron.training import checkpointing, local_restart
from megatron.training.arguments import moc_config_from_args
from megatron.training.loaders import build_loaders
from megatron.training.log import print_rank_0
from megatron.training.loop_watch import LoopWatch
from megatron.training.recovery import LoopTime, record_start, report_ettr


_FAULT_FLAGS = ("--moc-fault", "--moc-fault-mtbf", "--moc-fault-seed")


@functools.lru_cache(maxsize=1)  # every frame records it; argv does not change
def _replay_command() -> Tuple[str, ...]:
    """This run's command line without its fault injection: what ``moc-ckpt densify``
    re-runs to replay a window of frames offline (a fault would fire there again)."""
    argv, out, skip = sys.argv[1:], [os.path.abspath(sys.argv[0])], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in _FAULT_FLAGS:
            skip = "=" not in arg
            continue
        if skip and not arg.startswith("--"):
            continue  # a value of the fault flag (--moc-fault takes several)
        skip = False
        out.append(arg)
    return tuple(out)


def _exact_client_state(state, scheduler) -> Dict:
    """What an exact-recovery frame needs from the trainer to resume at its iteration,
    and the command that can replay it (``moc-ckpt densify``)."""
    return {"iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "opt_param_scheduler": scheduler.state_dict(),
            "command": list(_replay_command()), "cwd": os.getcwd()}


def _size_upstream_log(engine, args, exact) -> None:
    """Every rank, after each frame: once the exact-mode window is known (or changes),
    the upstream log keeps two of them and its budget is checked."""
    log = getattr(engine, "moc_upstream", None)
    schedule = exact.schedule
    if log is None or schedule is None or getattr(engine, "moc_upstream_window", None) == schedule.window:
        return
    from megatron.training.pipeline import check_upstream_log
    check_upstream_log(log, args, schedule.window)
    engine.moc_upstream_window = schedule.window


def _batches_from(args, datasets):
    """``consumed samples -> iterator`` of the training batches from there (a stage that
    replays reads its steps' data from it)."""
    def batches_from(consumed: int):
        resume = checkpointing.ResumeState(iteration=consumed // args.global_batch_size,
                                           consumed_train_samples=consumed)
        return build_loaders(args, datasets, resume)[0]
    return batches_from


def _stage_loss(args, engine, exact, scheduler, batches_from):
    """Every rank: the ``lose-stage`` faults' in-process recovery
    (:mod:`megatron.training.stage_loss`), or None."""
    from megatron.training.faults import faults_from_args
    specs = [s for s in faults_from_args(args, dist.get_world_size()) if s.kind == "lose-stage"]
    if not specs or exact is None:
        return None
    from megatron.training.stage_loss import StageLoss
    stage_size = dist.get_world_size() // args.pipeline_model_parallel_size
    return StageLoss(engine, exact, specs, lambda rank: rank // stage_size, batches_from,
                     scheduler, args, print_rank_0)


def _progress_recorder(args: argparse.Namespace):
    """Rank 0's per-iteration progress record beside ``--moc-event-file`` (the next start
    reports the iterations a failure lost from it); None where there is none."""
    if not getattr(args, "moc_event_file", None) or dist.get_rank() != 0:
        return None
    import socket
    from megatron.training.events import Progress
    from megatron.training.recovery import progress_path
    recorder = Progress(progress_path(args.moc_event_file))
    run_id = f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
    return lambda iteration, loop: recorder.record(iteration, run_id, loop.record())


def _fault_injector(args: argparse.Namespace, engine):
    """Every rank: the ``--moc-fault``/``--moc-fault-mtbf`` injector, or None. Its record
    of fired faults lives beside the checkpoints, so restarts do not fire them again."""
    if not (getattr(args, "moc_fault", None) or getattr(args, "moc_fault_mtbf", None)):
        return None
    from megatron.training.events import EventLog
    from megatron.training.faults import FaultInjector, faults_from_args
    lose_memory = None
    if getattr(args, "moc_two_level", False):
        lose_memory = lambda: engine.moc.two_level.drop_node_memory()  # noqa: E731
    elif getattr(args, "moc_mode", "pec") == "exact":
        lose_memory = lambda: engine.moc_exact.drop_node_memory()  # noqa: E731
    emit = EventLog(args.moc_event_file).append if args.moc_event_file else None
    rank, world = dist.get_rank(), dist.get_world_size()
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(getattr(args, "moc_ranks_per_node", 0), world)
    node = rank // per_node
    def slow_compute(seconds: float) -> None:
        engine.module.register_forward_pre_hook(lambda *_: time.sleep(seconds))

    return FaultInjector(faults_from_args(args, world), rank, world,
                         os.path.join(args.save, "moc-faults.json"),
                         mtbf_s=args.moc_fault_mtbf, seed=args.moc_fault_seed,
                         lose_memory=lose_memory, emit=emit,
                         node_ranks=range(node * per_node, min(world, (node + 1) * per_node)),
                         slow_compute=slow_compute)


def _enable_moc(args: argparse.Namespace, engine, injector) -> None:
    """Every rank, with ``--moc-checkpoint``: MoC's checkpointer on the engine."""
    from deepspeed_ext import enable_moc_checkpointing
    armed = injector.persist_env() if injector is not None else {}
    os.environ.update(armed)  # the node keeper, started now, inherits it ...
    try:
        enable_moc_checkpointing(engine, moc_config_from_args(args))
    finally:
        for key in armed:  # ... but not this process, which persists in-process
            os.environ.pop(key, None)  # when the keeper is gone
    if injector is not None and engine.moc.two_level is not None:
        engine.moc.two_level.fault_hook = injector.in_snapshot
    print_rank_0(f"> MoC checkpointing on: K = {args.moc_pec_k or args.num_experts} of "
                 f"{args.num_experts} experts per MoE layer per checkpoint, "
                 f"policy {args.moc_pec_policy}"
                 + (f", scope {args.moc_pec_scope}" if args.moc_pec_scope != "wo" else ""))


def _exact_snapshots(args: argparse.Namespace, engine):
    """Every rank, with ``--moc-mode exact``: the frames (and the upstream log with
    ``--moc-upstream-logging``); None otherwise."""
    if getattr(args, "moc_mode", "pec") != "exact":
        return None
    from deepspeed_ext.exact import ExactConfig, ExactSnapshots
    from deepspeed_ext.two_level import default_shm_dir
    exact = ExactSnapshots(engine, args.save,
                           ExactConfig(window=args.moc_window,
                                       memory_dir=args.moc_shm_dir or default_shm_dir(args.save),
                                       ranks_per_node=args.moc_ranks_per_node,
                                       expected_mtbf_s=(args.moc_expected_mtbf
                                                        or args.moc_fault_mtbf or 0.0),
                                       host_memory_gb=args.moc_host_memory_gb),
                           log=print_rank_0)
    engine.moc_exact = exact  # for the lose-memory fault
    if getattr(args, "moc_upstream_logging", False):
        from megatron.training.pipeline import attach_upstream_log
        engine.moc_upstream = attach_upstream_log(engine, args)
    return exact


class FaultTolerance:
    """Everything a run does to survive failures, behind the loop's hooks (see the module
    docstring for the order). One per run; every rank makes one."""

    def __init__(self, args: argparse.Namespace, engine, scheduler, injector=None,
                 exact=None, stage_loss=None, batches_from=None):
        self.args, self.engine, self.scheduler = args, engine, scheduler
        self.injector, self.exact, self.stage_loss = injector, exact, stage_loss
        self.watch: Optional[LoopWatch] = None
        self.progress = None
        self.loop_time: Optional[LoopTime] = None
        # --moc-restart in-job under a pipeline, exact mode and upstream logs: a survivor
        # keeps its state for a localized recovery (megatron/training/local_restart.py)
        self.localizes = exact is not None and local_restart.applies(args)
        self.batches_from = batches_from
        self.last_mark: Optional[local_restart.LoopMark] = None

    @classmethod
    def setup(cls, args: argparse.Namespace, engine, scheduler, datasets) -> "FaultTolerance":
        """Every rank, after ``deepspeed.initialize`` and before the checkpoint load: the
        fault injector, MoC's checkpointer (its keeper started with two levels), the
        exact-mode frames and the stage-loss recovery."""
        injector = _fault_injector(args, engine)
        if args.moc_checkpoint:
            _enable_moc(args, engine, injector)
        exact = _exact_snapshots(args, engine)
        batches_from = _batches_from(args, datasets)
        return cls(args, engine, scheduler, injector, exact,
                   _stage_loss(args, engine, exact, scheduler, batches_from), batches_from)

    @property
    def moc(self):
        """The engine's MoC checkpointer, or None."""
        return getattr(self.engine, "moc", None)

    @property
    def replaying(self) -> bool:
        """An exact replay runs: the frozen operators' fp32 state is not whole yet, so no
        checkpoint may be saved."""
        return self.exact is not None and self.exact.replaying

    def resume_in_job(self) -> Optional[checkpointing.ResumeState]:
        """Every rank, before the checkpoint load: under an in-job restart of a pipeline,
        the localized recovery (only the failed rank's stage replays); None: load as
        before (:func:`megatron.training.local_restart.resume_localized`)."""
        if not self.localizes:
            return None
        return local_restart.resume_localized(self.args, self.engine, self.scheduler,
                                              self.exact, self.batches_from)

    def after_load(self) -> None:
        """Every rank, after the checkpoint load."""
        if self.replaying and getattr(self.engine, "moc_upstream", None) \
                and not self.localizes:  # in-job: resume_in_job said why
            print_rank_0("[moc] upstream logs: none survived the restart (they live in the "
                         "training processes, which it replaced): every stage replays the "
                         "window (global exact replay)")

    def start(self, state: checkpointing.ResumeState) -> None:
        """Every rank, right before the first iteration: the heartbeat, rank 0's start
        event and progress record, the faults' clock and the first exact-mode frame.

        Raises:
            ConfigError: exact mode over a memory budget, on every rank (the figures
                are all-reduced).
        """
        self.watch = LoopWatch(self.args)
        self.progress = _progress_recorder(self.args)
        self.watch.ready(state.iteration)
        if self.injector is not None:
            self.injector.training_starts()
        record_start(self.args, state.iteration)
        self.loop_time = LoopTime()  # after the start event: the ETTR's measured iteration time
        if self.exact is not None:
            self._exact_call(lambda: self.exact.start(
                state.iteration, _exact_client_state(state, self.scheduler)))

    def _exact_call(self, call) -> None:
        try:
            call()
            _size_upstream_log(self.engine, self.args, self.exact)
        except (MemoryError, ConfigError) as e:  # the same on every rank: the figures are all-reduced
            self.exact.close()  # bad input, not a failure: no keeper and memory left behind
            raise ConfigError(str(e)) from None

    def before_iteration(self, iteration: int) -> float:
        """Every rank, at the top of ``iteration``: due faults fire, a lost stage is
        recovered, the heartbeat beats. Returns the iteration's start time
        (``time.perf_counter()``)."""
        if self.injector is not None:
            self.injector.before_iteration(iteration)
        if self.stage_loss is not None:
            self.stage_loss.before_iteration(iteration)
        self.watch.beat(iteration)
        top = time.perf_counter()
        self.loop_time.top(top)
        return top

    def after_step(self, iteration: int, stats) -> None:
        """Every rank, once ``iteration``'s optimizer step ran and counts: the expert
        tokens summed over ranks (one all-reduce) feed the checkpoint policy; an exact
        replay loads its next frame's weights; rank 0 records its progress."""
        moc = self.moc
        if moc is not None and stats.expert_counts.numel():
            counts = stats.expert_counts.clone()
            dist.all_reduce(counts)  # the policy state must be identical on every rank
            # (the host waits at tolist(); the clock times the all-reduce on the stream).
            # The T ranks of a tensor-parallel group route the same tokens: each token
            # was counted T times, which would inflate the lost-token figures' totals.
            counts //= getattr(self.args, "tensor_model_parallel_size", 1)
            moc.observe_tokens(counts.tolist())
            if self.exact is not None:
                self.exact.observe_tokens(counts.tolist())
        if self.exact is not None:  # replaying: the next frame's weights, before any evaluation
            self.exact.after_step(iteration)
        if self.progress is not None:
            self.progress(iteration, self.loop_time)

    def after_iteration(self, state: checkpointing.ResumeState) -> None:
        """Every rank, after the iteration's logs and evaluation, before its save: the
        exact-mode frame of this iteration."""
        if self.exact is not None:
            self._exact_call(lambda: self.exact.snapshot(
                state.iteration, _exact_client_state(state, self.scheduler)))
        if self.localizes and not self.replaying:
            # a global replay's frozen groups are not the original's until it ends
            self.last_mark = local_restart.LoopMark(
                survivor_mark(self.engine), state.iteration, state.consumed_train_samples,
                self.scheduler.state_dict(), get_rng_state(), dict(self.exact.popularity))

    def touch(self) -> None:
        """Progress inside an iteration (evaluation steps, a save): not a hang."""
        self.watch.touch()

    def end_loop(self, state: checkpointing.ResumeState) -> bool:
        """Every rank, when the loop ended normally: the loop time and the heartbeat stop
        (a long final save must not look like a hang), the upstream log reports, the
        frames close. Returns False when no final save may follow (stopped inside an
        exact replay)."""
        self.loop_time.stop(time.perf_counter())
        self.watch.stop()
        if getattr(self.engine, "moc_upstream", None) is not None:
            from megatron.training.pipeline import report_upstream_log
            print_rank_0(report_upstream_log(self.engine.moc_upstream, self.args))
        if self.exact is None:
            return True
        self.exact.close()
        if self.exact.replaying:
            print_rank_0(f"WARNING: stopped at iteration {state.iteration} inside an exact "
                         f"replay: no final checkpoint (the frames still hold the window)")
            return False
        return True

    def close(self, state: checkpointing.ResumeState) -> Optional[Dict]:
        """Every rank, after the final save: MoC's last save committed (or its failure
        raised) and, with two levels, the node's keeper stopped and its memory freed.
        Returns rank 0's ETTR figures (None elsewhere, or without an event file)."""
        if self.moc is not None:
            self.moc.shutdown()
        return report_ettr(self.args, state.iteration, self.loop_time)

    def abort(self) -> None:
        """Every rank whose run raised: the heartbeat and its watchdog thread stop; with
        ``--moc-restart in-job`` MoC's threads stop too (the process trains again in the
        next round; its keeper and snapshots stay). No collective runs (the other ranks
        may be gone)."""
        if self.watch is not None:
            self.watch.stop()
        if self.localizes:
            try:
                why = local_restart.keep(self.engine, self.exact, self.last_mark)
            except Exception as e:  # noqa: BLE001  (the run's own failure must stay the one raised)
                why = f"{type(e).__name__}: {e}"
            if why:
                print(f"[moc] rank {dist.get_rank()}: keeps no state for a localized recovery "
                      f"({why})", flush=True)
        if self.moc is not None and getattr(self.args, "moc_restart", "relaunch") == "in-job":
            self.moc.abandon()
