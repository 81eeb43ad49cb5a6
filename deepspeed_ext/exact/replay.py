"""Exact recovery's replay: a window's frames read back (checksums verified), checked
against this rank's tensors, and applied one by one as training re-runs the window."""

from typing import Any, Dict

import torch

from deepspeed_ext.exact.frames import LP_PREFIX, data_path, read_marker
from deepspeed_ext.exact.operators import engine_counters
from deepspeed_ext.policy import window as win


class Replay:
    """The window being replayed: its frames' tensors, in host memory.

    Args:
        start: the window's first frame.
        schedule: the window's schedule (its groups).
        frames: frame -> this rank's tensors of it.
    """

    def __init__(self, start: int, schedule: win.Schedule, frames: Dict[int, Dict[str, torch.Tensor]]):
        self.start = start
        self.schedule = schedule
        self.frames = frames

    @property
    def end(self) -> int:
        """The iteration at whose start the state is dense again."""
        return self.start + self.schedule.window

    def apply(self, frame: int, index, engine) -> None:
        """Every rank together: group ``frame - start`` exact from its active copy, the
        compute weights rebuilt, the later groups' compute weights from the frame.

        Args:
            index: this rank's :class:`OperatorIndex`.
            engine: the DeepSpeed engine the frame is applied to.
        """
        from deepspeed_ext.state import refresh_compute_weights
        snap = win.snapshot_at(self.schedule, frame - self.start)  # what that frame holds
        data = self.frames[frame]
        frags, params = index.fragments_by_op(), index.params_by_op()
        with torch.no_grad():
            for op in snap.active:
                for frag in frags.get(op, []):
                    frag.tensor.copy_(data[frag.key])
            refresh_compute_weights(engine)
            for op in snap.frozen:
                for name, param in params.get(op, []):
                    param.data.view(-1).copy_(data[LP_PREFIX + name])
        del self.frames[frame]  # host memory: a frame is applied once


def load_frame(load_dir: str, frame: int, rank: int):
    """Rank ``rank``'s frame ``frame`` under ``load_dir`` (storage or the node's memory),
    its checksum verified: ``(tensors, objects)``."""
    from deepspeed_ext.format.fragment_reader import FragmentReader
    from deepspeed_ext.format.objects import decode
    from deepspeed_ext.format.storage import check_file
    record = read_marker(load_dir, frame, rank)
    path = data_path(load_dir, frame, rank)
    problem = check_file(path, record["nbytes"], record["sha256"])
    if problem:
        raise RuntimeError(problem)
    with FragmentReader(path) as reader:
        tensors = {k: reader.read(k) for k in reader.keys()}
    objects = decode(record["objects"], tensors)
    return {k: v for k, v in tensors.items() if not k.startswith("obj/")}, objects


def check_window(index, start: int, schedule: win.Schedule,
                 frames: Dict[int, Dict[str, torch.Tensor]]) -> None:
    """This rank, before the ranks' outcome exchange: every tensor :meth:`Replay.apply`
    will take from each frame of the window is there, with this rank's number of
    elements.

    Args:
        index: this rank's tensors by operator (``fragments_by_op``, ``params_by_op``:
            an :class:`OperatorIndex`).

    Raises:
        RuntimeError: naming the frame and the tensor.
    """
    frags, params = index.fragments_by_op(), index.params_by_op()
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


def restore_objects(engine, objects: Dict[str, Any]) -> None:
    """Every rank, when a replay begins: the engine's counters, the optimizer's scalars
    and the loss scaler from a frame's ``objects``; creates the optimizer's moments if
    they do not exist yet (the caller then describes its fragments again)."""
    from deepspeed_ext.state import (ensure_optimizer_state, set_loss_scaler_state,
                                     set_optimizer_scalars)
    # Checked again (the window's frames were before its outcome exchange, in
    # Recovery.try_window): nothing but the known counters is ever set on the engine.
    counters = engine_counters(objects)
    ensure_optimizer_state(engine)
    for key, value in counters.items():
        setattr(engine, key, value)
    set_optimizer_scalars(engine, objects["optimizer_scalars"])
    set_loss_scaler_state(engine, objects.get("loss_scaler"))
