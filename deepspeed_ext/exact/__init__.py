"""Exact recovery, runtime half: sparse per-iteration frames and sparse-to-dense replay.

The plan (which operators a frame holds active or frozen, how a window is replayed) is
:mod:`deepspeed_ext.policy.window`; this package moves the bytes. A *frame* ``f`` is the state
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

Call order, every rank, every iteration (the trainer, ``megatron/training/fault_tolerance.py``)::

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

The parts, one module each: :mod:`~deepspeed_ext.exact.config` (:class:`ExactConfig`),
:mod:`~deepspeed_ext.exact.frames` (paths, markers, complete windows),
:mod:`~deepspeed_ext.exact.operators` (the operator index), :mod:`~deepspeed_ext.exact.memory`
(the node's memory and keeper), :mod:`~deepspeed_ext.exact.writer` (the frame writer),
:mod:`~deepspeed_ext.exact.sizing` (the automatic window, the memory check),
:mod:`~deepspeed_ext.exact.replay` and :mod:`~deepspeed_ext.exact.recovery` (the restart),
composed by :class:`~deepspeed_ext.exact.snapshots.ExactSnapshots`.
"""

from deepspeed_ext.exact.config import MOMENTS, PROBE_ITERATIONS, UNCOPIED_WINDOWS, ExactConfig
from deepspeed_ext.exact.frames import (EXACT_DIR, FRAME_RE, LP_PREFIX, MARKER_MAX_BYTES,
                                        WindowOnDisk, agree_window, data_path, find_window,
                                        frame_dir, frame_job, frame_layout, list_frames,
                                        marker_path, read_marker)
from deepspeed_ext.exact.memory import NodeMemory
from deepspeed_ext.exact.operators import (BYTES_PER_ACTIVE_ELEMENT, ENGINE_COUNTERS,
                                           OperatorIndex, build_operators, engine_counters,
                                           operator_of)
from deepspeed_ext.exact.recovery import Recovery
from deepspeed_ext.exact.replay import Replay, check_window, load_frame, restore_objects
from deepspeed_ext.exact.sizing import WindowSizer
from deepspeed_ext.exact.snapshots import ExactSnapshots
from deepspeed_ext.exact.writer import FrameWriter, compute_done

__all__ = [
    "BYTES_PER_ACTIVE_ELEMENT", "ENGINE_COUNTERS", "EXACT_DIR", "FRAME_RE", "LP_PREFIX",
    "MARKER_MAX_BYTES", "MOMENTS", "PROBE_ITERATIONS", "UNCOPIED_WINDOWS",
    "ExactConfig", "ExactSnapshots", "FrameWriter", "NodeMemory", "OperatorIndex", "Recovery",
    "Replay", "WindowOnDisk", "WindowSizer",
    "agree_window", "build_operators", "check_window", "compute_done", "data_path",
    "engine_counters", "find_window", "frame_dir", "frame_job", "frame_layout", "list_frames",
    "load_frame", "marker_path", "operator_of", "read_marker", "restore_objects",
]
