"""deepspeed_ext.runtime.rounds: who trains in each recovery round of an in-job restart
(the supervisor writes the rounds, the trainer reads them), and the record a process
reads from the store refused unless it is one the module wrote."""

import dataclasses
import json

import pytest

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, MAX_JSON_BYTES, PREFIX, BadRound,
                                          RoundAssignment, first_round, group_prefix, next_round,
                                          node_of_slot, round_key, store_address)


def test_the_first_round_gives_slot_i_rank_i_and_keeps_the_last_slots_waiting():
    first = first_round(3, 2)
    assert first == RoundAssignment(0, (0, 1, 2), (3, 4), ())
    assert first.world_size == 3
    assert [first.rank_of(slot) for slot in range(5)] == [0, 1, 2, None, None]
    assert first.rank_of(7) is None  # a slot the launch never had
    assert first_round(1, 0) == RoundAssignment(0, (0,), (), ())


@pytest.mark.parametrize("nproc, spares, nodes", [(0, 1, 1), (-1, 0, 1), (2, -1, 1), (2, 1, 0)])
def test_the_first_round_refuses_no_training_process_negative_spares_or_no_node(nproc, spares,
                                                                              nodes):
    with pytest.raises(ValueError, match="training processes and"):
        first_round(nproc, spares, nodes)


def test_several_nodes_fill_ranks_node_by_node_each_with_its_own_spares():
    first = first_round(2, 1, nodes=3)  # slots 0-2 on node 0, 3-5 on node 1, 6-8 on node 2
    assert first.slots == (0, 1, 3, 4, 6, 7) and first.spares == (2, 5, 8)
    assert first_round(3, 0, nodes=2) == RoundAssignment(0, (0, 1, 2, 3, 4, 5), (), ())


def test_with_nodes_a_dead_rank_goes_to_a_spare_of_its_own_node_only():
    first = first_round(2, 1, nodes=2)  # slots (0, 1 | 3, 4), spares (2 | 5)
    after = next_round(first, {4}, launched=3)
    assert after == RoundAssignment(1, (0, 1, 3, 5), (2,), (4,))  # not slot 2, node 0's
    assert next_round(after, {3}, launched=3) is None  # node 1 has no spare left
    assert next_round(after, {3}).slots == (0, 1, 2, 5)  # without nodes: any spare
    both = next_round(first, {0, 3}, launched=3)
    assert both.slots == (2, 1, 5, 4) and both.spares == ()
    assert node_of_slot(5, 3) == 1 and node_of_slot(6, 3) == 2


def test_a_dead_training_slot_s_rank_goes_to_the_first_spare_and_the_survivors_keep_theirs():
    after = next_round(first_round(4, 2), {2})
    assert after == RoundAssignment(1, (0, 1, 4, 3), (5,), (2,))
    assert [after.rank_of(slot) for slot in (0, 1, 3)] == [0, 1, 3]  # survivors: same ranks
    assert after.rank_of(4) == 2 and after.rank_of(2) is None and after.rank_of(5) is None


def test_rounds_follow_each_other_and_a_replacement_can_die_in_turn():
    one = next_round(first_round(2, 2), [0])
    two = next_round(one, [2])  # the spare that took rank 0 dies too
    assert one == RoundAssignment(1, (2, 1), (3,), (0,))
    assert two == RoundAssignment(2, (3, 1), (), (2,))
    assert next_round(two, [1]) is None  # no spare left


def test_a_dead_spare_leaves_the_waiting_list_and_the_training_slots_stay():
    assert next_round(first_round(2, 3), {3}) == RoundAssignment(1, (0, 1), (2, 4), (3,))
    # the first spare dead together with a training slot: the next live spare takes the rank
    assert next_round(first_round(2, 2), {0, 2}) == RoundAssignment(1, (3, 1), (), (0, 2))


def test_two_training_slots_dying_at_once_take_the_spares_in_rank_order():
    after = next_round(first_round(3, 2), {2, 0})  # a set: no order of its own
    assert after == RoundAssignment(1, (3, 1, 4), (), (0, 2))


@pytest.mark.parametrize("world_size, spares, dead", [
    (2, 0, {1}),       # no spare at all
    (2, 1, {0, 1}),    # one spare for two deaths
    (3, 2, {0, 3, 4}), # both spares die with a training slot
])
def test_no_round_without_a_live_spare_for_every_dead_training_slot(world_size, spares, dead):
    assert next_round(first_round(world_size, spares), dead) is None


def test_failed_names_only_the_round_s_slots_and_no_death_changes_nothing_but_the_number():
    assert next_round(first_round(2, 1), {1, 9}).failed == (1,)  # 9 was never launched
    assert next_round(first_round(2, 1), ()) == RoundAssignment(1, (0, 1), (2,), ())


def test_the_store_keys_are_distinct_per_round_and_under_the_prefix():
    keys = [CURRENT_KEY, DONE_KEY, round_key(0), round_key(1), round_key(10)]
    assert len(set(keys)) == len(keys) and all(k.startswith(PREFIX) for k in keys)
    prefixes = [group_prefix(r) for r in (0, 1, 10)]
    assert len(set(prefixes)) == 3 and all(p.startswith(PREFIX) for p in prefixes)
    # one round's group keys never fall under another round's prefix (1/ vs 10/)
    assert not group_prefix(10).startswith(group_prefix(1))
    assert not any(p.startswith(q) for p in prefixes for q in keys)


@pytest.mark.parametrize("record", [
    first_round(3, 2), next_round(first_round(3, 2), {1}), RoundAssignment(4, (7,), (), (1, 2)),
])
def test_a_record_reads_back_from_text_and_from_the_store_s_bytes(record):
    assert RoundAssignment.from_json(record.to_json()) == record
    assert RoundAssignment.from_json(record.to_json().encode()) == record
    assert RoundAssignment.from_json(bytearray(record.to_json().encode())) == record


_MISSING = object()
"""A field left out of :func:`_record`'s record."""


def _record(**changes) -> str:
    """A round's record as the module writes it, with ``changes`` (a field set to
    :data:`_MISSING` left out)."""
    data = {"round": 1, "slots": [0, 3], "spares": [2], "failed": [1]}
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not _MISSING})


@pytest.mark.parametrize("text, needle", [
    ("", "not JSON"),
    (b"{\"round\": 1,", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    ("[0, 1]", "int round"),
    ("null", "int round"),
    (_record(round="1"), "int round"),
    (_record(round=1.0), "int round"),
    (_record(round=True), "int round"),
    (_record(round=-1), "int round"),
    (_record(round=_MISSING), "int round"),
    (_record(slots="0,3"), "int lists"),
    (_record(slots=[0, "3"]), "int lists"),
    (_record(slots=[0, 3.0]), "int lists"),
    (_record(slots=[0, -3]), "int lists"),
    (_record(spares=[False]), "int lists"),
    (_record(spares={"2": 2}), "int lists"),
    (_record(failed=None), "int lists"),
    (_record(failed=_MISSING), "int lists"),
    (_record(slots=[0, 0]), "a slot twice"),             # one slot runs two ranks
    (_record(spares=[2, 2]), "a slot twice"),
    (_record(slots=[0, 2]), "a slot twice"),             # slot 2 both training and waiting
    (_record(slots=[]), "no training slot"),
])
def test_a_record_that_is_not_one_this_module_wrote_is_refused(text, needle):
    with pytest.raises(BadRound, match=needle):
        RoundAssignment.from_json(text)


def test_an_oversized_record_is_refused_before_it_is_parsed():
    valid = first_round(2, 1).to_json().encode()
    padded = valid + b" " * (MAX_JSON_BYTES - len(valid))  # JSON allows trailing blanks
    assert RoundAssignment.from_json(padded) == first_round(2, 1)  # at the limit: read
    with pytest.raises(BadRound, match=f"{MAX_JSON_BYTES + 1} bytes"):
        RoundAssignment.from_json(padded + b" ")
    assert issubclass(BadRound, ValueError)  # callers that catch ValueError see it


def test_the_store_address_is_host_and_port():
    assert store_address("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert store_address("node-a.cluster:1") == ("node-a.cluster", 1)


@pytest.mark.parametrize("value", ["", "127.0.0.1", ":29500", "host:", "host:x", "host:0",
                                   "host:65536", "host:-1"])
def test_a_store_address_that_is_not_host_and_port_is_refused(value):
    with pytest.raises(ValueError, match="MOC_RESTART_STORE"):
        store_address(value)


def test_the_write_time_round_trips_and_a_bad_one_is_refused():
    stamped = dataclasses.replace(next_round(first_round(2, 1), {1}), at=1767225600.5)
    assert RoundAssignment.from_json(stamped.to_json()) == stamped
    unstamped = json.loads(first_round(2, 1).to_json())
    del unstamped["at"]  # a record without it reads as not stamped
    assert RoundAssignment.from_json(json.dumps(unstamped)).at == 0.0
    for bad in (-1, "now", None, float("inf")):
        record = json.loads(stamped.to_json())
        record["at"] = bad
        with pytest.raises(BadRound, match="is not a time"):
            RoundAssignment.from_json(json.dumps(record, allow_nan=True))


def test_a_spare_node_waits_whole_and_takes_a_lost_node_s_ranks_in_order():
    first = first_round(2, 1, nodes=3, spare_nodes=1)  # nodes 0, 1 train; node 2 waits
    assert first.slots == (0, 1, 3, 4) and first.spares == (2, 5, 6, 7, 8)
    lost = next_round(first, {3, 4, 5}, launched=3)  # node 1, its spare included
    assert lost == RoundAssignment(1, (0, 1, 6, 7), (2, 8), (3, 4, 5))
    # both ranks dead, one spare of its own: not split over two nodes, the spare node;
    # node 1's live spare is displaced (its supervisor ends it)
    assert next_round(first, {3, 4}, launched=3) == RoundAssignment(1, (0, 1, 6, 7), (2, 8),
                                                                    (3, 4, 5))
    assert next_round(first, {4}, launched=3).slots == (0, 1, 3, 5)  # one death: own spare
    # the spare node used, node 0 lost next: node 0's own spare cannot take two ranks
    assert next_round(lost, {0, 1}, launched=3) is None
    assert next_round(lost, {6}, launched=3).slots == (0, 1, 8, 7)  # node 2 has a spare now
    with pytest.raises(ValueError, match="spare"):
        first_round(2, 1, nodes=2, spare_nodes=2)  # no training node


def test_a_node_without_a_spare_of_its_own_moves_whole_to_the_spare_node():
    """One crash on a node with no spare left: its live rank is displaced with it (a
    node's ranks never straddle two machines), and the spare node trains both."""
    first = first_round(2, 0, nodes=3, spare_nodes=1)  # slots (0, 1 | 2, 3), node 2 waits
    assert next_round(first, {2}, launched=2) == RoundAssignment(1, (0, 1, 4, 5), (), (2, 3))
    assert next_round(first, {2}) == RoundAssignment(1, (0, 1, 4, 3), (5,), (2,))  # one node


def test_a_refill_round_lists_the_restarted_slot_last_and_is_no_recovery():
    from deepspeed_ext.runtime.rounds import next_round, recoveries, refill_round
    first = first_round(2, 1)
    one = next_round(first, [1])
    assert (one.slots, one.spares, one.failed) == ((0, 2), (), (1,))
    two = refill_round(one, 1)
    assert (two.round, two.slots, two.spares, two.failed) == (2, (0, 2), (1,), ())
    assert refill_round(two, 1) is None and refill_round(two, 0) is None  # in the job already
    three = next_round(two, [0])
    assert (three.slots, three.spares) == ((1, 2), ())  # the refilled slot takes rank 0
    assert recoveries([first, one, two, three]) == 2


def test_a_round_s_rendezvous_waits_for_all_and_gives_up_when_a_newer_round_supersedes_it():
    """A spare that joined round 1 while a second death made round 2 (the survivors
    joined that): round 1's rendezvous never fills, so it gives up at once and the spare
    joins round 2 (before: both waited for the group's timeout)."""
    import threading
    import torch.distributed as dist
    from deepspeed_ext.runtime.rounds import (RoundSuperseded, await_round, next_round,
                                              round_key)
    store = dist.HashStore()
    first = first_round(4, 2)
    one = next_round(first, [3])  # rank 3 -> slot 4
    two = next_round(one, [2])  # rank 2 -> slot 5
    for r in (first, one):
        store.set(round_key(r.round), r.to_json())
    store.set(CURRENT_KEY, "1")
    waiting = threading.Thread(target=lambda: pytest.raises(RoundSuperseded, await_round,
                                                           store, one, 30.0), daemon=True)
    waiting.start()  # slot 4, alone in round 1
    store.set(round_key(2), two.to_json())
    store.set(CURRENT_KEY, "2")
    waiting.join(timeout=5)
    assert not waiting.is_alive()
    arrivals = [threading.Thread(target=await_round, args=(store, two, 30.0), daemon=True)
                for _ in range(two.world_size)]
    for t in arrivals:
        t.start()
    for t in arrivals:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in arrivals)  # all four arrived: every one goes on
    alone = dist.HashStore()
    alone.set(CURRENT_KEY, "1")
    with pytest.raises(TimeoutError, match="1 of round 1's 4 training processes"):
        await_round(alone, one, 0.05)
