"""Boundaries of :mod:`deepspeed_ext.two_level.records` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/two_level``): the records' defaults are what
the collaborators rely on before anything fills them in."""

import dataclasses
import time

import pytest

from deepspeed_ext.two_level.records import (PendingPersist, PersistRequest, RankPlace,
                                             SnapshotPlan, SnapshotTiming)


def test_a_pending_persist_starts_now_with_its_keeper():
    before = time.monotonic()
    pending = PendingPersist(save_dir="s", tag="t", selected=frozenset(), policy_before=None,
                             slot=0, in_process=False, claim=None)
    assert before <= pending.started <= time.monotonic() and pending.keeper_lost is False


def test_a_snapshot_plan_persists_nothing_until_decided():
    plan = SnapshotPlan(save_dir="s", tag="t", step=1, save_latest=True, start=0.0, want=True)
    assert (plan.persist, plan.rng_state, plan.rng_states, plan.prepared, plan.union,
            plan.persist_sel, plan.policy_before, plan.claim, plan.started) == (
        False, None, [], None, None, frozenset(), None, None, False)
    other = SnapshotPlan(save_dir="s", tag="t", step=1, save_latest=True, start=0.0, want=True)
    assert other.rng_states is not plan.rng_states


def test_a_persist_request_is_a_value_and_timings_start_at_zero():
    request = PersistRequest(snap=None, selected=None, claim=None)
    assert request.commit is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.claim = "c"
    timing = SnapshotTiming(step=3, persist=True)
    assert (timing.nbytes, timing.copies, timing.save_s, timing.slot_wait_s, timing.host_wait_s,
            timing.device_wait_s, timing.copy_s, timing.checksum_s, timing.checksum_threads,
            timing.publish_s, timing.sealed) == (0, 0, 0.0, 0.0, 0.0, None, 0.0, 0.0, 0, 0.0,
                                                 False)


def test_a_rank_place_has_no_slots_budget_or_peers_until_made():
    place = RankPlace(session=None, cfg=None, rank=0, world=1, node=0, first_of_node=True,
                      node_dir="/shm/node0", spec=None)
    assert (place.topo, place.num_slots, place.run_id, place.copier, place.slots,
            place.redundancy, place.budget_bytes) == (None, 0, None, None, None, None, 0)
