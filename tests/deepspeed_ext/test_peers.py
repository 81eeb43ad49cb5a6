"""Snapshot redundancy across simulated nodes on real multi-rank engines: a node that
loses its keeper and shared memory is rebuilt from its peers' copies (replicate) or
parities (erasure) and the job resumes from memory, bitwise, without storage; losing
more nodes than the redundancy covers falls back to storage and says why."""

import os
import shutil
import signal
import time

from tests.deepspeed_ext.two_level_runs import committed
from tests.deepspeed_ext.two_level_runs import flags as _flags
from tests.deepspeed_ext.two_level_runs import keeper_pid as _keeper_pid
from tests.deepspeed_ext.two_level_runs import run as _run
from tests.shm import new_shm_dir, stop_keepers

STEPS = 3


def _crash_then_lose(tmp_path, nproc, ep, extra, lost_nodes, steps=STEPS):
    """Train ``steps`` iterations with a snapshot each (only the first persisted), crash
    once every snapshot is protected, then delete the shared memory of ``lost_nodes`` (and
    SIGKILL their keepers), as when those machines die."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    flags = _flags(shm, nproc, ep, ["--moc-persist-interval", "100", *extra])
    first, results = _run(tmp_path, "first", nproc, "train-save", flags + [
        "--train-iters", str(steps), "--save", ckpt, "--save-interval", "1"],
        env={"MOC_TEST_CRASH": "1"}, ok=False)
    assert all(r.returncode == -signal.SIGKILL for r in results)
    assert "protected" in results[0].output, results[0].output[-3000:]
    deadline = time.monotonic() + 120  # the keepers finish persisting step 1 first
    while not committed(ckpt, "global_step1"):
        assert time.monotonic() < deadline, "step 1 was never committed"
        time.sleep(0.1)
    for node in lost_nodes:
        lost = os.path.join(shm, f"node{node}")
        os.kill(_keeper_pid(lost), signal.SIGKILL)
        shutil.rmtree(lost)
    return shm, ckpt, flags, first


def _assert_rebuilt_bitwise(second, first, results, ranks, step=STEPS, trained=1):
    out = results[0].output
    assert second[0]["client_state"] == {"step": step}, out[-3000:]
    assert all(r["load_source"] == "memory+peers" for r in second), [r["load_source"] for r in second]
    assert f"rebuilt the step-{step} snapshots of rank(s) {ranks}" in out
    assert f"recovered step {step} from memory" in out and "0 from storage" in out
    assert second[0]["recovery"]["plt"] == 0.0
    snapshot, after = first[0]["saved_states"][str(step)], second[0]["state_after_load"]
    assert after.keys() == snapshot.keys()
    assert [k for k in after if after[k] != snapshot[k]] == []
    # and the training went on from there on every rank
    assert all(len(r["losses"]) == trained for r in second)


def test_replicate_rebuilds_a_lost_node_from_its_peer(tmp_path):
    """4 ranks as 2 nodes, one replica: node 1's ranks get their snapshots back from node 0."""
    extra = ["--moc-ranks-per-node", "2", "--moc-redundancy", "replicate"]
    shm, ckpt, flags, first = _crash_then_lose(tmp_path, 4, 4, extra, [1])
    try:
        second, results = _run(tmp_path, "second", 4, "load-train-save", flags + [
            "--train-iters", str(STEPS + 1), "--load", ckpt, "--save", ckpt,
            "--save-interval", "1"])
        _assert_rebuilt_bitwise(second, first, results, [2, 3])
        assert "redundancy (replicate (1 replica))" in results[0].output  # shutdown summary
        assert not os.path.exists(shm)  # normal end: the peers' copies are freed too
    finally:
        stop_keepers(shm)


def test_erasure_rebuilds_a_lost_node_from_parity(tmp_path):
    """6 ranks as 3 nodes, 2 data + 1 XOR parity: node 1 is decoded from nodes 0 and 2."""
    extra = ["--moc-ranks-per-node", "2", "--moc-redundancy", "erasure", "--moc-ec-data", "2"]
    shm, ckpt, flags, first = _crash_then_lose(tmp_path, 6, 2, extra, [1])
    try:
        # each rank holds one parity of half a snapshot per protected step, not a copy
        peers = os.path.join(shm, "node0", "peers", "rank00000")
        parity = [n for n in os.listdir(peers) if n.startswith("parity") and n.endswith(".img")]
        slot = os.path.getsize(os.path.join(shm, "node0", "rank00000", "slot0.img"))
        assert parity and all(os.path.getsize(os.path.join(peers, n)) <= slot // 2 + 1
                              for n in parity)
        second, results = _run(tmp_path, "second", 6, "load-train-save", flags + [
            "--train-iters", str(STEPS + 1), "--load", ckpt, "--save", ckpt,
            "--save-interval", "1"])
        _assert_rebuilt_bitwise(second, first, results, [2, 3])
    finally:
        stop_keepers(shm)


def test_erasure_with_an_interval_keeps_the_protected_snapshot_for_a_rebuild(tmp_path):
    """3 ranks as 3 nodes, 2 data + 1 parity, every 4th snapshot protected: at the crash
    after step 8 the newest protected step is 5, three snapshots back. The survivors kept
    their own step-5 snapshots (which decoding node 1's needs, beside the parities), so
    node 1 is rebuilt at 5; before, their slots held 6-8 only and recovery went to storage."""
    extra = ["--moc-ranks-per-node", "1", "--moc-redundancy", "erasure", "--moc-ec-data", "2",
             "--moc-redundancy-interval", "4"]
    shm, ckpt, flags, first = _crash_then_lose(tmp_path, 3, 1, extra, [1], steps=8)
    try:
        second, results = _run(tmp_path, "second", 3, "load-train-save", flags + [
            "--train-iters", "6", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        _assert_rebuilt_bitwise(second, first, results, [1], step=5, trained=1)
    finally:
        stop_keepers(shm)


def test_more_lost_nodes_than_covered_fall_back_to_storage(tmp_path):
    """4 ranks as 4 nodes, one replica each on the next node: losing nodes 1 and 2 loses
    rank 1's snapshots and their only copy, so recovery goes to storage and says why."""
    extra = ["--moc-ranks-per-node", "1", "--moc-redundancy", "replicate"]
    shm, ckpt, flags, first = _crash_then_lose(tmp_path, 4, 4, extra, [1, 2])
    try:
        second, results = _run(tmp_path, "second", 4, "load-train-save", flags + [
            "--train-iters", str(STEPS), "--load", ckpt])
        out = results[0].output
        assert "cannot recover from memory, even with the peers' redundancy" in out, out[-3000:]
        assert "rank(s) [1, 2] (node(s) [1, 2]) have no snapshot in memory" in out
        assert second[0]["client_state"] == {"step": 1}  # the one persisted snapshot
        assert {r["load_source"] for r in second} <= {"storage", "storage+memory"}
    finally:
        stop_keepers(shm)


def _replicate_with_fault(tmp_path, shm, env):
    """4 ranks as 2 nodes with one replica, 4 iterations with a snapshot each, under the
    engine worker's fault ``env``; every rank's result."""
    from tests.deepspeed_ext.two_level_runs import WORKER
    from tests.launch import run_ranks
    out = tmp_path / "run"
    out.mkdir()
    return run_ranks(4, ["train-save", str(out)] + _flags(shm, 4, 4, [
        "--moc-ranks-per-node", "2", "--moc-redundancy", "replicate",
        "--train-iters", "4", "--save-interval", "1", "--save", str(tmp_path / "ckpt")]),
        script=WORKER, timeout=150, env=env)


def test_a_snapshot_failing_on_one_rank_with_redundancy_reaches_every_rank(tmp_path):
    """Rank 1 cannot size its second snapshot's slot (after the exchange, before its copy
    thread starts) while the peers protect each other's snapshots: the error reaches
    every rank at the next exchange, and no rank hangs on the peers' messages. (Whether
    the failing rank's stand-in protection keeps later messages paired is not visible
    here: the job stops at that exchange.)"""
    from tests.launch import describe
    shm = new_shm_dir()
    try:
        results = _replicate_with_fault(tmp_path, shm, {"MOC_TEST_FAIL_SLOT_RANK": "1"})
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "No space left on device (injected)" in r.output, describe(results)
    finally:
        stop_keepers(shm)


def test_a_peer_that_cannot_hold_a_snapshot_keeps_its_peers_going(tmp_path):
    """Rank 1 cannot make room for the second snapshot rank 3 sends it (its node's memory
    full): it still receives it (into scratch), says so, and takes part in the later
    protections, so rank 3 is not left waiting on it until the group's timeout (600 s)
    and the job ends normally."""
    from tests.launch import describe
    shm = new_shm_dir()
    try:
        results = _replicate_with_fault(tmp_path, shm, {"MOC_TEST_FAIL_PEER_STORE_RANK": "1"})
        assert all(r.returncode == 0 for r in results), describe(results)
        assert "snapshot redundancy failed at step 2" in results[1].output, describe(results)
        assert "No space left on device (injected)" in results[1].output
        assert "4 snapshot(s) protected" in results[0].output, describe(results)
        assert not os.path.exists(shm)  # a normal end: memory freed
    finally:
        stop_keepers(shm)
