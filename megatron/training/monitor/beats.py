"""The heartbeat: what each rank publishes per iteration, and how a watchdog reads it.

Every rank publishes one heartbeat per iteration under ``moc/hb/<rank>``
(:func:`heartbeat_key`) of a ``torch.distributed`` Store (the job's rendezvous store,
:func:`default_store`): a JSON object ``{"t", "iteration", "iter_s", "own_s", "comm_s",
"collectives", "median_iter_s", "median_own_s", "host", "pid", "done"}``.
:class:`Heartbeat` writes it (one ``store.set`` per beat), :class:`Beat` is one rank's
last heartbeat as a watchdog reads it back.

A heartbeat carries two times: ``iter_s``, the wall time of the last iteration, and
``own_s``, the part of it this rank spent on its own, not waiting for other ranks (None:
all of it; :mod:`megatron.training.monitor.clock` measures the rest). Each rank keeps
the median of each over its last ``straggler_window`` beats (:class:`WindowMedian`),
which :func:`~megatron.training.monitor.rules.find_stragglers` compares.
"""

import json
import os
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional


def heartbeat_key(rank: int) -> str:
    """Store key of ``rank``'s heartbeat."""
    return f"moc/hb/{rank}"


def alive_key(rank: int) -> str:
    """Store key of ``rank``'s watchdog's poll count: it advances while the process runs,
    even with its main thread blocked in a collective, and stops when the whole process
    is frozen (SIGSTOP, a debugger, a machine that stopped scheduling it)."""
    return f"moc/alive/{rank}"


def default_store():
    """The rendezvous store of the default process group (after ``init_process_group``).
    Launchers create a new one for every restart, so no heartbeat of an earlier attempt
    is ever read."""
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


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
        """``rank``'s beat from ``data``, the JSON its :class:`Heartbeat` set; read by the
        watchdog's thread at each poll. ``t`` and ``iteration`` are required (KeyError);
        the other fields default when missing."""
        d = json.loads(data)
        return cls(rank=rank, t=d["t"], iteration=d["iteration"], iter_s=d.get("iter_s"),
                   own_s=d.get("own_s"), median_iter_s=d.get("median_iter_s"),
                   median_own_s=d.get("median_own_s"), host=d.get("host", "?"),
                   pid=d.get("pid", -1), done=bool(d.get("done", False)))


class WindowMedian:
    """Median of the last ``window`` values pushed; None until there are ``window``.

    Each :class:`Heartbeat` keeps two (iteration time and own time), pushed by the thread
    that beats (the training loop's main thread).
    """

    def __init__(self, window: int):
        self._values = deque(maxlen=window)

    def push(self, value: float) -> None:
        self._values.append(value)

    @property
    def value(self) -> Optional[float]:
        if len(self._values) < self._values.maxlen:
            return None
        return statistics.median(self._values)


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
