"""Exact recovery, runtime half: sparse per-iteration frames and sparse-to-dense replay.

The plan (which operators a frame holds active or frozen, how a window is replayed) is
:mod:`deepspeed_ext.policy.window`; this module moves the bytes. A *frame* ``f`` is the state
at the start of iteration ``f`` (after ``f`` optimizer steps). In a window of ``W``
frames starting at ``s``, frame ``s+t`` holds, for this rank:

* group ``t``'s fp32 master weights and optimizer moments (this rank's ZeRO partitions);
* the compute weights (bf16/fp16/fp32 module parameters) of groups ``t+1 .. W-1``;
* this rank's RNG state, the optimizer's step counters, the engine's counters and the
  caller's client state (LR scheduler, consumed samples).

Frames go to ``<save>/exact/frame<f>/rank<r>.safetensors``: the training loop copies
them into host memory on a background thread (it waits only before the next optimizer
step, if the copy is not done by then), the same thread writes the file (temp file,
fsync, rename) and then ``rank<r>.json`` with its checksum. A frame is complete when
every rank's ``.json`` exists; no collective is involved, so a slow or failed writer
only makes its window incomplete (recovery then uses an older one).

Recovery (every rank, :meth:`ExactSnapshots.recover`) takes the newest window whose
``W`` frames are complete, loads them (checksums verified), applies frame ``s``, and
then, as training re-runs iterations ``s .. s+W-1`` on the same data, applies frame
``s+j`` after step ``s+j-1`` (:meth:`ExactSnapshots.after_step`): group ``j`` becomes
exact, the groups after it get the compute weights the original run used. After step
``s+W-1`` every tensor holds the original run's bytes. While that replay runs, the
fp32 state of the still-frozen groups is not the original's: :attr:`replaying` tells
the caller not to save a checkpoint then.

Call order, every rank, every iteration (the trainer, ``megatron/training/training.py``)::

    exact = ExactSnapshots(engine, save_dir, ExactConfig(window=W))
    resume = exact.recover(load_dir, newer_than=checkpoint_iteration)  # None: load normally
    exact.start(iteration, client_state)        # before the loop: frame `iteration`
    loop:
        train_step(...)                         # exact waits for a frame copy before step
        exact.observe_tokens(counts)            # gate counts, summed over ranks
        exact.after_step(iteration)             # replay: next frame applied
        evaluate(...)                           # if due
        exact.snapshot(iteration, client_state)
        if not exact.replaying: save_checkpoint(...)
    exact.close()
"""

import json
import logging
import os
import re
import shutil
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.format.storage import ensure_dir
from deepspeed_ext.jobs import FrameJob
from deepspeed_ext.policy import operators
from deepspeed_ext.policy import window as win
from deepspeed_ext.private_dir import make_private_dir
from deepspeed_ext.runtime.groups import init_metadata_group, metadata_group
from deepspeed_ext.runtime.log import log_line, rank_zero_lines

logger = logging.getLogger(__name__)

EXACT_DIR = "exact"
FRAME_RE = re.compile(r"^frame(\d{8,})$")
LP_PREFIX = "lp|"
"""Key prefix of a frozen compute weight in a frame file (then the global parameter name)."""
MOMENTS = ("exp_avg", "exp_avg_sq")
PROBE_ITERATIONS = 2
UNCOPIED_WINDOWS = 4
"""Windows back a memory frame the keeper has not yet copied to storage is kept for it."""
"""Iterations timed (after a first, untimed one) before the automatic window is chosen."""
BYTES_PER_ACTIVE_ELEMENT = 12
"""fp32 master weight plus Adam's two fp32 moments."""


@dataclass
class ExactConfig:
    """Exact recovery (``--moc-mode exact``)."""

    window: int = 0
    """Iterations per window, ``W``; 0: chosen from the first measured iteration
    (``--moc-window``)."""
    reorder_threshold: float = 0.25
    """Re-order the experts (least popular first) at a window boundary when the
    popularity order moved by more than this fraction of pairs."""
    write_frames: bool = True
    """Persist frames to storage (tests turn it off to measure the copy alone)."""
    memory_dir: str = ""
    """The job's shared-memory directory (one ``node<N>/`` per node, each with a keeper
    that persists frames to storage); empty: frames go straight to storage."""
    ranks_per_node: int = 0
    """Ranks per node for the memory level; 0: the launcher's count
    (:mod:`deepspeed_ext.node_layout`)."""
    keeper_idle_timeout_s: float = 600.0
    """A keeper exits when none of its training processes has been alive this long."""
    expected_mtbf_s: float = 0.0
    """Expected seconds between failures; when set, the automatic window weighs a frame's
    cost against the replay a failure costs (``--moc-expected-mtbf``); 0: unknown."""
    hide_fraction: float = 0.0
    """The automatic window's budget: a frame's copy and writes may take this fraction
    of an iteration; 0: 1 on GPUs (the host works while the GPU computes), 0.1 on CPU
    (the frame's work takes the training's own cores)."""
    host_memory_gb: float = 0.0
    """Budget for what one rank holds in host memory: a whole window during a replay;
    0: unchecked (``--moc-host-memory-gb``)."""

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"--moc-window must be an int >= 0 (0: automatic), got {self.window!r}")
        if self.expected_mtbf_s < 0:
            raise ValueError(f"--moc-expected-mtbf must be >= 0 (0: unknown), got {self.expected_mtbf_s}")
        if not 0.0 <= self.hide_fraction <= 1.0:
            raise ValueError(f"hide_fraction must be in [0, 1] (0: automatic), got {self.hide_fraction}")
        if not 0.0 <= self.reorder_threshold <= 1.0:
            raise ValueError(f"reorder_threshold must be in [0, 1], got {self.reorder_threshold}")


ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
"""The engine attributes a frame restores (what :meth:`ExactSnapshots._record` saves)."""


def engine_counters(objects: Any) -> Dict[str, int]:
    """The engine counters of a frame's objects, checked: only :data:`ENGINE_COUNTERS`,
    as non-negative ints. Every key of a frame's ``engine`` record used to be set on the
    engine, so a crafted frame could replace its optimizer (or any attribute) or make
    ``global_steps`` a string.

    Raises:
        CheckpointError: anything else (the window is unusable, as a damaged one is).
    """
    from deepspeed_ext.format.errors import CheckpointError
    counters = objects.get("engine") if isinstance(objects, dict) else None
    if not isinstance(counters, dict):
        raise CheckpointError(f"frame objects: engine counters are {type(counters).__name__}, "
                              f"not an object")
    for key, value in counters.items():
        if key not in ENGINE_COUNTERS:
            raise CheckpointError(f"frame objects: engine field {key!r} is not a counter a "
                                  f"frame restores")
        if type(value) is not int or value < 0:
            raise CheckpointError(f"frame objects: engine counter {key} is {value!r}, not a "
                                  f"non-negative int")
    return counters


# ----------------------------------------------------------------------- operators

def operator_of(name: str, expert: Optional[Tuple[int, int]]) -> str:
    """The operator a global parameter name belongs to.

    Experts are ``expert/<moe layer>/<expert>``; a gate is its module path ending in
    ``.gate``; a parameter under ``<container>.<index>.`` (a transformer layer) belongs to
    that layer's dense block; anything else to its top-level module.
    """
    if expert is not None:
        return f"expert/{expert[0]}/{expert[1]}"
    if ".gate." in name:
        return name[:name.index(".gate.") + len(".gate")]
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def build_operators(engine, naming) -> List[operators.Operator]:
    """Every operator of the model with its global sizes, identical on every rank.

    Expert sizes come from this rank's experts of the same MoE layer (a layer's experts
    are alike), so every rank lists all global experts without communicating.
    """
    sizes: Dict[str, List[int]] = {}
    kinds: Dict[str, Tuple[str, Optional[Tuple[int, int]]]] = {}
    expert_sizes: Dict[int, List[int]] = {}
    for local_name, param in engine.module.named_parameters():
        expert = naming.expert_of(local_name)
        numel, lp = param.numel(), param.numel() * param.element_size()
        if expert is not None:
            if expert[1] == naming.first_expert[expert[0]]:  # one local expert per layer
                acc = expert_sizes.setdefault(expert[0], [0, 0])
                acc[0] += numel * BYTES_PER_ACTIVE_ELEMENT
                acc[1] += lp
            continue
        op = operator_of(naming.global_name(local_name), None)
        acc = sizes.setdefault(op, [0, 0])
        acc[0] += numel * BYTES_PER_ACTIVE_ELEMENT
        acc[1] += lp
        kinds[op] = ("gate" if op.endswith(".gate") else "dense", None)
    ops = [operators.Operator(op, kinds[op][0], None, a, f) for op, (a, f) in sizes.items()]
    for layer, (a, f) in sorted(expert_sizes.items()):
        for e in range(naming.num_experts[layer]):
            ops.append(operators.Operator(f"expert/{layer}/{e}", "expert", (layer, e), a, f))
    return ops


# --------------------------------------------------------------------------- frames

def frame_dir(save_dir: str, frame: int) -> str:
    return os.path.join(save_dir, EXACT_DIR, f"frame{frame:08d}")


def _marker(save_dir: str, frame: int, rank: int) -> str:
    return os.path.join(frame_dir(save_dir, frame), f"rank{rank:05d}.json")


def _data(save_dir: str, frame: int, rank: int) -> str:
    return os.path.join(frame_dir(save_dir, frame), f"rank{rank:05d}.safetensors")


def frame_job(node_dir: str, save_dir: str, frame: int, rank: int, run_id: Optional[str],
              job_id: Optional[str] = None) -> FrameJob:
    """The keeper's job copying frame ``frame`` of ``rank`` from the node's memory
    directory ``node_dir`` to ``save_dir`` (its ``id``: ``job_id``)."""
    return FrameJob(data=_data(node_dir, frame, rank), marker=_marker(node_dir, frame, rank),
                    dst_data=_data(save_dir, frame, rank),
                    dst_marker=_marker(save_dir, frame, rank),
                    save_dir=save_dir, run_id=run_id, id=job_id)


def list_frames(save_dir: str) -> List[int]:
    """Frame numbers present under ``<save_dir>/exact`` (complete or not), ascending."""
    root = os.path.join(save_dir, EXACT_DIR)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(FRAME_RE.match, names) if m)


MARKER_MAX_BYTES = 64 << 20
"""Longest frame marker read (its objects: RNG state, counters, the schedule's groups)."""


def read_marker(save_dir: str, frame: int, rank: int) -> Optional[Dict[str, Any]]:
    """A rank's frame record, or None if it is missing, unreadable, too long, nested too
    deeply or not a JSON object (the frame counts as incomplete)."""
    path = _marker(save_dir, frame, rank)
    try:
        if not os.path.isfile(path):  # a FIFO or device planted there must not block
            return None
        with open(path, "rb") as f:
            data = f.read(MARKER_MAX_BYTES + 1)
        if len(data) > MARKER_MAX_BYTES:
            return None
        record = json.loads(data)
    except (OSError, ValueError, RecursionError, MemoryError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class WindowOnDisk:
    """A complete window found by :func:`find_window`."""

    start: int
    window: int
    groups: List[List[str]]
    world_size: int


def find_window(save_dir: str, world_size: int) -> Optional[WindowOnDisk]:
    """The newest window under ``save_dir`` whose ``W`` frames every rank completed."""
    per_rank = [{f: m for f in list_frames(save_dir)
                 for m in [read_marker(save_dir, f, r)] if m is not None}
                for r in range(world_size)]
    return agree_window(per_rank)


def agree_window(per_rank: List[Dict[int, Dict[str, Any]]]) -> Optional[WindowOnDisk]:
    """The newest window whose ``W`` frames every rank holds (pure; every rank computes
    the same answer from the same gathered records).

    Args:
        per_rank: for each rank, frame -> its record (from memory or storage).

    Frames of one window agree on ``window_start``, ``window`` and the schedule (each
    record repeats them); a frame whose records disagree does not count.
    """
    world_size = len(per_rank)
    records: Dict[int, Dict[str, Any]] = {}
    for f in sorted(set().union(*per_rank)) if per_rank else []:
        marks = [mine.get(f) for mine in per_rank]
        if all(m is not None and m.get("world_size") == world_size for m in marks):
            first = marks[0]
            if all((m["window_start"], m["window"], m["groups"]) ==
                   (first["window_start"], first["window"], first["groups"]) for m in marks):
                records[f] = first
    for f in sorted(records, reverse=True):
        rec = records[f]
        s, w = rec["window_start"], rec["window"]
        if f != s:
            continue
        if all(s + t in records and (records[s + t]["window_start"], records[s + t]["groups"])
               == (s, rec["groups"]) for t in range(w)):
            return WindowOnDisk(start=s, window=w, groups=rec["groups"], world_size=world_size)
    return None


# --------------------------------------------------------------------------- runtime

class _Replay:
    """The window being replayed: its frames' tensors, in host memory."""

    def __init__(self, start: int, schedule: win.Schedule, frames: Dict[int, Dict[str, torch.Tensor]]):
        self.start = start
        self.schedule = schedule
        self.frames = frames

    @property
    def end(self) -> int:
        """The iteration at whose start the state is dense again."""
        return self.start + self.schedule.window


class ExactSnapshots:
    """Sparse frames every iteration, and recovery by sparse-to-dense replay.

    Every rank builds one after ``deepspeed.initialize`` (and after MoC's patch, if any)
    and calls its methods at the same points of every iteration (module docstring).

    Args:
        engine: the DeepSpeed engine (ZeRO stage 0-2, ``deepspeed.moe`` layers allowed).
        save_dir: the job's ``--save``; frames go under ``<save_dir>/exact``.
        config: :class:`ExactConfig`.
        log: where rank 0's lines about the job go (each already says ``[moc] ...``);
            None: the module's logger (``deepspeed_ext.exact``), from rank 0.
    """

    def __init__(self, engine, save_dir: str, config: ExactConfig, log=None):
        from deepspeed_ext.state import expert_naming
        self.engine, self.save_dir, self.cfg = engine, save_dir, config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        init_metadata_group()  # every rank, here: the group of all of this class's collectives
        self._log = log if log is not None else rank_zero_lines(logger, prefix="")
        self.naming = expert_naming(engine.module)
        self.operators = build_operators(engine, self.naming)
        self._by_name = operators.index_operators(self.operators)
        self.schedule: Optional[win.Schedule] = None
        self.base: Optional[int] = None
        """First frame of the current window grid; windows start at base + k*W."""
        self.replay: Optional[_Replay] = None
        self.popularity: Dict[Tuple[int, int], int] = {}
        self._order: Optional[List[str]] = None
        self._probe: Optional[Tuple[int, float]] = None
        self._probe_warm = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-exact")
        self._side_stream = None
        """CUDA: the stream frame copies run on (:meth:`_copy_from_gpu`), made on first use."""
        self._copy: Optional[Future] = None
        self._write: Optional[Future] = None
        self.write_error: Optional[str] = None
        self.last_source: Optional[str] = None
        """Where the last recovery's frames came from: memory, storage or both."""
        self.failed_window: Optional[str] = None
        """Why the newest complete window could not be replayed (the same on every rank),
        None when recovery found none or used it: the caller must not then start from
        scratch, and the frames are set aside, not deleted (:meth:`start`)."""
        self._failed_in: Optional[str] = None  # the --load directory of failed_window
        self._uncopied_warned = False
        self.stall_s: List[float] = []
        self.frame_bytes: List[int] = []
        self.copy_s: List[float] = []
        self._fragments = None
        self._fragments_have_moments = False
        self._fixed_start = False
        self._op_of_param: Dict[str, str] = {}
        for local_name, _ in engine.module.named_parameters():
            self._op_of_param[local_name] = operator_of(self.naming.global_name(local_name),
                                                        self.naming.expert_of(local_name))
        self.node_dir: Optional[str] = None
        self.keeper_error: Optional[str] = None
        self.run_id: Optional[str] = None
        """This job's identity (:mod:`deepspeed_ext.job_identity`), with a memory level."""
        if config.memory_dir:
            self._start_keeper()
        self._wrap_step()

    def _start_keeper(self) -> None:
        """Every rank: attach to (or start) this node's keeper. Without one, frames go
        straight to storage, which the log says once; but a node directory that is not
        private or serves another job is refused on every rank (one collective), before
        training, naming ``--moc-shm-dir``."""
        from deepspeed_ext import keeper
        from deepspeed_ext.job_identity import ForeignJobError, agree_run_id
        from deepspeed_ext.private_dir import UnsafeDirectoryError
        self.run_id = agree_run_id(self.save_dir, self.cfg.memory_dir, log=self._log)
        from deepspeed_ext.node_layout import ranks_per_node
        per_node = ranks_per_node(self.cfg.ranks_per_node, self.world)
        self.node = self.rank // per_node
        self.first_of_node = self.rank % per_node == 0
        self.node_dir = os.path.join(self.cfg.memory_dir, f"node{self.node}")
        refused = None
        try:
            keeper.ensure_keeper(self.node_dir, self.cfg.keeper_idle_timeout_s,
                                 run_id=self.run_id, save_dir=self.save_dir)
        except (UnsafeDirectoryError, ForeignJobError) as e:
            refused = f"rank {self.rank}: {e}"
        except Exception as e:
            self._keeper_lost(e)
        problems: List = [None] * self.world
        dist.all_gather_object(problems, refused, group=metadata_group())
        problems = [p for p in problems if p]
        if problems:
            raise RuntimeError("exact recovery's shared memory: " + "; ".join(problems))

    @staticmethod
    def _warn(message: str) -> None:
        """A line about this rank, logged by every rank (``log`` may be rank 0's only)."""
        log_line(logger, message)

    def _keeper_lost(self, error: Exception) -> None:
        if self.keeper_error is None:
            self._warn(f"[moc] rank {self.rank}: WARNING: no keeper for {self.node_dir} "
                      f"({type(error).__name__}: {error}); exact-recovery frames go straight "
                      f"to storage")
        self.keeper_error = f"{type(error).__name__}: {error}"

    def drop_node_memory(self) -> None:
        """Fault injection: this node loses its frames, as when the machine dies. Kills
        the node's keeper and deletes its shared memory; any rank of the node may call
        it, the node's other ranks are expected to die with it."""
        import signal
        from deepspeed_ext import keeper
        if not self.node_dir:
            return
        try:
            os.kill(keeper.request(self.node_dir, {"op": "ping"})["pid"], signal.SIGKILL)
        except Exception as e:  # already gone: its memory is what matters
            self._log(f"[moc] node {self.node}: keeper not reachable ({e})")
        shutil.rmtree(self.node_dir, ignore_errors=True)

    # -- bookkeeping -------------------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether a replay is under way (the fp32 state is not whole: do not save)."""
        return self.replay is not None

    def observe_tokens(self, counts) -> None:
        """One iteration's gate counts, ``[moe_layer][expert]``, summed over ranks."""
        for layer, row in enumerate(counts):
            for e, n in enumerate(row):
                self.popularity[(layer, e)] = self.popularity.get((layer, e), 0) + int(n)

    def _fragments_by_op(self):
        from deepspeed_ext.state import describe_local_state
        if self._fragments is None:
            frags = describe_local_state(self.engine, self.naming)
            self._fragments_have_moments = any(f.kind != "fp32" for f in frags)
            self._fragments = {}
            for frag in frags:
                self._fragments.setdefault(operator_of(frag.name, frag.expert), []).append(frag)
        return self._fragments

    def _params_by_op(self) -> Dict[str, List[Tuple[str, torch.nn.Parameter]]]:
        out: Dict[str, List] = {}
        for local_name, param in self.engine.module.named_parameters():
            out.setdefault(self._op_of_param[local_name], []).append(
                (self.naming.global_name(local_name), param))
        return out

    # -- the stall point ---------------------------------------------------------------

    def _wrap_step(self) -> None:
        from deepspeed_ext.engine.hostcopy import wait_before_step
        wait_before_step(self.engine, lambda: self._copy is not None, self._join_copy,
                         self.stall_s)

    def _join_copy(self) -> None:
        """Wait for the frame copy. Its failure (host memory exhausted, say) is recorded,
        never raised: this runs inside ``engine.step`` on this rank alone, and raising
        would leave the other ranks in the step's collectives. The frame's writer sees
        the same error and leaves the window incomplete (recovery uses an older one)."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        try:
            copy.result()
        except Exception as e:
            if self.write_error is None:
                self._warn(f"[moc] rank {self.rank}: WARNING: an exact-recovery frame copy "
                          f"failed ({type(e).__name__}: {e}); its window stays incomplete")
            self.write_error = f"{type(e).__name__}: {e}"

    # -- window choice -----------------------------------------------------------------

    def start(self, iteration: int, client_state: Dict[str, Any]) -> None:
        """Before the loop (every rank): drop frames of an earlier timeline, then begin
        the window grid at ``iteration`` (or at the first iteration with optimizer state)
        with a fixed ``--moc-window``, or start measuring for the automatic choice. After
        a recovery the replayed window's grid continues and nothing happens here."""
        if self.replay is not None:
            return
        # Frames of an earlier timeline (a run that fell back to a checkpoint, or started
        # afresh) must not mix with this one's: a window assembled from both would replay
        # to a state neither run had, and retention would trust their windows.
        if self.failed_window is not None and self._failed_in == os.path.abspath(self.save_dir):
            self._set_aside_frames()  # the only copy of the newest state: kept for a human
        self._drop_frames_from(self.save_dir, 0)
        if self.cfg.window:
            # Check the budget now, before training, on the schedule the grid will use.
            self._new_grid(iteration, self.cfg.window)
            self._fixed_start = True
            self.snapshot(iteration, client_state)
        else:
            self._probe = (iteration, time.perf_counter())

    def _new_grid(self, base: int, window: int) -> None:
        ordered = operators.order_operators(self.operators, self.popularity)
        window = min(window, len(ordered))
        self.schedule = win.build_schedule(ordered, window)
        self._order = [op.name for op in ordered]
        self.base = base
        self._check_memory()

    def _check_memory(self) -> None:
        """Every rank, when a grid starts: report the largest frame and a window's bytes
        on the busiest rank (a replay holds a whole window), and refuse a smaller
        ``--moc-host-memory-gb`` on every rank alike (one all_reduce)."""
        by_name = {op.name: op for op in self._local_operators()}
        figures = torch.tensor([win.max_bytes_per_iteration(self.schedule, by_name),
                                win.window_host_bytes(self.schedule, by_name)],
                               dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=metadata_group())
        frame, window = (int(x) for x in figures.tolist())
        self.window_bytes = window
        self._log(f"[moc] exact recovery: W = {self.schedule.window}; per rank at most "
                  f"{frame / 2**20:.2f} MiB per frame, {window / 2**20:.2f} MiB per window "
                  f"(held in host memory while a replay runs)")
        budget = self.cfg.host_memory_gb * 2**30
        if budget and window > budget:
            raise MemoryError(f"--moc-host-memory-gb {self.cfg.host_memory_gb:g} is below the "
                              f"{window / 2**30:.3f} GiB one rank needs to replay a window of "
                              f"{self.schedule.window} frames; raise it or lower --moc-window")

    def _choose_window(self, iteration: int) -> None:
        """After :data:`PROBE_ITERATIONS` timed iterations: W from their time and what a frame's bytes
        cost on their way (copy, write to memory, the keeper's copy to storage), the
        same on every rank (the slowest rank's figures)."""
        first, began = self._probe
        iter_s = (time.perf_counter() - began) / max(1, iteration - first)
        try:
            seconds_per_byte, failed = self._measure_frame_cost(), None
        except Exception as e:  # the probe frame could not be written (its memory full)
            seconds_per_byte, failed = None, f"{type(e).__name__}: {e}"
            self._warn(f"[moc] rank {self.rank}: ERROR: cannot write a probe frame ({failed})")
        # The background work hides behind compute only where it runs elsewhere (a GPU
        # computes while the host copies); on CPU it takes the training's own cores,
        # so a frame may cost at most a tenth of an iteration.
        fraction = self.cfg.hide_fraction or (1.0 if self._on_gpu() else 0.1)
        budget_s = iter_s * fraction
        # The schedule must be the same everywhere, but what a rank copies is its own
        # share: choose on this rank's bytes, then take the largest W any rank needs.
        mtbf = self.cfg.expected_mtbf_s
        mine = [1.0, iter_s, 0.0, 1.0]  # a failed probe: only its flag counts
        if failed is None:
            ops, bandwidth = self._local_operators(), 1.0 / seconds_per_byte
            if mtbf:
                hidden_s = iter_s if self._on_gpu() else 0.0
                choice = win.choose_window_for_failures(ops, bandwidth, iter_s, hidden_s, mtbf)
            else:
                choice = win.choose_window(ops, bandwidth, budget_s)
            mine = [choice.window, iter_s, choice.snapshot_s, 0.0]
        figures = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=metadata_group())
        if figures[3]:  # on every rank: one rank raising alone would hang the others
            raise RuntimeError("exact recovery: a rank could not write a probe frame where its "
                               "frames go (its node's --moc-shm-dir memory, or --save without "
                               "a keeper); see that rank's ERROR line")
        window, iter_s, snapshot_s = int(figures[0]), float(figures[1]), float(figures[2])
        fits = snapshot_s <= iter_s * fraction
        why = (f"least time lost to frames and to replays at a failure every {mtbf:g} s"
               if mtbf else f"budget {fraction:g} of an iteration"
               + ("" if fits else ": no window fits, expect a slowdown"))
        self._log(f"[moc] exact recovery: window W = {window} (iteration {iter_s * 1e3:.0f} ms, "
                  f"largest frame {snapshot_s * 1e3:.1f} ms to copy and write; {why})")
        self._probe = None
        self._new_grid(iteration, window)

    def _on_gpu(self) -> bool:
        return any(p.device.type == "cuda" for p in self.engine.module.parameters())

    def _measure_frame_cost(self) -> float:
        """Seconds per byte of this rank's state: a copy into host memory, plus writing
        it where frames go (memory), plus the keeper's copy to storage when there is one."""
        from deepspeed_ext.format.storage import write_fragment_file
        frags = [f for fs in self._fragments_by_op().values() for f in fs]
        nbytes = max(1, sum(f.tensor.numel() * f.tensor.element_size() for f in frags))
        if self._on_gpu():
            # The step's kernels may still be queued: the first copy would wait for them,
            # and the copy would look slower than it is.
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            if self._on_gpu():
                # As real frames are copied (_copy_from_gpu): into page-locked memory. A
                # pageable .to("cpu") is several times slower, and the window was sized
                # for that bandwidth.
                copies = {}
                for f in frags:
                    host = torch.empty(f.tensor.shape, dtype=f.tensor.dtype, pin_memory=True)
                    copies[f.key] = host.copy_(f.tensor.detach(), non_blocking=True)
                torch.cuda.synchronize()
            else:
                copies = {f.key: f.tensor.detach().to("cpu", copy=True) for f in frags}
        copy_s = time.perf_counter() - t0
        root = self.node_dir if self.node_dir and not self.keeper_error else self.save_dir
        probe = os.path.join(root, EXACT_DIR, f"probe{self.rank:05d}.safetensors")
        self._make_frame_parent(os.path.dirname(probe), in_memory=root != self.save_dir)
        t0 = time.perf_counter()
        try:
            write_fragment_file(probe, copies, make_parent=False)
        finally:
            write_s = time.perf_counter() - t0
            try:
                os.remove(probe)
            except FileNotFoundError:
                pass
        writes = 2 if root != self.save_dir else 1  # the keeper writes it once more
        return max(copy_s + writes * write_s, 1e-9) / nbytes

    def _local_operators(self) -> List[operators.Operator]:
        """The operators in snapshot order, sized by what THIS rank copies of each."""
        frags, params = self._fragments_by_op(), self._params_by_op()
        # Before the first step the moments do not exist yet: count them as the fp32
        # weights' size each (Adam's two).
        scale = 1 if self._fragments_have_moments else 1 + len(MOMENTS)
        out = []
        for op in operators.order_operators(self.operators, self.popularity):
            active = scale * sum(f.tensor.numel() * f.tensor.element_size()
                                 for f in frags.get(op.name, []))
            frozen = sum(p.numel() * p.element_size() for _, p in params.get(op.name, []))
            out.append(operators.Operator(op.name, op.kind, op.expert, active, frozen))
        return out

    # -- snapshots -----------------------------------------------------------------------

    def after_step(self, iteration: int) -> None:
        """After step ``iteration - 1`` (so ``iteration`` steps are done), every rank.

        During a replay: applies frame ``iteration`` (or ends the replay); else nothing.
        """
        if self.replay is None:
            return
        if iteration < self.replay.end:
            self._apply_frame(iteration)
            return
        self._log(f"[moc] exact recovery: replay done at iteration {iteration}; the state "
                  f"is the original run's")
        self.replay = None

    def snapshot(self, iteration: int, client_state: Dict[str, Any]) -> None:
        """Take frame ``iteration`` (every rank, after evaluation, before a save).

        Returns once the copy is queued; the copy runs on the background thread and the
        next optimizer step waits for it.
        """
        if self.replay is not None:
            return  # the frames being replayed are the window; nothing new until dense
        if not self._optimizer_ready():
            return  # before the first step: no moments to snapshot yet (see below)
        if self._fixed_start:  # the grid starts at the first frame with moments
            self._fixed_start = False
            self.base = iteration
        if self._probe is not None:
            first, _ = self._probe
            if not self._probe_warm:
                # The first iteration warms up (allocations, first collectives) and would
                # make the iteration look slower than it is: time the next ones.
                self._probe, self._probe_warm = (iteration, time.perf_counter()), True
                return
            if iteration < first + PROBE_ITERATIONS:
                return
            self._choose_window(iteration)
        if self.schedule is None:
            return
        t = (iteration - self.base) % self.schedule.window
        if t == 0:
            self._maybe_reorder(iteration)
        self._join_copy()
        if self._write is not None and not self._write.done():
            # Never more than one frame behind storage: host memory stays bounded.
            start = time.perf_counter()
            self._write.result()
            self.stall_s.append(time.perf_counter() - start)
        sources = self._frame_sources(t)
        record = self._record(iteration, t, client_state)
        self._copy = copy = self._pool.submit(self._copy_frame, sources, _compute_done(sources))
        if self.cfg.write_frames:
            self._write = self._pool.submit(self._write_frame, iteration, record, copy)

    def _optimizer_ready(self) -> bool:
        """Whether the optimizer's moments exist. Torch creates them at the first step; a
        frame taken before would lack them, and a replay from it could not recreate the
        lazily-initialised state bit for bit (the step counters would differ)."""
        from deepspeed_ext.state import base_optimizer
        opt = base_optimizer(self.engine)
        ready = any(opt.state.get(p) for g in opt.param_groups for p in g["params"])
        if ready and self._fragments is not None and not self._fragments_have_moments:
            self._fragments = None  # built before the moments existed
        return ready

    def _maybe_reorder(self, iteration: int) -> None:
        ordered = operators.order_operators(self.operators, self.popularity)
        names = [op.name for op in ordered]
        if self._order is not None and names != self._order:
            shift = operators.popularity_shift(self._order, names)
            if operators.should_reorder(shift, self.cfg.reorder_threshold):
                self.schedule = win.build_schedule(ordered, self.schedule.window)
                self._order = names
                self._log(f"[moc] exact recovery: experts re-ordered at iteration "
                          f"{iteration} (popularity order moved {shift:.0%})")

    def _frame_sources(self, t: int) -> Dict[str, torch.Tensor]:
        """Live tensors of frame position ``t``: group t active, later groups frozen."""
        snap = win.snapshot_at(self.schedule, t)
        frags, params = self._fragments_by_op(), self._params_by_op()
        out: Dict[str, torch.Tensor] = {}
        for op in snap.active:
            for frag in frags.get(op, []):
                out[frag.key] = frag.tensor
        for op in snap.frozen:
            for name, param in params.get(op, []):
                out[LP_PREFIX + name] = param.data.view(-1)
        return out

    def _record(self, iteration: int, t: int, client_state: Dict[str, Any]) -> Dict[str, Any]:
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
        layout = self._layout()
        return {"frame": iteration, "window_start": iteration - t, "position": t,
                "window": self.schedule.window,
                "groups": [list(g) for g in self.schedule.groups],
                "world_size": self.world, "layout": layout,
                "command": client_state.get("command"), "cwd": client_state.get("cwd"),
                "objects": tree, "_object_tensors": tensors}

    def _layout(self) -> Dict[str, Any]:
        """What a frame of this rank depends on: the world and this rank's experts."""
        return {"world_size": self.world, "rank": self.rank,
                "num_moe_layers": len(self.naming.moe_prefixes),
                "first_expert": list(self.naming.first_expert),
                "num_experts": list(self.naming.num_experts)}

    def _copy_frame(self, sources: Dict[str, torch.Tensor],
                    ready: Optional[Tuple[Any, torch.device]] = None) -> Dict[str, torch.Tensor]:
        """Background thread: the frame's bytes into fresh host memory (``copy_`` and
        ``clone`` release the GIL, so this overlaps the next forward/backward).

        Args:
            ready: CUDA: the event that ends the compute stream's work up to the frame
                (see :func:`_compute_done`), and its device; None elsewhere.
        """
        start = time.perf_counter()
        with torch.no_grad():
            if ready is not None:
                copies = self._copy_from_gpu(sources, *ready)
            else:
                copies = {k: v.detach().to("cpu", copy=True) if v.device.type != "cpu"
                          else v.detach().clone() for k, v in sources.items()}
        self.copy_s.append(time.perf_counter() - start)
        self.frame_bytes.append(sum(v.numel() * v.element_size() for v in copies.values()))
        return copies

    def _copy_from_gpu(self, sources: Dict[str, torch.Tensor], ready,
                       device: torch.device) -> Dict[str, torch.Tensor]:
        """Background thread, CUDA: the copies run on a side stream into page-locked host
        memory. A plain ``.to("cpu")`` here would run on the default stream, which the
        training's kernels use too, so the next forward/backward would wait behind it
        (and a pageable copy blocks besides); the side stream first waits for ``ready``,
        so the frame still sees the optimizer step before it."""
        with torch.cuda.device(device):
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=device)
            stream = self._side_stream
            stream.wait_event(ready)
            copies: Dict[str, torch.Tensor] = {}
            with torch.cuda.stream(stream):
                for key, tensor in sources.items():
                    tensor = tensor.detach()
                    if tensor.device.type == "cuda":
                        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                        host.copy_(tensor, non_blocking=True)
                        copies[key] = host
                    else:
                        copies[key] = tensor.clone()
                done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps
                done.record(stream)
            done.synchronize()
        return copies

    def _write_frame(self, frame: int, record: Dict[str, Any], copy: Future) -> None:
        """Background thread, after the copy: the frame file, then its marker."""
        from deepspeed_ext.format.storage import atomic_write_json, write_fragment_file
        try:
            copies = dict(copy.result())
            copies.update(record.pop("_object_tensors"))
            # Memory first, when the node has a keeper: it survives this process and
            # the keeper copies it to storage; else storage directly.
            root = self.save_dir if self.keeper_error or not self.node_dir else self.node_dir
            in_memory = root != self.save_dir
            self._make_frame_parent(frame_dir(root, frame), in_memory)
            rec = write_fragment_file(_data(root, frame, self.rank), copies, make_parent=False)
            record.update(sha256=rec.sha256, nbytes=rec.nbytes, run_id=self.run_id)
            # The marker is written last: a frame counts only once every rank's exists.
            atomic_write_json(_marker(root, frame, self.rank), record, make_parent=False)
            if in_memory:
                self._hand_to_keeper(frame)
                self._retire_memory(record["window_start"], record["window"])
            if self.rank == 0 and record["position"] == 0:
                self._retire_old_windows()
        except Exception as e:  # this window stays incomplete; recovery uses an older one
            traceback.print_exc()
            if self.write_error is None:
                self._warn(f"[moc] rank {self.rank}: WARNING: exact-recovery frame {frame} not "
                          f"written ({type(e).__name__}: {e})")
            self.write_error = f"{type(e).__name__}: {e}"

    def _make_frame_parent(self, directory: str, in_memory: bool) -> None:
        """Create a frame's (or the probe's) directory. In the node's memory it is 0700
        like the rest of it (the restart refuses memory others may read), and the files
        are then written with ``make_parent=False``: a write after a wipe (lose-memory)
        fails instead of recreating the directory with the umask's mode."""
        if in_memory:
            make_private_dir(directory, root=self.node_dir)
        else:
            ensure_dir(directory)

    def _hand_to_keeper(self, frame: int) -> None:
        """Queue frame ``frame``'s copy to storage with the node's keeper; a keeper that
        does not answer is given up (later frames go straight to storage) and this one
        is copied here."""
        from deepspeed_ext import keeper
        job = frame_job(self.node_dir, self.save_dir, frame, self.rank, self.run_id,
                        keeper.job_id(f"frame{frame}", self.rank))
        why: Exception = keeper.KeeperError(f"it did not take the copy of frame {frame}")
        try:
            # A frame copied twice is the same bytes written atomically twice: a keeper
            # silent for 20 s is given up and the frame copied here (no slot is reused).
            handed = keeper.hand_over(self.node_dir, job.to_json(), patience_s=20.0)
        except Exception as e:  # no socket, or silent: the same as a dead keeper
            handed, why = False, e
        if not handed:
            self._keeper_lost(why)
            keeper.persist_frame(job)

    def _retire_memory(self, window_start: int, window: int) -> None:
        """This rank's memory frames older than the previous window, once the keeper has
        copied them to storage: memory holds the window being written and the one before
        (complete unless a rank failed it; storage keeps the newest complete one anyway),
        and older frames still waiting for the keeper, up to :data:`UNCOPIED_WINDOWS`
        windows back (deleting them first would leave storage without them for ever)."""
        from deepspeed_ext.keeper import copied_marker
        for f in list_frames(self.node_dir):
            if f >= window_start - window:
                continue
            if not os.path.exists(copied_marker(_marker(self.node_dir, f, self.rank))):
                if f >= window_start - UNCOPIED_WINDOWS * window:
                    continue
                if not self._uncopied_warned:
                    self._uncopied_warned = True
                    self._warn(f"[moc] rank {self.rank}: WARNING: frame {f} is still not on "
                               f"storage {UNCOPIED_WINDOWS} windows later; dropping its "
                               f"memory copy (frames come faster than the node's keeper "
                               f"writes them: a larger --moc-window, or faster storage)")
            self._remove_own_memory_frame(f)

    def _remove_own_memory_frame(self, frame: int) -> None:
        """This rank's files of ``frame`` in the node's memory, the marker first (a frame
        without it does not count); the directory once the node's last rank is done."""
        from deepspeed_ext.keeper import copied_marker
        marker = _marker(self.node_dir, frame, self.rank)
        for path in (marker, _data(self.node_dir, frame, self.rank), copied_marker(marker)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(frame_dir(self.node_dir, frame))
        except OSError:
            pass

    def _retire_old_windows(self) -> None:
        """Rank 0, background: drop frames before the newest complete window (which the
        window now being written does not replace until it completes)."""
        found = find_window(self.save_dir, self.world)
        if found is None:
            return
        for f in list_frames(self.save_dir):
            if f < found.start:
                shutil.rmtree(frame_dir(self.save_dir, f), ignore_errors=True)

    # -- recovery ------------------------------------------------------------------------

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
        self.failed_window = None
        began = time.perf_counter()
        failure = None  # (window start, every rank's errors) of the first unusable window
        for memory in (True, False):
            found, frames, sources, errors = self._try_window(load_dir, newer_than, memory,
                                                              check_client_state)
            if found is None:  # storage alone may hold no complete window at all
                break
            if not errors:
                return self._begin_replay(load_dir, found, frames, sources, began)
            failure = failure or (found.start, errors)
            self._log(f"[moc] exact recovery: cannot use the window at {found.start} "
                      f"({'; '.join(errors)})")
            # Every rank knows where every rank read from (gathered with the outcomes).
            if not memory or "memory" not in set().union(*sources):
                break
            self._log("[moc] exact recovery: trying that window again from storage alone")
        if failure is not None:
            self.failed_window = f"window at iteration {failure[0]}: {'; '.join(failure[1])}"
            self._failed_in = os.path.abspath(load_dir)
        return None

    def _try_window(self, load_dir: str, newer_than: Optional[int], memory: bool,
                    check_client_state: Optional[Callable[[Any], None]] = None):
        """Every rank: agree on the newest complete window (frames from the node's memory
        first when ``memory``, else storage only) and load this rank's frames of it.

        Returns:
            ``(found, frames, sources, errors)``: the window (None: none to replay), this
            rank's loaded frames, every rank's set of sources and every rank's error
            (empty when every rank loaded and checked its frames).
        """
        try:
            mine = self._available_frames(load_dir, memory=memory)
        except OSError as e:  # this rank offers no frames: the ranks agree on none
            self._warn(f"[moc] rank {self.rank}: cannot list its frames ({e})")
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
            if record.get("layout") != self._layout():
                raise RuntimeError(f"frames were taken on another layout ({record.get('layout')}, "
                                   f"this run {self._layout()})")
            window = range(found.start, found.start + found.window)
            sources = {"memory" if mine[f][1] != load_dir else "storage" for f in window}
            frames = {f: self._load_frame(mine[f][1], f) for f in window}
            schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
            # Checked before the outcome exchange, without touching the engine (a failed
            # recovery must leave it as it was: the fallback may find no checkpoint and
            # start from scratch): a frame missing a tensor would otherwise raise on one
            # rank inside the replay's collectives.
            self._check_window(found.start, schedule, {f: t for f, (t, _) in frames.items()})
            for _, objects in frames.values():
                engine_counters(objects)  # a crafted frame: this window is unusable
            if check_client_state is not None:
                first = frames[found.start][1]
                check_client_state(first.get("client_state") if isinstance(first, dict) else None)
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
            frames = {}
        # One decision for all ranks: a rank that alone fell back to a checkpoint would
        # wait in a collective the others never join.
        outcomes: List = [None] * self.world
        dist.all_gather_object(outcomes, (error, sorted(sources)), group=metadata_group())
        return (found, frames, [set(src) for _, src in outcomes],
                [e for e, _ in outcomes if e is not None])

    def _begin_replay(self, load_dir: str, found, frames, sources, start: float) -> Dict[str, Any]:
        """Every rank, once every rank loaded its frames of ``found``: restore the first
        frame into the engine and arm the replay; returns the frame's objects."""
        schedule = win.Schedule(found.window, tuple(tuple(g) for g in found.groups))
        self.replay = _Replay(found.start, schedule, {f: t for f, (t, _) in frames.items()})
        self.schedule, self.base = schedule, found.start
        self._order = [name for group in schedule.groups for name in group]
        objects = frames[found.start][1]
        self.popularity = {(l, e): n for l, e, n in objects.get("popularity", [])}
        self._restore_objects(objects)
        self._apply_frame(found.start)
        if os.path.abspath(load_dir) == os.path.abspath(self.save_dir):
            self._drop_frames_from(load_dir, self.replay.end)  # the incomplete window after it
        else:  # replaying another run's frames (moc-ckpt densify): leave them as they are
            dist.barrier(group=metadata_group())
        self.last_source = "+".join(sorted(set().union(*sources)))
        self._log(f"[moc] exact recovery: window of {found.window} frames at iteration "
                  f"{found.start} loaded from {self.last_source} in "
                  f"{time.perf_counter() - start:.2f} s; replaying iterations "
                  f"{found.start + 1}..{self.replay.end} to rebuild the exact state")
        return objects

    def _available_frames(self, load_dir: str,
                          memory: bool = True) -> Dict[int, Tuple[Dict[str, Any], str]]:
        """This rank's frames: frame -> (record, root it is read from), memory first
        (``memory`` False: storage only)."""
        out: Dict[int, Tuple[Dict[str, Any], str]] = {}
        roots = [load_dir] + ([self.node_dir] if memory and self.node_dir
                              and os.path.isdir(self.node_dir) else [])
        for root in roots:  # later roots win: memory over storage
            for f in list_frames(root):
                record = read_marker(root, f, self.rank)
                if root == self.node_dir and isinstance(record, dict) \
                        and record.get("run_id") != self.run_id:
                    continue  # not this job's frame: never recovered from
                if record is not None:
                    out[f] = (record, root)
        return out

    def _set_aside_frames(self) -> None:
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
        except OSError as e:  # then _drop_frames_from deletes them, as before
            self._log(f"[moc] WARNING: cannot set aside the frames in {root} ({e})")
            return
        self._log(f"[moc] WARNING: the frames of the unusable {self.failed_window.split(':')[0]} "
                  f"were set aside as {aside}")

    def _drop_frames_from(self, load_dir: str, first: int) -> None:
        """Every rank together: delete frames ``>= first`` (storage: rank 0; memory:
        each rank its own), then a barrier so no rank writes a new one before."""
        if self.rank == 0:
            for f in list_frames(load_dir):
                if f >= first:
                    shutil.rmtree(frame_dir(load_dir, f), ignore_errors=True)
        if self.node_dir and os.path.isdir(self.node_dir):
            for f in list_frames(self.node_dir):
                if f >= first:
                    self._remove_own_memory_frame(f)
        dist.barrier(group=metadata_group())

    def _load_frame(self, load_dir: str, frame: int):
        """This rank's frame ``frame`` under ``load_dir`` (storage or the node's memory),
        its checksum verified: ``(tensors, objects)``."""
        from deepspeed_ext.format.fragment_reader import FragmentReader
        from deepspeed_ext.format.objects import decode
        from deepspeed_ext.format.storage import check_file
        record = read_marker(load_dir, frame, self.rank)
        path = _data(load_dir, frame, self.rank)
        problem = check_file(path, record["nbytes"], record["sha256"])
        if problem:
            raise RuntimeError(problem)
        with FragmentReader(path) as reader:
            tensors = {k: reader.read(k) for k in reader.keys()}
        objects = decode(record["objects"], tensors)
        return {k: v for k, v in tensors.items() if not k.startswith("obj/")}, objects

    def _restore_objects(self, objects: Dict[str, Any]) -> None:
        from deepspeed_ext.state import (ensure_optimizer_state, set_loss_scaler_state,
                                         set_optimizer_scalars)
        engine = self.engine
        # Checked again (the window's frames were before its outcome exchange, in
        # _try_window): nothing but the known counters is ever set on the engine.
        counters = engine_counters(objects)
        ensure_optimizer_state(engine)
        self._fragments = None  # moments may have just been created
        for key, value in counters.items():
            setattr(engine, key, value)
        set_optimizer_scalars(engine, objects["optimizer_scalars"])
        set_loss_scaler_state(engine, objects.get("loss_scaler"))

    def _check_window(self, start: int, schedule, frames: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """This rank: every tensor :meth:`_apply_frame` will take from each frame of the
        window is there, with this rank's number of elements.

        Raises:
            RuntimeError: naming the frame and the tensor.
        """
        frags, params = self._fragments_by_op(), self._params_by_op()
        for frame, data in frames.items():
            snap = win.snapshot_at(schedule, frame - start)
            wanted = [(frag.key, frag.length) for op in snap.active for frag in frags.get(op, [])]
            wanted += [(LP_PREFIX + name, param.numel())
                       for op in snap.frozen for name, param in params.get(op, [])]
            for key, numel in wanted:
                if key not in data:
                    raise RuntimeError(f"frame {frame} lacks {key}")
                if data[key].numel() != numel:
                    raise RuntimeError(f"frame {frame}: {key} has {data[key].numel()} elements, "
                                       f"this rank holds {numel}")

    def _apply_frame(self, frame: int) -> None:
        """Every rank together: group ``frame - start`` exact from its active copy, the
        compute weights rebuilt, the later groups' compute weights from the frame."""
        from deepspeed_ext.state import refresh_compute_weights
        rp = self.replay
        snap = win.snapshot_at(rp.schedule, frame - rp.start)  # what that frame holds
        data = rp.frames[frame]
        frags, params = self._fragments_by_op(), self._params_by_op()
        with torch.no_grad():
            for op in snap.active:
                for frag in frags.get(op, []):
                    frag.tensor.copy_(data[frag.key])
            refresh_compute_weights(self.engine)
            for op in snap.frozen:
                for name, param in params.get(op, []):
                    param.data.view(-1).copy_(data[LP_PREFIX + name])
        del rp.frames[frame]  # host memory: a frame is applied once

    def summary(self) -> Dict[str, Any]:
        """This rank's figures: frames taken, their bytes, copy time and the training
        loop's waits (medians and maxima), and the host memory two frames in flight need."""
        def med(xs):
            return sorted(xs)[len(xs) // 2] if xs else 0.0
        return {"frames": len(self.frame_bytes), "window": self.schedule.window if self.schedule else None,
                "frame_bytes_mean": sum(self.frame_bytes) / len(self.frame_bytes) if self.frame_bytes else 0,
                "frame_bytes_max": max(self.frame_bytes, default=0),
                "copy_s_median": med(self.copy_s), "stall_s_median": med(self.stall_s),
                "stall_s_max": max(self.stall_s, default=0.0),
                "host_bytes_peak": 2 * max(self.frame_bytes, default=0)}

    def close(self) -> None:
        """Finish the frame being written and log this rank's figures (every rank, at the
        end of training; rank 0's line is printed)."""
        self._join_copy()
        if self._write is not None:
            self._write.result()
        self._pool.shutdown(wait=True)
        if self.node_dir:
            # The keeper copies what it was given, then deletes the node's memory: a
            # finished run leaves no shared memory behind.
            from deepspeed_ext import keeper
            dist.barrier(group=metadata_group())
            if self.first_of_node:
                keeper.shutdown_keeper(self.node_dir, run_id=self.run_id)
            dist.barrier(group=metadata_group())
            if self.rank == 0:
                try:
                    os.rmdir(self.cfg.memory_dir)
                except OSError:
                    pass
        s = self.summary()
        if s["frames"]:
            self._log(f"[moc] exact recovery: {s['frames']} frames (W = {s['window']}), "
                      f"{s['frame_bytes_mean'] / 2**20:.2f} MiB per frame on rank {self.rank} "
                      f"(max {s['frame_bytes_max'] / 2**20:.2f}), copy {s['copy_s_median'] * 1e3:.1f} ms, "
                      f"training waited {s['stall_s_median'] * 1e3:.1f} ms median, "
                      f"{s['stall_s_max'] * 1e3:.1f} ms max; host memory {s['host_bytes_peak'] / 2**20:.2f} MiB")


def _compute_done(sources: Dict[str, torch.Tensor]) -> Optional[Tuple[Any, torch.device]]:
    """Main thread, when a frame is taken: on CUDA, an event recorded on the compute
    stream of the sources' device, which the frame's copies wait for (they run on
    another stream, see :meth:`ExactSnapshots._copy_from_gpu`); None when no source is on
    a GPU."""
    device = next((t.device for t in sources.values() if t.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, device
