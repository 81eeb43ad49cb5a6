"""Exact recovery's frame writer: a frame's bytes copied into host memory on a
background thread, then written where frames go (the node's memory, handed to its
keeper, or storage), and old frames retired."""

import logging
import shutil
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.exact.frames import (data_path, find_window, frame_dir, list_frames,
                                        marker_path)
from deepspeed_ext.exact.memory import NodeMemory
from deepspeed_ext.runtime.log import log_line

logger = logging.getLogger(__name__)


class FrameWriter:
    """One background thread that copies each frame and writes it, one frame at a time.

    The training's thread calls :meth:`wait_for_previous` then :meth:`submit` when it
    takes a frame (every rank), :meth:`join_copy` before each optimizer step (through
    the engine's step hook) and :meth:`finish` at the end.

    Args:
        rank, world: this rank and the world size.
        save_dir: the job's ``--save`` (storage).
        memory: the node's memory level (where frames go first).
        write_frames: False: copy only (tests measuring the copy alone).
    """

    def __init__(self, rank: int, world: int, save_dir: str, memory: NodeMemory,
                 write_frames: bool = True):
        self.rank, self.world, self.save_dir, self.memory = rank, world, save_dir, memory
        self.write_frames = write_frames
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-exact")
        self._side_stream = None
        """CUDA: the stream frame copies run on (:meth:`copy_from_gpu`), made on first use."""
        self.pending_copy: Optional[Future] = None
        """The copy of the frame last taken, until :meth:`join_copy` collects it."""
        self._write: Optional[Future] = None
        self.write_error: Optional[str] = None
        self.stall_s: List[float] = []
        self.frame_bytes: List[int] = []
        self.copy_s: List[float] = []

    def copy_pending(self) -> bool:
        """Whether a frame copy is still to be joined (the step hook's question)."""
        return self.pending_copy is not None

    def join_copy(self) -> None:
        """Wait for the frame copy. Its failure (host memory exhausted, say) is recorded,
        never raised: this runs inside ``engine.step`` on this rank alone, and raising
        would leave the other ranks in the step's collectives. The frame's writer sees
        the same error and leaves the window incomplete (recovery uses an older one)."""
        copy, self.pending_copy = self.pending_copy, None
        if copy is None:
            return
        try:
            copy.result()
        except Exception as e:
            if self.write_error is None:
                log_line(logger, f"[moc] rank {self.rank}: WARNING: an exact-recovery frame "
                                 f"copy failed ({type(e).__name__}: {e}); its window stays "
                                 f"incomplete")
            self.write_error = f"{type(e).__name__}: {e}"

    def wait_for_previous(self) -> None:
        """Training's thread, before a frame is taken: the previous frame's copy joined
        and its write finished (the wait counted as a stall)."""
        self.join_copy()
        if self._write is not None and not self._write.done():
            # Never more than one frame behind storage: host memory stays bounded.
            start = time.perf_counter()
            self._write.result()
            self.stall_s.append(time.perf_counter() - start)

    def submit(self, frame: int, sources: Dict[str, torch.Tensor], record: Dict[str, Any]) -> None:
        """Training's thread: queue frame ``frame``'s copy of ``sources`` (live tensors)
        and, unless writes are off, its write with ``record`` (its marker)."""
        self.pending_copy = copy = self._pool.submit(self.copy_frame, sources,
                                                     compute_done(sources))
        if self.write_frames:
            self._write = self._pool.submit(self.write_frame, frame, record, copy)

    def finish(self) -> None:
        """Training's thread, at the end: the last copy joined, its write finished and the
        thread stopped."""
        self.join_copy()
        if self._write is not None:
            self._write.result()
        self._pool.shutdown(wait=True)

    def copy_frame(self, sources: Dict[str, torch.Tensor],
                   ready: Optional[Tuple[Any, torch.device]] = None) -> Dict[str, torch.Tensor]:
        """Background thread: the frame's bytes into fresh host memory (``copy_`` and
        ``clone`` release the GIL, so this overlaps the next forward/backward).

        Args:
            ready: CUDA: the event that ends the compute stream's work up to the frame
                (see :func:`compute_done`), and its device; None elsewhere.
        """
        start = time.perf_counter()
        with torch.no_grad():
            if ready is not None:
                copies = self.copy_from_gpu(sources, *ready)
            else:
                copies = {k: v.detach().to("cpu", copy=True) if v.device.type != "cpu"
                          else v.detach().clone() for k, v in sources.items()}
        self.copy_s.append(time.perf_counter() - start)
        self.frame_bytes.append(sum(v.numel() * v.element_size() for v in copies.values()))
        return copies

    def copy_from_gpu(self, sources: Dict[str, torch.Tensor], ready,
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

    def write_frame(self, frame: int, record: Dict[str, Any], copy: Future) -> None:
        """Background thread, after the copy: the frame file, then its marker."""
        from deepspeed_ext.format.storage import atomic_write_json, write_fragment_file
        try:
            copies = dict(copy.result())
            copies.update(record.pop("_object_tensors"))
            # Memory first, when the node has a keeper: it survives this process and
            # the keeper copies it to storage; else storage directly.
            root = self.memory.frame_root()
            in_memory = root != self.save_dir
            self.memory.make_frame_parent(frame_dir(root, frame), in_memory)
            rec = write_fragment_file(data_path(root, frame, self.rank), copies,
                                      make_parent=False)
            record.update(sha256=rec.sha256, nbytes=rec.nbytes, run_id=self.memory.run_id)
            # The marker is written last: a frame counts only once every rank's exists.
            atomic_write_json(marker_path(root, frame, self.rank), record, make_parent=False)
            if in_memory:
                self.memory.hand_over(frame)
                self.memory.retire(record["window_start"], record["window"])
            if self.rank == 0 and record["position"] == 0:
                self.retire_old_windows()
        except Exception as e:  # this window stays incomplete; recovery uses an older one
            traceback.print_exc()
            if self.write_error is None:
                log_line(logger, f"[moc] rank {self.rank}: WARNING: exact-recovery frame "
                                 f"{frame} not written ({type(e).__name__}: {e})")
            self.write_error = f"{type(e).__name__}: {e}"

    def retire_old_windows(self) -> None:
        """Rank 0, background: drop frames before the newest complete window (which the
        window now being written does not replace until it completes)."""
        found = find_window(self.save_dir, self.world)
        if found is None:
            return
        for f in list_frames(self.save_dir):
            if f < found.start:
                shutil.rmtree(frame_dir(self.save_dir, f), ignore_errors=True)


def compute_done(sources: Dict[str, torch.Tensor]) -> Optional[Tuple[Any, torch.device]]:
    """Main thread, when a frame is taken: on CUDA, an event recorded on the compute
    stream of the sources' device, which the frame's copies wait for (they run on
    another stream, see :meth:`FrameWriter.copy_from_gpu`); None when no source is on
    a GPU."""
    device = next((t.device for t in sources.values() if t.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, device
