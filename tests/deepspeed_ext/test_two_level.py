"""Two-level checkpointing on real multi-rank engines: snapshots into the keeper's shared
memory survive a SIGKILL of the training processes and are recovered from memory; a
node whose memory is gone recovers from storage while the others take newer experts
from memory; nothing is left in shared memory after a normal end."""

import json
import os
import shutil
import signal
import time
import uuid

from tests.launch import describe, run_ranks

WORKER = "tests/deepspeed_ext/engine_worker.py"


def _flags(shm, nproc, ep, extra=()):
    return ["--moe-expert-parallel-size", str(ep), "--zero-stage", "2",
            "--global-batch-size", str(2 * nproc), "--moc-checkpoint", "--moc-two-level",
            "--moc-shm-dir", shm, *extra]


def _run(tmp_path, name, nproc, action, flags, env=None, ok=True):
    out = tmp_path / name
    out.mkdir()
    results = run_ranks(nproc, [action, str(out)] + flags, script=WORKER, timeout=300, env=env)
    if ok:
        assert all(r.returncode == 0 for r in results), describe(results)
    return [json.load(open(out / f"rank{r}.json")) for r in range(nproc)], results


def _shm():
    return f"/dev/shm/moc-test-{uuid.uuid4().hex[:10]}"


def _keeper_pid(node_dir):
    from deepspeed_ext.keeper import request
    return request(node_dir, {"op": "ping"})["pid"]


def test_crash_then_recover_from_memory_bitwise(tmp_path):
    shm, ckpt = _shm(), str(tmp_path / "ckpt")
    try:
        # persist only the first snapshot: steps 2 and 3 exist in memory only
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "100"])
        first, results = _run(tmp_path, "first", 2, "train-save", flags + [
            "--train-iters", "3", "--save", ckpt, "--save-interval", "1"],
            env={"MOC_TEST_CRASH": "1"}, ok=False)
        assert all(r.returncode == -signal.SIGKILL for r in results), describe(results)
        assert os.path.isdir(os.path.join(shm, "node0", "rank00001"))  # memory survived
        snapshot = first[0]["saved_states"]["3"]
        second, results = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "4", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        assert second[0]["client_state"] == {"step": 3}
        assert all(r["load_source"] == "memory" for r in second)
        assert "recovered step 3 from memory" in results[0].output
        assert "0 from storage" in results[0].output
        after = second[0]["state_after_load"]
        assert after.keys() == snapshot.keys()
        assert [k for k in after if after[k] != snapshot[k]] == []
        assert second[0]["host_memory_bytes"] > 0
        assert not os.path.exists(shm), os.listdir(shm)  # normal end: memory freed
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_node_memory_lost_two_level_recovery(tmp_path):
    """4 ranks as 2 nodes; node 1 loses its keeper and memory: storage for everything but
    the experts node 0 holds newer in memory."""
    shm, ckpt = _shm(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 4, 4, ["--moc-persist-interval", "100", "--moc-ranks-per-node", "2"])
        first, results = _run(tmp_path, "first", 4, "train-save", flags + [
            "--train-iters", "3", "--save", ckpt, "--save-interval", "1"],
            env={"MOC_TEST_CRASH": "1"}, ok=False)
        saved = first[0]["saved_states"]
        # the keepers finish persisting step 1 after the crash; then node 1 dies
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(ckpt, "global_step1", "manifest.json")):
            assert time.monotonic() < deadline, "step 1 was never committed"
            time.sleep(0.1)
        lost = os.path.join(shm, "node1")
        os.kill(_keeper_pid(lost), signal.SIGKILL)
        shutil.rmtree(lost)
        second, results = _run(tmp_path, "second", 4, "load-train-save", flags + [
            "--train-iters", "3", "--load", ckpt])
        assert [r["load_source"] for r in second] == ["storage+memory"] * 2 + ["storage"] * 2
        assert second[0]["client_state"] == {"step": 1}
        assert "two-level recovery" in results[0].output
        after = second[0]["state_after_load"]
        node0_experts = newer = 0
        for key, values in after.items():
            name = key.split("|")[0]
            if ".deepspeed_experts." not in name:
                assert values == saved["1"][key], key
                continue
            expert = int(name.split(".deepspeed_experts.")[1].split(".")[0])
            want = saved["3"] if expert < 2 else saved["1"]  # EP 4: expert e on rank e
            assert values == want[key], key
            node0_experts += expert < 2
            newer += saved["3"][key] != saved["1"][key]
        assert node0_experts and newer  # the memory versions really were newer
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_memory_budget_too_small_fails_every_rank_before_training(tmp_path):
    shm = _shm()
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = run_ranks(2, ["train-save", str(out)] + _flags(shm, 2, 2, [
            "--moc-host-memory-gb", "0.0001"]) + ["--train-iters", "1", "--save",
                                                   str(tmp_path / "ckpt"), "--save-interval", "1"],
            script=WORKER, timeout=300)
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "--moc-host-memory-gb allows 0.0001" in r.output, describe(results)
        assert not (tmp_path / "ckpt").exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
