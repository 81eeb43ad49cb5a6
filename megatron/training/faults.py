"""Fault injection for tests and demos: crash, fail, hang or slow down a chosen rank.

A fault is written ``KIND@ITER[:rank=R][:slow=S]`` (``--moc-fault``, repeatable), e.g.
``crash@12:rank=1`` or ``slow@5:rank=0:slow=0.3``. ``--moc-fault-mtbf SECONDS`` adds
random crashes of random ranks (exponential inter-arrival times of that mean, measured
from the start of the job, reproducible from ``--moc-fault-seed``).

Kinds (what the chosen rank does when the fault fires):

- ``crash``: SIGKILLs itself (a dead node: no exception, no cleanup).
- ``raise``: raises :class:`InjectedFault` (a rank failing with a Python error).
- ``hang``: sleeps forever right before the iteration's first collective.
- ``slow``: sleeps ``slow`` seconds at the top of every iteration from then on, in this
  process; a restarted job is not slowed again (the straggling node counts as replaced).
- ``slow-compute``: sleeps ``slow`` seconds at the start of every micro-batch's forward
  from then on: inside the iteration, between collectives, where the other ranks wait
  for it in the next collective (a slow GPU rather than a slow host).
- ``snapshot-crash``: SIGKILLs itself in the middle of a two-level snapshot: its bytes
  are in the slot but it is not yet published as complete (the copy thread calls
  :meth:`FaultInjector.in_snapshot`).
- ``persist-crash``: the node's keeper SIGKILLs itself while persisting a snapshot
  (armed through :meth:`FaultInjector.persist_env`).
- ``lose-memory``: calls ``lose_memory()`` (the node's in-memory snapshots are gone),
  then SIGKILLs itself.
- ``lose-node``: the same, then SIGKILLs its whole process group: under MoC's supervisor
  (``--moc-restart in-job``) started by ``scripts/run_elastic.sh`` in a session of its
  own, that is the node's launch (its supervisor, its ranks and spares), as when a
  machine is gone.
- ``lose-stage``: the chosen rank's pipeline stage loses its training state in place
  (weights, optimizer state, upstream logs; the processes live on) and the job recovers
  without a restart, localized or global. Fired by the trainer on every rank
  (:mod:`megatron.training.stage_loss`), not by :class:`FaultInjector`; once per process.

Every fault fires once per *job*, not once per process: the automatic restart resumes
from a checkpoint taken before the fault's iteration and would otherwise meet the same
fault again, forever. The rank that fires a fault records it in a small JSON state file
(``state_path``, a local path shared by the job's ranks and restarts) before firing, so
a SIGKILL cannot lose the record. MTBF crashes that fell due while no training loop ran
(start-up, a restart) are skipped, not fired at once.

What ``ITER`` means: the fault fires when the training loop is about to run iteration
``ITER`` (1-based), i.e. at the top of the loop while ``state.iteration == ITER - 1``:
iterations ``1 .. ITER-1`` are complete, nothing of ``ITER`` has run. A job that starts
(or resumes) past ``ITER`` without the fault having fired fires it at its first
iteration. For ``snapshot-crash`` and ``persist-crash``, ``ITER`` is the first snapshot
iteration ``>= ITER`` (the value of ``state.iteration`` the snapshot was taken at).

Call order on every rank (the training loop wires it)::

    validate_faults(specs, mtbf_s, world_size, train_iters)    # with the other flag checks
    injector = FaultInjector(specs, rank, world_size, state_path, mtbf_s, seed, ...)
    env = injector.persist_env()            # the rank that starts the node's keeper
    while state.iteration < train_iters:
        injector.before_iteration(state.iteration + 1)    # may crash, raise, hang, sleep
        ...                                 # the iteration; during a two-level snapshot
        injector.in_snapshot(iteration)     # copy, the checkpoint code calls this

The keeper process calls :func:`deepspeed_ext.keeper.faults.crash_in_persist_if_due`
while it persists a snapshot: the keeper's side of ``persist-crash`` and the state file
live in the checkpoint library (the keeper does not import the trainer); this module
arms it through the environment (:meth:`FaultInjector.persist_env`).
"""

import argparse
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from deepspeed_ext.keeper.faults import (FAULT_KEY_ENV, FAULT_STATE_ENV, PERSIST_CRASH_ENV,
                                         read_state, record_fired, sigkill_self, state_lock,
                                         write_state)
from megatron.errors import ConfigError

KINDS = ("crash", "raise", "hang", "slow", "slow-compute", "snapshot-crash", "persist-crash",
         "lose-memory", "lose-node", "lose-stage")
SLOW_KINDS = ("slow", "slow-compute")
"""Every fault kind ``--moc-fault`` accepts."""

_LOOP_KINDS = ("slow", "slow-compute", "lose-memory", "lose-node", "crash", "raise", "hang")
"""Kinds :meth:`FaultInjector.before_iteration` fires, in firing order: ``slow`` first,
since it lets the rank go on and another fault due at the same iteration still fires."""

JOB_START_ENV = "MOC_JOB_START"
"""Seconds since the epoch when the job (not the restart) started; a launcher may set it
so every rank and every restart measure MTBF crash times from the same origin."""


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault raises (a rank failing with a Python error)."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault of ``--moc-fault``: what happens, on which rank, when.

    Raises:
        ConfigError: (a ValueError) unknown kind, negative rank, iteration < 1 or
            ``slow_s <= 0``; the message names ``--moc-fault`` and the fault.
    """

    kind: str
    """One of :data:`KINDS`."""
    rank: int
    """Global rank that fires it (for ``persist-crash``: any rank of the node whose keeper dies)."""
    iteration: int
    """Fires when the loop is about to run this iteration (1-based; see the module doc)."""
    slow_s: float = 0.5
    """Seconds a ``slow`` fault sleeps each iteration; ignored by the other kinds."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"--moc-fault {self.text}: unknown kind {self.kind!r}; "
                              f"valid kinds: {', '.join(KINDS)}")
        for name in ("rank", "iteration"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"--moc-fault {self.text}: {name} must be an integer")
        if self.rank < 0:
            raise ConfigError(f"--moc-fault {self.text}: rank must be >= 0")
        if self.iteration < 1:
            raise ConfigError(f"--moc-fault {self.text}: iteration must be >= 1 (1-based)")
        if not self.slow_s > 0:
            raise ConfigError(f"--moc-fault {self.text}: slow must be > 0 seconds")

    @property
    def text(self) -> str:
        """The canonical ``--moc-fault`` text; also the fault's key in the state file."""
        out = f"{self.kind}@{self.iteration}:rank={self.rank}"
        return out + (f":slow={self.slow_s:g}" if self.kind in SLOW_KINDS else "")


def parse_fault(text: str) -> FaultSpec:
    """Parse ``KIND@ITER[:rank=R][:slow=S]`` (rank defaults to 0).

    Raises:
        ConfigError: (a ValueError) the message quotes ``text`` and lists the valid kinds.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"--moc-fault {text!r}: {why}; expected KIND@ITER[:rank=R][:slow=S] "
                           f"with KIND one of {', '.join(KINDS)}")

    head, *options = text.strip().split(":")
    kind, at, iteration = head.partition("@")
    if not at:
        raise bad("missing '@ITER'")
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r}")
    values: Dict[str, str] = {}
    for option in options:
        name, eq, value = option.partition("=")
        if not eq or name not in ("rank", "slow"):
            raise bad(f"unknown option {option!r} (options: rank=R, slow=S)")
        if name in values:
            raise bad(f"{name}= given twice")
        values[name] = value
    if "slow" in values and kind not in SLOW_KINDS:
        raise bad("slow= applies to the slow and slow-compute kinds only")
    try:
        it, rank = int(iteration), int(values.get("rank", "0"))
        slow_s = float(values.get("slow", "0.5"))
    except ValueError:
        raise bad("ITER and rank must be integers, slow a number of seconds") from None
    try:
        return FaultSpec(kind=kind, rank=rank, iteration=it, slow_s=slow_s)
    except ConfigError as e:
        raise bad(str(e).split(": ", 1)[-1]) from None


def validate_faults(specs: Sequence[FaultSpec], mtbf_s: Optional[float], world_size: int,
                    train_iters: int) -> None:
    """Check the faults against the job; every rank calls it before any collective.

    Raises:
        ConfigError: naming ``--moc-fault`` or ``--moc-fault-mtbf`` and the bad value.
    """
    for spec in specs:
        if not 0 <= spec.rank < world_size:
            raise ConfigError(f"--moc-fault {spec.text}: rank {spec.rank} is not a rank of "
                              f"this job (world size {world_size})")
        if not 1 <= spec.iteration <= train_iters:
            raise ConfigError(f"--moc-fault {spec.text}: iteration {spec.iteration} is outside "
                              f"1..{train_iters} (--train-iters {train_iters})")
        if not spec.slow_s > 0:
            raise ConfigError(f"--moc-fault {spec.text}: slow must be > 0 seconds")
    if mtbf_s is not None and not mtbf_s > 0:
        raise ConfigError(f"--moc-fault-mtbf {mtbf_s}: must be > 0 seconds")


# ------------------------------------------------------------------------------ MTBF

def _mtbf_events(mtbf_s: float, seed: int, world_size: int) -> Iterator[Tuple[float, int]]:
    """The endless crash sequence: ``(seconds since job start, rank)``, one RNG per seed."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield t, rng.randrange(world_size)


def mtbf_schedule(mtbf_s: float, seed: int, horizon_s: float,
                  world_size: int) -> List[Tuple[float, int]]:
    """Random crashes up to ``horizon_s``: ``[(seconds since job start, rank), ...]``.

    Inter-arrival times are exponential with mean ``mtbf_s`` (a Poisson process), each
    crash hits a uniformly drawn rank. The same arguments give the same list, and a longer
    horizon extends the list without changing its prefix (what every rank and every
    restart relies on to agree on the schedule).
    """
    out = []
    for t, rank in _mtbf_events(mtbf_s, seed, world_size):
        if t > horizon_s:
            return out
        out.append((t, rank))


# ------------------------------------------------------------------------ state file

def _job_start(state_path: str, explicit: Optional[float], clock: Callable[[], float]) -> float:
    """The job's start time, the same on every rank and after every restart.

    Order: the argument, ``$MOC_JOB_START``, the state file, else now (then written to
    the file under the lock, so the first rank to get here sets it for all others).
    """
    if explicit is not None:
        return float(explicit)
    if os.environ.get(JOB_START_ENV):
        return float(os.environ[JOB_START_ENV])
    with state_lock(state_path):
        state = read_state(state_path)
        if "job_start" not in state:
            state["job_start"] = clock()
            write_state(state_path, state)
        return float(state["job_start"])


def _print_flush(message: str) -> None:
    # Flushed: a rank that SIGKILLs itself next would lose a buffered line.
    print(message, flush=True)


# -------------------------------------------------------------------------- injector

class FaultInjector:
    """Fires this rank's faults at the right moment, each once per job.

    Every rank creates one after the process group exists and before the training loop,
    with the same ``specs``, ``state_path``, ``mtbf_s`` and ``seed``; each rank only fires
    its own faults. ``before_iteration`` costs a few comparisons when nothing is due.

    Args:
        specs: every fault of the job (all ranks' faults; others' are ignored here).
        rank: this process's global rank.
        world_size: ranks in the job (MTBF crashes pick among them).
        state_path: local JSON file shared by all ranks and restarts of the job
            (e.g. next to the checkpoints); created if missing.
        mtbf_s: mean seconds between random crashes; None: none.
        seed: seed of the random crash schedule (same on every rank).
        job_start_time: the schedule's time origin (seconds since the epoch); default:
            ``$MOC_JOB_START``, else the one in the state file, else now.
        lose_memory: callback dropping the node's in-memory snapshots; required when
            this rank has a ``lose-memory`` fault.
        log: prints one line per fired fault (must flush: a SIGKILL follows).
        clock: seconds since the epoch (tests pass a fake clock).
        emit: called with a ``{"kind": "fault", ...}`` event before a fault fires (the
            trainer appends it to the job's event file, so the restart can name it).
        node_ranks: the global ranks of this rank's node (default: only this rank); a
            ``persist-crash`` naming any of them arms this node's keeper.
        slow_compute: called with ``slow`` seconds when a ``slow-compute`` fault fires;
            makes every later forward of this rank sleep that long (the trainer hooks
            the model); required when this rank has such a fault.

    Raises:
        ConfigError: this rank has a ``lose-memory`` fault but no ``lose_memory`` callback.
    """

    def __init__(self, specs: Sequence[FaultSpec], rank: int, world_size: int, state_path: str,
                 mtbf_s: Optional[float] = None, seed: int = 0,
                 job_start_time: Optional[float] = None,
                 lose_memory: Optional[Callable[[], None]] = None,
                 log: Callable[[str], None] = _print_flush,
                 clock: Callable[[], float] = time.time,
                 emit: Optional[Callable[[Dict], object]] = None,
                 node_ranks: Optional[Sequence[int]] = None,
                 slow_compute: Optional[Callable[[float], None]] = None):
        self.rank, self.world_size, self.state_path = rank, world_size, state_path
        self._emit = emit
        self._lose_memory, self._log, self._clock = lose_memory, log, clock
        self._fired = set(read_state(state_path)["fired"])
        self._pending = [s for s in specs if s.rank == rank and s.text not in self._fired]
        # Any rank of a node may be the one that starts its keeper: all of them arm it.
        self._node_persist = [s for s in specs if s.kind == "persist-crash"
                              and s.rank in set(node_ranks or (rank,))
                              and s.text not in self._fired]
        self._slow_compute = slow_compute
        if slow_compute is None and any(s.kind == "slow-compute" for s in self._pending):
            raise ConfigError("--moc-fault slow-compute needs the trainer's model hook "
                              "(slow_compute callback)")
        if lose_memory is None and any(s.kind in ("lose-memory", "lose-node")
                                       for s in self._pending):
            raise ConfigError("--moc-fault lose-memory needs in-memory snapshots "
                              "(--moc-two-level): there is nothing to lose")
        self._slow_s = 0.0
        self._mtbf_s, self._seed = mtbf_s, seed
        self._next_crash: Optional[Tuple[int, float]] = None
        self.job_start: Optional[float] = None
        """The MTBF schedule's time origin (seconds since the epoch); None without MTBF."""
        if mtbf_s is not None:
            self.job_start = _job_start(state_path, job_start_time, clock)
            self._crashes = enumerate(_mtbf_events(mtbf_s, seed, world_size))
            self._skip_missed(clock() - self.job_start)

    # ------------------------------------------------------------ called by the loop

    def before_iteration(self, iteration: int) -> None:
        """Every rank, at the top of every loop iteration, before anything of ``iteration``
        (1-based: ``state.iteration + 1``) runs, in particular before its first collective.

        Fires this rank's due ``slow``, ``lose-memory``, ``crash``, ``raise`` and ``hang``
        faults and a due MTBF crash; then sleeps if a ``slow`` fault is active.

        Raises:
            InjectedFault: a ``raise`` fault is due.
        """
        for kind in _LOOP_KINDS:
            for spec in self._due(kind, iteration):
                self._fire(spec, iteration)
        if self._next_crash is not None and self._clock() - self.job_start >= self._next_crash[1]:
            self._fire_mtbf(iteration)
        if self._slow_s:
            time.sleep(self._slow_s)

    def training_starts(self) -> None:
        """Every rank, right before the training loop: drop MTBF crashes that fell due
        since the injector was made (the checkpoint load, a replay's set-up): the job
        was not training then, and firing them at the first iteration would make two
        failures of one."""
        now_s = self._clock() - self.job_start if self._next_crash is not None else None
        while self._next_crash is not None and self._next_crash[1] <= now_s:
            index, t = self._next_crash
            self._log(f"[fault] rank {self.rank}: skipping MTBF crash #{index} due at {t:.1f} s "
                      "(the job was loading, not training)")
            self._advance()

    def in_snapshot(self, iteration: int) -> None:
        """The copy thread of the rank taking a two-level snapshot of ``iteration``
        (``state.iteration``), once the bytes are copied and before the snapshot is
        published as complete: SIGKILLs this rank if a ``snapshot-crash`` fault is due."""
        for spec in self._due("snapshot-crash", iteration):
            self._fire(spec, iteration)

    def persist_env(self) -> Dict[str, str]:
        """Environment for the node keeper this rank starts: arms its ``persist-crash``
        fault (empty when there is none, or it fired earlier in the job). The keeper
        calls :func:`deepspeed_ext.keeper.faults.crash_in_persist_if_due`, which records
        the firing."""
        for spec in self._node_persist:
            if spec.kind == "persist-crash":
                return {PERSIST_CRASH_ENV: str(spec.iteration), FAULT_KEY_ENV: spec.text,
                        FAULT_STATE_ENV: os.path.abspath(self.state_path)}
        return {}

    # --------------------------------------------------------------------- internals

    def _due(self, kind: str, iteration: int) -> List[FaultSpec]:
        return [s for s in self._pending if s.kind == kind and iteration >= s.iteration]

    def _fire(self, spec: FaultSpec, iteration: int) -> None:
        self._pending.remove(spec)
        self._fired.add(spec.text)
        record_fired(self.state_path, spec.text, {
            "kind": spec.kind, "rank": self.rank, "iteration": iteration, "time": time.time()})
        self._log(f"[fault] rank {self.rank}: injected {spec.kind} at iteration {iteration} "
                  f"(--moc-fault {spec.text})")
        self._event(spec.kind, iteration, spec.text)
        if spec.kind == "slow":
            self._slow_s += spec.slow_s
        elif spec.kind == "slow-compute":
            self._slow_compute(spec.slow_s)
        elif spec.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at iteration {iteration} "
                                f"(--moc-fault {spec.text})")
        elif spec.kind == "hang":
            while True:  # the rank stops answering; only a kill ends it
                time.sleep(3600)
        else:
            if spec.kind in ("lose-memory", "lose-node"):
                self._lose_memory()
            if spec.kind == "lose-node":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            sigkill_self()

    def _mtbf_key(self, index: int) -> str:
        return f"mtbf={self._mtbf_s:g}:seed={self._seed}:#{index}"

    def _advance(self) -> None:
        """Move ``_next_crash`` to this rank's next crash of the schedule not yet fired."""
        for index, (t, rank) in self._crashes:
            if rank == self.rank and self._mtbf_key(index) not in self._fired:
                self._next_crash = (index, t)
                return

    def _skip_missed(self, now_s: float) -> None:
        """Crashes due while no training loop of this job ran (start-up, restarts) are
        dropped: a process cannot crash while it does not exist, and firing them all at
        once on restart would crash the job again before it made any progress."""
        self._advance()
        while self._next_crash[1] <= now_s:
            index, t = self._next_crash
            self._log(f"[fault] rank {self.rank}: skipping MTBF crash #{index} due at {t:.1f} s "
                      "(the job was not training then)")
            self._advance()

    def _fire_mtbf(self, iteration: int) -> None:
        index, t = self._next_crash
        self._fired.add(self._mtbf_key(index))
        self._advance()
        record_fired(self.state_path, self._mtbf_key(index), {
            "kind": "crash", "rank": self.rank, "iteration": iteration, "time": time.time(),
            "due_s": t})
        self._log(f"[fault] rank {self.rank}: injected crash at iteration {iteration} "
                  f"(--moc-fault-mtbf {self._mtbf_s:g} --moc-fault-seed {self._seed}: "
                  f"crash #{index} due at {t:.1f} s)")
        self._event("crash", iteration, self._mtbf_key(index))
        sigkill_self()

    def _event(self, fault: str, iteration: int, spec: str) -> None:
        if self._emit is None:
            return
        try:
            self._emit({"kind": "fault", "fault": fault, "rank": self.rank,
                        "iteration": iteration, "spec": spec})
        except Exception as e:  # the fault still fires: reporting it is secondary
            self._log(f"[fault] rank {self.rank}: could not record the event: {e}")


# ------------------------------------------------------------------------------ flags

def add_fault_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--moc-fault``, ``--moc-fault-mtbf`` and ``--moc-fault-seed`` to ``parser``."""
    g = parser.add_argument_group("fault injection (tests and demos)")
    g.add_argument("--moc-fault", action="extend", nargs="+", default=[],
                   metavar="KIND@ITER[:rank=R][:slow=S]",
                   help=f"Inject a fault once per job; KIND: {', '.join(KINDS)}. Repeatable.")
    g.add_argument("--moc-fault-mtbf", type=float, default=None,
                   help="Crash a random rank at exponentially distributed times of this mean "
                        "(seconds since the job started).")
    g.add_argument("--moc-fault-seed", type=int, default=0,
                   help="Seed of the --moc-fault-mtbf schedule.")


def faults_from_args(args: argparse.Namespace, world_size: int) -> List[FaultSpec]:
    """Parse and validate the fault flags added by :func:`add_fault_args`.

    Raises:
        ConfigError: naming the flag and the bad value.
    """
    specs = [parse_fault(text) for text in (args.moc_fault or [])]
    validate_faults(specs, args.moc_fault_mtbf, world_size, args.train_iters)
    return specs
