"""Device-to-host copies of a snapshot: a side CUDA stream into registered host memory.

A snapshot copies the training state into the keeper's shared memory while the next
forward/backward runs. How the bytes move depends on where the state lives:

* **CUDA** (fp32 master weights and moments on the GPU): the slot's shared-memory
  mapping is registered with CUDA once (``cudaHostRegister``: page-locked, so a
  device-to-host copy is a real DMA that does not block the host), the copies are queued
  on a side stream that first waits for the compute stream (the snapshot must see the
  optimizer step that just ended), and an event marks their end. The host thread that
  publishes the slot waits on that event only.
* **CPU** (no GPU, or ZeRO-Offload): there is nothing to queue; the copy itself runs on
  the snapshot's background thread (``copy_`` releases the GIL).

A snapshot's image is copied by a cached copy plan (:mod:`deepspeed_ext.format.copy_plan`):
a few large copies per parameter group, not one per fragment.

Order, per snapshot (the training process; :mod:`deepspeed_ext.two_level.stages`)::

    copier.register(buffer)                   # once per mapping, at start-up (CUDA only)
    CUDA: copy = copier.launch_plan(buffer, layout, plan, tensors)  # save call: queued
          copier.order_after(copy)            # the optimizer step: its stream waits
          copier.wait_host(copy)              # seal thread: before the checksum
    CPU:  copier.copy_plan(buffer, layout, plan, tensors)  # copy thread; the step joins it
"""

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from deepspeed_ext.format.copy_plan import CopyPlan, run_copies
from deepspeed_ext.format.image import ImageLayout

logger = logging.getLogger(__name__)


def wait_before_step(engine, pending: Callable[[], bool], join: Callable[[], None],
                     stalls: List[float]) -> None:
    """Wrap ``engine.step`` so that the optimizer step waits for a host copy in flight.

    The step is about to overwrite the tensors the copy reads; that wait is the only
    stall a background snapshot may cause (DESIGN Eq. 10). Micro-steps that only
    accumulate gradients do not wait. Each wait's seconds are appended to ``stalls``.
    Called once per engine by the owner of the copies (two-level snapshots, exact
    frames), after ``deepspeed.initialize``.
    """
    original = engine.step

    def step(*args, **kwargs):
        if pending() and _is_optimizer_step(engine):
            start = time.perf_counter()
            join()
            stalls.append(time.perf_counter() - start)
        return original(*args, **kwargs)
    engine.step = step


def _is_optimizer_step(engine) -> bool:
    """Whether the ``engine.step`` call about to run steps the optimizer.

    With ``managed_gradient_accumulation`` off, DeepSpeed reports a boundary only while
    ``step()`` itself runs, so asked before the call it says no; but there every call
    is a boundary, and skipping the wait would let the optimizer overwrite tensors
    still being copied.
    """
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is not None and not managed():
        return True
    return bool(engine.is_gradient_accumulation_boundary())


def _clear_cuda_error() -> bool:
    """Best effort: reset CUDA's last error after a failed runtime call made through
    ``torch.cuda.cudart()``, which returns the code but leaves the error set.

    Otherwise the next kernel launch anywhere in the process (PyTorch checks
    ``cudaGetLastError`` after each) would raise this unrelated error, and the fallback
    to pageable memory would never run. Uses the libcudart already loaded into the
    process; a static runtime (none loaded as a library) is left alone.

    Returns:
        True when ``cudaGetLastError`` was called.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()  # already loaded: the same handle
            return True
        except (OSError, AttributeError):
            continue
    return False


@dataclass
class DeviceCopy:
    """A snapshot's copies queued on the side stream (CUDA)."""

    started: Any
    """``torch.cuda.Event`` recorded before the first copy (timing)."""
    done: Any
    """``torch.cuda.Event`` that completes with the last copy."""
    copies: int
    """``copy_`` calls queued."""

    def seconds(self) -> float:
        """The copy's time on the side stream (only once ``done`` completed)."""
        return self.started.elapsed_time(self.done) / 1e3


CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable`` (CUDA runtime API)."""


class HostCopier:
    """Copies one rank's snapshot fragments into a host image buffer.

    Args:
        device: where the fragments live; ``cuda`` devices get the side-stream path.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._registered: Dict[int, int] = {}
        """data_ptr -> bytes of every host range registered with CUDA."""
        self.register_error: Optional[str] = None
        """Why registration failed (the copies then go to pageable memory, still correct)."""

    @staticmethod
    def device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
        """The accelerator device among ``tensors``, else CPU."""
        for tensor in tensors.values():
            if tensor.device.type != "cpu":
                return tensor.device
        return torch.device("cpu")

    def register(self, buffer: torch.Tensor) -> None:
        """Page-lock ``buffer``'s memory for CUDA DMA, once per mapping (CUDA only).

        A failure (too much locked memory, say) is remembered and the copy falls back to
        pageable memory, which is slower but gives the same bytes.
        """
        if not self.cuda or buffer.data_ptr() in self._registered:
            return
        nbytes = buffer.numel() * buffer.element_size()
        # Portable: page-locked for every CUDA context of the process, not only the
        # one current on this thread.
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes,
                                                        CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            _clear_cuda_error()
            if self.register_error is None:  # say it once: every later copy is slower
                logger.warning(
                    f"[moc] WARNING: cudaHostRegister of {nbytes} bytes of shared memory "
                    f"failed (CUDA error {code}); snapshots copy to pageable memory, "
                    f"which blocks the host")
            self.register_error = f"cudaHostRegister of {nbytes} bytes failed (error {code})"
            return
        self._registered[buffer.data_ptr()] = nbytes

    def unregister(self, buffer: torch.Tensor) -> None:
        """Undo :meth:`register` before the mapping is dropped (a grown slot)."""
        if self._registered.pop(buffer.data_ptr(), None) is not None:
            self._unregister(buffer.data_ptr())

    def unregister_all(self) -> None:
        """Undo every :meth:`register` (the end of training, after the last copy): a
        mapping freed while still registered would leave the range pinned, and a later
        mapping at the same address could not be registered."""
        for ptr in list(self._registered):
            del self._registered[ptr]
            self._unregister(ptr)

    @staticmethod
    def _unregister(ptr: int) -> None:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _clear_cuda_error()

    def launch_plan(self, buffer: torch.Tensor, layout: ImageLayout, plan: CopyPlan,
                    tensors: Mapping[str, torch.Tensor]) -> DeviceCopy:
        """Save call (main thread), CUDA only: queue the image's copies by ``plan`` on
        the side stream, behind everything queued so far on the compute stream.

        Returns:
            The queued copy; the optimizer step orders itself after it
            (:meth:`order_after`), the seal thread waits for it (:meth:`wait_host`).
        """
        # Without this wait the side stream could read the tensors before the optimizer
        # step that produced them has run: a snapshot mixing two steps' bytes.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
            copies = run_copies(buffer, layout, plan, tensors, non_blocking=True)
            # Blocking: the seal thread that waits for it sleeps instead of spinning a
            # core for the whole copy.
            done = torch.cuda.Event(enable_timing=True, blocking=True)
            done.record(self.stream)
        return DeviceCopy(started, done, copies)

    def order_after(self, copy: DeviceCopy) -> Tuple[Any, Any]:
        """The optimizer step (main thread), CUDA only: the compute stream waits for the
        copy's last event before the optimizer overwrites the tensors; the host does not
        wait. Returns timing events recorded on the compute stream before and after that
        wait (their distance is the device's wait)."""
        stream = torch.cuda.current_stream(self.stream.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(copy.done)
        after = torch.cuda.Event(enable_timing=True)
        after.record(stream)
        return before, after

    def wait_host(self, copy: DeviceCopy) -> None:
        """Seal thread, CUDA only: block until the copy's bytes are in host memory."""
        # On the fragments' device: a CUDA call from a thread with no current device
        # would set up a context on GPU 0 for every rank of the node.
        with torch.cuda.device(self.stream.device):
            copy.done.synchronize()

    @staticmethod
    def copy_plan(buffer: torch.Tensor, layout: ImageLayout, plan: CopyPlan,
                  tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy thread, CPU state: copy the image by ``plan`` now; returns the copies."""
        with torch.no_grad():
            return run_copies(buffer, layout, plan, tensors)

    def copy_now(self, buffer: torch.Tensor, layout: ImageLayout, plan: CopyPlan,
                 tensors: Mapping[str, torch.Tensor]) -> int:
        """Both stages' copy in one call, for a caller without a training step between
        (a benchmark, a test): CUDA: queued, then waited for; CPU: copied. Returns the
        copies."""
        if not self.cuda:
            return self.copy_plan(buffer, layout, plan, tensors)
        copy = self.launch_plan(buffer, layout, plan, tensors)
        self.wait_host(copy)
        return copy.copies

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())
