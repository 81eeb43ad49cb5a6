"""Snapshots of a real :class:`deepspeed_ext.two_level.TwoLevel` on a one-rank CPU engine
in the test's own process (:mod:`tests.deepspeed_ext.two_level.one_rank_job`): what a
snapshot holds, which snapshots persist and what they log, the stages' timings, the
engine's state followed after its moments were replaced, and slot rotation."""

import copy
import logging
import os
import re
import threading
import time

import pytest

from deepspeed_ext.format import memsum
from deepspeed_ext.format.objects import decode, tensor_keys
from deepspeed_ext.snapshot import SLOTS, SlotImage
from deepspeed_ext.state import base_optimizer
from tests.deepspeed_ext.two_level.one_rank_job import one_rank_job, same_state

ALL_EXPERTS = [[0, 0], [0, 1], [0, 2], [0, 3]]


def slot_tensors(two, slot):
    """Every tensor of the snapshot in ``slot``, by key."""
    meta = two.slots.meta(slot)
    image = SlotImage(two.slots.image_path(slot))
    try:
        return {e["key"]: image.read(e) for e in meta["entries"]}
    finally:
        image.close()


def slot_objects(two, slot):
    meta = two.slots.meta(slot)
    tensors = slot_tensors(two, slot)
    tree = meta["objects_tree"]
    return decode(tree, {k: tensors[k] for k in tensor_keys(tree)})


def slot_of(two, step):
    (slot,) = [i for i, m in two.slots.complete() if m["step"] == step]
    return slot


def experts_of(meta):
    return [list(e) for e in meta["experts"]]


def moc_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[moc] snapshot")]


def test_every_persist_interval_th_snapshot_persists_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "2") as job:
        two = job.two
        assert two.first_of_node and two.place.num_slots == SLOTS == 3
        walls = []
        for _ in range(3):
            job.train()
            before = time.perf_counter()
            assert job.save() is True
            walls.append(time.perf_counter() - before)
            if job.step == 1:
                job.moc.wait()  # committed: the third snapshot, due, is persisted
        two.join_copy()
        timings = two.timings
        assert [(t.step, t.persist, t.sealed) for t in timings] == [
            (1, True, True), (2, False, True), (3, True, True)]
        for timing, wall in zip(timings, walls):
            assert 0 < timing.save_s <= wall and timing.slot_wait_s == 0
            assert timing.publish_s >= 0 and timing.checksum_s >= 0
            assert timing.nbytes > 0 and timing.copies > 0 and timing.host_wait_s >= 0
        assert two.last.meta["step"] == 3 and two.last.persisted and two.persist is not None
        job.moc.wait()
        assert two.persist is None
        lines = moc_lines(caplog)
        node, mib = re.escape(two.node_dir), r"\d+\.\d\d MiB on rank 0"
        assert len(lines) == 2, lines  # the not-due one is not logged: it would flood
        for step, line in zip((1, 3), lines):
            assert re.fullmatch(rf"\[moc\] snapshot global_step{step} \(step {step}\) into {node}: "
                                rf"{mib}, 4 of 4 experts, persisting 4 of them; the save call "
                                rf"took \d+\.\d\d\d s", line), line
        size = float(re.search(r"(\d+\.\d\d) MiB", lines[0]).group(1))
        assert abs(size - timings[0].nbytes / 2**20) < 0.01
        assert "still running" not in caplog.text
        assert two.host_memory_bytes() == two.slots.host_bytes() > 0
        with open(os.path.join(job.save_dir, "latest")) as f:
            assert f.read().strip() == "global_step3"
        assert not os.path.exists(job.tag_dir(2))


def test_a_snapshot_holds_the_live_state_and_its_own_metadata(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train()
        job.save(tag="first")
        job.train()
        job.save()
        two.join_copy()
        live = job.state()
        slot = slot_of(two, 2)
        meta = two.slots.meta(slot)
        assert (meta["step"], meta["tag"], meta["run_id"]) == (2, "global_step2", two.place.run_id)
        assert experts_of(meta) == ALL_EXPERTS and set(meta["specs"]) == set(live)
        assert meta["signature"] == two.slots.meta(slot_of(two, 1))["signature"]
        assert two.slots.meta(slot_of(two, 1))["tag"] == "first"
        tensors = slot_tensors(two, slot)
        assert same_state({k: tensors[k] for k in live},
                          {k: t.reshape(-1) for k, t in live.items()}) == []
        size = max(e["start"] + e["nbytes"] for e in meta["entries"])
        with open(two.slots.image_path(slot), "rb") as f:
            assert memsum.verify(f.read(size), meta["checksum"]) is None
        objects = slot_objects(two, slot)
        assert objects["client_state"] == {"step": 2}
        # Not due for storage: no collective, this rank's own RNG state only.
        assert len(objects["rng_states"]) == 1 and objects["rng_states"][0] is not None
        assert not two.last.rng_gathered and two.last.rng_state is not None
        assert objects["snapshot_policy"]["k"] == 4


def test_k_snapshot_experts_rotate_and_a_persisted_one_holds_them_all(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100", "--moc-k-snapshot", "1") as job:
        two = job.two
        job.train_and_save(3)
        two.join_copy()
        experts = {m["step"]: experts_of(m) for _, m in two.slots.complete()}
        assert experts[1] == ALL_EXPERTS  # persisted: every expert PEC saves (pec_k 0: all)
        assert len(experts[2]) == len(experts[3]) == 1 and experts[2] != experts[3]
        meta = two.slots.meta(slot_of(two, 3))
        (expert,) = meta["experts"]
        held = {tuple(spec["expert"]) for spec in meta["specs"].values() if spec["expert"]}
        assert held == {tuple(expert)}  # only that expert's fragments, with the rest


def test_a_snapshot_follows_optimizer_moments_replaced_by_new_tensors(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train_and_save(1)
        opt = base_optimizer(job.engine)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new moment tensors
        for state in opt.state.values():
            for kind in ("exp_avg", "exp_avg_sq"):
                state[kind].fill_(0.25)
        job.save(tag="replaced")
        two.join_copy()
        live = job.state()
        moments = [k for k in live if "exp_avg" in k]
        assert moments and all(bool((live[k] == 0.25).all()) for k in moments)
        tensors = slot_tensors(two, two.last.slot)
        assert same_state({k: tensors[k] for k in live},
                          {k: t.reshape(-1) for k, t in live.items()}) == []


def _gated_digest(monkeypatch):
    """Hold every seal's checksum until the returned event is set."""
    gate, real = threading.Event(), memsum.digest

    def gated(*args, **kwargs):
        gate.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(memsum, "digest", gated)
    return gate


def test_a_save_takes_a_free_slot_and_waits_for_a_seal_only_when_none_is(tmp_path, monkeypatch):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train_and_save(1)
        job.moc.wait()  # step 1 complete and persisted: no slot is busy
        first = slot_of(two, 1)
        gate = _gated_digest(monkeypatch)
        seen = []
        two.fault_hook = lambda step: seen.append(
            (step, step in {m["step"] for _, m in two.slots.complete()}))
        job.train()
        job.save()  # A (step 2): copied, its seal held at the gate
        slot_a = two.last.slot
        job.train()  # the wrapped step waits for A's copy, never for its seal
        assert not gate.is_set() and two.slots.meta(slot_a) is None
        job.save()  # B (step 3): a slot is still free
        slot_b = two.last.slot
        assert two.timings[-1].slot_wait_s == 0 and len({first, slot_a, slot_b}) == 3
        job.train()
        threading.Timer(0.3, gate.set).start()
        job.save()  # C (step 4): step 1 newest complete, A and B sealing: waits for A
        timing = two.timings[-1]
        assert 0.1 <= timing.slot_wait_s <= timing.save_s  # the wait is part of the call
        assert two.last.slot == first  # A sealed is the newest complete: step 1's slot is free
        two.join_copy()
        assert seen == [(2, False), (3, False), (4, False)]  # filled, not yet published
        assert {m["step"] for _, m in two.slots.complete()} == {2, 3, 4}


class _Redundancy:
    """A stand-in for the peers' redundancy (:class:`deepspeed_ext.peers.PeerRedundancy`):
    records what it is asked to protect; :attr:`busy` slots stay busy until a wait."""

    def __init__(self):
        self.protected = []
        self.busy = set()
        self.waits = 0
        self.store = self

    def protect(self, step, slot, buffer, meta):
        self.protected.append((step, slot, buffer is not None, meta and meta["step"]))

    def busy_slots(self):
        return set(self.busy)

    def wait_slots(self):
        self.waits += 1
        self.busy = set()
        return 0.125

    def host_bytes(self):
        return 1000

    def stop(self):
        pass


def test_the_redundancy_protects_every_interval_th_snapshot_even_one_that_failed(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100",
                      "--moc-redundancy-interval", "2") as job:
        two = job.two
        two.place.redundancy = redundancy = _Redundancy()
        assert two.host_memory_bytes() == two.slots.host_bytes() + 1000
        job.train_and_save(4)
        two.join_copy()
        slots = {m["step"]: i for i, m in two.slots.complete()}
        assert redundancy.protected == [(1, 0, True, 1), (3, slots[3], True, 3)]
        assert two.snapshotter.protected == (slots[3], 3)
        real = two.slots.buffer
        two.slots.buffer = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left (test)"))
        job.train()
        assert job.save() is False  # the fifth snapshot, to be protected, never started
        two.slots.buffer = real
        assert redundancy.protected[-1] == (5, -1, False, None)


def test_a_save_waits_for_the_redundancy_only_while_no_slot_is_free(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train_and_save(2)
        job.moc.wait()
        two.place.redundancy = redundancy = _Redundancy()
        newest = slot_of(two, 2)
        redundancy.busy = {i for i in range(SLOTS) if i != newest}
        job.train()
        job.save()
        assert redundancy.waits == 1 and two.redundancy_wait_s == 0.125
        assert two.timings[-1].slot_wait_s == 0.125 and two.last.slot != newest
        assert "WARNING: the next snapshot waited 0.125 s for the redundancy of an earlier " \
               "one" in caplog.text
        job.train()
        job.save()  # nothing busy now: no wait
        assert redundancy.waits == 1 and two.timings[-1].slot_wait_s == 0


def test_erasure_keeps_the_protected_snapshot_until_no_other_slot_is_left(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "100",
                         "--moc-redundancy-interval", "10") as job:
        two = job.two
        two.place.redundancy = redundancy = _Redundancy()
        two.place.spec = type("Erasure", (), {"mode": "erasure", "enabled": True})()
        job.train_and_save(1)
        job.moc.wait()  # step 1: persisted, protected
        kept = slot_of(two, 1)
        redundancy.busy = {kept}  # still sent to the peers, too
        job.train_and_save(3)  # steps 2-4: step 4 must not take step 1's slot
        two.join_copy()
        assert two.slots.meta(kept)["step"] == 1
        assert "reusing the slot" not in caplog.text
        # Every slot but the kept one and the newest being persisted: the kept one goes.
        newest = slot_of(two, 4)
        others = [i for i in range(SLOTS) if i not in (kept, newest)]
        markers = [two.slots.persist_marker(i) for i in others]
        job.train()
        assert job.save() is True and two.last.slot == kept
        assert "WARNING: reusing the slot of step 1's snapshot, the newest one erasure " \
               "coding protects" in caplog.text
        for marker in markers:
            os.remove(marker)


def test_a_save_with_no_slot_left_fails_on_this_rank_and_is_raised_at_the_wait(tmp_path, caplog,
                                                                              monkeypatch):
    """After waiting snapshot.PERSIST_WAIT_S (shortened here) for the keeper."""
    from deepspeed_ext import snapshot
    from deepspeed_ext.runtime.outcomes import MoCCheckpointError
    monkeypatch.setattr(snapshot, "PERSIST_WAIT_S", 0.2)
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train_and_save(1)
        job.moc.wait()
        newest = slot_of(two, 1)
        markers = [two.slots.persist_marker(i) for i in range(SLOTS) if i != newest]
        job.train()
        assert job.save() is False
        assert re.search(r"WARNING: snapshot global_step2: RuntimeError: no free snapshot slot",
                         caplog.text)
        for marker in markers:
            os.remove(marker)
        with pytest.raises(MoCCheckpointError, match="no free snapshot slot"):
            job.moc.wait()
        job.train()
        assert job.save() is True  # the error was reported once
