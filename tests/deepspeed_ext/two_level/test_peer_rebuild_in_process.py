"""Rebuilding lost snapshots from the peers
(:func:`deepspeed_ext.two_level.peer_rebuild.rebuild_from_peers`) on the slots of a real
one-rank two-level job in the test's own process
(:mod:`tests.deepspeed_ext.two_level.one_rank_job`): what this rank offers, what the
redundancy gets, and what is logged. The redundancy and its plan are stand-ins: one rank
has no peers."""

import dataclasses
import logging
import re
import types

import pytest

from deepspeed_ext.policy import redundancy as rd
from deepspeed_ext.snapshot import image_end
from deepspeed_ext.two_level.peer_rebuild import rebuild_from_peers
from tests.deepspeed_ext.two_level.one_rank_job import one_rank_job


class _Redundancy:
    def __init__(self, replicas=None, parities=None, fail=None):
        self.held = (replicas or {}, parities or {})
        self.fail = fail
        self.rebuilds = []

    def holdings_record(self):
        return self.held

    def rebuild(self, plan, chunks, own_image, slots):
        if self.fail:
            raise OSError(5, self.fail)
        self.rebuilds.append((plan.step, chunks, own_image(plan.step)))
        return {"received": 3 * 2**19}


@pytest.fixture
def job(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        job.train_and_save(2)
        job.two.join_copy()
        yield job


def _place(job, redundancy):
    topo = types.SimpleNamespace(node_of=lambda rank: 7)
    spec = types.SimpleNamespace(describe=lambda: "erasure (test)")
    return dataclasses.replace(job.two.place, redundancy=redundancy, topo=topo, spec=spec)


def _plans(monkeypatch, step, rebuilt=(0,), why=""):
    """``rd.plan_rebuild`` answers ``(step, rebuilt, why)``; returns the holdings it got."""
    seen = []

    def plan(holdings, topo, spec):
        seen.append(holdings)
        return types.SimpleNamespace(step=step, rebuilt=rebuilt, why=why)
    monkeypatch.setattr(rd, "plan_rebuild", plan)
    return seen


def _signature(job):
    # Equal to the slots' but another object, as a load computes it.
    return "".join(list(job.two.slots.meta(job.two.last.slot)["signature"]))


def test_a_rebuild_gets_this_ranks_own_images_and_is_logged(job, monkeypatch, caplog):
    seen = _plans(monkeypatch, 2, why="a parity short")
    redundancy = _Redundancy(parities={"2": "chunk"})
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
        assert rebuild_from_peers(_place(job, redundancy), _signature(job)) is True
    (holdings,) = seen
    assert holdings.own == {0: frozenset({1, 2})} and holdings.replicas == {0: {}}
    assert holdings.parities == {0: frozenset({2})}
    ((step, chunks, image),) = redundancy.rebuilds
    meta = job.two.slots.meta(job.two.last.slot)
    with open(job.two.slots.image_path(job.two.last.slot), "rb") as f:
        assert image.numpy().tobytes() == f.read(image_end(meta)) and image.numel() > 0
    assert (step, chunks) == (2, {0: {2: "chunk"}})
    match = re.search(r"\[moc\] recovery: rebuilt the step-2 snapshots of rank\(s\) \[0\] "
                      r"\(lost node\(s\) \[7\]\) from the peers' memory \(erasure \(test\)\): "
                      r"1\.50 MiB in (\d+\.\d\d) s; a parity short$", caplog.text, re.M)
    assert match and float(match.group(1)) < 1, caplog.text


def test_a_failed_rebuild_is_logged_and_leaves_memory_recovery_out(job, monkeypatch, caplog):
    _plans(monkeypatch, 2)
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
        assert rebuild_from_peers(_place(job, _Redundancy(fail="peer gone (test)")),
                                  _signature(job)) is False
    assert "recovery: rebuilding snapshots from peers failed (rank 0: OSError: [Errno 5] peer " \
           "gone (test))" in caplog.text
    _plans(monkeypatch, 2, why="")
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
        assert rebuild_from_peers(_place(job, _Redundancy()), _signature(job)) is True
    assert re.search(r"MiB in \d+\.\d\d s$", caplog.text, re.M)


@pytest.mark.parametrize("own, replicas", [(True, {}), (False, {"1": [2]})])
def test_no_plan_is_said_when_anything_is_held(job, monkeypatch, caplog, own, replicas):
    seen = _plans(monkeypatch, None, why="two nodes lost (test)")
    signature = _signature(job) if own else "another layout"
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
        assert rebuild_from_peers(_place(job, _Redundancy(replicas=replicas)), signature) is False
    assert seen[0].own == {0: frozenset({1, 2} if own else ())}
    assert "recovery: cannot recover from memory, even with the peers' redundancy: two nodes " \
           "lost (test); loading from storage" in caplog.text


def test_nothing_held_anywhere_or_nothing_to_rebuild_is_not_logged(job, monkeypatch, caplog):
    _plans(monkeypatch, None, why="nothing (test)")
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
        assert rebuild_from_peers(_place(job, _Redundancy()), "another layout") is False
        _plans(monkeypatch, 2, rebuilt=())
        redundancy = _Redundancy()
        assert rebuild_from_peers(_place(job, redundancy), _signature(job)) is False
    assert redundancy.rebuilds == [] and "recovery:" not in caplog.text
