"""The in-job restart's pieces inside a training process (megatron/training/in_job.py),
in process: the hang action under ``--moc-monitor``, and what a failed run leaves
behind for the collector. The whole restart, with processes, is in test_restart.py."""

import weakref

import pytest
import torch.distributed as dist

from deepspeed_ext.runtime import rounds
from megatron.training import in_job
from megatron.training.in_job import (OwnError, RoundClient, on_hang_in_job,
                                      request_kills)

HUNG = {"kind": "hang", "rank": 1, "suspects": [1], "waiting": [0, 2],
        "seconds_since_progress": 3.2, "iteration": 7}


class Calls:
    def __init__(self):
        self.stopped, self.exited = [], 0

    def stop_job(self, event):
        self.stopped.append(event)

    def exit_hung(self):
        self.exited += 1


def _act(event, rank, store, monkeypatch):
    monkeypatch.setenv(rounds.ROUND_ENV, "2")
    calls = Calls()
    did = on_hang_in_job(event, rank, calls.stop_job, calls.exit_hung,
                         client=RoundClient(store, slot=rank))
    return did, calls


def test_the_others_ask_the_supervisor_to_kill_the_hung_rank(monkeypatch):
    store = dist.HashStore()
    did, calls = _act(HUNG, 0, store, monkeypatch)
    assert (did, calls.stopped, calls.exited) == ("kill", [], 0)
    assert store.add(rounds.kill_count_key(2), 0) == 1
    assert store.get(rounds.kill_key(2, 1)).decode() == \
        "no progress for 3.2 s in iteration 7, found by rank 0"


def test_every_lagging_or_frozen_suspect_is_killed(monkeypatch):
    store = dist.HashStore()
    did, calls = _act(dict(HUNG, suspects=[1, 2], waiting=[0]), 0, store, monkeypatch)
    assert (did, calls.exited) == ("kill", 0)
    assert store.check([rounds.kill_key(2, 1)]) and store.check([rounds.kill_key(2, 2)])
    assert not store.check([rounds.kill_key(2, 0)])


def test_the_hung_rank_ends_itself_and_asks_nothing(monkeypatch):
    store = dist.HashStore()
    did, calls = _act(HUNG, 1, store, monkeypatch)
    assert (did, calls.stopped, calls.exited) == ("exit", [], 1)
    assert not store.check([rounds.kill_count_key(2)])


def test_without_a_culprit_every_suspect_is_killed_this_rank_too(monkeypatch):
    """Every rank stalled in one iteration (a rank SIGSTOPped inside it looks like the
    ranks waiting for it): each suspect's end is asked for."""
    store = dist.HashStore()
    event = dict(HUNG, waiting=[], suspects=[1, 0], rank=0)
    did, calls = _act(event, 0, store, monkeypatch)
    assert (did, calls.stopped, calls.exited) == ("kill", [], 0)
    assert store.add(rounds.kill_count_key(2), 0) == 2
    assert store.get(rounds.kill_key(2, 0)).decode() == \
        "no progress for 3.2 s in iteration 7, found by rank 0"
    assert store.check([rounds.kill_key(2, 1)])


def test_a_process_stuck_in_the_failed_round_asks_for_its_own_end(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setenv(rounds.ROUND_ENV, "2")
    request_kills([3], "still in the failed round 2 s after the hang was acted on",
                  client=RoundClient(store, slot=3))
    assert store.add(rounds.kill_count_key(2), 0) == 1
    assert store.get(rounds.kill_key(2, 3)).decode().startswith("still in the failed round")


def test_an_unreachable_store_stops_every_rank_as_without_in_job(monkeypatch):
    store = dist.HashStore()
    event = dict(HUNG, rank=-1, waiting=[], suspects=[])
    did, calls = _act(event, 0, store, monkeypatch)
    assert (did, calls.stopped, calls.exited) == ("stop", [event], 0)
    assert not store.check([rounds.kill_count_key(2)])


class Engine:
    """Stands for a run's engine: what must not outlive the failed run."""


def _train(keep):
    engine = Engine()  # noqa: F841  (a local of a frame in the error's traceback)
    keep.append(weakref.ref(engine))
    try:
        raise ValueError("the dead peer's connection reset")
    except ValueError as e:
        raise RuntimeError("a collective failed") from e


def test_a_failed_runs_error_is_kept_as_text_and_nothing_of_the_run_with_it(capsys):
    """run_in_job keeps the error (raised again when it is this process's own) as its
    printed traceback, not as the error object, whose frames hold the run's engine: the
    engine is collected once the except clause is left."""
    keep = []
    try:
        _train(keep)
    except RuntimeError as e:
        failure = OwnError(e)
        assert keep[0]() is not None  # the traceback's frame holds it here
    in_job.free_run_objects()
    assert keep[0]() is None
    assert failure.summary == "RuntimeError: a collective failed"
    assert "in _train" in failure.text and "ValueError: the dead peer's connection " \
        "reset" in failure.text  # the cause is printed too
    with pytest.raises(OwnError, match="a collective failed.*no peer died"):
        failure.raise_again()
    assert capsys.readouterr().err == failure.text


def test_free_run_objects_collects_a_runs_cycles_and_says_how_many_passes():
    """Cycles are freed and the passes counted (at least one; the last one freed nothing).
    Why one pass is not enough for a real engine is shown by test_reentry.py, which fails
    with a single pass."""
    inner = Engine()
    inner.self = inner
    ref = weakref.ref(inner)
    del inner
    passes = in_job.free_run_objects()
    assert ref() is None and 2 <= passes <= 5
    assert in_job.free_run_objects(max_passes=1) == 1


def test_a_refill_round_is_joined_as_the_recovery_round_before_it():
    """--moc-refill-spares writes a refill round right after each recovery round: the
    processes that read either form the recovery round's group (the same ranks), not two
    groups that never fill."""
    first = rounds.first_round(2, 1)
    one = rounds.next_round(first, [1])
    two = rounds.refill_round(one, 1)
    store = dist.HashStore()
    for r in (first, one, two):
        store.set(rounds.round_key(r.round), r.to_json())
    store.set(rounds.CURRENT_KEY, "2")
    client = RoundClient(store, slot=2)
    assert client.base_round(two) == one and client.base_round(one) == one
    assert client.base_round(first) == first
    assert client.recoveries_until(2) == 1


def test_a_run_failed_by_a_peer_is_told_from_one_failed_on_its_own():
    """A process whose run raised joins the next round only when a later round names one
    of its round's training processes failed; a round that drops a dead spare does not,
    and the error is then its own (``peer_failed`` returns False after its wait)."""
    first = rounds.first_round(2, 2)  # slots 0 and 1 train, 2 and 3 wait
    spare_gone = rounds.next_round(first, [3])
    store = dist.HashStore()
    for r in (first, spare_gone):
        store.set(rounds.round_key(r.round), r.to_json())
    store.set(rounds.CURRENT_KEY, str(spare_gone.round))
    client = RoundClient(store, slot=0)
    assert not client.peer_failed(first, within_s=0.05)
    peer_gone = rounds.next_round(spare_gone, [1])
    store.set(rounds.round_key(peer_gone.round), peer_gone.to_json())
    store.set(rounds.CURRENT_KEY, str(peer_gone.round))
    assert client.peer_failed(first, within_s=0.05)
    assert not client.peer_failed(peer_gone, within_s=0.05)
