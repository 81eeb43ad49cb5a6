"""Two-level checkpointing on real multi-rank engines: snapshots into the keeper's shared
memory survive a SIGKILL of the training processes and are recovered from memory; a
node whose memory is gone recovers from storage while the others take newer experts
from memory; nothing is left in shared memory after a normal end."""

import json
import os
import shutil
import signal
import time

import pytest

from deepspeed_ext.format.naming import ITERATION_FILE
from deepspeed_ext.job_identity import RUN_ID_FILE
from deepspeed_ext.keeper import HANG_PERSIST_ENV
from deepspeed_ext.two_level.handover import LATE_HAND_OVER_ENV
from tests.deepspeed_ext.two_level_runs import WORKER, committed
from tests.deepspeed_ext.two_level_runs import flags as _flags
from tests.deepspeed_ext.two_level_runs import keeper_pid as _keeper_pid
from tests.deepspeed_ext.two_level_runs import run as _run
from tests.launch import describe, run_ranks
from tests.shm import new_shm_dir, stop_keepers


def _crashed_after_3(tmp_path, flags, ckpt, nproc=2):
    """A job of ``nproc`` ranks saving every step, SIGKILLed after step 3's snapshot;
    every rank's results."""
    first, results = _run(tmp_path, "first", nproc, "train-save", flags + [
        "--train-iters", "3", "--save", ckpt, "--save-interval", "1"],
        env={"MOC_TEST_CRASH": "1"}, ok=False)
    assert all(r.returncode == -signal.SIGKILL for r in results), describe(results)
    return first


def test_crash_then_recover_from_memory_bitwise(tmp_path):
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        # persist only the first snapshot: steps 2 and 3 exist in memory only
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "100"])
        first = _crashed_after_3(tmp_path, flags, ckpt)
        assert os.path.isdir(os.path.join(shm, "node0", "rank00001"))  # memory survived
        snapshot = first[0]["saved_states"]["3"]
        second, results = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "4", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        assert second[0]["client_state"] == {"step": 3}
        assert all(r["load_source"] == "memory" for r in second)
        # every expert came from the step-3 snapshot: the token ledger counts no loss
        recovery = second[0]["recovery"]
        assert recovery["step"] == 3 and recovery["exact"] and recovery["plt"] == 0.0
        assert sum(map(sum, recovery["lost"])) == 0 and min(recovery["assigned"]) > 0
        assert "recovered step 3 from memory" in results[0].output
        assert "0 from storage" in results[0].output
        after = second[0]["state_after_load"]
        assert after.keys() == snapshot.keys()
        assert [k for k in after if after[k] != snapshot[k]] == []
        assert second[0]["host_memory_bytes"] > 0
        # the last snapshot was not due for storage (interval 100): the end persists it
        assert _latest(ckpt) == "global_step4" and _verify(ckpt, "global_step4") == []
        assert not os.path.exists(shm), os.listdir(shm)  # normal end: memory freed
    finally:
        stop_keepers(shm)


def test_a_snapshot_damaged_in_memory_is_not_recovered(tmp_path):
    """A bit flipped in rank 1's newest snapshot after the crash: recovery used to load it
    (the image has no checksum); now rank 1 refuses that slot, and every rank recovers
    the newest step all of them still hold intact."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "100"])
        _crashed_after_3(tmp_path, flags, ckpt)
        rank1 = os.path.join(shm, "node0", "rank00001")
        held = {json.load(open(os.path.join(rank1, n)))["step"]: n[:-len(".json")]
                for n in os.listdir(rank1) if n.startswith("slot") and n.endswith(".json")}
        assert 2 in held and 3 in held, held
        with open(os.path.join(rank1, held[3] + ".img"), "r+b") as f:
            f.seek(4096 + 3)
            byte = f.read(1)
            f.seek(4096 + 3)
            f.write(bytes([byte[0] ^ 0x04]))
        second, results = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "4", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        assert "not recovering from the step-3 snapshot" in results[1].output, describe(results)
        assert "checksum mismatch" in results[1].output
        assert second[0]["client_state"] == {"step": 2}
        assert all(r["load_source"] == "memory" for r in second)
    finally:
        stop_keepers(shm)


def test_storage_newer_than_every_ranks_memory_wins(tmp_path):
    """Rank 1's memory lacks the newest step (a rank rebuilt from peers holds only the
    protected step; a slot lost): recovering the older step all ranks hold would throw
    persisted progress away, and the next persist's index could not extend the newer
    checkpoint. Storage's newer checkpoint is loaded instead."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "1"])
        first, results = _run(tmp_path, "first", 2, "train-save", flags + [
            "--train-iters", "4", "--save", ckpt, "--save-interval", "1"],
            env={"MOC_TEST_CRASH": "1", "MOC_TEST_PERSIST_FIRST": "1"}, ok=False)
        assert all(r.returncode == -signal.SIGKILL for r in results), describe(results)
        assert _latest(ckpt) == "global_step4"
        # the keeper wrote the objects' tensors to their own file, not into rank 0's share
        assert os.path.isfile(os.path.join(ckpt, "global_step4", "objects.safetensors"))
        rank1 = os.path.join(shm, "node0", "rank00001")
        held = {}
        for name in os.listdir(rank1):
            if name.startswith("slot") and name.endswith(".json"):
                held[json.load(open(os.path.join(rank1, name)))["step"]] = name
        assert 4 in held and 3 in held, held  # steps 3 and 4 in memory on both ranks
        os.remove(os.path.join(rank1, held[4]))
        second, results = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "6", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        assert second[0]["client_state"] == {"step": 4}
        assert all(r["load_source"] == "storage" for r in second)
        assert "storage holds a newer checkpoint (step 4) than every rank's memory (step 3)" \
            in results[0].output
        assert _latest(ckpt) == "global_step6" and _verify(ckpt, "global_step6") == []
    finally:
        stop_keepers(shm)


def test_failed_memory_recovery_with_nothing_on_storage_stops_every_rank(tmp_path):
    # Memory recovery fails on rank 1 after writing into the engine, and storage holds no
    # checkpoint: "starting from scratch" would train on from half-restored tensors as
    # iteration 0. Every rank must stop with the reason instead.
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "100"])
        _crashed_after_3(tmp_path, flags, ckpt)
        # The keeper's persist of step 1 lands first: wait for the end of its commit
        # (the manifest, then `latest`); deleting after the manifest alone raced with the
        # keeper writing `latest` afterwards, which then named a deleted checkpoint.
        deadline = time.monotonic() + 120
        while not committed(ckpt, "global_step1"):
            assert time.monotonic() < deadline, "step 1 was never committed"
            time.sleep(0.1)
        # Its checkpoints lost; the snapshots of steps 2-3 are in memory. (The run id
        # stays: without it the memory would be another job's, and the start refused.)
        for name in os.listdir(ckpt):
            if name != RUN_ID_FILE:
                shutil.rmtree(os.path.join(ckpt, name), ignore_errors=True)
                if os.path.exists(os.path.join(ckpt, name)):
                    os.remove(os.path.join(ckpt, name))
        out = tmp_path / "second"
        out.mkdir()
        results = run_ranks(2, ["load-train-save", str(out)] + flags + [
            "--train-iters", "4", "--load", ckpt, "--save", ckpt, "--save-interval", "1"],
            script=WORKER, timeout=300, env={"MOC_TEST_FAIL_RESTORE_RANK": "1"})
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "holds no checkpoint to fall back to" in r.output, describe(results)
    finally:
        stop_keepers(shm)


def test_node_memory_lost_two_level_recovery(tmp_path):
    """4 ranks as 2 nodes; node 1 loses its keeper and memory: storage for everything but
    the experts node 0 holds newer in memory. The nodes come from the environment
    DeepSpeed's launcher sets (LOCAL_SIZE, no LOCAL_WORLD_SIZE): read only the latter,
    every rank counted as node 0."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    deepspeed_launcher = {"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "2"}
    try:
        flags = _flags(shm, 4, 4, ["--moc-persist-interval", "100"])
        first, results = _run(tmp_path, "first", 4, "train-save", flags + [
            "--train-iters", "3", "--save", ckpt, "--save-interval", "1"],
            env={"MOC_TEST_CRASH": "1", **deepspeed_launcher}, ok=False)
        saved = first[0]["saved_states"]
        # the keepers finish persisting step 1 after the crash; then node 1 dies
        deadline = time.monotonic() + 120
        while not committed(ckpt, "global_step1"):
            assert time.monotonic() < deadline, "step 1 was never committed"
            time.sleep(0.1)
        lost = os.path.join(shm, "node1")
        os.kill(_keeper_pid(lost), signal.SIGKILL)
        shutil.rmtree(lost)
        second, results = _run(tmp_path, "second", 4, "load-train-save", flags + [
            "--train-iters", "3", "--load", ckpt], env=deepspeed_launcher)
        assert [r["load_source"] for r in second] == ["storage+memory"] * 2 + ["storage"] * 2
        assert second[0]["client_state"] == {"step": 1}
        assert "two-level recovery" in results[0].output
        assert all(r["recovery"] == second[0]["recovery"] for r in second)
        assert second[0]["recovery"]["step"] == 1 and second[0]["recovery"]["plt"] == 0.0
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
        stop_keepers(shm)


def test_memory_budget_too_small_fails_every_rank_before_training(tmp_path):
    shm = new_shm_dir()
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
        # nothing but the job's run id was written (kept for its next start)
        assert os.listdir(tmp_path / "ckpt") == [RUN_ID_FILE]
    finally:
        stop_keepers(shm)


def test_persist_directory_failure_reaches_every_rank(tmp_path):
    # Rank 0 alone creates a persist's directory (before the snapshot's exchange); a
    # directory holding someone else's file must stop every rank, not only rank 0.
    shm, ckpt = new_shm_dir(), tmp_path / "ckpt"
    (ckpt / "global_step1").mkdir(parents=True)
    (ckpt / "global_step1" / "notes.txt").write_text("not MoC's")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = run_ranks(2, ["train-save", str(out)] + _flags(shm, 2, 2) + [
            "--train-iters", "2", "--save", str(ckpt), "--save-interval", "1"],
            script=WORKER, timeout=300)
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "MoC persist to" in r.output and "failed on rank 0" in r.output, describe(results)
            assert "holds files MoC did not write" in r.output, describe(results)
        assert os.listdir(ckpt / "global_step1") == ["notes.txt"]  # nothing deleted
    finally:
        stop_keepers(shm)


def test_a_job_ending_with_a_failed_persist_keeps_the_snapshots_in_memory(tmp_path):
    """The last persist never commits (the keeper stalls in it; --moc-commit-timeout
    ends the wait): every rank reports the failure, and the node's memory, the only copy
    of the newest snapshots, stays for a restart. Before, the end of the job asked the
    keeper to shut down, and on its slow answer deleted the directory under it."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = run_ranks(2, ["train-save", str(out)] + _flags(shm, 2, 2, [
            "--moc-persist-interval", "1", "--moc-commit-timeout", "6"]) + [
            "--train-iters", "2", "--save", ckpt, "--save-interval", "1"],
            script=WORKER, timeout=300,
            env={"MOC_TEST_END_BY_SHUTDOWN": "1", "MOC_FAULT_HANG_PERSIST_STEP": "2"})
        for r in results:
            assert r.returncode != 0 and "not committed within 6 s" in r.output, describe(results)
        assert "leaving them in" in results[0].output, describe(results)
        rank0 = os.path.join(shm, "node0", "rank00000")
        steps = {json.load(open(os.path.join(rank0, n)))["step"]
                 for n in os.listdir(rank0) if n.startswith("slot") and n.endswith(".json")}
        assert 2 in steps, steps
        os.kill(_keeper_pid(os.path.join(shm, "node0")), signal.SIGKILL)  # hung in the persist
    finally:
        stop_keepers(shm)


def _latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


def _verify(ckpt, tag):
    from deepspeed_ext.store.verify import verify_checkpoint
    return verify_checkpoint(ckpt, tag)


def test_sigkill_during_persist_keeps_previous_latest(tmp_path):
    """The keeper is SIGKILLed in the middle of a persist (a rank file written, no report,
    no manifest): storage still names the previous checkpoint as latest, intact, and a
    restart without memory loads it and saves over the leftovers."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "1"])
        _, results = _run(tmp_path, "first", 2, "train-save", flags + [
            "--train-iters", "3", "--save", ckpt, "--save-interval", "1"],
            env={"MOC_TEST_CRASH": "1", "MOC_FAULT_HANG_PERSIST_STEP": "2",
                 "MOC_TEST_WAIT_AFTER_STEP": "1"}, ok=False)
        assert all(r.returncode == -signal.SIGKILL for r in results), describe(results)
        node = os.path.join(shm, "node0")
        deadline = time.monotonic() + 60
        while "hanging after writing rank" not in open(os.path.join(node, "keeper.log")).read():
            assert time.monotonic() < deadline, "no persist reached the hang"
            time.sleep(0.1)
        log = open(os.path.join(node, "keeper.log")).read()
        hung = log.split("hanging after writing rank ")[1].split(" of ")[1].split()[0]
        assert hung == "global_step2"
        assert "the previous persist (global_step2) is still running" in results[0].output
        os.kill(_keeper_pid(node), signal.SIGKILL)  # mid-persist
        assert _latest(ckpt) == "global_step1"
        assert any(n.endswith(".safetensors") for n in os.listdir(os.path.join(ckpt, hung)))
        assert not os.path.exists(os.path.join(ckpt, hung, "manifest.json"))
        assert _verify(ckpt, "global_step1") == []
        shutil.rmtree(shm)  # the node's memory is gone too: recovery must use storage
        second, results = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "3", "--load", ckpt, "--save", ckpt, "--save-interval", "1"])
        assert second[0]["client_state"] == {"step": 1}
        assert all(r["load_source"] == "storage" for r in second)
        assert _latest(ckpt) == "global_step3"
        assert _verify(ckpt, "global_step3") == []
        assert not os.path.exists(shm)
    finally:
        stop_keepers(shm)


def _keeper_dies_mid_persist(tmp_path, shm, ckpt, step, iters, waits):
    """A job of two ranks on one node persisting every snapshot, whose keeper dies in the
    middle of step ``step``'s persist: it hangs after writing rank 1's file, before its
    report, and is killed there; rank 0 hands its share over only after that
    (MOC_FAULT_LATE_HAND_OVER, as a loaded machine did) and writes it, and the commit,
    itself. ``waits``: the steps a wait follows. Returns every rank's output."""
    flags = _flags(shm, 2, 2, ["--moc-persist-interval", "1"])
    _, results = _run(tmp_path, "run", 2, "train-save", flags + [
        "--train-iters", str(iters), "--save", ckpt, "--save-interval", "1"],
        env={"MOC_TEST_KILL_KEEPER_STEP": str(step), "MOC_TEST_WAIT_AFTER_STEP": waits,
             HANG_PERSIST_ENV: str(step), LATE_HAND_OVER_ENV: f"0@{step}"})
    return "".join(r.output for r in results)


def test_keeper_killed_training_goes_on_persisting_in_process(tmp_path):
    """The keeper dies in the middle of step 2's persist, rank 1's share with it, while
    rank 0 writes its own (:func:`_keeper_dies_mid_persist`). Every rank says so once; the
    pending persist ends as failed at step 3's snapshot, whatever the speed (before, rank
    0's view depended on whether rank 1 had written its error report yet: "still running"
    left step 3 in memory only, and the wait after it raised "the keeper of node 0 died
    while persisting global_step2"); steps 3 and 4 are persisted by the training
    processes, the run ends normally and leaves no shared memory."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        # Waiting after step 3 too: without it, on a loaded machine, step 3's in-process
        # persist can still be running at step 4 (which then stays in memory until the
        # end), and the test would not show that both are persisted by the processes.
        output = _keeper_dies_mid_persist(tmp_path, shm, ckpt, 2, 4, "1,3")
        for rank in range(2):
            assert output.count(f"rank {rank}: WARNING: the keeper of node 0 is gone") == 1, output
        # the interleaving: rank 0's share written by rank 0, rank 1's lost with the keeper
        assert "rank 0: WARNING: the keeper of node 0 is gone (it did not take the persist " \
               "of global_step2)" in output
        assert "rank 1: WARNING: the keeper of node 0 is gone (it stopped answering" in output
        assert "persisting global_step2 failed" in output
        assert "still running; this snapshot stays in memory only" not in output
        assert "before returning from wait" not in output  # step 4 persisted when it was taken
        assert not os.path.exists(os.path.join(ckpt, "global_step2", "manifest.json"))
        assert _verify(ckpt, "global_step3") == []
        assert _latest(ckpt) == "global_step4"
        assert _verify(ckpt, "global_step4") == []
        assert not os.path.exists(shm), os.listdir(shm)
    finally:
        stop_keepers(shm)


def test_a_wait_persists_in_process_what_died_with_the_keeper(tmp_path):
    """The keeper dies in the middle of step 1's persist (:func:`_keeper_dies_mid_persist`)
    and a wait comes next, with no snapshot between: the wait settles the persist as
    failed on every rank and persists step 1 from the training processes instead of
    raising "MoC two-level wait failed ... the keeper of node 0 died while persisting
    global_step1"."""
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        output = _keeper_dies_mid_persist(tmp_path, shm, ckpt, 1, 1, "1")
        assert "a keeper died with the pending persist: persisting the newest snapshot" in output
        assert output.count("persisting the newest snapshot global_step1 (step 1) before "
                            "returning from wait") == 1, output
        assert _latest(ckpt) == "global_step1"
        assert _verify(ckpt, "global_step1") == []
        assert not os.path.exists(shm), os.listdir(shm)
    finally:
        stop_keepers(shm)


def test_end_of_job_persists_a_snapshot_that_was_not_due(tmp_path):
    """Steps 2 and 3 are snapshots not due for storage (interval 100), taken without any
    collective. The normal end persists step 3 with every rank's RNG state, and a new job
    whose memory is gone loads exactly that state from storage."""
    from deepspeed_ext.format.objects import read_objects_file
    shm, ckpt = new_shm_dir(), str(tmp_path / "ckpt")
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "100"])
        first, _ = _run(tmp_path, "first", 2, "train-save", flags + [
            "--train-iters", "3", "--save", ckpt, "--save-interval", "1"])
        assert _latest(ckpt) == "global_step3" and _verify(ckpt, "global_step3") == []
        assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == [
            "global_step1", "global_step3", "latest", ITERATION_FILE, RUN_ID_FILE]
        rng = read_objects_file(os.path.join(ckpt, "global_step3")).tree["rng_states"]
        assert len(rng) == 2 and all(state is not None for state in rng)
        assert not os.path.exists(shm)  # the end freed the memory: the next load is storage
        second, _ = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "3", "--load", ckpt])
        assert second[0]["client_state"] == {"step": 3}
        assert all(r["load_source"] == "storage" for r in second)
        after, saved = second[0]["state_after_load"], first[0]["saved_states"]["3"]
        assert after.keys() == saved.keys()
        assert [k for k in after if after[k] != saved[k]] == []
    finally:
        stop_keepers(shm)


def test_keeper_persists_to_an_fsspec_url(tmp_path):
    """The keeper writes through fsspec (``file://`` here, ``s3://`` in production); after
    the memory is gone, the next job loads the persisted state from the URL exactly."""
    shm, local = new_shm_dir(), tmp_path / "ckpt"
    url = "file://" + str(local)
    try:
        flags = _flags(shm, 2, 2, ["--moc-persist-interval", "2"])
        first, _ = _run(tmp_path, "first", 2, "train-save", flags + [
            "--train-iters", "4", "--save", url, "--save-interval", "1"])
        # step 1 persisted in the background, step 3 too unless step 1 was still being
        # written when its turn came (training never waits), step 4 at the end of the job
        names = set(os.listdir(local))
        assert {"global_step1", "global_step4", "latest", ITERATION_FILE, RUN_ID_FILE} <= names
        assert names <= {"global_step1", "global_step3", "global_step4", "latest",
                         ITERATION_FILE, RUN_ID_FILE}
        assert _latest(str(local)) == "global_step4"
        assert _verify(url, "global_step1") == [] and _verify(url, "global_step4") == []
        assert not os.path.exists(shm)
        second, _ = _run(tmp_path, "second", 2, "load-train-save", flags + [
            "--train-iters", "4", "--load", url])
        assert all(r["load_source"] == "storage" for r in second)
        after, saved = second[0]["state_after_load"], first[0]["saved_states"]["4"]
        assert after.keys() == saved.keys()
        assert [k for k in after if after[k] != saved[k]] == []
    finally:
        stop_keepers(shm)


def test_snapshot_follows_replaced_optimizer_state(tmp_path):
    # Snapshots reuse the fragment description while the state's tensors are the same;
    # replacing the moments by new tensors (as torch's load_state_dict does) must be
    # noticed, or later snapshots would copy the old, dead moments.
    shm = new_shm_dir()
    try:
        res, _ = _run(tmp_path, "identity", 2, "snapshot-identity",
                      _flags(shm, 2, 2, ["--train-iters", "2", "--save", str(tmp_path / "ckpt")]))
        for r in res:
            assert r["same_after_step"], r
            assert r["changed_after_replace"], r
            assert r["moments_in_snapshot"] > 0, r
            assert r["snapshot_equals_live_state"], r
    finally:
        stop_keepers(shm)


def test_the_step_waits_for_the_copy_and_a_save_for_a_slot_never_for_a_seal(tmp_path):
    # The seal's checksum is held at a gate (deepspeed_ext.two_level.stages). The
    # optimizer step after a snapshot must return while the gate is closed (it waits for
    # the copy only), the slot stays unpublished until its seal ends, and the checksum
    # then verifies the bytes of that step's state. The next save finds a free slot and
    # does not wait; the one after finds none (newest complete, two sealing) and its
    # wait for the oldest seal is its slot wait. Slots are mapped once, at start-up,
    # whatever expert set a snapshot holds (--moc-k-snapshot 1 of 4 rotates them), and
    # each snapshot's own metadata file is small (the layout's is written once).
    shm = new_shm_dir()
    try:
        res, _ = _run(tmp_path, "stages", 1, "stages",
                      _flags(shm, 1, 1, ["--train-iters", "4", "--moc-k-snapshot", "1",
                                         "--moc-persist-interval", "100",
                                         "--save", str(tmp_path / "ckpt")]))
        r = res[0]
        assert r["step_returned_with_gate_closed"] and r["unsealed_not_published"], r
        assert r["b_returned_with_gate_closed"] and r["b_slot_wait_s"] == 0.0, r
        assert r["c_slot_wait_s"] >= 0.3, r
        assert r["a_step"] == 2 and r["a_checksum_matches"] and r["a_checksum_is_chunked"], r
        assert r["a_holds_step_2_state"] and r["sealed"], r
        assert r["maps_at_start"] == r["maps_after"] == r["slots"] and r["grown"] == 0, r
        assert len(r["experts"]) >= 2, r  # the snapshots held different expert sets
        # a few large copies, not one per fragment (the header, a run per flat source)
        assert max(r["copies"]) < r["fragments"] / 2, r
        # the whole ZeRO-2 state: one run per flat source (a fp32 partition, exp_avg and
        # exp_avg_sq per param group), against one per fragment or so in key order
        assert r["param_groups"] >= 2 and r["runs_per_source"] == [1] * (3 * r["param_groups"]), r
        assert r["whole_copies"] == 1 + 3 * r["param_groups"] and r["whole_read_back"], r
        assert r["key_order_runs"] > 5 * 3 * r["param_groups"], r
        assert r["slot_json_bytes"] < 4096, r
    finally:
        stop_keepers(shm)


def test_a_snapshot_failing_on_one_rank_is_raised_on_every_rank(tmp_path):
    # Rank 1 cannot size the slot of its second snapshot, after that snapshot's exchange:
    # it must not raise there while rank 0 goes on into training's collectives; the
    # error is raised on every rank at the next persisted snapshot or wait().
    shm = new_shm_dir()
    try:
        out = tmp_path / "fail"
        out.mkdir()
        results = run_ranks(2, ["train-save", str(out)] + _flags(shm, 2, 2, [
            "--train-iters", "4", "--save-interval", "1", "--save", str(tmp_path / "ckpt")]),
            script=WORKER, timeout=300, env={"MOC_TEST_FAIL_SLOT_RANK": "1"})
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "MoC" in r.output and "No space left on device (injected)" in r.output, \
                describe(results)
            assert "Connection closed" not in r.output, describe(results)
    finally:
        stop_keepers(shm)


def test_a_storage_error_reading_a_persists_outcome_is_not_raised_before_the_exchange(tmp_path):
    # Rank 0 reads the pending persist's outcome just before a snapshot's exchange; a
    # transient storage error there counts as "still running" instead of raising on
    # rank 0 while rank 1 waits in the exchange. The run ends normally, all persisted.
    shm = new_shm_dir()
    try:
        res, results = _run(tmp_path, "run", 2, "train-save",
                            _flags(shm, 2, 2, ["--moc-persist-interval", "1", "--train-iters",
                                               "4", "--save-interval", "1",
                                               "--save", str(tmp_path / "ckpt")]),
                            env={"MOC_TEST_FAIL_OUTCOME_RANK": "0"})
        assert "treating it as still running" in results[0].output, describe(results)
        assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step4"
    finally:
        stop_keepers(shm)


def test_a_rank_failing_to_restore_from_memory_sends_every_rank_to_storage(tmp_path):
    # Rank 1's restore of the snapshot's objects fails: every rank must hear of it in the
    # outcome exchange and load from storage, instead of rank 1 raising while rank 0
    # waits in the collective after the exchange.
    shm = new_shm_dir()
    try:
        res, _ = _run(tmp_path, "reload", 2, "reload-memory",
                      _flags(shm, 2, 2, ["--train-iters", "5", "--save-interval", "1",
                                         "--save", str(tmp_path / "ckpt")]),
                      env={"MOC_TEST_FAIL_RESTORE_RANK": "1"})
        for r in res:
            assert r["load_source"] == "storage", r
        assert res[0]["client_state"] == res[1]["client_state"], res
        assert res[0]["global_steps"] == res[1]["global_steps"] == res[0]["client_state"]["step"]
    finally:
        stop_keepers(shm)


@pytest.mark.parametrize("exchange_bytes", [None, "16"])
def test_memory_load_in_a_running_process_restores_the_snapshot(tmp_path, exchange_bytes):
    # A load into an engine that already has its moments describes the state once for
    # both the layout signature and the copy; the state must still be the snapshot's.
    # With 16 bytes the load's exchanges do not fit their preset buffer and regrow.
    shm = new_shm_dir()
    env = {"MOC_TEST_LOAD_EXCHANGE_BYTES": exchange_bytes} if exchange_bytes else None
    try:
        res, _ = _run(tmp_path, "reload", 2, "reload-memory",
                      _flags(shm, 2, 2, ["--train-iters", "5", "--save-interval", "1",
                                         "--save", str(tmp_path / "ckpt")]), env=env)
        for r in res:
            assert r["moved_on"], r
            assert r["load_source"] == "memory", r
            assert r["client_state"] == {"step": 3} and r["global_steps"] == 3, r
            assert r["restored"], r
            if exchange_bytes:  # regrown by the slow path, else the preset size
                assert r["exchange_capacity"] > int(exchange_bytes), r
            else:
                assert r["exchange_capacity"] == 4096, r
    finally:
        stop_keepers(shm)


def test_a_pending_persist_counts_as_failed_after_the_commit_timeout(tmp_path):
    """Rank 0's view of a persist whose directory shows no outcome (a committer that died
    without a failure record): still running until --moc-commit-timeout, then failed.
    Before, every later persist was deferred behind it for the rest of the run."""
    import types
    from deepspeed_ext.store import prepare
    from deepspeed_ext.store.claims import read_claim
    from deepspeed_ext.two_level import PendingPersist
    from deepspeed_ext.two_level.persister import Persister
    tag_dir = prepare.prepare_checkpoint_dir(str(tmp_path), "global_step2")
    pending = PendingPersist(save_dir=str(tmp_path), tag="global_step2", selected=frozenset(),
                             policy_before=None, slot=0, in_process=False,
                             claim=read_claim(tag_dir))
    place = types.SimpleNamespace(world=2, cfg=types.SimpleNamespace(commit_timeout_s=30.0))
    persister = Persister(place, handover=None)
    persister.pending = pending
    assert persister.persist_view() is None  # running
    persister.pending.started -= 31
    ok, why = persister.persist_view()
    assert not ok and why == f"{tag_dir} not committed within 30 s (--moc-commit-timeout)"


def test_the_shared_memory_check_adds_up_the_ranks_of_a_node():
    """Every rank of a node fits alone, not together: refused, naming the node and the
    flag; images a previous attempt left (reused) count as already taken."""
    from deepspeed_ext.two_level import short_nodes
    gib = 2**30
    ranks = [(None, 10 * gib, 0, 30 * gib, node, "/dev/shm") for node in (0, 0, 0, 0, 1)]
    assert short_nodes(ranks) == [
        "node 0: /dev/shm has 30.000 GiB free, its 4 rank(s)' snapshot slots need 40.000 GiB "
        "more (point --moc-shm-dir at a larger shared-memory filesystem, or enlarge it)"]
    reused = [(None, 10 * gib, 4 * gib, 30 * gib, 0, "/dev/shm") for _ in range(4)]
    assert short_nodes(reused) == []  # 24 GiB more needed, 30 free
    assert short_nodes([(None, gib, 0, None, 0, "/nowhere")]) == []  # unknown: unchecked
