"""Exact recovery's restart side: agree on the newest complete window every rank can
load, load it (memory first, then storage alone), begin its replay; and the frames of
an earlier timeline dropped or set aside."""

import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.exact.frames import (EXACT_DIR, WindowOnDisk, agree_window, frame_dir,
                                        list_frames, read_marker)
from deepspeed_ext.exact.operators import engine_counters
from deepspeed_ext.exact.replay import Replay, check_window, load_frame, restore_objects
from deepspeed_ext.policy import window as win
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import log_line

logger = logging.getLogger(__name__)


class Recovery:
    """Finds, checks and begins the replay of a window; every rank calls :meth:`recover`
    once, before the loop, and :meth:`drop_earlier_timeline` when no replay began.

    Args:
        engine: the DeepSpeed engine (restored when a replay begins).
        index: this rank's :class:`OperatorIndex`.
        memory: the node's memory level (:class:`NodeMemory`).
        rank, world: this rank and the world size.
        save_dir: the job's ``--save``.
        layout: this rank's frame layout (:func:`frame_layout`); frames of another are
            refused.
        log: rank 0's lines about the job.
    """

    def __init__(self, engine, index, memory, rank: int, world: int, save_dir: str,
                 layout: Optional[Dict[str, Any]], log: Callable[[str], None]):
        self.engine, self.index, self.memory = engine, index, memory
        self.rank, self.world, self.save_dir = rank, world, save_dir
        self.layout, self.log = layout, log
        self.last_source: Optional[str] = None
        """Where the last recovery's frames came from: memory, storage or both."""
        self.failed_window: Optional[str] = None
        """Why the newest complete window could not be replayed (the same on every rank),
        None when recovery found none or used it: the caller must not then start from
        scratch, and the frames are set aside, not deleted (:meth:`drop_earlier_timeline`)."""
        self._failed_in: Optional[str] = None  # the --load directory of failed_window

    def recover(self, load_dir: str, newer_than: Optional[int] = None,
                check_client_state: Optional[Callable[[Any], None]] = None
                ) -> Optional[Tuple[Replay, Dict[str, Any]]]:
        """Every rank: begin a replay of the newest complete window under ``load_dir``
        if it ends after iteration ``newer_than`` (see :meth:`ExactSnapshots.recover`).
        A window that cannot be used is tried again from storage alone when memory
        supplied any of it; if that fails too, :attr:`failed_window` says why.

        Returns:
            ``(replay, the first frame's objects)``, or None (nothing to replay).
        """
        self.failed_window = None
        began = time.perf_counter()
        failure = None  # (window start, every rank's errors) of the first unusable window
        for memory in (True, False):
            found, frames, sources, errors = self.try_window(load_dir, newer_than, memory,
                                                             check_client_state)
            if found is None:  # storage alone may hold no complete window at all
                break
            if not errors:
                return self.begin_replay(load_dir, found, frames, sources, began)
            failure = failure or (found.start, errors)
            self.log(f"[moc] exact recovery: cannot use the window at {found.start} "
                     f"({'; '.join(errors)})")
            # Every rank knows where every rank read from (gathered with the outcomes).
            if not memory or "memory" not in set().union(*sources):
                break
            self.log("[moc] exact recovery: trying that window again from storage alone")
        if failure is not None:
            self.failed_window = f"window at iteration {failure[0]}: {'; '.join(failure[1])}"
            self._failed_in = os.path.abspath(load_dir)
        return None

    def try_window(self, load_dir: str, newer_than: Optional[int], memory: bool,
                   check_client_state: Optional[Callable[[Any], None]] = None):
        """Every rank (two all_gather_object): agree on the newest complete window (frames
        from the node's memory first when ``memory``, else storage only) and load this
        rank's frames of it.

        Returns:
            ``(found, frames, sources, errors)``: the window (None: none to replay), this
            rank's loaded frames, every rank's set of sources and every rank's error
            (empty when every rank loaded and checked its frames).
        """
        try:
            mine = self.available_frames(load_dir, memory=memory)
        except OSError as e:  # this rank offers no frames: the ranks agree on none
            log_line(logger, f"[moc] rank {self.rank}: cannot list its frames ({e})")
            mine = {}
        gathered: List = [None] * self.world
        dist.all_gather_object(gathered, {f: rec for f, (rec, _) in mine.items()},
                               group=metadata_group())
        found = agree_window(gathered)
        if found is None or (newer_than is not None and found.start + found.window <= newer_than):
            return None, {}, [], []
        frames, error, sources = {}, None, set()
        try:
            # Each rank checks its own records: the frames hold this rank's partitions
            # and experts, which only a run of the same layout can use.
            record = mine[found.start][0]
            if record.get("layout") != self.layout:
                raise RuntimeError(f"frames were taken on another layout "
                                   f"({record.get('layout')}, this run {self.layout})")
            window = range(found.start, found.start + found.window)
            sources = {"memory" if mine[f][1] != load_dir else "storage" for f in window}
            frames = self.load_checked(found, {f: mine[f][1] for f in window},
                                       check_client_state)
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
            frames = {}
        # One decision for all ranks: a rank that alone fell back to a checkpoint would
        # wait in a collective the others never join.
        outcomes: List = [None] * self.world
        dist.all_gather_object(outcomes, (error, sorted(sources)), group=metadata_group())
        return (found, frames, [set(src) for _, src in outcomes],
                [e for e, _ in outcomes if e is not None])

    def load_checked(self, found: WindowOnDisk, roots: Dict[int, str],
                     check_client_state=None) -> Dict[int, Any]:
        """This rank alone, no collectives: load its frames of ``found`` (frame -> the
        root it is read from) and check them; raises on any problem (the caller agrees
        on the ranks' outcomes before anything collective). Returns frame -> (tensors,
        objects)."""
        frames = {f: load_frame(root, f, self.rank) for f, root in roots.items()}
        schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
        # Checked before the outcome exchange, without touching the engine (a failed
        # recovery must leave it as it was: the fallback may find no checkpoint and
        # start from scratch): a frame missing a tensor would otherwise raise on one
        # rank inside the replay's collectives.
        check_window(self.index, found.start, schedule, {f: t for f, (t, _) in frames.items()})
        for _, objects in frames.values():
            engine_counters(objects)  # a crafted frame: this window is unusable
        if check_client_state is not None:
            first = frames[found.start][1]
            check_client_state(first.get("client_state") if isinstance(first, dict) else None)
        return frames

    def begin_replay(self, load_dir: str, found: WindowOnDisk, frames, sources,
                     start: float) -> Tuple[Replay, Dict[str, Any]]:
        """Every rank, once every rank loaded its frames of ``found``: restore the first
        frame into the engine, apply it, and arm the replay (then one barrier, in
        :meth:`drop_frames_from` or here); returns the replay and the frame's objects."""
        objects = frames[found.start][1]
        self.index.popularity = {(l, e): n for l, e, n in objects.get("popularity", [])}
        replay, objects = self.start_replay(found, frames)
        if os.path.abspath(load_dir) == os.path.abspath(self.save_dir):
            self.drop_frames_from(load_dir, replay.end)  # the incomplete window after it
        else:  # replaying another run's frames (moc-ckpt densify): leave them as they are
            dist.barrier(group=metadata_group())
        self.last_source = "+".join(sorted(set().union(*sources)))
        self.log(f"[moc] exact recovery: window of {found.window} frames at iteration "
                 f"{found.start} loaded from {self.last_source} in "
                 f"{time.perf_counter() - start:.2f} s; replaying iterations "
                 f"{found.start + 1}..{replay.end} to rebuild the exact state")
        return replay, objects

    def start_replay(self, found: WindowOnDisk, frames) -> Tuple[Replay, Dict[str, Any]]:
        """The ranks replaying, together (ZeRO's all-gather of the weights), once every
        one loaded and checked its frames (:meth:`load_checked`): restore the window's
        first frame into the engine (counters, optimizer scalars, the first group's fp32
        state, every compute weight). Returns the replay that applies the later frames,
        and the first frame's objects."""
        schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
        replay = Replay(found.start, schedule, {f: t for f, (t, _) in frames.items()})
        objects = frames[found.start][1]
        restore_objects(self.engine, objects)
        self.index.forget_fragments()  # moments may have just been created
        replay.apply(found.start, self.index, self.engine)
        return replay, objects

    def available_frames(self, load_dir: str,
                         memory: bool = True) -> Dict[int, Tuple[Dict[str, Any], str]]:
        """This rank's frames: frame -> (record, root it is read from), memory first
        (``memory`` False: storage only)."""
        out: Dict[int, Tuple[Dict[str, Any], str]] = {}
        node_dir = self.memory.node_dir
        roots = [load_dir] + ([node_dir] if memory and node_dir
                              and os.path.isdir(node_dir) else [])
        for root in roots:  # later roots win: memory over storage
            for f in list_frames(root):
                record = read_marker(root, f, self.rank)
                if root == node_dir and isinstance(record, dict) \
                        and record.get("run_id") != self.memory.run_id:
                    continue  # not this job's frame: never recovered from
                if record is not None:
                    out[f] = (record, root)
        return out

    def drop_earlier_timeline(self) -> None:
        """Every rank, before the loop when no replay began (one barrier): frames of an
        earlier timeline (a run that fell back to a checkpoint, or started afresh) must
        not mix with this one's: a window assembled from both would replay to a state
        neither run had, and retention would trust their windows."""
        if self.failed_window is not None and self._failed_in == os.path.abspath(self.save_dir):
            self.set_aside_frames()  # the only copy of the newest state: kept for a human
        self.drop_frames_from(self.save_dir, 0)

    def set_aside_frames(self) -> None:
        """Rank 0: move the storage frames of a window recovery could not use out of the
        way (hidden ``.moc-set-aside.exact.<ns>`` beside the checkpoints, listed by
        ``moc-ckpt inspect``, never read or deleted by MoC), so that the run that fell
        back to a checkpoint neither mixes its frames with them nor deletes them."""
        from deepspeed_ext.store.prepare import SET_ASIDE_PREFIX
        if self.rank != 0:
            return
        root = os.path.join(self.save_dir, EXACT_DIR)
        aside = os.path.join(self.save_dir, f"{SET_ASIDE_PREFIX}{EXACT_DIR}.{time.time_ns()}")
        try:
            os.rename(root, aside)
        except FileNotFoundError:
            return
        except OSError as e:  # then drop_frames_from deletes them, as before
            self.log(f"[moc] WARNING: cannot set aside the frames in {root} ({e})")
            return
        self.log(f"[moc] WARNING: the frames of the unusable {self.failed_window.split(':')[0]} "
                 f"were set aside as {aside}")

    def drop_frames_from(self, load_dir: str, first: int) -> None:
        """Every rank together: delete frames ``>= first`` (storage: rank 0; memory:
        each rank its own), then a barrier so no rank writes a new one before."""
        if self.rank == 0:
            for f in list_frames(load_dir):
                if f >= first:
                    shutil.rmtree(frame_dir(load_dir, f), ignore_errors=True)
        node_dir = self.memory.node_dir
        if node_dir and os.path.isdir(node_dir):
            for f in list_frames(node_dir):
                if f >= first:
                    self.memory.remove_own_frame(f)
        dist.barrier(group=metadata_group())
