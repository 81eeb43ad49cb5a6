"""The two stages of a snapshot after the save call: *copied*, then *sealed*
(:mod:`deepspeed_ext.two_level`).

A snapshot's bytes must be in the slot before the next optimizer step overwrites the
tensors they come from; nothing else has to be done by then. The checksum of a slot
image (tens of milliseconds per GB on one core) and the metadata write used to run in
the same job the step waited for, and made a snapshot every iteration cost +331 % on
an H200 where the copy alone was 21 ms. So the work is split:

* **copied**: CUDA: the copies are queued on a side stream by the save call, and the
  optimizer step's compute stream waits on their event (a device wait, the host goes
  on); CPU: the copy runs on the copy thread, and the step joins it.
* **sealed**: on a seal thread, after the copy: the memory checksum (chunks hashed on a
  small pool of threads, :mod:`deepspeed_ext.format.memsum`), the slot published as
  complete, its persist job handed to the keeper, its protection queued with the peers.

A slot being sealed is busy: the next save picks another one, and waits for the oldest
seal only when none is free (:attr:`SnapshotTiming.slot_wait_s`). A process killed
between the stages leaves a slot without metadata, which recovery ignores.

Order, per snapshot (the training process)::

    stages.start(work)       # save call: CUDA copies queued; CPU copy and seal submitted
    stages.wait_copied()     # the wrapped engine.step, before the optimizer runs
    ... seal thread: checksum, publish, hand-over, protect (off the step's path)
    stages.join()            # wait(), a load, shutdown: every stage of every snapshot
"""

import collections
import logging
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch

from deepspeed_ext.format import memsum
from deepspeed_ext.two_level.persister import Persister
from deepspeed_ext.two_level.records import PersistRequest, RankPlace, SnapshotTiming

logger = logging.getLogger(__name__)

TIMINGS_KEPT = 4096
"""Snapshots whose :class:`SnapshotTiming` a rank keeps (a week of per-iteration
snapshots would otherwise grow without bound)."""


@dataclass
class SnapshotWork:
    """One snapshot as the save call hands it to the copy and seal threads."""

    slot: int
    buffer: torch.Tensor
    """The slot's mapping (uint8), at least ``layout.nbytes`` long."""
    layout: Any
    """The image layout (:class:`deepspeed_ext.format.image.ImageLayout`)."""
    plan: Any
    """Its cached copy plan (:class:`deepspeed_ext.format.copy_plan.CopyPlan`)."""
    tensors: Dict[str, torch.Tensor]
    meta: Dict[str, Any]
    """The slot's metadata; the seal adds ``checksum``."""
    layout_id: Optional[str]
    """The layout's id: its static metadata is written once (:meth:`SnapshotSlots.publish`)."""
    persist: Optional[PersistRequest]
    """Its persist, whose keeper job the seal builds and hands over; None: memory only."""
    protect: bool
    """Whether the peers' redundancy protects it (every rank the same)."""
    timing: SnapshotTiming


@dataclass
class _InFlight:
    """The copy the next optimizer step must not overtake."""

    work: SnapshotWork
    host: Optional[Future] = None
    """CPU: the copy on the copy thread (its result: whether it succeeded)."""
    device: Any = None
    """CUDA: :class:`deepspeed_ext.engine.hostcopy.DeviceCopy` (its events)."""


class SnapshotStages:
    """This rank's snapshot copies and seals, each on one long-lived thread.

    Args:
        place: this rank's place (its copier, slots, redundancy, config).
        persister: builds a persist's keeper job on the seal thread (the write plan and
            layout records cost milliseconds the save call does not pay), and reports
            a share that never reached the keeper as failed.
        submit_job: hands a sealed snapshot's persist job to the keeper (seal thread).
        fault_hook: returns the fault-injection hook, if any: called on the seal thread
            with the step once the bytes are copied, before the slot is published.
    """

    def __init__(self, place: RankPlace, persister: Persister,
                 submit_job: Callable[[Any], None],
                 fault_hook: Callable[[], Optional[Callable[[int], None]]]):
        self.place = place
        self._persister = persister
        self._submit_job = submit_job
        self._fault_hook = fault_hook
        self.threads = memsum.resolve_threads(place.cfg.checksum_threads)
        """Threads a seal's checksum uses (``--moc-checksum-threads``; 0: automatic)."""
        # Long-lived threads: starting a thread per snapshot made the save call wait up
        # to a GIL switch interval (5 ms) for it to start.
        self.copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-snapshot")
        self.seal_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moc-seal")
        self._copy: Optional[_InFlight] = None
        self._seals: Deque[Tuple[int, Future]] = collections.deque()
        """``(slot, seal)`` of snapshots not known to be sealed, oldest first."""
        self._device_waits: List[Tuple[SnapshotTiming, Any, Any]] = []
        """CUDA: ``(timing, before, after)`` events around a step's wait, read once done."""
        self._error_lock = threading.Lock()
        self._error: Optional[str] = None
        self.timings: Deque[SnapshotTiming] = collections.deque(maxlen=TIMINGS_KEPT)

    # -- main thread ---------------------------------------------------------------

    def start(self, work: SnapshotWork) -> None:
        """Save call: start the copy (CUDA: queued on the side stream now; CPU: on the
        copy thread) and queue the seal behind it."""
        copier = self.place.copier
        self.timings.append(work.timing)
        work.timing.nbytes = work.layout.nbytes
        flight = _InFlight(work)
        if copier.cuda:
            flight.device = copier.launch_plan(work.buffer, work.layout, work.plan, work.tensors)
            work.timing.copies = flight.device.copies
        else:
            flight.host = self.copy_pool.submit(self._copy_on_host, work)
        self._copy = flight
        self._seals.append((work.slot, self.seal_pool.submit(self._seal, flight)))

    def copy_pending(self) -> bool:
        """Whether a copy is still to be waited for (the wrapped step's question)."""
        return self._copy is not None

    def wait_copied(self) -> None:
        """The wrapped ``engine.step`` (main thread), before the optimizer runs: the
        tensors may be overwritten once the copy has read them. CUDA: the compute stream
        waits on the copy's event (no host wait); CPU: joins the copy thread."""
        flight, self._copy = self._copy, None
        if flight is None:
            return
        start = time.perf_counter()
        if flight.device is not None:
            before, after = self.place.copier.order_after(flight.device)
            self._device_waits.append((flight.work.timing, before, after))
        else:
            flight.host.result()  # _copy_on_host records its errors; it does not raise
        flight.work.timing.host_wait_s = time.perf_counter() - start

    def sealing(self) -> Set[int]:
        """Slots whose snapshot is not sealed yet (busy: the next save must not use them)."""
        while self._seals and self._seals[0][1].done():
            self._seals.popleft()
        return {slot for slot, seal in self._seals if not seal.done()}

    def wait_oldest_seal(self) -> float:
        """Wait for the oldest unsealed snapshot; returns the seconds waited."""
        start = time.perf_counter()
        if self._seals:
            self._seals.popleft()[1].result()
        return time.perf_counter() - start

    def join(self) -> None:
        """Wait for every stage of every snapshot (``wait()``, a load, shutdown)."""
        self.wait_copied()
        while self._seals:
            self._seals.popleft()[1].result()
        self._read_device_waits(final=True)

    def take_error(self) -> Optional[str]:
        """This rank's first copy or seal error since the last call, and forget it."""
        with self._error_lock:
            error, self._error = self._error, None
        return error

    def record_error(self, error: str) -> None:
        """Keep the first error: it may be reported only at a later persist or wait."""
        with self._error_lock:
            self._error = self._error or error

    @property
    def error(self) -> Optional[str]:
        return self._error

    def shutdown(self) -> None:
        self.join()
        self.copy_pool.shutdown(wait=True)
        self.seal_pool.shutdown(wait=True)

    def settled_timings(self) -> List[SnapshotTiming]:
        """The timings kept, CUDA device waits read where their events completed."""
        self._read_device_waits(final=False)
        return list(self.timings)

    def _read_device_waits(self, final: bool) -> None:
        pending = []
        for timing, before, after in self._device_waits:
            if final or after.query():
                after.synchronize()
                timing.device_wait_s = before.elapsed_time(after) / 1e3
            else:
                pending.append((timing, before, after))
        self._device_waits = pending

    # -- copy thread ------------------------------------------------------------------

    def _copy_on_host(self, work: SnapshotWork) -> bool:
        """Copy thread (CPU state): the image into the slot; False when it failed."""
        start = time.perf_counter()
        try:
            with torch.no_grad():
                work.timing.copies = self.place.copier.copy_plan(work.buffer, work.layout,
                                                                 work.plan, work.tensors)
            return True
        except Exception as e:
            traceback.print_exc()
            self.record_error(f"{type(e).__name__}: {e}")
            return False
        finally:
            work.timing.copy_s = time.perf_counter() - start

    # -- seal thread -------------------------------------------------------------------

    def _seal(self, flight: _InFlight) -> None:
        """Seal thread: once the bytes are in the slot, checksum them, mark the slot
        complete, hand the persist job to the keeper and the image to the redundancy."""
        work, place, timing = flight.work, self.place, flight.work.timing
        published = handed_over = False
        try:
            if not self._copied(flight):
                if work.persist is not None:
                    self._persister.report_failed(work.persist, self.error or "copy failed")
                return
            start = time.perf_counter()
            # Recovery and the keeper check it before using the bytes: a bit flipped in
            # memory must neither be loaded nor persisted under a fresh SHA-256.
            work.meta["checksum"] = memsum.digest(work.buffer[:work.layout.nbytes],
                                                  threads=self.threads)
            timing.checksum_s = time.perf_counter() - start
            timing.checksum_threads = self.threads
            hook = self._fault_hook()
            if hook is not None:  # fault injection: die with the slot filled
                hook(work.meta["step"])  # but not yet published as complete
            start = time.perf_counter()
            place.slots.publish(work.slot, work.meta, layout_id=work.layout_id)
            published = True
            if work.persist is not None:
                self._submit_job(replace(self._persister.job_for(work.persist),
                                         checksum=work.meta["checksum"],
                                         done_marker=place.slots.persist_marker(work.slot)))
                handed_over = True
            timing.publish_s = time.perf_counter() - start
        except Exception as e:
            traceback.print_exc()
            self.record_error(f"{type(e).__name__}: {e}")
            if work.persist is not None and not handed_over:
                self._persister.report_failed(work.persist, f"{type(e).__name__}: {e}")
        finally:
            if work.protect:  # every rank, even after a failed copy: the peers pair up
                place.redundancy.protect(work.meta["step"], work.slot,
                                         work.buffer if published else None,
                                         work.meta if published else None)
            timing.sealed = True

    def _copied(self, flight: _InFlight) -> bool:
        """Seal thread: wait until the snapshot's bytes are in the slot; False when the
        copy failed (already recorded)."""
        if flight.device is None:
            return flight.host.result()
        self.place.copier.wait_host(flight.device)
        flight.work.timing.copy_s = flight.device.seconds()
        return True
