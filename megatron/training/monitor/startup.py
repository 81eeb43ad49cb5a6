"""The start-up watch: each rank's start-up and loading phases, timed before any
heartbeat exists.

Before the loop there is no heartbeat yet: :class:`StartupWatch` times each start-up and
loading phase of its own rank (process group, data, model and engine, checkpoint load)
and reports a phase that outlasts ``startup_timeout_s`` as a hang naming the phase,
exiting with :data:`~megatron.training.monitor.exits.EXIT_HANG` like a hang in the loop.
"""

import os
import socket
import threading
import time
from typing import Callable, Dict, Optional

from megatron.training.monitor.config import MonitorConfig
from megatron.training.monitor.exits import EXIT_HANG, exit_now, print_event, print_line


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
        self._emit = emit or print_event
        self._on_hang = on_hang or (lambda event: exit_now(EXIT_HANG))
        self._hint = hint
        self._log = log or print_line
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
