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

Order, per snapshot (the training process, main thread then copy thread)::

    copier.register(buffer)                      # once per mapping (CUDA only)
    event = copier.launch(buffer, layout, tensors)  # CUDA: queued, returns at once; CPU: None
    ... background thread: copier.finish(event, buffer, layout, tensors)  # CPU copies here
"""

import time
from typing import Callable, Dict, List, Mapping, Optional

import torch

from deepspeed_ext.image import ImageLayout, fill_image


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
        if pending() and engine.is_gradient_accumulation_boundary():
            start = time.perf_counter()
            join()
            stalls.append(time.perf_counter() - start)
        return original(*args, **kwargs)
    engine.step = step


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
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if code != 0:
            self.register_error = f"cudaHostRegister of {nbytes} bytes failed (error {code})"
            return
        self._registered[buffer.data_ptr()] = nbytes

    def unregister(self, buffer: torch.Tensor) -> None:
        """Undo :meth:`register` before the mapping is dropped (a grown slot)."""
        if self._registered.pop(buffer.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

    def launch(self, buffer: torch.Tensor, layout: ImageLayout,
               tensors: Mapping[str, torch.Tensor]) -> Optional["torch.cuda.Event"]:
        """Main thread, right after the optimizer step: queue the copies (CUDA).

        Returns:
            The event that completes with the last copy (CUDA), or None (CPU: the copy
            is done by :meth:`finish` on the background thread).
        """
        if not self.cuda:
            return None
        # The side stream must not read the tensors before the step that produced them
        # has run on the compute stream: without this wait the snapshot could mix
        # bytes from before and after an optimizer step.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), torch.no_grad():
            fill_image(buffer, layout, tensors, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def finish(self, event, buffer: torch.Tensor, layout: ImageLayout,
               tensors: Mapping[str, torch.Tensor]) -> None:
        """Background thread: wait for the queued copies (CUDA) or do them (CPU)."""
        if event is not None:
            event.synchronize()
            return
        with torch.no_grad():
            fill_image(buffer, layout, tensors)

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())
