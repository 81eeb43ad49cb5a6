"""Several nodes, one supervisor each, in process: two :class:`Supervisor` objects over one
in-memory store (node 0's wrote round 0, as its ``run`` does), their processes stand-ins
(test_job.py's). What each decides from its own processes' exits and from what the other
wrote: rounds built on the other node's, a round number claimed by one node only, the
job's end seen by both, kill requests acted on by the node whose process it names, and a
store that is gone. Real processes and two real supervisors: test_supervisor.py.
"""

import logging
import signal
import threading
import time

import pytest
import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (LEFT_KEY, RoundAssignment, claim_key, first_round,
                                          next_round, node_beat_key, request_kill)
from deepspeed_ext.supervisor import job
from deepspeed_ext.supervisor.children import Child
from deepspeed_ext.supervisor.job import Supervisor
from deepspeed_ext.supervisor.main import LOGGER
from deepspeed_ext.supervisor.options import SupervisorOptions
from deepspeed_ext.supervisor.store import write_round
from tests.deepspeed_ext.supervisor.test_job import (FIRST_PID, PROGRAM, StandIn, done, ended,
                                                     lines, no_real_signal, rounds)

__all__ = ["no_real_signal"]  # test_job's autouse fixture: no stand-in pid is signalled


def two_nodes(nproc: int, spares: int, **options):
    """Node 0's and node 1's supervisors over one store, round 0 written, every slot
    started (stand-ins)."""
    store = dist.HashStore()
    nodes = []
    for node in range(2):
        supervisor = Supervisor(SupervisorOptions(nproc, spares, (PROGRAM,), grace_s=0.0,
                                                  host="10.0.0.1", nnodes=2, node_rank=node,
                                                  **options), store, port=29500)
        supervisor.children = [Child(slot, StandIn(FIRST_PID + slot, store))
                               for slot in supervisor.options.own_slots]
        nodes.append(supervisor)
    write_round(store, nodes[0].current)
    return nodes


def test_each_node_hands_its_dead_rank_to_its_own_spare_building_on_the_other_s_round(caplog):
    zero, one = two_nodes(2, 1)  # node 0: slots 0, 1 train, 2 waits; node 1: 3, 4 and 5
    assert zero.current == one.current == first_round(2, 1, nodes=2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert zero.on_exit(ended(zero.children[1], -signal.SIGKILL)) is None
        assert one.on_exit(ended(one.children[0], 3)) is None  # its view was round 0
    assert rounds(zero.store)[1:] == [RoundAssignment(1, (0, 2, 3, 4), (5,), (1,)),
                                      RoundAssignment(2, (0, 2, 5, 4), (), (3,))]
    assert lines(caplog) == [
        f"[moc supervisor, node 0] slot 1 (rank 1, pid {FIRST_PID + 1}) exited with signal "
        "9: round 1, rank 1 -> slot 2 (spare); 1 spare left, 0 on this node",
        f"[moc supervisor, node 1] slot 3 (rank 2, pid {FIRST_PID + 3}) exited with status "
        "3: round 2, rank 2 -> slot 5 (spare); 0 spares left, 0 on this node"]
    assert zero.follow() is None and zero.current.round == 2  # node 0 reads node 1's round
    assert all(c.process.signals == [] for c in zero.children + one.children)


def test_a_round_number_another_node_claimed_is_waited_for_and_built_upon():
    """Two deaths at once on two nodes: node 0 claimed round 1 and writes it a moment
    later; node 1 must not write its own round 1 over it, but round 2 after it."""
    zero, one = two_nodes(1, 1)  # node 0: slot 0 trains, 1 waits; node 1: 2 and 3
    assert zero.store.add(claim_key(1), 1) == 1  # node 0's claim
    node_0_round = next_round(zero.current, {0}, launched=2)
    writer = threading.Timer(0.3, write_round, (zero.store, node_0_round))
    writer.start()
    try:
        assert one.on_exit(ended(one.children[0], -signal.SIGKILL)) is None
    finally:
        writer.join()
    assert rounds(one.store)[1:] == [RoundAssignment(1, (1, 2), (3,), (0,)),
                                     RoundAssignment(2, (1, 3), (), (2,))]


def test_a_dead_rank_with_no_spare_left_on_its_node_fails_the_job_on_every_node(caplog):
    zero, one = two_nodes(1, 1)
    assert one.on_exit(ended(one.children[0], 3)) is None  # node 1's spare takes rank 1
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert one.on_exit(ended(one.children[1], 3)) == 1  # node 0's spare may not
        assert zero.follow() == 1
    why = (f"slot 3 (rank 1, pid {FIRST_PID + 3}) exited with status 3 and no spare of its "
           "node is left to take rank 1")
    assert done(zero.store) == f"failed: {why}"
    assert lines(caplog)[-2:] == [
        f"[moc supervisor, node 1] ERROR: {why}; stopping every process: the job must be "
        "relaunched",
        f"[moc supervisor, node 0] ERROR: the job ended on another node (failed: {why}); "
        "stopping this node's processes"]
    assert [c.process.signals for c in zero.children] == [[(signal.SIGTERM, f"failed: {why}")]] * 2


def test_the_job_is_done_when_every_node_s_training_processes_exited_0():
    zero, one = two_nodes(1, 1)
    assert zero.on_exit(ended(zero.children[0], 0)) is None  # rank 0 done, rank 1 trains on
    assert done(zero.store) is None and zero.follow() is None
    assert one.on_exit(ended(one.children[0], 0)) == 0
    assert done(zero.store) == "ok"
    assert zero.follow() == 0  # node 0 releases its spare too
    assert [c.process.signals for c in zero.children + one.children] == \
        [[], [(signal.SIGTERM, "ok")], [], [(signal.SIGTERM, "ok")]]


def test_a_death_after_another_node_s_rank_finished_fails_the_job():
    zero, one = two_nodes(1, 1)
    assert zero.on_exit(ended(zero.children[0], 0)) is None
    assert one.on_exit(ended(one.children[0], -signal.SIGKILL)) == 1
    assert done(one.store).startswith(
        f"failed: slot 2 (rank 1, pid {FIRST_PID + 2}) exited with signal 9 after training "
        "process(es) of another node finished")


def test_a_kill_request_is_acted_on_by_the_node_whose_process_it_names():
    zero, one = two_nodes(1, 1)
    request_kill(zero.store, 0, 1, "no progress for 3 s, found by rank 0")
    assert zero.kill_requested() == []  # rank 1 is node 1's slot 2: not node 0's to kill
    assert one.kill_requested() == [2]
    assert one.children[0].process.signals == [(signal.SIGKILL, None)]
    assert zero.children[0].process.signals == []


class GoneStore:
    """A store whose server went away after round 0 was written (the wait for it
    returns): every other call fails as torch's client does."""

    def wait(self, keys, timeout):
        pass

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise dist.DistNetworkError("Connection reset by peer")
        return fail


def test_a_node_whose_store_is_gone_stops_its_processes_and_exits_1(monkeypatch, caplog):
    one = two_nodes(1, 1)[1]
    one.children = []
    one.store = GoneStore()
    monkeypatch.setattr(job, "start_child",
                        lambda argv, env, slot: Child(slot, StandIn(FIRST_PID + slot,
                                                                   dist.HashStore())))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert one.run() == 1
    assert [c.process.signals for c in one.children] == [[(signal.SIGTERM, None)]] * 2
    assert lines(caplog)[-1] == (
        "[moc supervisor, node 1] ERROR: the job's store at 10.0.0.1:29500 is gone "
        "(Connection reset by peer); stopping every process: the job must be relaunched")


def test_node_0_keeps_the_store_until_the_other_node_has_left():
    zero, one = two_nodes(1, 1)
    leaving = threading.Thread(target=zero.leave)
    start = time.monotonic()
    leaving.start()
    time.sleep(0.3)
    assert leaving.is_alive()  # still serving: node 1 may need the store
    one.leave()
    leaving.join(5)
    assert not leaving.is_alive() and time.monotonic() - start >= 0.3
    assert zero.store.add(LEFT_KEY, 0) == 2


@pytest.mark.parametrize("flags, needle", [
    (["--nnodes", "0"], "--nnodes 0: at least 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--port", "1"],
     "--node-rank 2: 0 to --nnodes - 1 (1)"),
    (["--nnodes", "2", "--master-addr", "h"], "--port not given (nor MASTER_PORT) with --nnodes 2"),
    (["--nnodes", "2", "--port", "29500"], "--master-addr not given (nor MASTER_ADDR)"),
])
def test_bad_node_flags_name_the_flag(capsys, flags, needle):
    from deepspeed_ext.supervisor.options import parse_options
    with pytest.raises(SystemExit) as stop:
        parse_options(["--nproc", "1", "--spares", "1", *flags, "--", PROGRAM], environ={})
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {needle}")


def test_a_node_is_lost_once_its_beats_stop_for_the_timeout_and_never_before_its_first():
    from deepspeed_ext.supervisor.nodes import NodeWatch
    watch = NodeWatch(timeout_s=2.0)
    assert watch.look({1: 0, 2: 5}, now=0.0) == []  # node 1 has not started yet
    assert watch.look({1: 0, 2: 5}, now=10.0) == [2]  # node 2 stuck at 5 for 10 s
    assert watch.look({1: 3, 2: 5}, now=11.0) == []  # found once; node 1 starts beating
    assert watch.look({1: 4}, now=12.9) == [] and watch.look({1: 4}, now=14.8) == []
    assert watch.look({1: 4}, now=15.0) == [1]  # unmoved since 12.9
    assert watch.silent_s(1, 15.5) == pytest.approx(2.6)


def three_nodes(timeout_s=0.2):
    """Nodes 0 and 1 train 2 ranks each, node 2 is a spare node (2 slots waiting)."""
    store = dist.HashStore()
    nodes = []
    for node in range(3):
        supervisor = Supervisor(SupervisorOptions(2, 0, (PROGRAM,), grace_s=0.0,
                                                  host="10.0.0.1", nnodes=3, node_rank=node,
                                                  spare_nodes=1, node_timeout_s=timeout_s),
                                store, port=29500)
        supervisor.children = [Child(slot, StandIn(FIRST_PID + slot, store))
                               for slot in supervisor.options.own_slots]
        nodes.append(supervisor)
    write_round(store, nodes[0].current)
    return nodes


def test_node_0_gives_a_silent_node_s_ranks_to_the_spare_node_and_the_stalled_node_is_fenced(
        caplog):
    zero, one, two = three_nodes()
    assert zero.current == RoundAssignment(0, (0, 1, 2, 3), (4, 5), ())
    for node in (1, 2):
        zero.store.add(node_beat_key(node), 1)
    assert zero.watch_nodes() is None  # first beats seen
    time.sleep(0.3)
    zero.store.add(node_beat_key(2), 1)  # node 2 beats on, node 1 is silent
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert zero.watch_nodes() is None
    assert rounds(zero.store)[1:] == [RoundAssignment(1, (0, 1, 4, 5), (), (2, 3))]
    (line,) = lines(caplog)
    assert line.startswith("[moc supervisor, node 0] node 1's supervisor has been silent for ")
    assert line.endswith(" s: node lost; round 1: rank 2 -> slot 4, rank 3 -> slot 5; "
                         "0 spares left")
    # node 1 was only stalled: its processes were given away, it kills them and leaves
    assert one.follow() == job.LEFT_JOB  # 3: not a failure of the job, no relaunch
    assert [c.process.signals for c in one.children] == [[(signal.SIGKILL, None)]] * 2
    assert one.on_exit(one.children[0]) is None  # a fenced death starts no round
    assert two.follow() is None and two.current.round == 1  # the spare node trains now
    two.leave()
    start = time.monotonic()
    zero.leave()  # waits for node 2's leave only: node 1 is lost and never leaves
    assert time.monotonic() - start < 5


def test_a_lost_node_without_a_spare_node_fails_the_job():
    zero, one, _ = three_nodes()
    zero.store.add(node_beat_key(1), 1)
    zero.watch_nodes()
    # the spare node was used already: node 2's slots are gone from the waiting list
    write_round(zero.store, RoundAssignment(1, (0, 1, 2, 3), (), (4, 5)))
    time.sleep(0.3)
    assert zero.watch_nodes() == 1
    assert done(zero.store).startswith("failed: node 1's supervisor has been silent for ")
    assert done(zero.store).endswith("node lost and no spare node can take its ranks [2, 3]")


def test_a_crash_on_a_node_without_a_spare_moves_the_whole_node_to_the_spare_node(caplog):
    zero, one, two = three_nodes()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert one.on_exit(ended(one.children[0], -signal.SIGKILL)) is None
    assert rounds(one.store)[1:] == [RoundAssignment(1, (0, 1, 4, 5), (), (2, 3))]
    assert lines(caplog) == [
        f"[moc supervisor, node 1] slot 2 (rank 2, pid {FIRST_PID + 2}) exited with signal 9: "
        "round 1, rank 2 -> slot 4, rank 3 -> slot 5 (slot(s) [3] displaced); 0 spares left, "
        "0 on this node"]
    assert one.follow() == job.LEFT_JOB  # its live rank 3 was displaced: killed, node left
    assert one.children[1].process.signals == [(signal.SIGKILL, None)]
    assert zero.follow() is None and two.follow() is None and two.current.round == 1
    assert [c.process.signals for c in zero.children + two.children] == [[]] * 4


@pytest.mark.parametrize("spare_nodes, said", [("0", True), ("1", False)])
def test_node_0_says_when_no_spare_node_can_take_a_lost_node(monkeypatch, caplog, spare_nodes,
                                                              said):
    from deepspeed_ext.supervisor.main import main
    from tests.launch import free_port
    monkeypatch.setattr(job.Supervisor, "run", lambda self: 0)  # the line comes before
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert main(["--nproc", "1", "--spares", "0", "--nnodes", "2", "--node-rank", "0",
                     "--master-addr", "127.0.0.1", "--port", str(free_port()),
                     "--spare-nodes", spare_nodes, "--", PROGRAM]) == 0
    line = ("[moc supervisor, node 0] no spare node (--spare-nodes 0): a lost node, or a "
            "crash on a node with no spare process left, relaunches the job")
    assert (line in lines(caplog)) == said


def test_a_coordinator_gives_a_silent_node_0_s_ranks_to_the_spare_node(caplog):
    """With a ``--coordinator`` serving the store (the nodes ``--store-elsewhere``), node
    0 is watched like any node: silent, its ranks (rank 0 too) go to the spare node, and
    the coordinator, which starts no process, waits at the end for the nodes still in
    the job to leave."""
    store = dist.HashStore()
    common = dict(grace_s=0.0, host="10.0.0.9", nnodes=3, spare_nodes=1, node_timeout_s=0.2)
    coordinator = Supervisor(SupervisorOptions(2, 0, (PROGRAM,), coordinator=True, **common),
                             store, port=29500)
    assert coordinator.options.own_slots == range(0)
    assert coordinator.options.watched_nodes == range(3) and coordinator.options.serves_store
    nodes = []
    for node in range(3):
        supervisor = Supervisor(SupervisorOptions(2, 0, (PROGRAM,), node_rank=node,
                                                  store_elsewhere=True, **common),
                                store, port=29500)
        assert not supervisor.options.serves_store and not supervisor.options.watched_nodes
        supervisor.children = [Child(slot, StandIn(FIRST_PID + slot, store))
                               for slot in supervisor.options.own_slots]
        nodes.append(supervisor)
    write_round(store, coordinator.current)
    for node in range(3):
        store.add(node_beat_key(node), 1)
    assert coordinator.watch_nodes() is None  # first beats seen
    time.sleep(0.3)
    for node in (1, 2):  # node 0 is silent
        store.add(node_beat_key(node), 1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert coordinator.watch_nodes() is None
    assert rounds(store)[1:] == [RoundAssignment(1, (4, 5, 2, 3), (), (0, 1))]
    (line,) = lines(caplog)
    assert line.startswith("[moc supervisor, coordinator] node 0's supervisor has been silent")
    assert line.endswith("node lost; round 1: rank 0 -> slot 4, rank 1 -> slot 5; 0 spares left")
    zero, one, two = nodes
    assert zero.follow() == job.LEFT_JOB  # node 0 was only stalled: it leaves the job
    assert one.follow() is None and two.follow() is None and two.current.round == 1
    one.leave()
    two.leave()
    start = time.monotonic()
    coordinator.leave()  # its own leave and nodes 1 and 2's; node 0 is lost
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("flags, needle", [
    (["--coordinator", "--store-elsewhere"], "--coordinator with --store-elsewhere"),
    (["--coordinator"], "--coordinator with --nnodes 1"),
    (["--store-elsewhere"], "--store-elsewhere with --nnodes 1"),
])
def test_coordinator_flags_are_checked(capsys, flags, needle):
    from deepspeed_ext.supervisor.options import parse_options
    with pytest.raises(SystemExit) as stop:
        parse_options(["--nproc", "1", "--spares", "1", *flags, "--", PROGRAM], environ={})
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {needle}")
