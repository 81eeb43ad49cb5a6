"""Persists of a real :class:`deepspeed_ext.two_level.TwoLevel` on a one-rank CPU engine in
the test's own process (:mod:`tests.deepspeed_ext.two_level.one_rank_job`): the jobs the
keeper gets and what they commit, waits, failures of the copy, the publish, the
hand-over, the writes and the commit's outcome, a keeper that dies or is late, and the
end of the job."""

import json
import logging
import os
import threading

import pytest

from deepspeed_ext.format import storage
from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.store import commit
from deepspeed_ext.two_level.handover import LATE_HAND_OVER_ENV
from deepspeed_ext.two_level.storage_versions import StorageVersions
from tests.deepspeed_ext.two_level.one_rank_job import one_rank_job


def report(tag_dir):
    """Rank 0's report in a persist's directory."""
    with open(os.path.join(tag_dir, commit.report_name(0))) as f:
        return json.load(f)


def latest(job):
    with open(os.path.join(job.save_dir, "latest")) as f:
        return f.read().strip()


def failing(message):
    def fail(*args, **kwargs):
        raise OSError(5, message)
    return fail


def test_a_failed_copy_fails_its_persist_at_once_and_is_raised_at_the_wait(tmp_path):
    with one_rank_job(tmp_path) as job:
        two = job.two
        real, two.place.copier.copy_plan = two.place.copier.copy_plan, failing("copy (test)")
        job.train()
        assert job.save() is True  # rank-local: recorded, raised at the next wait
        two.join_copy()
        two.place.copier.copy_plan = real
        assert two.slots.meta(two.last.slot) is None  # never published
        # Its share's failure report, so that the commit stops now, not at its timeout.
        failed = report(job.tag_dir(1))
        assert not failed["ok"] and failed["error"] == "OSError: [Errno 5] copy (test)"
        with pytest.raises(MoCCheckpointError, match=r"^MoC two-level wait failed on 1 rank\(s\): "
                                                     r"rank 0: OSError: \[Errno 5\] copy "
                                                     r"\(test\)$"):
            job.moc.wait()


def test_a_slot_that_cannot_be_published_fails_its_persist(tmp_path):
    with one_rank_job(tmp_path) as job:
        two = job.two
        real, two.slots.publish = two.slots.publish, failing("publish (test)")
        job.train()
        job.save()
        two.join_copy()
        two.slots.publish = real
        assert report(job.tag_dir(1))["error"] == "OSError: [Errno 5] publish (test)"
        with pytest.raises(MoCCheckpointError, match=r"publish \(test\)"):
            job.moc.wait()


def test_the_wait_persists_the_newest_snapshot_with_every_ranks_rng_state(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        job.train_and_save(3)  # step 1 persisted, 2 and 3 in memory only
        assert not job.two.last.persisted and not job.two.last.rng_gathered
        job.moc.wait()
        assert job.two.last.persisted and latest(job) == "global_step3"
        assert "[moc] persisting the newest snapshot global_step3 (step 3) before returning " \
               "from wait" in caplog.text
        with open(os.path.join(job.tag_dir(3), "objects.json")) as f:
            assert "rng_states" in f.read()
        assert os.path.isfile(os.path.join(job.tag_dir(3), "objects.safetensors"))
        assert not os.path.exists(job.tag_dir(2))
        assert LATE_HAND_OVER_ENV not in caplog.text  # no hand-over was held


def test_a_hand_over_failing_at_the_end_is_raised_at_once(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        two = job.two
        job.train_and_save(1)
        job.moc.wait()
        job.train_and_save(1)
        real, two.handover.send = two.handover.send, failing("hand-over (test)")
        with pytest.raises(MoCCheckpointError, match=r"^MoC two-level wait failed on 1 rank\(s\): "
                                                     r"rank 0: OSError: \[Errno 5\] hand-over "
                                                     r"\(test\)$"):
            job.moc.wait()
        two.handover.send = real
        assert report(job.tag_dir(2))["error"] == "OSError: [Errno 5] hand-over (test)"
        assert latest(job) == "global_step1"


def test_a_wait_polls_until_the_commit_lands(tmp_path):
    with one_rank_job(tmp_path) as job:
        job.keeper.hold()
        job.train_and_save(1)
        threading.Timer(0.3, job.keeper.release).start()
        job.moc.wait()
        assert latest(job) == "global_step1" and job.two.persist is None


def test_a_storage_error_reading_the_outcome_fails_the_wait(tmp_path, monkeypatch):
    with one_rank_job(tmp_path) as job:
        job.train_and_save(1)
        monkeypatch.setattr(commit, "commit_outcome", failing("storage (test)"))
        with pytest.raises(MoCCheckpointError, match=r"rank 0: OSError: \[Errno 5\] storage "
                                                     r"\(test\)$"):
            job.moc.wait()


def test_a_failed_write_is_raised_and_its_experts_count_as_unsaved_again(tmp_path, monkeypatch,
                                                                         caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), one_rank_job(tmp_path) as job:
        policy = job.moc.policy
        job.train()
        before = policy.state_dict()
        assert sum(map(sum, before["unsaved_tokens"])) > 0
        real = storage.write_image_file

        def full(path, image):
            if os.path.basename(os.path.dirname(path)) == "global_step1":
                raise OSError(28, "No space left on device (test)")
            return real(path, image)
        monkeypatch.setattr(storage, "write_image_file", full)
        job.save()
        assert sum(map(sum, policy.state_dict()["unsaved_tokens"])) == 0
        with pytest.raises(MoCCheckpointError, match="No space left on device"):
            job.moc.wait()
        after = policy.state_dict()
        assert after["unsaved_tokens"] == before["unsaved_tokens"]
        assert after["last_saved_step"] == before["last_saved_step"]
        assert "a keeper died" not in caplog.text  # failed, not lost with a keeper
        monkeypatch.undo()
        job.train_and_save(1)
        job.moc.wait()
        assert latest(job) == "global_step2"


def test_pec_persists_save_their_selected_experts_only(tmp_path):
    with one_rank_job(tmp_path, "--moc-pec-k", "2") as job:
        job.train_and_save(1)
        job.moc.wait()
        job.train_and_save(1)
        job.moc.wait()
        first, second = (StorageVersions(job.save_dir, s) for s in (1, 2))
        try:
            assert set(first.versions.values()) == {1}
            assert sorted(second.versions.values()) == [1, 1, 2, 2]
        finally:
            first.close()
            second.close()
        assert job.two.persist is None


def test_a_dead_keeper_s_persists_run_in_this_process(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), one_rank_job(tmp_path) as job:
        job.train_and_save(1)
        job.moc.wait()
        job.keeper.kill()
        job.train_and_save(1)
        job.moc.wait()
        assert job.two.keeper_gone and latest(job) == "global_step2"
        assert "WARNING: the keeper of node 0 is gone (it did not take the persist of " \
               "global_step2); training goes on, persisting from this process" in caplog.text
        job.train_and_save(1)
        assert job.two.persist.in_process
        job.moc.wait()
        assert latest(job) == "global_step3" and "abandoned" not in caplog.text


def test_a_late_hand_over_waits_for_the_keeper_s_death_then_persists_here(tmp_path, monkeypatch,
                                                                          caplog):
    monkeypatch.setenv(LATE_HAND_OVER_ENV, "0@1")
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), one_rank_job(tmp_path) as job:
        threading.Timer(0.3, job.keeper.kill).start()
        job.train_and_save(1)
        job.moc.wait()
        assert job.two.keeper_gone and latest(job) == "global_step1"
        assert f"{LATE_HAND_OVER_ENV}: handing over the persist of global_step1 once the keeper " \
               f"of node 0 is gone" in caplog.text
        assert "abandoned" not in caplog.text


def test_the_end_of_a_job_persists_stops_the_keeper_and_frees_the_memory(tmp_path):
    with one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        job.train_and_save(2)
        job.moc.shutdown()
        assert latest(job) == "global_step2"
        assert not os.path.exists(job.shm_dir)  # the node's directory, then rank 0 the rest


def test_a_job_ending_with_a_failed_persist_keeps_its_memory(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="deepspeed_ext"), \
            one_rank_job(tmp_path, "--moc-persist-interval", "100") as job:
        job.train_and_save(1)
        job.moc.wait()
        job.train_and_save(1)
        monkeypatch.setattr(job.two.handover, "send", failing("hand-over (test)"))
        with pytest.raises(MoCCheckpointError, match=r"hand-over \(test\)"):
            job.moc.shutdown()
        assert os.path.isdir(job.two.node_dir)
        assert f"WARNING: the newest snapshots are not all on storage: leaving them in " \
               f"{job.two.node_dir}" in caplog.text


def test_a_share_written_here_is_not_failed_when_its_keeper_is_found_dead(tmp_path, monkeypatch):
    """A late hand-over found the keeper dead and writes its share itself: the check that
    fails the pending persist for the dead keeper leaves that share (no error report of
    its own, the slot still marked until that writer has read it); rank 0 marks the save
    failed, and the wait persists the newest snapshot again."""
    monkeypatch.setenv(LATE_HAND_OVER_ENV, "0@1")
    gate, real = threading.Event(), storage.write_image_file

    def gated(path, image):
        gate.wait(30)
        return real(path, image)
    monkeypatch.setattr(storage, "write_image_file", gated)
    with one_rank_job(tmp_path) as job:
        two = job.two
        job.train_and_save(1)
        two.join_copy()  # sealed: its hand-over waits for the keeper's death
        job.keeper.kill()
        two.handover.send_job.result()  # the hand-over: nothing listens, written here
        assert two.handover.ran_here == (job.save_dir, "global_step1", two.persist.claim)
        two.handover.abandon_if_keeper_died(two.persist)
        assert two.persist.keeper_lost
        assert commit.report_name(0) not in os.listdir(job.tag_dir(1))
        assert two.slots.persisting(two.last.slot)
        assert commit.commit_outcome(job.tag_dir(1), 1, two.persist.claim) == (
            False, "the keeper of node 0 died while persisting global_step1")
        gate.set()
        job.moc.wait()
        assert latest(job) == "global_step1"
