"""Hang and straggler detection through per-rank heartbeats in the rendezvous store.

Every rank publishes one heartbeat per iteration under ``moc/hb/<rank>`` of a
``torch.distributed`` Store (the job's rendezvous store): a JSON object ``{"t",
"iteration", "iter_s", "own_s", "comm_s", "collectives", "median_iter_s",
"median_own_s", "host", "pid", "done"}``. A :class:`Watchdog` thread on *every* rank reads all heartbeats every
``poll_s`` seconds, so a hang is found even when the hung rank is rank 0, and a rank
blocked in a collective still finds it: gloo's collectives release the GIL while they
wait (``tests/training/test_monitor.py`` checks that with ranks blocked in
``all_reduce`` and ``all_to_all_single``).

**Hang.** Once every rank has beaten at least once (each publishes a *ready* beat of the
iteration it resumes from before the loop), the
job hangs when no rank that is not finished has made progress (a new heartbeat; a
*touch* after each evaluation step and before a save counts) for ``hang_timeout_s``
seconds. In
synchronous training a rank cannot run more than one iteration ahead of the others, so
the hung rank is the one whose heartbeat lags: it last beat at the start of iteration
``i`` and never started ``i + 1``, while the others beat ``i + 1`` and then blocked in
its first collective. When all ranks stalled in the same iteration (a hang inside an
iteration) the culprit is unknown; the event names the rank silent the longest and
lists every suspect. Each watchdog then
calls ``on_hang`` (default: :meth:`Watchdog.stop_job`, ending with ``os._exit(EXIT_HANG)``
once every rank detected it, so the launcher's restart machinery -- torchrun
``--max-restarts`` -- restarts the job); the hung rank's own watchdog finds itself the
same way and exits too (its main thread sleeps or waits without the GIL). A rank stuck
holding the GIL cannot run its watchdog: the others exit and the launcher kills it.

**Start-up.** Before the loop there is no heartbeat yet: :class:`StartupWatch` times each
start-up and loading phase of its own rank (process group, data, model and engine,
checkpoint load) and reports a phase that outlasts ``startup_timeout_s`` as a hang
naming the phase, exiting with :data:`EXIT_HANG` like a hang in the loop.

**Straggler.** In synchronous training every rank's *wall-clock* iteration time is the
same: the fast ranks wait inside the collectives for the slow one. So a heartbeat
carries two times: ``iter_s``, the wall time of the last iteration, and ``own_s``, the
part of it this rank spent on its own, not waiting for other ranks (None: all of it).
Each rank keeps the median of each over its last ``straggler_window`` beats. The
straggler rule (:func:`find_stragglers`) for rank ``r``::

    excess_r   = median_own_r - median(median_own_s for every other rank s)
    slowdown_r = median_iter_r / (median_iter_r - excess_r)
    straggler when slowdown_r > straggler_factor

``slowdown`` is how much faster the job would iterate without ``r``'s extra time; with
``own_s == iter_s`` it is simply ``median_iter_r / median of the others' medians``. The
baseline excludes ``r`` itself: with two ranks a median including the straggler would
halve its apparent slowdown. Because it compares medians of ``window`` beats, a rank is
flagged only after more than half of its last ``window`` iterations were slow; one (or
up to ``(window - 1) // 2``) slow iterations never flag it. Each straggler is reported
once per process; ``straggler_action="stop"`` exits like a hang (``EXIT_STRAGGLER``).

Each event is emitted once per job attempt: the first rank to ``store.add`` the key
``moc/event/<kind>/<rank>`` emits it; every detecting rank still logs and acts on it.

Call order on every rank (the training loop wires it)::

    store = default_store()                           # after init_process_group
    heartbeat = Heartbeat(store, rank, window=config.straggler_window)
    watchdog = Watchdog(store, rank, world_size, config, emit=...).start()
    clock = CollectiveClock().install()               # times every collective
    heartbeat.ready(state.iteration)                  # after the load, before the loop
    last_top = None
    while state.iteration < train_iters:
        injector.before_iteration(state.iteration + 1)   # a hang or slow fault acts here
        comm_s, calls = clock.take()                  # held by collectives since the last
        top = time.perf_counter()                     # beat (first waits for the device)
        iter_s = top - last_top if last_top else None
        heartbeat.beat(state.iteration + 1, iter_s=iter_s,   # before the first collective
                       own_s=iter_s - comm_s if iter_s else None, comm_s=comm_s, ...)
        last_top = top
        ...                                           # the iteration, evaluation, saves
                                                      # (heartbeat.touch() per eval step
                                                      # and before each save)
    heartbeat.finish()                                # this rank will beat no more
    watchdog.stop()
    clock.uninstall()

``own_s`` is thus the iteration's time outside collectives, wherever it was spent:
between iterations (an injected ``slow`` fault, host-side logging, a slow save of its
own files) or inside the iteration between DeepSpeed's collectives (``slow-compute``:
a slow device), where the other ranks wait for the slow one inside the next collective
and their own ``own_s`` stays normal. Not per-collective *arrival* times as C4 keeps
them (no rank records when it entered which collective), but their sum per iteration,
which is what the straggler rule needs.

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

Cost: a beat is one ``store.set``; a poll reads ``world_size`` keys, on every rank, so
the store serves ``world_size**2`` reads per ``poll_s``: fine for tens of ranks; for
thousands use a larger ``poll_s``.
"""

import argparse
import atexit
import functools
import inspect
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from megatron.training.errors import ConfigError

EXIT_HANG = 75
"""Exit status of a rank stopped by a detected hang (``EX_TEMPFAIL``: try again)."""
EXIT_STRAGGLER = 76
"""Exit status of a rank stopped by a detected straggler (``--moc-straggler-action stop``)."""

STRAGGLER_ACTIONS = ("report", "stop")


def heartbeat_key(rank: int) -> str:
    """Store key of ``rank``'s heartbeat."""
    return f"moc/hb/{rank}"


def event_key(kind: str, rank: int) -> str:
    """Store counter electing the one rank that emits the ``kind`` event about ``rank``."""
    return f"moc/event/{kind}/{rank}"


@dataclass
class MonitorConfig:
    """Thresholds of the hang and straggler detection (same on every rank).

    Raises:
        ConfigError: (a ValueError) a value out of range; the message names the flag.
    """

    hang_timeout_s: float = 300.0
    """The job hangs once no rank made progress for this long (``--moc-hang-timeout``);
    must exceed the longest legitimate iteration, evaluation step or synchronous save."""
    straggler_factor: float = 2.0
    """A rank slowing iterations down more than this is a straggler (``--moc-straggler-factor``)."""
    straggler_window: int = 5
    """Beats whose median is compared (``--moc-straggler-window``)."""
    straggler_action: str = "report"
    """``report``: emit an event only; ``stop``: exit like a hang (``--moc-straggler-action``)."""
    poll_s: float = 5.0
    """Seconds between two reads of all heartbeats (``--moc-monitor-poll``)."""
    startup_timeout_s: float = 600.0
    """A start-up or loading phase (process group, data, model and engine, checkpoint
    load) lasting longer than this is a hang (``--moc-startup-timeout``): longer than an
    iteration, since a phase may legitimately take minutes (a large load)."""

    def __post_init__(self):
        if not 0 < self.startup_timeout_s < float("inf"):
            raise ConfigError(f"--moc-startup-timeout {self.startup_timeout_s}: must be a "
                              "finite number > 0 seconds")
        if not self.hang_timeout_s > 0:
            raise ConfigError(f"--moc-hang-timeout {self.hang_timeout_s}: must be > 0 seconds")
        if not self.straggler_factor > 1:
            raise ConfigError(f"--moc-straggler-factor {self.straggler_factor}: must be > 1")
        if self.straggler_window < 3:
            raise ConfigError(f"--moc-straggler-window {self.straggler_window}: must be >= 3 "
                              "(the median of fewer beats follows a single slow iteration)")
        if self.straggler_action not in STRAGGLER_ACTIONS:
            raise ConfigError(f"--moc-straggler-action {self.straggler_action!r}: must be one "
                              f"of {', '.join(STRAGGLER_ACTIONS)}")
        if not 0 < self.poll_s < self.hang_timeout_s:
            raise ConfigError(f"--moc-monitor-poll {self.poll_s}: must be > 0 and below "
                              f"--moc-hang-timeout {self.hang_timeout_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MonitorConfig":
        """From the flags :func:`add_monitor_args` adds."""
        return cls(hang_timeout_s=args.moc_hang_timeout, straggler_factor=args.moc_straggler_factor,
                   straggler_window=args.moc_straggler_window,
                   straggler_action=args.moc_straggler_action, poll_s=args.moc_monitor_poll,
                   startup_timeout_s=getattr(args, "moc_startup_timeout", cls.startup_timeout_s))


# ------------------------------------------------------------------------- heartbeat

@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat as a watchdog reads it."""

    rank: int
    """The beating rank."""
    t: float
    """``time.time()`` of the beat on the beating rank."""
    iteration: int
    """The iteration (1-based) this rank was starting when it beat."""
    iter_s: Optional[float]
    """Wall seconds of its last iteration (None on its first beat)."""
    own_s: Optional[float]
    """Seconds of that iteration the rank spent on its own, not waiting for others."""
    median_iter_s: Optional[float]
    """Median ``iter_s`` of the last ``window`` beats; None until ``window`` beats had one."""
    median_own_s: Optional[float]
    """Median ``own_s`` of the same beats."""
    host: str
    """``socket.gethostname()`` of the rank: where to look."""
    pid: int
    """Process id of the rank: what to inspect (py-spy) or kill."""
    done: bool
    """The rank finished training and beats no more (it must not count as hung)."""

    @classmethod
    def from_json(cls, rank: int, data) -> "Beat":
        d = json.loads(data)
        return cls(rank=rank, t=d["t"], iteration=d["iteration"], iter_s=d.get("iter_s"),
                   own_s=d.get("own_s"), median_iter_s=d.get("median_iter_s"),
                   median_own_s=d.get("median_own_s"), host=d.get("host", "?"),
                   pid=d.get("pid", -1), done=bool(d.get("done", False)))


class WindowMedian:
    """Median of the last ``window`` values pushed; None until there are ``window``."""

    def __init__(self, window: int):
        self._values = deque(maxlen=window)

    def push(self, value: float) -> None:
        self._values.append(value)

    @property
    def value(self) -> Optional[float]:
        if len(self._values) < self._values.maxlen:
            return None
        return statistics.median(self._values)


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


class Heartbeat:
    """This rank's heartbeat publisher: one ``store.set`` per iteration.

    Every rank creates one after ``init_process_group``, calls :meth:`beat` at the top of
    every loop iteration and :meth:`finish` once after the loop.

    Args:
        store: any ``torch.distributed.Store`` all ranks share (see :func:`default_store`).
        rank: this process's global rank.
        window: beats per median (``MonitorConfig.straggler_window``).
    """

    def __init__(self, store, rank: int, window: int = 5):
        self._store, self.rank = store, rank
        self._iter, self._own = WindowMedian(window), WindowMedian(window)
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._last = {"iteration": 0, "iter_s": None, "own_s": None}

    def beat(self, iteration: int, iter_s: Optional[float] = None,
             own_s: Optional[float] = None, comm_s: Optional[float] = None,
             collectives: Optional[int] = None) -> None:
        """Every rank, once per iteration, at the top of the loop after the fault injector
        and before the iteration's first collective.

        Args:
            iteration: the iteration about to run, 1-based (``state.iteration + 1``,
                the same number the fault injector's ``before_iteration`` gets).
            iter_s: wall seconds of the last iteration (None on the first beat).
            own_s: seconds of it this rank spent on its own, not waiting for other ranks
                (see the module doc); None: all of ``iter_s``.
            comm_s, collectives: seconds inside collectives and their number in the
                last iteration (:class:`CollectiveClock`), published for the record.
        """
        if own_s is None:
            own_s = iter_s
        if iter_s is not None:
            self._iter.push(iter_s)
            self._own.push(own_s)
        self._last = {"iteration": iteration, "iter_s": iter_s, "own_s": own_s,
                      "comm_s": comm_s, "collectives": collectives}
        self._publish(done=False)

    def ready(self, iteration: int) -> None:
        """Every rank, once, before the loop: a beat of the last finished ``iteration``.

        Without it a rank that hung before its first :meth:`beat` (in the fault injector,
        or in work between the load and the loop) left the job unwatched: no hang is
        found before every rank has beaten once, and the others waited in their first
        collective forever. With it that rank lags at ``iteration`` while the others
        beat ``iteration + 1``."""
        self._last = {"iteration": iteration, "iter_s": None, "own_s": None}
        self._publish(done=False)

    def touch(self) -> None:
        """Progress inside an iteration (an evaluation step, the start of a save): the
        same beat again with a new time, so that the hang timeout counts each phase on
        its own instead of the iteration, evaluation and save together."""
        self._publish(done=False)

    def finish(self) -> None:
        """Every rank, once it left the training loop: a finished rank is not a hung one."""
        self._publish(done=True)

    def _publish(self, done: bool) -> None:
        payload = dict(self._last, t=time.time(), median_iter_s=self._iter.value,
                       median_own_s=self._own.value, host=self._host, pid=self._pid, done=done)
        self._store.set(heartbeat_key(self.rank), json.dumps(payload))


# ----------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class HangFinding:
    """What :func:`find_hang` concluded."""

    rank: int
    """The rank blamed: the lagging rank, or (no rank lags) the one silent longest."""
    seconds: float
    """How long the blamed rank's heartbeat has not advanced."""
    iteration: int
    """The iteration the blamed rank was starting at its last beat."""
    suspects: List[int]
    """Every stalled rank at the lowest iteration (one rank when the culprit is known)."""
    waiting: List[int]
    """Ranks that started a later iteration: they wait for the suspects in a collective."""


def find_hang(beats: Mapping[int, Beat], ages: Mapping[int, float], world_size: int,
              timeout_s: float) -> Optional[HangFinding]:
    """The hang rule (see the module doc); pure.

    Args:
        beats: each rank's last beat (ranks that never beat are missing).
        ages: seconds since each rank's heartbeat last advanced, as the caller observed.
        world_size: ranks in the job; no hang is found before all of them beat once.
        timeout_s: ``hang_timeout_s``.
    """
    if len(beats) < world_size:
        return None  # not every rank is training yet: start-up is not watched
    active = {r: b for r, b in beats.items() if not b.done}
    # A per-rank timeout would add nothing but false alarms: no rank can progress more
    # than one iteration without the others, so while any rank progresses, all do.
    if not active or min(ages[r] for r in active) <= timeout_s:
        return None
    low = min(b.iteration for b in active.values())
    suspects = sorted(r for r, b in active.items() if b.iteration == low)
    culprit = max(suspects, key=lambda r: (ages[r], -r))
    waiting = sorted(r for r, b in active.items() if b.iteration > low)
    return HangFinding(rank=culprit, seconds=ages[culprit], iteration=low,
                       suspects=suspects, waiting=waiting)


def find_stragglers(beats: Mapping[int, Beat], factor: float) -> Dict[int, float]:
    """The straggler rule (see the module doc); pure.

    Returns:
        ``{rank: slowdown}`` of every rank whose slowdown exceeds ``factor``; ranks
        without a full window, and finished ranks, are neither judged nor compared.
    """
    medians = {r: (b.median_iter_s, b.median_own_s) for r, b in beats.items()
               if not b.done and b.median_iter_s is not None and b.median_own_s is not None}
    out = {}
    for r, (m_iter, m_own) in medians.items():
        others = [own for s, (_, own) in medians.items() if s != r]
        if not others:
            continue
        excess = m_own - statistics.median(others)
        if excess <= 0:
            continue
        slowdown = m_iter / max(m_iter - excess, 1e-9)
        if slowdown > factor:
            out[r] = slowdown
    return out


# -------------------------------------------------------------------------- watchdog

def _print_flush(message: str) -> None:
    print(message, flush=True)  # flushed: os._exit follows and would drop a buffered line


def _print_event(event: Dict) -> None:
    print(json.dumps(event), flush=True)


def _report_only(event: Dict) -> None:
    pass


def exit_now(status: int) -> None:
    """Flush stdout and stderr, then end this process at once with ``status`` (no clean-up:
    a rank that stops for a hang or a straggler must not wait in a collective).

    Called by :meth:`Watchdog.stop_job` on every rank that stops (from the watchdog's
    thread, and from the atexit handler it registers first) and by
    :class:`StartupWatch`'s default ``on_hang``; tests replace it to observe the status
    instead of exiting.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def default_store():
    """The rendezvous store of the default process group (after ``init_process_group``).
    Launchers create a new one for every restart, so no heartbeat of an earlier attempt
    is ever read."""
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


class Watchdog:
    """Detects hangs and stragglers from every rank's heartbeat; one per rank.

    Every rank creates one after the process group exists, calls :meth:`start` before
    the training loop and :meth:`stop` after :meth:`Heartbeat.finish`. It polls in a
    daemon thread; :meth:`poll_once` runs one poll in the caller's thread (tests).

    Args:
        store: the store the ranks' :class:`Heartbeat` objects write to.
        rank: this process's global rank (``detected_by`` of its events).
        world_size: ranks in the job.
        config: thresholds.
        emit: receives each event once per job attempt (default: print it as JSON).
        on_hang: called on every detecting rank after a hang was found (default:
            :meth:`stop_job`, which ends the process with :data:`EXIT_HANG`).
        on_straggler: called on every detecting rank per straggler (default: by
            ``config.straggler_action``: nothing, or :meth:`stop_job`).
        log: prints the detection lines (default: print, flushed).
        clock: monotonic seconds (tests pass a fake clock).
    """

    def __init__(self, store, rank: int, world_size: int, config: MonitorConfig,
                 emit: Optional[Callable[[Dict], None]] = None,
                 on_hang: Optional[Callable[[Dict], None]] = None,
                 on_straggler: Optional[Callable[[Dict], None]] = None,
                 log: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self.rank, self.world_size, self.config = store, rank, world_size, config
        self._emit = emit or _print_event
        self._on_hang = on_hang or self.stop_job
        if on_straggler is None:
            on_straggler = self.stop_job if config.straggler_action == "stop" else _report_only
        self._on_straggler = on_straggler
        self._log = log or _print_flush
        self._clock = clock
        self._seen: Dict[int, tuple] = {}
        """rank -> (the beat's identity, when this watchdog first saw it)."""
        self._hang_reported = False
        self._stragglers_reported = set()
        self._store_failing_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        """Start polling in a daemon thread (a daemon: it must never keep a process alive)."""
        self._thread = threading.Thread(target=self._run, name=f"moc-watchdog-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; waits for a poll in progress (bounded: a dead store may block)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.poll_s + 5.0)

    def stop_job(self, event: Dict) -> None:
        """Default ``on_hang`` (and ``on_straggler`` with ``straggler_action="stop"``): end
        this process with :data:`EXIT_HANG` (:data:`EXIT_STRAGGLER`), together with the
        other ranks, so the launcher (torchrun ``--max-restarts``) restarts the job.

        ``os._exit``, not ``sys.exit``: the main thread is blocked in a collective and
        would never see an exception raised here. Before exiting, the rank waits until
        every rank has detected the same event (each adds 1 to ``moc/ack/<kind>``; at
        most ``2 * poll_s + 1`` seconds): a rank that exited at once would break the
        collective the slower detectors' main threads wait in, and they would die of
        that error instead, without logging what happened. If the main thread dies
        first anyway, an atexit handler still sets the exit status.
        """
        status = EXIT_HANG if event["kind"] == "hang" else EXIT_STRAGGLER
        atexit.register(exit_now, status)
        self._log(f"[monitor] rank {self.rank}: stopping with exit status {status} "
                  "for the launcher to restart the job")
        deadline = time.monotonic() + 2 * self.config.poll_s + 1.0  # real time, even in tests
        try:
            key = f"moc/ack/{event['kind']}"
            count = self._store.add(key, 1)
            while count < self.world_size and time.monotonic() < deadline:
                time.sleep(0.02)
                count = self._store.add(key, 0)
        except Exception:
            pass  # the store's host exited: the others are going down already
        exit_now(status)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self.poll_once()
                self._store_failing_since = None
            except Exception as e:  # the thread must outlive a store hiccup
                self._store_failed(e)

    def _store_failed(self, error: Exception) -> None:
        """A store that stays unreachable means its host died (rank 0 or the launcher's
        agent): treat it as a hang so this rank does not wait for the collective timeout."""
        now = self._clock()
        if self._store_failing_since is None:
            self._store_failing_since = now
            self._log(f"[monitor] rank {self.rank}: poll failed: {error!r}")
        elif now - self._store_failing_since > self.config.hang_timeout_s and not self._hang_reported:
            self._hang_reported = True
            event = {"kind": "hang", "rank": -1, "host": None, "pid": None,
                     "seconds_since_progress": now - self._store_failing_since,
                     "iteration": None, "time": time.time(), "detected_by": self.rank,
                     "reason": f"rendezvous store unreachable: {error}"}
            self._log(f"[monitor] rank {self.rank}: HANG: the rendezvous store has been "
                      f"unreachable for {event['seconds_since_progress']:.1f} s; stopping")
            self._emit_safely(event)  # no election without the store: every rank emits
            self._on_hang(event)

    def poll_once(self) -> List[Dict]:
        """Read every heartbeat once and act on what it shows; returns the events found
        (also the ones another rank emitted)."""
        beats = self._read_beats()
        now = self._clock()
        for r, b in beats.items():
            identity = (b.t, b.iteration, b.done)
            if r not in self._seen or self._seen[r][0] != identity:
                self._seen[r] = (identity, now)
        ages = {r: now - self._seen[r][1] for r in beats}
        events = []
        hang = None if self._hang_reported else find_hang(
            beats, ages, self.world_size, self.config.hang_timeout_s)
        if hang is not None:
            events.append(self._hang_event(hang, beats))
        for r, slowdown in sorted(find_stragglers(beats, self.config.straggler_factor).items()):
            if r not in self._stragglers_reported:
                events.append(self._straggler_event(r, slowdown, beats[r]))
        for event in events:
            self._act(event)
        return events

    def _read_beats(self) -> Dict[int, Beat]:
        keys = [heartbeat_key(r) for r in range(self.world_size)]
        if len(self._seen) == self.world_size:  # every key exists: one round trip
            return {r: Beat.from_json(r, v) for r, v in enumerate(self._store.multi_get(keys))}
        # ``get`` of a missing key blocks until the store's timeout: check first.
        return {r: Beat.from_json(r, self._store.get(k))
                for r, k in enumerate(keys) if self._store.check([k])}

    def _hang_event(self, hang: HangFinding, beats: Mapping[int, Beat]) -> Dict:
        self._hang_reported = True
        b = beats[hang.rank]
        event = {"kind": "hang", "rank": hang.rank, "host": b.host, "pid": b.pid,
                 "seconds_since_progress": round(hang.seconds, 3), "iteration": hang.iteration,
                 "time": time.time(), "detected_by": self.rank, "last_beat_time": b.t,
                 "suspects": hang.suspects, "waiting": hang.waiting}
        if hang.waiting:
            what = (f"rank {hang.rank} (host {b.host}, pid {b.pid}) made no progress for "
                    f"{hang.seconds:.2f} s: it never started iteration {hang.iteration + 1}, "
                    f"{'rank' if len(hang.waiting) == 1 else 'ranks'} {_ranks(hang.waiting)} "
                    f"did and {'waits' if len(hang.waiting) == 1 else 'wait'} for it")
        else:
            what = (f"all ranks stalled in iteration {hang.iteration} for "
                    f"{hang.seconds:.2f} s; culprit unknown (suspects {_ranks(hang.suspects)}); "
                    f"silent longest: rank {hang.rank} (host {b.host}, pid {b.pid})")
        self._log(f"[monitor] rank {self.rank}: HANG: {what}")
        return event

    def _straggler_event(self, r: int, slowdown: float, b: Beat) -> Dict:
        self._stragglers_reported.add(r)
        event = {"kind": "straggler", "rank": r, "host": b.host, "pid": b.pid,
                 "slowdown": round(slowdown, 3), "iteration": b.iteration, "time": time.time(),
                 "detected_by": self.rank, "median_iter_s": b.median_iter_s,
                 "median_own_s": b.median_own_s, "action": self.config.straggler_action}
        self._log(f"[monitor] rank {self.rank}: STRAGGLER: rank {r} (host {b.host}, pid "
                  f"{b.pid}) slows iterations down {slowdown:.2f}x (median own time "
                  f"{b.median_own_s:.3f} s of {b.median_iter_s:.3f} s per iteration) at "
                  f"iteration {b.iteration}; action: {self.config.straggler_action}")
        return event

    def _act(self, event: Dict) -> None:
        try:
            first = self._store.add(event_key(event["kind"], event["rank"]), 1) == 1
        except Exception:
            first = True  # better twice in the event file than never
        if first:
            self._emit_safely(event)
        if event["kind"] == "hang":
            self._on_hang(event)
        else:
            self._on_straggler(event)

    def _emit_safely(self, event: Dict) -> None:
        """Record an event; a failure to (the event file's disk full) is logged, never
        raised: the action that follows (stopping this rank at a hang) must still run,
        or this rank would go on while the others wait for it."""
        try:
            self._emit(event)
        except Exception as e:
            self._log(f"[monitor] rank {self.rank}: cannot record the {event['kind']} event "
                      f"({type(e).__name__}: {e}); acting on it anyway")


def _ranks(ranks: List[int]) -> str:
    return ",".join(str(r) for r in ranks)


# -------------------------------------------------------------------------- start-up

class StartupWatch:
    """Start-up and loading watched like iterations: a phase lasting longer than
    ``config.startup_timeout_s`` is a hang, reported naming the phase, and the rank exits
    with :data:`EXIT_HANG` for the launcher to restart the job.

    Heartbeats need the rendezvous store, which exists only once the process group does,
    and :func:`find_hang` finds nothing before every rank beat once; so a rank stuck in
    start-up (a JIT build waiting for a dead builder's lock file, a rendezvous a peer
    never joins, a load from a stalled file system) waited forever, unreported. This
    watch needs no store: each rank times its own phases in a daemon thread. A rank that
    waits in a start-up collective for a stuck peer times out as well and names its own
    phase; the launcher stops the others once one rank exits.

    Every rank: ``watch = StartupWatch(rank, config).start()`` first, ``watch.phase(name)``
    as each phase begins, ``watch.stop()`` once the training loop's :class:`Heartbeat` and
    :class:`Watchdog` take over, and also when start-up fails. :meth:`poll_once` runs one
    check in the caller's thread (tests).

    Args:
        rank: this process's global rank (the launcher's ``RANK``).
        config: ``startup_timeout_s`` and ``poll_s`` are used.
        emit: receives the hang event (default: print it as JSON). Every detecting rank
            emits its own: there is no store to elect one.
        on_hang: called after the event (default: exit with :data:`EXIT_HANG`).
        hint: returns a line to add to the report (the JIT build locks present), or "".
        log: prints the detection line (default: print, flushed).
        clock: monotonic seconds (tests pass a fake clock).
    """

    def __init__(self, rank: int, config: MonitorConfig,
                 emit: Optional[Callable[[Dict], None]] = None,
                 on_hang: Optional[Callable[[Dict], None]] = None,
                 hint: Optional[Callable[[], str]] = None,
                 log: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.config = rank, config
        self._emit = emit or _print_event
        self._on_hang = on_hang or (lambda event: exit_now(EXIT_HANG))
        self._hint = hint
        self._log = log or _print_flush
        self._clock = clock
        self._mutex = threading.Lock()
        self._phase: Optional[str] = None
        self._since = 0.0
        self._reported = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StartupWatch":
        """Start checking in a daemon thread (it must never keep a process alive)."""
        self._thread = threading.Thread(target=self._run, name=f"moc-startup-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def phase(self, name: str) -> None:
        """A new phase begins: its own timeout starts now."""
        with self._mutex:
            self._phase, self._since = name, self._clock()

    def stop(self) -> None:
        """Start-up is over (or failed): no more checks."""
        self._stop.set()
        with self._mutex:
            self._phase = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.poll_s + 5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            self.poll_once()

    def poll_once(self) -> Optional[Dict]:
        """Check the current phase once; the hang event if it just timed out, else None."""
        with self._mutex:
            phase, since = self._phase, self._since
        if phase is None or self._reported:
            return None
        seconds = self._clock() - since
        if seconds <= self.config.startup_timeout_s:
            return None
        self._reported = True
        host, pid = socket.gethostname(), os.getpid()
        event = {"kind": "hang", "rank": self.rank, "host": host, "pid": pid,
                 "phase": phase, "seconds_since_progress": round(seconds, 3),
                 "iteration": None, "time": time.time(), "detected_by": self.rank}
        hint = ""
        if self._hint is not None:
            try:
                hint = self._hint()
            except Exception as e:  # the report must not die of its decoration
                hint = f"(no hint: {type(e).__name__}: {e})"
        self._log(f"[monitor] rank {self.rank}: HANG in start-up: phase {phase!r} has lasted "
                  f"{seconds:.1f} s (--moc-startup-timeout {self.config.startup_timeout_s:g}) "
                  f"on host {host}, pid {pid}; stopping with exit status {EXIT_HANG}"
                  + (f"; {hint}" if hint else ""))
        try:
            self._emit(event)
        except Exception as e:  # stopping must still happen (see Watchdog._emit_safely)
            self._log(f"[monitor] rank {self.rank}: cannot record the hang event "
                      f"({type(e).__name__}: {e}); acting on it anyway")
        self._on_hang(event)
        return event


# ------------------------------------------------------------------------------ flags

def add_monitor_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--moc-monitor`` and its thresholds to ``parser``."""
    d = MonitorConfig()
    g = parser.add_argument_group("hang and straggler detection")
    g.add_argument("--moc-monitor", action="store_true",
                   help="Publish a heartbeat per iteration and watch all ranks' heartbeats.")
    g.add_argument("--moc-hang-timeout", type=float, default=d.hang_timeout_s,
                   help="Seconds without progress of any rank after which every rank exits "
                        f"with status {EXIT_HANG} (for the launcher to restart the job).")
    g.add_argument("--moc-straggler-factor", type=float, default=d.straggler_factor,
                   help="Report a rank that slows iterations down by more than this factor.")
    g.add_argument("--moc-straggler-window", type=int, default=d.straggler_window,
                   help="Iterations whose median time is compared (>= 3).")
    g.add_argument("--moc-straggler-action", default=d.straggler_action, choices=STRAGGLER_ACTIONS,
                   help=f"On a straggler: report it, or stop the job (exit {EXIT_STRAGGLER}).")
    g.add_argument("--moc-monitor-poll", type=float, default=d.poll_s,
                   help="Seconds between two checks of the heartbeats.")
    g.add_argument("--moc-startup-timeout", type=float, default=d.startup_timeout_s,
                   help="Seconds a start-up or loading phase (process group, data, model and "
                        "engine, checkpoint load) may last before the rank reports a hang "
                        f"naming the phase and exits with status {EXIT_HANG}.")
