"""megatron/training/round_watch.py: the thread beside a run that aborts this process's
NCCL communicators once a newer round names a peer failed (the rounds in a store, the
abort a stand-in: NCCL needs GPUs; the aborted world's teardown is test_process.py's)."""

import time

import torch.distributed as dist

from deepspeed_ext.runtime import rounds
from megatron.training.round_watch import RoundWatcher


def _publish(store, assignment):
    store.set(rounds.round_key(assignment.round), assignment.to_json())
    store.set(rounds.CURRENT_KEY, str(assignment.round))


class Abort:
    def __init__(self, did=True):
        self.calls, self.did = 0, did

    def __call__(self):
        self.calls += 1
        return self.did


def _wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_round_naming_a_peer_failed_aborts_once_and_a_refill_round_does_not():
    """Round 0: slots 0 and 1 train, 2 and 3 wait. A round that only drops a dead spare,
    and a refill round, leave the run alone; the round naming slot 1 failed aborts, once,
    with one line; rounds after it change nothing."""
    first = rounds.first_round(2, 2)
    store, abort, lines = dist.HashStore(), Abort(), []
    _publish(store, first)
    with RoundWatcher(lambda: store, first, abort, lines.append, poll_s=0.01) as watch:
        spare_gone = rounds.next_round(first, [3])
        _publish(store, spare_gone)
        refill = rounds.refill_round(spare_gone, 3)
        _publish(store, refill)
        time.sleep(0.1)
        assert abort.calls == 0 and watch.acted_on is None
        peer_gone = rounds.next_round(refill, [1])
        _publish(store, peer_gone)
        assert _wait_for(lambda: abort.calls == 1)
        _publish(store, rounds.next_round(peer_gone, [0]))
        time.sleep(0.1)
    assert abort.calls == 1 and watch.acted_on == peer_gone.round
    assert lines == [f"[moc] round {peer_gone.round} names a process of round 0 failed: this "
                     "process's NCCL communicators aborted, leaving the run"]


def test_nothing_to_abort_logs_nothing_and_a_lost_store_ends_the_watch():
    """On gloo the abort does nothing (False): no line. A store that cannot be reached
    (the job ended) ends the thread without an error, and leaving joins it."""
    first = rounds.first_round(2, 1)
    store, abort, lines = dist.HashStore(), Abort(did=False), []
    _publish(store, first)
    with RoundWatcher(lambda: store, first, abort, lines.append, poll_s=0.01):
        _publish(store, rounds.next_round(first, [0]))
        assert _wait_for(lambda: abort.calls == 1)
    assert lines == []

    def unreachable():
        raise RuntimeError("connection refused")
    watch = RoundWatcher(unreachable, first, abort, lines.append, poll_s=0.01)
    with watch:
        assert _wait_for(lambda: not watch.watching)
    assert abort.calls == 1 and lines == []
