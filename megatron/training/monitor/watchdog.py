"""The watchdog: a thread on every rank that reads all heartbeats and acts on a hang or
a straggler, up to ending its own process.

A :class:`Watchdog` thread on *every* rank reads all heartbeats every ``poll_s`` seconds,
so a hang is found even when the hung rank is rank 0, and a rank blocked in a collective
still finds it: gloo's collectives release the GIL while they wait
(``tests/training/test_monitor.py`` checks that with ranks blocked in ``all_reduce`` and
``all_to_all_single``). It applies :mod:`megatron.training.monitor.rules`.

On a hang each watchdog calls ``on_hang`` (default: :meth:`Watchdog.stop_job`, ending
with ``os._exit(EXIT_HANG)`` once every rank detected it, so the launcher's restart
machinery -- torchrun ``--max-restarts`` -- restarts the job); the hung rank's own
watchdog finds itself the same way and exits too (its main thread sleeps or waits
without the GIL). A rank stuck holding the GIL cannot run its watchdog: the others exit
and the launcher kills it. Each straggler is reported once per process;
``straggler_action="stop"`` exits like a hang (``EXIT_STRAGGLER``).

Each event is emitted once per job attempt: the first rank to ``store.add`` the key
``moc/event/<kind>/<rank>`` (:func:`event_key`) emits it; every detecting rank still logs
and acts on it.

Cost: a poll reads ``world_size`` keys, on every rank, so the store serves
``world_size**2`` reads per ``poll_s``: fine for tens of ranks; for thousands use a
larger ``poll_s``.
"""

import atexit
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional

from megatron.training.monitor.beats import Beat, alive_key, heartbeat_key
from megatron.training.monitor.config import MonitorConfig
from megatron.training.monitor.exits import (EXIT_HANG, EXIT_STRAGGLER, exit_now, print_event,
                                             print_line)
from megatron.training.monitor.rules import HangFinding, find_hang, find_stragglers


def event_key(kind: str, rank: int) -> str:
    """Store counter electing the one rank that emits the ``kind`` event about ``rank``."""
    return f"moc/event/{kind}/{rank}"


def _report_only(event: Dict) -> None:
    pass


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
        self._emit = emit or print_event
        self._on_hang = on_hang or self.stop_job
        if on_straggler is None:
            on_straggler = self.stop_job if config.straggler_action == "stop" else _report_only
        self._on_straggler = on_straggler
        self._log = log or print_line
        self._clock = clock
        self._seen: Dict[int, tuple] = {}
        """rank -> (the beat's identity, when this watchdog first saw it)."""
        self._polls = 0
        self._alive_seen: Dict[int, tuple] = {}
        """rank -> (its watchdog's poll count, when this watchdog first saw it)."""
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
        """Say this process is alive, read every heartbeat once and act on what it shows;
        returns the events found (also the ones another rank emitted)."""
        self._polls += 1
        self._store.set(alive_key(self.rank), str(self._polls))
        beats = self._read_beats()
        now = self._clock()
        alive_ages = self._alive_ages(now)
        for r, b in beats.items():
            identity = (b.t, b.iteration, b.done)
            if r not in self._seen or self._seen[r][0] != identity:
                self._seen[r] = (identity, now)
        ages = {r: now - self._seen[r][1] for r in beats}
        events = []
        hang = None if self._hang_reported else find_hang(
            beats, ages, self.world_size, self.config.hang_timeout_s, alive_ages)
        if hang is not None:
            events.append(self._hang_event(hang, beats))
        for r, slowdown in sorted(find_stragglers(beats, self.config.straggler_factor).items()):
            if r not in self._stragglers_reported:
                events.append(self._straggler_event(r, slowdown, beats[r]))
        for event in events:
            self._act(event)
        return events

    def _alive_ages(self, now: float) -> Dict[int, float]:
        """Seconds since each rank's watchdog poll count last changed, as this watchdog
        saw it (ranks whose count it never read are left out)."""
        counts = self._per_rank(alive_key, all_exist=len(self._alive_seen) == self.world_size)
        for r, count in counts.items():
            if r not in self._alive_seen or self._alive_seen[r][0] != count:
                self._alive_seen[r] = (count, now)
        return {r: now - seen for r, (_, seen) in self._alive_seen.items()}

    def _read_beats(self) -> Dict[int, Beat]:
        return {r: Beat.from_json(r, v) for r, v in self._per_rank(
            heartbeat_key, all_exist=len(self._seen) == self.world_size).items()}

    def _per_rank(self, key_of: Callable[[int], str], all_exist: bool) -> Dict[int, bytes]:
        """``{rank: value}`` of each rank's key that exists; one round trip once every
        key is known to exist (``get`` of a missing key blocks until the store's
        timeout, so until then each is checked first)."""
        keys = [key_of(r) for r in range(self.world_size)]
        if all_exist:
            return dict(enumerate(self._store.multi_get(keys)))
        return {r: self._store.get(k) for r, k in enumerate(keys) if self._store.check([k])}

    def _hang_event(self, hang: HangFinding, beats: Mapping[int, Beat]) -> Dict:
        self._hang_reported = True
        b = beats[hang.rank]
        event = {"kind": "hang", "rank": hang.rank, "host": b.host, "pid": b.pid,
                 "seconds_since_progress": round(hang.seconds, 3), "iteration": hang.iteration,
                 "time": time.time(), "detected_by": self.rank, "last_beat_time": b.t,
                 "suspects": hang.suspects, "waiting": hang.waiting}
        if hang.frozen:
            what = (f"rank {hang.rank} (host {b.host}, pid {b.pid}) is frozen: no progress "
                    f"for {hang.seconds:.2f} s in iteration {hang.iteration} and its "
                    f"watchdog stopped polling too; "
                    f"{'rank' if len(hang.waiting) == 1 else 'ranks'} {_ranks(hang.waiting)} "
                    f"{'waits' if len(hang.waiting) == 1 else 'wait'} for it")
        elif hang.waiting:
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
