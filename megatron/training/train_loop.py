"""The training loop: iterations until ``--train-iters`` (or ``--train-tokens``), with
the interval log, evaluation, the save schedule and the exit rules; everything about
failures is behind the fault-tolerance component's hooks
(:class:`megatron.training.fault_tolerance.FaultTolerance`).

Every rank runs :meth:`TrainLoop.run` once per run, after the checkpoint load, with the
same arguments; each iteration runs one :func:`megatron.training.step.train_step` and
the same collectives in the same order on every rank.
"""

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch.distributed as dist

from megatron.training import checkpointing
from megatron.training.fault_tolerance import FaultTolerance
from megatron.training.log import (MetricsWriter, eval_log_line, is_nan_iteration, print_rank_0,
                                   throughput, timestamp, training_log_line)
from megatron.training.step import StepStats, evaluate, train_step
from megatron.training.stopping import DurationLimit, train_tokens_reached
from megatron.training.tb_tags import (Position, interval_scalars, training_scalars,
                                       validation_scalars)


@dataclass
class TrainResult:
    """What a run returns (for tests and wrappers)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    losses: List[float] = field(default_factory=list)
    """LM loss of every iteration this process ran."""
    valid_losses: List[float] = field(default_factory=list)


@dataclass
class LogWindow:
    """The iterations since the last interval log line (Megatron's ``--log-interval``)."""

    stats: List[StepStats] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    paused: float = 0.0
    """Evaluation and save time inside the window: not iteration time (as Megatron)."""

    def seconds(self) -> float:
        """Iteration time since the window started."""
        return time.perf_counter() - self.started - self.paused


@dataclass
class LoopState:
    """The loop's own state on this rank (the run's position is its ``resume``)."""

    resume: checkpointing.ResumeState
    result: TrainResult
    window: LogWindow = field(default_factory=LogWindow)
    skipped_total: int = 0
    """Skipped (fp16 overflow) iterations since this process started (Megatron: per interval)."""
    nan_total: int = 0
    last_saved: int = -1
    """Iteration of the newest checkpoint of this run (-1: none, and no --load)."""


class TrainLoop:
    """One run's loop on this rank; the objects it drives are made and closed by
    :func:`megatron.training.training.pretrain`."""

    def __init__(self, args: argparse.Namespace, engine, scheduler, ft: FaultTolerance,
                 writer: MetricsWriter, train_iter: Iterator, valid_iter: Optional[Iterator],
                 limit: Optional[DurationLimit] = None):
        self.args, self.engine, self.scheduler, self.ft = args, engine, scheduler, ft
        self.writer, self.train_iter, self.valid_iter = writer, train_iter, valid_iter
        self.limit = limit or DurationLimit(None)
        self.save_interval = args.save_interval
        if getattr(args, "moc_two_level", False) and args.moc_snapshot_interval:
            self.save_interval = args.moc_snapshot_interval

    def run(self, resume: checkpointing.ResumeState) -> TrainResult:
        """Every rank: train from ``resume`` until done or an exit rule fires; then the
        final save and the fault-tolerance component's close."""
        args = self.args
        s = LoopState(resume, TrainResult(iteration=resume.iteration,
                                          consumed_train_samples=resume.consumed_train_samples),
                      last_saved=resume.iteration if args.load else -1)
        print_rank_0(f"[{timestamp()}] training from iteration {resume.iteration} to "
                     f"{args.train_iters}"
                     + (f" or {args.train_tokens} tokens" if getattr(args, "train_tokens", None)
                        else "")
                     + ("" if args.save else " (no --save: no checkpoints will be written)"))
        if resume.recovery is not None:
            self.writer.write("moc", resume.iteration, resume.recovery.metrics())
        try:
            self.ft.start(resume)
            while not self._finished(resume):
                if self._iteration(s):
                    break
        except BaseException:
            self.ft.abort()
            raise
        return self._finish(s)

    def _finished(self, resume: checkpointing.ResumeState) -> bool:
        return (resume.iteration >= self.args.train_iters
                or train_tokens_reached(self.args, resume.consumed_train_samples))

    def _iteration(self, s: LoopState) -> bool:
        """One iteration and what follows it; True when an exit rule ends the loop."""
        args, state = self.args, s.resume
        top = self.ft.before_iteration(state.iteration + 1)
        stats = train_step(self.engine, self.train_iter, args)
        # The tokens consumed once this iteration counts (a token schedule's position).
        self.scheduler.step(1, token_num=(state.consumed_train_samples + args.global_batch_size)
                            * args.seq_length)
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        self.ft.after_step(state.iteration, stats)
        s.skipped_total += int(stats.skipped)
        s.nan_total += int(is_nan_iteration(stats.skipped, stats.lm_loss, stats.moe_aux_loss))
        s.window.stats.append(stats)
        s.result.losses.append(stats.lm_loss)
        last = self._finished(state)
        self._write_step(state, stats, top)
        if state.iteration % args.log_interval == 0 or last:
            self._log_interval(s, stats)
        if self.valid_iter is not None and state.iteration % args.eval_interval == 0:
            self._evaluate(s)
        self.ft.after_iteration(state)
        if (args.save and self.save_interval and state.iteration % self.save_interval == 0
                and not self.ft.replaying):
            self._save(s, last)
        return self._exit_now(state)

    def _lr(self) -> float:
        return self.scheduler.optimizer.param_groups[0]["lr"]

    def _write_step(self, state: checkpointing.ResumeState, stats: StepStats, top: float) -> None:
        """The iteration's metrics record and TensorBoard scalars."""
        args = self.args
        record = {
            "consumed_samples": state.consumed_train_samples, "lm_loss": stats.lm_loss,
            "moe_aux_loss": stats.moe_aux_loss, "grad_norm": stats.grad_norm,
            "lr": self._lr(), "skipped": int(stats.skipped)}
        if getattr(args, "log_batch_size_to_tensorboard", False):
            record["batch_size"] = args.global_batch_size
        if getattr(args, "log_timers_to_tensorboard", False):
            record["iteration_time_ms"] = 1000.0 * (time.perf_counter() - top)
        at = self._position(state)
        losses = {"lm loss": stats.lm_loss, "moe aux loss": stats.moe_aux_loss}
        self.writer.write("train", state.iteration, record, scalars=training_scalars(
            at, losses, record["lr"], stats.grad_norm, args.global_batch_size, args.seq_length,
            loss_scale=stats.loss_scale, fp16=args.fp16,
            log_batch_size=getattr(args, "log_batch_size_to_tensorboard", False)))

    def _position(self, state: checkpointing.ResumeState) -> Position:
        return Position(state.iteration, state.consumed_train_samples,
                        state.consumed_train_samples * self.args.seq_length)

    def _log_interval(self, s: LoopState, stats: StepStats) -> None:
        """Rank 0's interval line (Megatron's) and the interval scalars; a new window."""
        args, state, window = self.args, s.resume, s.window.stats
        elapsed = s.window.seconds()
        world_size = dist.get_world_size()
        rates = throughput(len(window), elapsed, args.global_batch_size, args.seq_length,
                           world_size)
        at = self._position(state)
        print_rank_0(training_log_line(state.iteration, args.train_iters, {
            "consumed_samples": state.consumed_train_samples, "consumed_tokens": at.tokens,
            "elapsed_ms": 1000.0 * elapsed / len(window),
            "tokens_per_s": rates["tokens_per_s"], "lr": self._lr(),
            "global_batch_size": args.global_batch_size,
            "lm_loss": sum(x.lm_loss for x in window) / len(window),
            "moe_aux_loss": sum(x.moe_aux_loss for x in window) / len(window),
            "loss_scale": stats.loss_scale, "grad_norm": window[-1].grad_norm,
            "seq_length": args.seq_length, "skipped": s.skipped_total, "nan": s.nan_total,
            "samples_per_s": rates["samples_per_s"], "tgs": rates["tgs"]}))
        losses = {"lm loss": stats.lm_loss, "moe aux loss": stats.moe_aux_loss}
        self.writer.add_scalars(interval_scalars(
            at, losses, elapsed / len(window), rates, world_size,
            log_timers=getattr(args, "log_timers_to_tensorboard", False)))
        s.window = LogWindow()

    def _evaluate(self, s: LoopState) -> None:
        """Every rank: the validation loss, its log line and records."""
        args, state = self.args, s.resume
        began = time.perf_counter()
        self.ft.touch()
        loss = evaluate(self.engine, self.valid_iter, args, on_step=self.ft.touch)
        s.result.valid_losses.append(loss)
        print_rank_0(eval_log_line(f"validation loss at iteration {state.iteration}", loss))
        valid_record = {"lm_loss": loss}
        log_ppl = getattr(args, "log_validation_ppl_to_tensorboard", False)
        ppl = math.exp(min(20.0, loss))  # as the log line's PPL
        if log_ppl:
            valid_record["ppl"] = ppl
        self.writer.write("valid", state.iteration, valid_record, scalars=validation_scalars(
            self._position(state), loss, ppl, log_ppl))
        s.window.paused += time.perf_counter() - began

    def _save(self, s: LoopState, last: bool) -> None:
        """Every rank: the scheduled checkpoint (or two-level snapshot)."""
        args, state = self.args, s.resume
        # Snapshots every iteration would print a line each: log them with the
        # training lines, and the last one.
        quiet = (self.save_interval != args.save_interval
                 and state.iteration % args.log_interval != 0
                 and not last
                 and not (args.exit_interval and state.iteration % args.exit_interval == 0))
        began = time.perf_counter()
        self.ft.touch()
        checkpointing.save_checkpoint(self.engine, args, self.scheduler, state, log=not quiet)
        s.last_saved = state.iteration
        s.window.paused += time.perf_counter() - began

    def _exit_now(self, state: checkpointing.ResumeState) -> bool:
        """``--exit-duration-in-mins`` (one all-reduce per iteration, of the flag only)
        and ``--exit-interval``."""
        args = self.args
        if self.limit.expired():
            print_rank_0(f"> exiting at iteration {state.iteration} after "
                         f"{self.limit.elapsed_minutes():.2f} minutes (--exit-duration-in-mins "
                         f"{args.exit_duration_in_mins:g})")
            return True
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            print_rank_0(f"> exiting at iteration {state.iteration} (--exit-interval "
                         f"{args.exit_interval})")
            return True
        return False

    def _finish(self, s: LoopState) -> TrainResult:
        """Every rank: the final save when the last iteration has none, the
        fault-tolerance component's close, the ETTR record and the end line."""
        args, state = self.args, s.resume
        if not self.ft.end_loop(state):
            s.last_saved = state.iteration
        if args.save and s.last_saved != state.iteration:
            checkpointing.save_checkpoint(self.engine, args, self.scheduler, state)
        ettr = self.ft.close(state)
        if ettr is not None:
            self.writer.write("moc", state.iteration, {"ettr": ettr["ettr"]})
        done = "done" if self._finished(state) else "stopped"
        print_rank_0(f"[{timestamp()}] training {done} at iteration {state.iteration} "
                     f"({state.consumed_train_samples} samples)")
        s.result.iteration = state.iteration
        s.result.consumed_train_samples = state.consumed_train_samples
        return s.result
