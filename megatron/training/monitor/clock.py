"""Timing collectives: the seconds each rank is held by collectives per iteration.

:class:`CollectiveClock` wraps the ``torch.distributed`` collectives (and the ones
DeepSpeed's communication backend bound at start-up). The loop publishes the sum as
``comm_s`` and the rest of the iteration as ``own_s``
(:mod:`megatron.training.monitor.beats`). ``own_s`` is thus the iteration's time outside
collectives, wherever it was spent: between iterations (an injected ``slow`` fault,
host-side logging, a slow save of its own files) or inside the iteration between
DeepSpeed's collectives (``slow-compute``: a slow device), where the other ranks wait
for the slow one inside the next collective and their own ``own_s`` stays normal. Not
per-collective *arrival* times as C4 keeps them (no rank records when it entered which
collective), but their sum per iteration, which is what the straggler rule needs.

**Same numbers on NCCL as on gloo.** A gloo collective on CPU tensors blocks the host
until every rank arrived, so its host wall time is the time the rank was held by it. An
NCCL call (or gloo's on CUDA tensors) returns once queued; the device stream waits in
it, and the host waits later, at the next ``.tolist()``/``.item()``, for that wait and
the compute queued before it together. :class:`CollectiveClock` therefore times device
collectives with CUDA events on the stream around the call, resolved at ``take()`` (see
:class:`DeviceTimer`), and an ``async_op=True`` collective's launch plus its ``wait()``
on either backend. ``comm_s`` is thus the time held by collectives and ``own_s`` the
rest (compute, host work) on both. ``take()`` also waits for the device to pass the
last collective before the beat, so no rank's heartbeat runs ahead of its device: the
hang rule's "at most one iteration ahead" holds on NCCL too, and a rank blocked in an
event wait or a ``.tolist()`` releases the GIL as a rank blocked in gloo does.
"""

import functools
import inspect
import threading
import time
from typing import List, Optional, Tuple


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "barrier", "gather", "scatter", "all_gather_object",
               "broadcast_object_list", "gather_object")
"""``torch.distributed`` functions :class:`CollectiveClock` times."""

WAIT_METHODS = ("wait", "synchronize", "block_current_stream")
"""Methods of an asynchronous collective's handle (``async_op=True``) at which this rank
waits for it: :class:`CollectiveClock` times them as part of the collective."""


class DeviceTimer:
    """How :class:`CollectiveClock` times a collective that returns before it finishes.

    On a CUDA device (NCCL, or gloo with CUDA tensors) a collective call only queues the
    work and returns; the device stream then waits inside it for the other ranks, and
    the host waits later, wherever it next reads a result (``.tolist()``, ``.item()``),
    together with the compute queued before. The host's time inside the call says
    nothing there, so the clock asks a device timer instead: :meth:`mark` queues a point
    on the stream before and after the call (or a handle's wait), and :meth:`seconds`
    measures the stream's time between the two, at the next :meth:`CollectiveClock.take`.
    That is the time the stream was held by the collective (waiting for the other ranks,
    then moving data), not the compute queued before it: the same quantity a gloo
    collective's host wall time is on the CPU.

    :class:`CudaEventTimer` is the default; tests inject a scripted one through
    ``CollectiveClock(device_timer=...)``. Only the thread that calls collectives (the
    training loop's main thread) calls it.
    """

    def device_of(self, args: tuple, kwargs: dict) -> Optional[object]:
        """The device whose stream a collective with these arguments runs on, or None
        for a host collective (CPU tensors, object collectives, barrier: host-timed)."""
        raise NotImplementedError

    def mark(self, device) -> object:
        """A point queued now on ``device``'s current stream; never waits."""
        raise NotImplementedError

    def seconds(self, start, end) -> float:
        """Stream seconds from mark ``start`` to mark ``end``; waits until ``end`` passed."""
        raise NotImplementedError


class CudaEventTimer(DeviceTimer):
    """:class:`DeviceTimer` on CUDA events: a collective with a CUDA tensor among its
    arguments is timed on the current stream of that tensor's device."""

    def device_of(self, args: tuple, kwargs: dict) -> Optional[object]:
        import torch
        for value in (*args, *kwargs.values()):
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    # A timing event cannot be recorded into a CUDA graph being captured.
                    return None if torch.cuda.is_current_stream_capturing() else t.device
        return None

    def mark(self, device) -> object:
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()  # releases the GIL: the watchdog thread polls meanwhile
        return start.elapsed_time(end) / 1000.0


@functools.lru_cache(maxsize=None)
def _timed_work_type():
    """The handle :class:`CollectiveClock` returns for an asynchronous collective: a
    ``torch.distributed.Work`` (isinstance checks still hold; C++ callers reach the
    Python ``wait`` and ``get_future`` overrides) forwarding every method to the real
    handle, with the waits of :data:`WAIT_METHODS` timed."""
    import torch.distributed as dist

    class TimedWork(dist.Work):
        def __init__(self, work, clock: "CollectiveClock", device):
            super().__init__()
            self.work, self._clock, self._device = work, clock, device

    def forward(name):
        def method(self, *args, **kwargs):
            return getattr(self.work, name)(*args, **kwargs)
        method.__name__ = name
        return method

    def timed(name):
        def method(self, *args, **kwargs):
            return self._clock.time_wait(self._device, getattr(self.work, name), args, kwargs)
        method.__name__ = name
        return method

    for name in dir(dist.Work):
        if name.startswith("__") or name == "_pybind11_conduit_v1_" or isinstance(
                inspect.getattr_static(dist.Work, name), (staticmethod, classmethod)):
            continue  # pybind's own, and unbox (static): nothing of the handle's to forward
        setattr(TimedWork, name, (timed if name in WAIT_METHODS else forward)(name))
    return TimedWork


class CollectiveClock:
    """Seconds this rank spends held by collectives, per iteration (the C4 idea).

    A rank that computes slowly arrives late at the next collective, and the others
    wait for it *inside* that collective; the slow rank itself barely waits. So the
    time a rank spends outside collectives (iteration time minus this clock) singles
    out a straggler wherever its slowness lies, also between DeepSpeed's collectives
    inside an iteration, which the time between iterations alone cannot see.

    :meth:`install` wraps the ``torch.distributed`` collectives (and the ones DeepSpeed's
    communication backend bound at start-up); a wrapper times each outermost call (a
    wrapped function that reaches another wrapped one counts once) in one of two ways:

    * a host collective (gloo on CPU tensors, object collectives, ``barrier``, which
      block the host until they finish): the call's host wall time;
    * a device collective (a CUDA tensor among the arguments: NCCL, or gloo on CUDA
      tensors, whose calls return once queued): the device stream's time from before to
      after the call, through the :class:`DeviceTimer`, resolved at :meth:`take`. The
      host's later wait at ``.tolist()``/``.item()`` is thus split correctly: the part
      the stream spent in the collective counts here, the compute queued before it is
      the rank's own time.

    An asynchronous call (``async_op=True``) returns a handle whose waits
    (:data:`WAIT_METHODS`) are timed the same way and added to the same counter: a
    rank's time held by a collective is its launch plus its wait, not the work it
    overlapped in between. Main thread and background threads share the counter: only
    the training loop's main thread calls collectives.

    Every rank: ``clock.install()`` before the loop, ``clock.take()`` once per
    iteration (at the heartbeat, before reading the iteration's end time),
    ``clock.uninstall()`` after the loop.

    Args:
        device_timer: times device collectives (default :class:`CudaEventTimer`).
    """

    def __init__(self, device_timer: Optional[DeviceTimer] = None) -> None:
        self._timer = device_timer if device_timer is not None else CudaEventTimer()
        self._total = 0.0
        self._calls = 0
        self._marks: List[Tuple[object, object]] = []
        """Device (start, end) marks not resolved yet: resolving one waits for the device."""
        self._depth = threading.local()
        self._saved: List = []

    def _span(self, device, fn, args, kwargs):
        """``fn(*args, **kwargs)`` as one outermost timed span."""
        self._depth.n = 1
        start = time.perf_counter() if device is None else self._timer.mark(device)
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth.n = 0
            if device is None:
                self._total += time.perf_counter() - start
            else:  # resolved at take(): waiting here would stall the launch queue
                self._marks.append((start, self._timer.mark(device)))

    def time_wait(self, device, wait, args: tuple, kwargs: dict):
        """Call ``wait(*args, **kwargs)`` (an asynchronous collective's handle waiting),
        adding its time to the collective it belongs to (``device``: that collective's
        device, None for a host collective); not counted as a call of its own."""
        if getattr(self._depth, "n", 0):  # inside another timed collective: that one counts
            return wait(*args, **kwargs)
        return self._span(device, wait, args, kwargs)

    def wrap(self, fn):
        """``fn`` (a collective) timed by this clock: the outermost timed call counts, one
        call inside another is not counted again.

        Called by :meth:`install` for each collective it replaces (every rank, once per
        clock), and by tests that wrap a call of their own.
        """
        import torch.distributed as dist
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if getattr(clock._depth, "n", 0):  # inside another timed collective: that one counts
                return fn(*args, **kwargs)
            device = clock._timer.device_of(args, kwargs)
            try:
                result = clock._span(device, fn, args, kwargs)
            finally:
                clock._calls += 1
            if isinstance(result, dist.Work):  # async_op=True: this rank waits at its wait
                return _timed_work_type()(result, clock, device)
            return result
        timed._moc_clock = clock
        return timed

    def install(self) -> "CollectiveClock":
        """Wrap the collectives (idempotent per clock)."""
        import torch.distributed as dist
        targets = [(dist, name) for name in COLLECTIVES]
        try:
            from deepspeed.comm import comm as ds_comm
            backend = getattr(ds_comm, "cdb", None)
            if backend is not None:
                targets += [(backend, name) for name in ("all_gather_function",
                                                          "reduce_scatter_function")]
        except ImportError:
            pass
        for owner, name in targets:
            fn = getattr(owner, name, None)
            if fn is None or getattr(fn, "_moc_clock", None) is self:
                continue
            self._saved.append((owner, name, fn))
            setattr(owner, name, self.wrap(fn))
        return self

    def uninstall(self) -> None:
        """Restore the original functions."""
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved = []

    def take(self) -> Tuple[float, int]:
        """``(seconds, calls)`` held by collectives since the last take; resets both.

        With device collectives among them, first waits until the device passed the last
        one's end (a host sync at the top of the iteration, where the loop's own
        ``.tolist()`` already waited for nearly all of it). That keeps every rank's
        heartbeat at most one iteration ahead of the device, as on gloo, which the hang
        rule assumes; a collective that never finishes blocks here, before the next beat,
        as it blocks inside the call on gloo (the GIL is released: the watchdog polls)."""
        total = self._total
        for start, end in self._marks:
            total += self._timer.seconds(start, end)
        out = (total, self._calls)
        self._total, self._calls, self._marks = 0.0, 0, []
        return out
