"""The supervisor's decisions (deepspeed_ext/supervisor/job.py), in process: a
:class:`~deepspeed_ext.supervisor.job.Supervisor` over an in-memory store, its children
:class:`~deepspeed_ext.supervisor.children.Child` records whose process is a stand-in
(:class:`StandIn`: no process, a signal is only recorded). A test ends a stand-in with a
status, hands it to :meth:`Supervisor.on_exit` as the watch would, and reads the rounds
and ``done`` in the store, the status returned, the signals each process got and the
supervisor's log lines.

Two tests go through the entry point (``main``) with the processes' start replaced by
stand-ins: a SIGTERM to the supervisor, and a port already in use. What needs real
processes (a survivor that keeps running, deaths close together, every process of a
failed job stopped by SIGTERM) is in test_supervisor.py.
"""

import dataclasses
import logging
import signal
import socket
from typing import List, Optional, Tuple

import pytest
import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, RoundAssignment, first_round,
                                          round_key)
from deepspeed_ext.supervisor import job, store as supervisor_store
from deepspeed_ext.supervisor.children import Child
from deepspeed_ext.supervisor.job import Supervisor
from deepspeed_ext.supervisor.main import LOGGER, main
from deepspeed_ext.supervisor.options import SupervisorOptions
from deepspeed_ext.supervisor.store import write_round

PROGRAM = __file__  # a .py file that exists: never started here
FIRST_PID = 1 << 23
"""Stand-ins' pids start above Linux's largest pid (2**22): not one of a real process."""
PREFIX = "[moc supervisor] "
RELAUNCH = "; stopping every process: the job must be relaunched"


class StandIn:
    """What a :class:`Child` needs of ``subprocess.Popen``, with no process behind it: a
    signal is recorded with the ``done`` the store held when it came (a real process reads
    it in its SIGTERM handler), and ends it."""

    def __init__(self, pid: int, store: dist.Store, on_first_poll=None):
        self.pid = pid
        self.store = store
        self.returncode: Optional[int] = None
        self.signals: List[Tuple[int, Optional[str]]] = []
        self.on_first_poll = on_first_poll

    def poll(self) -> Optional[int]:
        hook, self.on_first_poll = self.on_first_poll, None
        if hook is not None:
            hook()
        return self.returncode

    def wait(self) -> int:
        assert self.returncode is not None, f"pid {self.pid}: waited for while running"
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append((signum, done(self.store)))
        self.returncode = -signum


@pytest.fixture(autouse=True)
def no_real_signal(monkeypatch):
    """A stand-in's pid must never be signalled for real (another process could have it)."""
    def refuse(pid, signum):
        raise AssertionError(f"os.kill({pid}, {signum}) in an in-process test")
    monkeypatch.setattr("os.kill", refuse)
    monkeypatch.setattr("os.killpg", refuse)


def supervised(nproc: int, spares: int, **options) -> Supervisor:
    """A supervisor whose ``run`` has written round 0 and started every slot (stand-ins)."""
    store = dist.HashStore()
    supervisor = Supervisor(SupervisorOptions(nproc, spares, (PROGRAM,), grace_s=0.0,
                                              **options), store, port=0)
    write_round(store, supervisor.current)
    supervisor.children = [Child(slot, StandIn(FIRST_PID + slot, store))
                           for slot in range(nproc + spares)]
    return supervisor


def ended(child: Child, returncode: int) -> Child:
    """``child`` as the watch hands it over once its process ended with ``returncode``."""
    child.process.returncode = returncode
    assert child.poll()
    return child


def done(store: dist.Store) -> Optional[str]:
    return store.get(DONE_KEY).decode() if store.check([DONE_KEY]) else None


def rounds(store: dist.Store) -> List[RoundAssignment]:
    """Every round written, in order, less its time stamp; ``current`` names the last."""
    found = []
    while store.check([round_key(len(found))]):
        written = RoundAssignment.from_json(store.get(round_key(len(found))))
        found.append(dataclasses.replace(written, at=0.0))
    assert store.get(CURRENT_KEY).decode() == str(len(found) - 1)
    return found


def lines(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]


def test_max_rounds_0_fails_the_first_death_even_with_a_spare(caplog):
    supervisor = supervised(1, 1, max_rounds=0)
    trainer, spare = supervisor.children
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert supervisor.on_exit(ended(trainer, 3)) == 1
    why = (f"slot 0 (rank 0, pid {trainer.pid}) exited with status 3: round 1 would be more "
           "than --max-rounds 0 recoveries in place")
    assert rounds(supervisor.store) == [first_round(1, 1)]  # the spare took nothing
    assert done(supervisor.store) == f"failed: {why}"
    assert lines(caplog) == [f"{PREFIX}ERROR: {why}{RELAUNCH}"]
    assert spare.process.signals == [(signal.SIGTERM, f"failed: {why}")]  # done said why first
    assert not spare.running


@pytest.mark.parametrize("slot, role", [(0, "rank 0"), (1, "spare")])
def test_a_process_refusing_its_input_stops_the_job_with_exit_2_and_no_round(caplog, slot,
                                                                             role):
    """Exit 2 is the trainer's bad input: a spare given the same flags would refuse them
    too, so no round uses one and the supervisor exits 2 (no relaunch either)."""
    supervisor = supervised(1, 1)
    refused, other = supervisor.children[slot], supervisor.children[1 - slot]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert supervisor.on_exit(ended(refused, 2)) == 2
    why = (f"slot {slot} ({role}, pid {refused.pid}) refused its input (exit 2): a "
           "replacement would too")
    assert rounds(supervisor.store) == [first_round(1, 1)]
    assert done(supervisor.store) == f"failed: {why}"
    assert lines(caplog) == [f"{PREFIX}ERROR: {why}; stopping every process"]
    assert other.process.signals == [(signal.SIGTERM, f"failed: {why}")]
    assert refused.process.signals == []  # it had ended


def test_a_dead_spare_is_dropped_and_the_next_one_takes_the_rank(caplog):
    supervisor = supervised(1, 2)
    trainer, first, second = supervisor.children
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert supervisor.on_exit(ended(first, -signal.SIGKILL)) is None
        assert rounds(supervisor.store)[1:] == [RoundAssignment(1, (0,), (2,), (1,))]
        assert trainer.running and trainer.process.signals == []  # it trains on
        assert supervisor.on_exit(ended(trainer, 3)) is None
        assert supervisor.on_exit(ended(second, 0)) == 0
    assert rounds(supervisor.store)[1:] == [RoundAssignment(1, (0,), (2,), (1,)),
                                            RoundAssignment(2, (2,), (), (0,))]
    assert done(supervisor.store) == "ok"
    assert lines(caplog) == [
        f"{PREFIX}slot 1 (spare, pid {first.pid}) exited with signal 9: round 1, the spare "
        "is dropped; 1 spare left",
        f"{PREFIX}slot 0 (rank 0, pid {trainer.pid}) exited with status 3: round 2, rank 0 "
        "-> slot 2 (spare); 0 spares left",
        f"{PREFIX}every training process exited 0 (round 2, slots [2]): job done; releasing "
        "0 spare(s)"]
    assert [c.process.signals for c in supervisor.children] == [[], [], []]


@pytest.mark.parametrize("order, slots", [((0, 1), (2, 3)), ((1, 0), (3, 2))])
def test_deaths_seen_in_one_look_are_one_round_each_in_the_order_seen(order, slots):
    """The watch hands over the exits of one look one by one: each is a round on top of
    the one before, so the first seen gets the first spare."""
    supervisor = supervised(2, 2)
    for slot in order:
        assert supervisor.on_exit(ended(supervisor.children[slot], -signal.SIGKILL)) is None
    one, two = rounds(supervisor.store)[1:]
    assert (one.failed, two.failed) == ((order[0],), (order[1],))
    assert (two.slots, two.spares) == (slots, ())
    assert done(supervisor.store) is None
    assert [c.process.signals for c in supervisor.children] == [[]] * 4


def test_sigterm_to_the_supervisor_is_passed_on_and_ends_the_job(monkeypatch, caplog):
    """``main`` as ``python -m deepspeed_ext.supervisor`` runs it, every slot a stand-in:
    SIGTERM comes while the supervisor watches (at its first look); every process gets it,
    no round follows, and the exit status is 128 + 15. The signal's handler before is
    back afterwards."""
    stores, started = [], []
    host_store = supervisor_store.host_store

    def serve(host, port):
        stores.append(host_store(host, port))
        return stores[-1]

    def start_stand_in(argv, env, slot):
        term = (lambda: signal.raise_signal(signal.SIGTERM)) if slot == 0 else None
        started.append(Child(slot, StandIn(FIRST_PID + slot, stores[0], term)))
        return started[-1]

    def not_forwarded(signum, frame):  # main's handler missing: fail, not end pytest or hang
        raise AssertionError("SIGTERM reached the handler from before main")

    monkeypatch.setattr(supervisor_store, "host_store", serve)
    monkeypatch.setattr(job, "start_child", start_stand_in)
    before = signal.signal(signal.SIGTERM, not_forwarded)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            status = main(["--nproc", "1", "--spares", "1", "--port", "0", "--grace-s", "0",
                           "--", PROGRAM])
        assert signal.getsignal(signal.SIGTERM) is not_forwarded  # main put it back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == 128 + signal.SIGTERM
    assert [c.process.signals for c in started] == [[(signal.SIGTERM, None)]] * 2
    assert rounds(stores[0]) == [first_round(1, 1)]  # no recovery
    assert done(stores[0]) == "failed: the supervisor was stopped by SIGTERM"
    started_line, *others = lines(caplog)
    assert started_line.startswith(f"{PREFIX}store 127.0.0.1:{stores[0].port}, up to 3 ")
    assert others == [f"{PREFIX}ERROR: stopped by SIGTERM, passed on to every process; the "
                      "job must be relaunched"]


def test_a_port_in_use_exits_2_naming_the_flag_and_starts_nothing(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(job, "start_child", lambda argv, env, slot: started.append(slot))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--nproc", "1", "--spares", "0", "--port", str(port), "--",
                     PROGRAM]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --master-addr 127.0.0.1 --port {port}: the job's store "
                          "cannot be served"), err
    assert started == []


def test_a_rank_reported_hung_is_killed_and_its_death_starts_the_next_round(caplog):
    """A watchdog's request (rounds.request_kill) ends that rank's process with SIGKILL
    (a stopped process ignores SIGTERM); a request counted once is not acted on again,
    and one made in an older round still kills the process that rank had then (a
    survivor stuck in the failed round asks from there)."""
    from deepspeed_ext.runtime.rounds import request_kill
    supervisor = supervised(3, 1)
    assert supervisor.kill_requested() == []  # nothing asked
    request_kill(supervisor.store, 0, 1, "no progress for 3.1 s in iteration 7, found "
                 "by rank 0")
    request_kill(supervisor.store, 0, 1, "the same, found by rank 2")  # asked twice
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert supervisor.kill_requested() == [1]
        assert supervisor.kill_requested() == []  # each request acted on once
    hung = supervisor.children[1]
    assert hung.process.signals == [(signal.SIGKILL, None)]
    assert lines(caplog) == [f"{PREFIX}slot 1 (rank 1 of round 0, pid {hung.pid}) is hung "
                             "(the same, found by rank 2): killing it (SIGKILL)"]
    assert all(not c.process.signals for c in supervisor.children if c is not hung)
    assert supervisor.on_exit(ended(hung, -signal.SIGKILL)) is None
    assert rounds(supervisor.store)[-1] == RoundAssignment(1, (0, 3, 2), (), (1,))
    request_kill(supervisor.store, 0, 1, "late: slot 1 is dead already")
    assert supervisor.kill_requested() == []
    request_kill(supervisor.store, 0, 2, "stuck in round 0's collective")
    assert supervisor.kill_requested() == [2]  # round 0's rank 2: slot 2, still running
    request_kill(supervisor.store, 1, 1, "the spare hangs too")
    assert supervisor.kill_requested() == [3]  # round 1's rank 1: the spare's slot
    assert supervisor.children[3].process.signals == [(signal.SIGKILL, None)]


def refilling(monkeypatch, nproc: int, spares: int, **options):
    """A supervisor with ``--refill-spares`` whose restarts are stand-ins too (pids from
    ``FIRST_PID + 100``)."""
    supervisor = supervised(nproc, spares, refill_spares=True, **options)
    pids = iter(range(FIRST_PID + 100, FIRST_PID + 200))
    monkeypatch.setattr(job, "start_child", lambda argv, env, slot: Child(
        slot, StandIn(next(pids), supervisor.store)))
    return supervisor


def test_refill_spares_restarts_the_dead_slot_as_a_spare_and_recovers_again(monkeypatch,
                                                                             caplog):
    """--refill-spares: each death's slot gets a new process, listed as a waiting spare by
    a refill round (no rank moves, nobody failed), so the next death recovers in place
    too; --max-rounds counts recoveries, not refills."""
    supervisor = refilling(monkeypatch, 1, 1, max_rounds=2)
    trainer, spare = supervisor.children
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert supervisor.on_exit(ended(trainer, -signal.SIGKILL)) is None
        refilled = supervisor.children[0]
        assert refilled is not trainer and refilled.slot == 0 and refilled.running
        assert supervisor.on_exit(ended(spare, -signal.SIGKILL)) is None  # rank 0's process
        again = supervisor.children[1]
        assert supervisor.on_exit(ended(refilled, 3)) == 1  # a third recovery: too many
    assert rounds(supervisor.store)[1:] == [
        RoundAssignment(1, (1,), (), (0,)), RoundAssignment(2, (1,), (0,)),
        RoundAssignment(3, (0,), (), (1,)), RoundAssignment(4, (0,), (1,))]
    assert lines(caplog)[:4] == [
        f"{PREFIX}slot 0 (rank 0, pid {trainer.pid}) exited with signal 9: round 1, rank 0 -> "
        "slot 1 (spare); 0 spares left",
        f"{PREFIX}slot 0 refilled (pid {refilled.pid}): round 2, a waiting spare; 1 spare left",
        f"{PREFIX}slot 1 (rank 0, pid {spare.pid}) exited with signal 9: round 3, rank 0 -> "
        "slot 0 (spare); 0 spares left",
        f"{PREFIX}slot 1 refilled (pid {again.pid}): round 4, a waiting spare; 1 spare left"]
    assert "would be more than --max-rounds 2 recoveries in place" in done(supervisor.store)


def test_a_refilled_process_is_not_fenced_nor_killed_for_its_predecessor(monkeypatch):
    """The round that named the dead process failed, and a kill request its rank got in
    an earlier round, are about the process it replaced, not the refilled one."""
    from deepspeed_ext.runtime.rounds import request_kill
    supervisor = refilling(monkeypatch, 2, 1)
    assert supervisor.on_exit(ended(supervisor.children[1], -signal.SIGKILL)) is None
    refilled = supervisor.children[1]
    assert supervisor.fence() is None and refilled.process.signals == []
    request_kill(supervisor.store, 0, 1, "late: round 0's rank 1, slot 1's old process")
    assert supervisor.kill_requested() == []
    assert refilled.running and refilled.process.signals == []
    request_kill(supervisor.store, 1, 1, "round 1's rank 1: the spare in slot 2")
    assert supervisor.kill_requested() == [2]
