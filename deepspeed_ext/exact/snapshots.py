"""Exact recovery's facade: :class:`ExactSnapshots`, which the trainer calls at fixed
points of every iteration (see the package's docstring for the call order), composed of
the operator index, the node's memory level, the frame writer, the window sizing and
the recovery."""

import logging
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.exact.config import ExactConfig
from deepspeed_ext.exact.frames import frame_layout
from deepspeed_ext.exact.memory import NodeMemory
from deepspeed_ext.exact.operators import OperatorIndex
from deepspeed_ext.exact.recovery import Recovery
from deepspeed_ext.exact.replay import Replay
from deepspeed_ext.exact.sizing import WindowSizer
from deepspeed_ext.exact.writer import FrameWriter
from deepspeed_ext.policy import operators
from deepspeed_ext.policy import window as win
from deepspeed_ext.runtime.groups import init_metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines

logger = logging.getLogger("deepspeed_ext.exact")


class ExactSnapshots:
    """Sparse frames every iteration, and recovery by sparse-to-dense replay.

    Every rank builds one after ``deepspeed.initialize`` (and after MoC's patch, if any)
    and calls its methods at the same points of every iteration (package docstring).

    Args:
        engine: the DeepSpeed engine (ZeRO stage 0-2, ``deepspeed.moe`` layers allowed).
        save_dir: the job's ``--save``; frames go under ``<save_dir>/exact``.
        config: :class:`ExactConfig`.
        log: where rank 0's lines about the job go (each already says ``[moc] ...``);
            None: the package's logger (``deepspeed_ext.exact``), from rank 0.
    """

    def __init__(self, engine, save_dir: str, config: ExactConfig, log=None):
        from deepspeed_ext.state import expert_naming
        self.engine, self.save_dir, self.cfg = engine, save_dir, config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        init_metadata_group()  # every rank, here: the group of all of this class's collectives
        self.log: Callable[[str], None] = (log if log is not None
                                           else rank_zero_lines(logger, prefix=""))
        self.naming = expert_naming(engine.module)
        self.index = OperatorIndex(engine, self.naming)
        self.schedule: Optional[win.Schedule] = None
        self.base: Optional[int] = None
        """First frame of the current window grid; windows start at base + k*W."""
        self.replay: Optional[Replay] = None
        self._order: Optional[List[str]] = None
        self._fixed_start = False
        self._continued = False  # a localized recovery set the grid (continue_grid)
        self.memory = NodeMemory(self.rank, save_dir, self.log)
        self.writer = FrameWriter(self.rank, self.world, save_dir, self.memory,
                                  config.write_frames)
        self.sizer = WindowSizer(config, self.rank, self.index, self.memory, self.log)
        self.recovery = Recovery(engine, self.index, self.memory, self.rank, self.world,
                                 save_dir, frame_layout(self.naming, self.world, self.rank),
                                 self.log)
        if config.memory_dir:
            self.memory.attach(config, self.world)
        self._wrap_step()

    def _wrap_step(self) -> None:
        """The stall point: ``engine.step`` waits for the frame copy before it runs."""
        from deepspeed_ext.engine.hostcopy import wait_before_step
        wait_before_step(self.engine, self.writer.copy_pending, self.writer.join_copy,
                         self.writer.stall_s)

    # -- what the trainer reads ------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether a replay is under way (the fp32 state is not whole: do not save)."""
        return self.replay is not None

    @property
    def failed_window(self) -> Optional[str]:
        """Why the newest complete window could not be replayed (the same on every rank),
        None when recovery found none or used it: the caller must not then start from
        scratch, and the frames are set aside, not deleted (:meth:`start`)."""
        return self.recovery.failed_window

    @property
    def last_source(self) -> Optional[str]:
        """Where the last recovery's frames came from: memory, storage or both."""
        return self.recovery.last_source

    @property
    def popularity(self):
        """Tokens routed to each ``(moe layer, expert)`` so far, summed over ranks."""
        return self.index.popularity

    @property
    def write_error(self) -> Optional[str]:
        """This rank's first frame copy or write failure, if any."""
        return self.writer.write_error

    def observe_tokens(self, counts) -> None:
        """One iteration's gate counts, ``[moe_layer][expert]``, summed over ranks."""
        self.index.observe_tokens(counts)

    def drop_node_memory(self) -> None:
        """Fault injection: this node loses its frames (:meth:`NodeMemory.drop`)."""
        self.memory.drop()

    # -- the loop --------------------------------------------------------------------

    def recover(self, load_dir: str, newer_than: Optional[int] = None,
                check_client_state: Optional[Callable[[Any], None]] = None) -> Optional[Dict[str, Any]]:
        """Every rank: start a replay from the newest complete window under ``load_dir``
        (the job's ``--load``), if it ends after iteration ``newer_than`` (the checkpoint
        a normal load would use).

        ``check_client_state`` (the caller's) raises on a window's first frame's
        ``client_state`` that it could not use: checked with the frames, before the ranks'
        outcome exchange, so that a malformed one makes the window unusable on every rank
        instead of failing one rank after the replay began.

        A window that cannot be used (a frame failing its checksum or unreadable on some
        rank) is tried again from storage alone when memory supplied any of it; if that
        fails too, :attr:`failed_window` says why on every rank.

        Returns:
            The frame's objects (``client_state``, ``rng``, ``engine``) for the caller to
            position data and scheduler at the window's start, or None (nothing to
            replay: load normally).
        """
        begun = self.recovery.recover(load_dir, newer_than, check_client_state)
        if begun is None:
            return None
        self.replay, objects = begun
        self.schedule, self.base = self.replay.schedule, self.replay.start
        self._order = [name for group in self.schedule.groups for name in group]
        return objects

    def start(self, iteration: int, client_state: Dict[str, Any]) -> None:
        """Before the loop (every rank): drop frames of an earlier timeline, then begin
        the window grid at ``iteration`` (or at the first iteration with optimizer state)
        with a fixed ``--moc-window``, or start measuring for the automatic choice. After
        a recovery the replayed window's grid continues and nothing happens here."""
        if self.replay is not None:
            return
        if self._continued:  # the job's frames are this run's timeline: none dropped
            self._continued = False
            self.snapshot(iteration, client_state)
            return
        self.recovery.drop_earlier_timeline()
        if self.cfg.window:
            # Check the budget now, before training, on the schedule the grid will use.
            self._new_grid(iteration, self.cfg.window)
            self._fixed_start = True
            self.snapshot(iteration, client_state)
        else:
            self.sizer.start_probe(iteration)

    def continue_grid(self, found, popularity) -> None:
        """Every rank, in a new run of the same job after a localized recovery
        (``--moc-restart in-job``: the failed stage replayed window ``found``, the other
        stages took their state from their failed run): the grid of ``found`` goes on
        with the job's expert popularity (the same on every rank), and :meth:`start`
        takes the recovered iteration's frame again (a rank that died may not have
        written it) instead of dropping the frames."""
        self.schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
        self.base = found.start
        self._order = [name for group in self.schedule.groups for name in group]
        self.index.popularity = dict(popularity)
        self._continued = True

    def after_step(self, iteration: int) -> None:
        """After step ``iteration - 1`` (so ``iteration`` steps are done), every rank.

        During a replay: applies frame ``iteration`` (or ends the replay); else nothing.
        """
        if self.replay is None:
            return
        if iteration < self.replay.end:
            self.replay.apply(iteration, self.index, self.engine)
            return
        self.log(f"[moc] exact recovery: replay done at iteration {iteration}; the state "
                 f"is the original run's")
        self.replay = None

    def snapshot(self, iteration: int, client_state: Dict[str, Any]) -> None:
        """Take frame ``iteration`` (every rank, after evaluation, before a save).

        Returns once the copy is queued; the copy runs on the background thread and the
        next optimizer step waits for it.
        """
        if self.replay is not None:
            return  # the frames being replayed are the window; nothing new until dense
        if not self.index.optimizer_ready():
            return  # before the first step: no moments to snapshot yet (see below)
        if self._fixed_start:  # the grid starts at the first frame with moments
            self._fixed_start = False
            self.base = iteration
        if self.sizer.measuring:
            if not self.sizer.probe_done(iteration):
                return
            self._new_grid(iteration, self.sizer.choose_window(iteration))
        if self.schedule is None:
            return
        t = (iteration - self.base) % self.schedule.window
        if t == 0:
            self._maybe_reorder(iteration)
        self.writer.wait_for_previous()
        sources = self.index.frame_sources(self.schedule, t)
        record = self.record(iteration, t, client_state)
        self.writer.submit(iteration, sources, record)

    def close(self) -> None:
        """Finish the frame being written and log this rank's figures (every rank, at the
        end of training; rank 0's line is printed)."""
        self.writer.finish()
        if self.memory.node_dir:
            # The keeper copies what it was given, then deletes the node's memory: a
            # finished run leaves no shared memory behind.
            self.memory.shutdown(self.cfg.memory_dir)
        s = self.summary()
        if s["frames"]:
            self.log(f"[moc] exact recovery: {s['frames']} frames (W = {s['window']}), "
                     f"{s['frame_bytes_mean'] / 2**20:.2f} MiB per frame on rank {self.rank} "
                     f"(max {s['frame_bytes_max'] / 2**20:.2f}), copy {s['copy_s_median'] * 1e3:.1f} ms, "
                     f"training waited {s['stall_s_median'] * 1e3:.1f} ms median, "
                     f"{s['stall_s_max'] * 1e3:.1f} ms max; host memory {s['host_bytes_peak'] / 2**20:.2f} MiB")

    # -- the grid and the frame's record -----------------------------------------------

    def _new_grid(self, base: int, window: int) -> None:
        """Every rank: a window grid of ``window`` frames from ``base`` on the current
        popularity order, its memory checked (one all_reduce)."""
        ordered = self.index.ordered()
        window = min(window, len(ordered))
        self.schedule = win.build_schedule(ordered, window)
        self._order = [op.name for op in ordered]
        self.base = base
        self.sizer.check_memory(self.schedule)

    def _maybe_reorder(self, iteration: int) -> None:
        ordered = self.index.ordered()
        names = [op.name for op in ordered]
        if self._order is not None and names != self._order:
            shift = operators.popularity_shift(self._order, names)
            if operators.should_reorder(shift, self.cfg.reorder_threshold):
                self.schedule = win.build_schedule(ordered, self.schedule.window)
                self._order = names
                self.log(f"[moc] exact recovery: experts re-ordered at iteration "
                         f"{iteration} (popularity order moved {shift:.0%})")

    def record(self, iteration: int, t: int, client_state: Dict[str, Any]) -> Dict[str, Any]:
        """Every rank, when it takes frame ``iteration`` (position ``t`` of its window):
        the frame's marker (its objects' tensors under ``_object_tensors``, which the
        frame writer moves into the frame file)."""
        from deepspeed_ext.format.objects import encode
        from deepspeed_ext.state import loss_scaler_state, optimizer_scalars
        engine = self.engine
        objects = {"rng": get_rng_state(), "client_state": client_state,
                   "engine": {"global_steps": engine.global_steps,
                              "global_samples": engine.global_samples,
                              "skipped_steps": engine.skipped_steps},
                   "optimizer_scalars": optimizer_scalars(engine),
                   # fp16: the scale and its hysteresis decide which replayed steps
                   # overflow and are skipped, as in the original run
                   "loss_scaler": loss_scaler_state(engine),
                   "popularity": [[l, e, n] for (l, e), n in sorted(self.popularity.items())]}
        tree, tensors = encode(objects)
        return {"frame": iteration, "window_start": iteration - t, "position": t,
                "window": self.schedule.window,
                "groups": [list(g) for g in self.schedule.groups],
                "world_size": self.world, "layout": self.recovery.layout,
                "command": client_state.get("command"), "cwd": client_state.get("cwd"),
                "objects": tree, "_object_tensors": tensors}

    def summary(self) -> Dict[str, Any]:
        """This rank's figures: frames taken, their bytes, copy time and the training
        loop's waits (medians and maxima), and the host memory two frames in flight need."""
        def med(xs):
            return sorted(xs)[len(xs) // 2] if xs else 0.0
        w = self.writer
        return {"frames": len(w.frame_bytes), "window": self.schedule.window if self.schedule else None,
                "frame_bytes_mean": sum(w.frame_bytes) / len(w.frame_bytes) if w.frame_bytes else 0,
                "frame_bytes_max": max(w.frame_bytes, default=0),
                "copy_s_median": med(w.copy_s), "stall_s_median": med(w.stall_s),
                "stall_s_max": max(w.stall_s, default=0.0),
                "host_bytes_peak": 2 * max(w.frame_bytes, default=0)}
