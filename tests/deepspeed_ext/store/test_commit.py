"""The report-file commit protocol, without processes."""

import json
import os
import shutil
import threading
import time

import pytest

from deepspeed_ext.format.naming import ITERATION_FILE
from deepspeed_ext.store.claims import (CLAIM_NAME, CommitError, Superseded, check_claim,
                                        claim_dir, read_claim)
from deepspeed_ext.store.commit import (FAILURE_NAME, commit_checkpoint, remove_reports,
                                        report_name, wait_for_reports, write_report)
from tests.deepspeed_ext.commit_helpers import (commit_job, commit_keeping, commit_two_ranks,
                                                write_share)


def test_waits_for_every_report_in_rank_order(tmp_path):
    def late():
        time.sleep(0.2)
        write_report(str(tmp_path), 1, {"who": 1})
    write_report(str(tmp_path), 0, {"who": 0})
    thread = threading.Thread(target=late)
    thread.start()
    assert wait_for_reports(str(tmp_path), 2, timeout_s=10) == [{"who": 0}, {"who": 1}]
    thread.join()
    remove_reports(str(tmp_path), 2)
    assert list(tmp_path.iterdir()) == []


def test_error_report_stops_the_wait_at_once(tmp_path):
    write_report(str(tmp_path), 1, None, error="OSError: disk full")
    start = time.monotonic()
    with pytest.raises(CommitError, match="rank 1: OSError: disk full"):
        wait_for_reports(str(tmp_path), 3, timeout_s=30)
    assert time.monotonic() - start < 5


def test_missing_reports_time_out_naming_the_ranks(tmp_path):
    write_report(str(tmp_path), 0, {})
    with pytest.raises(CommitError, match=r"rank\(s\) 1, 2 within"):
        wait_for_reports(str(tmp_path), 3, timeout_s=0.3)


def test_an_abandoned_run_stops_the_wait_for_a_dead_ranks_report(tmp_path):
    """In-job restart: the save's run failed, rank 2 is dead; the committer stops at its
    next poll (its thread held the failed run's engine, and its groups, while it waited),
    and a complete set of reports still commits however abandoned."""
    write_report(str(tmp_path), 0, {})
    write_report(str(tmp_path), 1, {})
    abandoned = threading.Event()
    threading.Timer(0.2, abandoned.set).start()
    start = time.monotonic()
    with pytest.raises(CommitError, match=r"rank\(s\) 2, and the run was abandoned"):
        wait_for_reports(str(tmp_path), 3, timeout_s=60, given_up=abandoned.is_set)
    assert time.monotonic() - start < 10
    assert wait_for_reports(str(tmp_path), 2, timeout_s=60, given_up=lambda: True) == [{}, {}]


def test_report_of_another_rank_or_garbage_is_refused(tmp_path):
    write_report(str(tmp_path), 0, {})
    (tmp_path / report_name(0)).replace(tmp_path / report_name(1))
    with pytest.raises(CommitError, match="not a report of rank 1"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)
    (tmp_path / report_name(1)).write_text("{not json")
    with pytest.raises(CommitError, match="unreadable"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)


def test_a_report_carries_payload_or_error():
    with pytest.raises(ValueError):
        write_report("/nonexistent", 0, None)
    with pytest.raises(ValueError):
        write_report("/nonexistent", 0, {}, error="x")


# ------------------------------------------------------------------ claims and latest

def _keeper_job(save_dir, tag, step, claim, timeout_s=30.0):
    """Rank 0's keeper job (:class:`deepspeed_ext.jobs.PersistJob`) with that commit."""
    from deepspeed_ext.jobs import PersistJob
    return PersistJob.from_json(dict(
        commit_job(save_dir, tag, step, claim, timeout_s), step=step, rank=0, keys=None,
        image=os.path.join(save_dir, "unused.img"), entries=[], specs=[]))


def test_a_committer_of_an_earlier_attempt_stands_down_when_the_tag_is_saved_again(tmp_path):
    """A keeper commit waiting for a dead rank's report while the restarted job saves the
    same tag: the old commit must neither commit the new files under its own record nor
    mark the new save failed; the new save commits."""
    from deepspeed_ext import keeper
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest, prepare
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    old_claim = read_claim(tag_dir)
    write_share(save_dir, tag, 0, 1.0)  # rank 1 died before its report
    logged = []
    old = threading.Thread(target=keeper.commit_job,
                           args=(_keeper_job(save_dir, tag, 20, old_claim), tag_dir, logged.append))
    old.start()
    time.sleep(0.3)
    # The restarted job: prepare empties the crashed save and claims it again.
    assert prepare.prepare_checkpoint_dir(save_dir, tag) == tag_dir
    new_claim = read_claim(tag_dir)
    assert new_claim not in (None, old_claim)
    write_share(save_dir, tag, 0, 2.0)
    write_share(save_dir, tag, 1, 2.0)
    old.join(timeout=10)
    assert not old.is_alive()  # it noticed, long before its 30 s timeout
    assert not os.path.exists(os.path.join(tag_dir, FAILURE_NAME))
    assert not os.path.exists(os.path.join(tag_dir, mf.MANIFEST_FILE))
    # It stood down: seeing the new claim, or (polling between the old save's removal
    # and the new claim) the directory without one.
    assert any(line.startswith("not committing: ") and ("claimed by another save" in line
                                                        or "was deleted" in line)
               for line in logged), logged
    keeper.commit_job(_keeper_job(save_dir, tag, 20, new_claim), tag_dir, logged.append)
    manifest = mf.read_manifest(tag_dir)
    assert manifest.step == 20 and latest.read_latest(save_dir) == tag
    assert os.listdir(tag_dir) and CLAIM_NAME not in os.listdir(tag_dir)  # cleaned with reports


def test_a_committer_whose_directory_was_deleted_writes_nothing(tmp_path):
    from deepspeed_ext import keeper
    from deepspeed_ext.store import prepare
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    claim = read_claim(tag_dir)
    write_share(save_dir, tag, 0, 1.0)
    shutil.rmtree(tag_dir)  # retention of the restarted job removed the crashed save
    logged = []
    keeper.commit_job(_keeper_job(save_dir, tag, 20, claim, timeout_s=5), tag_dir, logged.append)
    assert not os.path.exists(tag_dir)  # not recreated by a failure file
    assert any("was deleted" in line for line in logged), logged


def test_a_commit_that_fails_on_its_own_directory_is_marked_failed(tmp_path):
    from deepspeed_ext import keeper
    from deepspeed_ext.store import prepare
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    write_share(save_dir, tag, 0, 1.0)
    keeper.commit_job(_keeper_job(save_dir, tag, 20, read_claim(tag_dir), timeout_s=0.3),
                       tag_dir, lambda line: None)
    assert "rank(s) 1 within" in open(os.path.join(tag_dir, FAILURE_NAME)).read()


def test_a_damaged_claim_ends_the_save_as_failed_instead_of_silently(tmp_path):
    """The claim file cannot be read (damaged): the writer and the committer still say
    the save failed, with this save's claim, so the training side's poll ends at once
    instead of at the commit timeout (a different claim would have made them stand down)."""
    from deepspeed_ext import keeper
    from deepspeed_ext.store import prepare
    from deepspeed_ext.store.commit import commit_outcome
    save_dir, tag = str(tmp_path / "ckpt"), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    claim = read_claim(tag_dir)
    with open(os.path.join(tag_dir, CLAIM_NAME), "w") as f:
        f.write("{damaged")
    marker = str(tmp_path / "slot1.persisting")
    keeper.run_persist_job(_persist_job_of(save_dir, tag, 1, claim, str(tmp_path), marker),
                           log=lambda line: None)
    keeper.commit_job(_keeper_job(save_dir, tag, 20, claim, timeout_s=5), tag_dir,
                       lambda line: None)
    ok, why = commit_outcome(tag_dir, 2, claim)
    assert not ok and "unreadable" in why, why
    with open(os.path.join(tag_dir, report_name(1))) as f:
        report = json.load(f)
    assert not report["ok"] and report["claim"] == claim and "unreadable" in report["error"]


def test_check_claim(tmp_path):
    tag_dir = str(tmp_path)
    claim = claim_dir(tag_dir)
    check_claim(tag_dir, claim)
    check_claim(tag_dir, None)  # unchecked
    claim_dir(tag_dir)  # a later save claims the directory
    with pytest.raises(Superseded, match="claimed by another save"):
        check_claim(tag_dir, claim)
    os.remove(os.path.join(tag_dir, CLAIM_NAME))
    with pytest.raises(Superseded, match="was deleted"):
        check_claim(tag_dir, claim)


def test_latest_is_not_moved_over_a_later_attempts_checkpoint(tmp_path):
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    assert commit_two_ranks(save_dir, "global_step30", 30, 3.0, attempt_started=200.0) == []
    # The first attempt's keeper finishes its commit of 20 only now.
    logged = commit_two_ranks(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)
    assert latest.read_latest(save_dir) == "global_step30"
    assert len(logged) == 1 and "latest stays at global_step30" in logged[0]
    assert mf.read_manifest(os.path.join(save_dir, "global_step20")).step == 20  # still committed
    assert mf.read_manifest(os.path.join(save_dir, "global_step30")).extra["attempt_started"] == 200.0
    assert commit_two_ranks(save_dir, "global_step40", 40, 4.0, attempt_started=200.0) == []
    assert latest.read_latest(save_dir) == "global_step40"
    # A later attempt may move it back: it resumed from an older checkpoint, or is a new
    # run writing into this directory.
    assert commit_two_ranks(save_dir, "global_step10", 10, 1.0, attempt_started=300.0) == []
    assert latest.read_latest(save_dir) == "global_step10"
    # Unknown attempts (a caller that does not say): moved, as before.
    assert commit_two_ranks(save_dir, "global_step5", 5, 0.5) == []
    assert latest.read_latest(save_dir) == "global_step5"


def test_latest_checkpointed_iteration_follows_latest_and_only_it(tmp_path):
    """Megatron-DeepSpeed's ``latest_checkpointed_iteration.txt`` names the step of the
    checkpoint ``latest`` names: written after it, never for a commit that leaves
    ``latest`` alone, never for a tag without a manifest."""
    import pytest
    from deepspeed_ext.format.naming import ITERATION_FILE
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    iteration = tmp_path / ITERATION_FILE
    assert commit_two_ranks(save_dir, "global_step30", 30, 3.0, attempt_started=200.0) == []
    assert iteration.read_text() == "30"
    commit_two_ranks(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)  # late, older
    assert latest.read_latest(save_dir) == "global_step30" and iteration.read_text() == "30"
    (tmp_path / "global_step50").mkdir()
    with pytest.raises(ValueError, match="has no"):
        latest.update_latest(save_dir, "global_step50")
    assert iteration.read_text() == "30"
    latest.update_latest(save_dir, "global_step20")  # the step read from its manifest
    assert iteration.read_text() == "20"
    assert [p.name for p in tmp_path.iterdir() if ITERATION_FILE in p.name] == [ITERATION_FILE]


def test_a_late_commit_of_an_earlier_step_of_the_same_attempt_keeps_latest(tmp_path):
    """The training side starts the next persist once a manifest exists, while that
    commit still writes ``latest``: a commit of step 20 finishing after step 30's must
    not move ``latest`` back (a restart would lose ten steps)."""
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    assert commit_two_ranks(save_dir, "global_step30", 30, 3.0, attempt_started=200.0) == []
    logged = commit_two_ranks(save_dir, "global_step20", 20, 2.0, attempt_started=200.0)
    assert latest.read_latest(save_dir) == "global_step30"
    assert len(logged) == 1 and "latest stays at global_step30" in logged[0]
    assert commit_two_ranks(save_dir, "global_step40", 40, 4.0, attempt_started=200.0) == []
    assert latest.read_latest(save_dir) == "global_step40"


def test_committers_of_one_process_take_turns_on_a_url(tmp_path, monkeypatch):
    """No flock on a URL: two commit threads of one keeper must still not interleave
    their read and write of ``latest`` (they share the writer's temporary name too)."""
    from deepspeed_ext.format import assemble
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest, prepare
    url = "file://" + str(tmp_path)
    inside, overlapped = [], []
    real = latest.update_latest

    def slow_update(save_dir, tag, step=None):
        inside.append(tag)
        if len(inside) > 1:
            overlapped.append(tag)
        time.sleep(0.2)
        real(save_dir, tag, step)
        inside.remove(tag)

    for step in (10, 20):
        tag_dir = prepare.prepare_checkpoint_dir(url, f"global_step{step}")
        for rank in range(2):
            write_share(url, f"global_step{step}", rank, step)
        mf.write_manifest(tag_dir, assemble.assemble_manifest(
            f"global_step{step}", step, 2, commit_job(url, "x", step, None)["commit"]["layout"],
            [assemble.RankReport.from_json(s["report"]) for s in wait_for_reports(tag_dir, 2, 5)], {},
            extra={"attempt_started": 1.0}))
    monkeypatch.setattr(latest, "update_latest", slow_update)
    threads = [threading.Thread(target=latest.advance_latest, args=(url, f"global_step{step}", 1.0, step))
               for step in (20, 10)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert overlapped == []
    assert latest.read_latest(url) == "global_step20"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10", "global_step20", "latest",
                                                          ITERATION_FILE]
    assert (tmp_path / ITERATION_FILE).read_text().strip() == "20"  # the late 10 did not win


def test_a_late_commit_of_an_earlier_attempt_leaves_latest_and_retention_to_a_started_one(tmp_path):
    """The restarted attempt records its start before it reads ``latest``; the first
    attempt's committer finishing only then must not move ``latest`` (the restart loads
    another checkpoint than the one it named) nor run a retention that deletes the
    checkpoint the restart resumes from (with keep=1 and full saves nothing references it)."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    assert commit_keeping(save_dir, "global_step20", 20, 2.0, 100.0, keep=1) == []
    latest.record_attempt(save_dir, 200.0)  # the restart, about to load global_step20
    logged = commit_keeping(save_dir, "global_step30", 30, 3.0, 100.0, keep=1)
    assert latest.read_latest(save_dir) == "global_step20"
    assert mf.read_manifest(os.path.join(save_dir, "global_step20")).step == 20
    assert any("a later attempt of the job started" in line for line in logged), logged
    assert any("retention after committing global_step30 left to the later" in line
               for line in logged), logged
    # The restarted attempt's own commits move latest and run retention.
    assert commit_keeping(save_dir, "global_step25", 25, 2.5, 200.0, keep=1) == [
        "retention: removed global_step20"]
    assert latest.read_latest(save_dir) == "global_step25"
    assert latest.later_attempt_started(save_dir, 100.0) and not latest.later_attempt_started(save_dir, 200.0)
    (tmp_path / latest.ATTEMPT_FILE).write_text("{")  # damaged: commits go on as before
    assert not latest.later_attempt_started(save_dir, 100.0)


def test_a_restart_rolls_latest_forward_to_its_attempts_unnamed_commits(tmp_path):
    """An attempt committed global_step20 but died before moving ``latest`` (or moving
    it failed): the restart, recording its start, points ``latest`` at 20, not at 10 (it
    would resume from 10 and its first save set 20 aside). Another attempt's later
    checkpoint is not taken."""
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    commit_two_ranks(save_dir, "global_step10", 10, 1.0, attempt_started=100.0)
    commit_two_ranks(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)
    commit_two_ranks(save_dir, "global_step30", 30, 3.0, attempt_started=50.0)  # an older attempt's
    latest.update_latest(save_dir, "global_step10")  # the crash between manifest and latest
    latest.record_attempt(save_dir, 200.0)
    assert latest.read_latest(save_dir) == "global_step20"
    latest.record_attempt(save_dir, 300.0)  # nothing newer of that attempt: unchanged
    assert latest.read_latest(save_dir) == "global_step20"


def test_a_failure_moving_latest_after_the_manifest_does_not_fail_the_save(tmp_path, monkeypatch):
    """The checkpoint is complete once its manifest is written: failing the save there
    undid its expert marks on every rank while it stayed on storage."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(latest, "update_latest", full)
    logged = commit_two_ranks(save_dir := str(tmp_path), "global_step10", 10, 1.0, attempt_started=1.0)
    assert mf.read_manifest(os.path.join(save_dir, "global_step10")).step == 10
    assert any("latest could not be moved (OSError" in line for line in logged), logged


def test_a_restart_preparing_a_tag_waits_for_a_committer_writing_its_manifest(tmp_path, monkeypatch):
    """An earlier attempt's committer has checked its claim and is writing its manifest
    when the restarted job prepares the same tag. The preparation used to empty the
    directory meanwhile, the manifest then landed in the recreated one, and the new save
    looked committed before any of its files existed."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import commit as cm
    from deepspeed_ext.store import prepare
    from deepspeed_ext.store.commit import commit_outcome
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    for rank in range(2):
        write_share(save_dir, tag, rank, 2.0)
    old_claim = read_claim(tag_dir)
    real, writing = mf.write_manifest, threading.Event()

    def slow_write(ckpt_dir, manifest):
        writing.set()
        time.sleep(0.5)  # holding the directory's lock, past its claim check
        real(ckpt_dir, manifest)
    monkeypatch.setattr(cm, "write_manifest", slow_write)  # where the committer looks it up
    old = threading.Thread(target=commit_checkpoint, args=(
        save_dir, tag, 20, commit_job(save_dir, tag, 20, old_claim)["commit"]["layout"],
        wait_for_reports(tag_dir, 2, timeout_s=5, claim=old_claim), None, None, None, True, 0),
        kwargs={"log": lambda m: None, "claim": old_claim, "attempt_started": 100.0})
    old.start()
    assert writing.wait(10)
    prepare.prepare_checkpoint_dir(save_dir, tag, attempt_started=200.0, log=lambda m: None)
    old.join(10)
    new_claim = read_claim(tag_dir)
    assert new_claim not in (None, old_claim)
    assert commit_outcome(tag_dir, 2, claim=new_claim) is None  # the new save is running
    assert not os.path.exists(os.path.join(tag_dir, mf.MANIFEST_FILE))
    aside = [n for n in os.listdir(save_dir) if n.startswith(prepare.SET_ASIDE_PREFIX + tag)]
    assert len(aside) == 1  # the old attempt's commit, kept for a human


def test_latest_naming_nothing_loadable_is_replaced(tmp_path):
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest
    save_dir = str(tmp_path)
    commit_two_ranks(save_dir, "global_step30", 30, 3.0, attempt_started=200.0)
    os.remove(os.path.join(save_dir, "global_step30", mf.MANIFEST_FILE))
    commit_two_ranks(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)
    assert latest.read_latest(save_dir) == "global_step20"


def test_a_crashed_save_with_its_claim_is_removed_by_retention(tmp_path):
    """The claim file is one of MoC's own names: a crashed save holding it is still
    recognised as a leftover (else retention would leave it forever)."""
    from deepspeed_ext.store import prepare, retention
    save_dir = str(tmp_path)
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, "global_step10")
    write_share(save_dir, "global_step10", 0, 1.0)  # crashed: no manifest
    assert CLAIM_NAME in os.listdir(tag_dir)
    old = time.time() - 100
    for name in os.listdir(tag_dir):
        os.utime(os.path.join(tag_dir, name), (old, old))
    commit_two_ranks(save_dir, "global_step20", 20, 2.0)
    assert "global_step10" in retention.apply_retention(save_dir, 1)
    assert not os.path.exists(tag_dir)


def test_reports_of_another_claim_do_not_count(tmp_path):
    """An earlier attempt's writer raced the new claim: its report (ok or error) is not
    this save's, and the committer waits for this save's own."""
    tag_dir = str(tmp_path)
    write_report(tag_dir, 0, {"who": 0}, claim="new")
    write_report(tag_dir, 1, {"who": "old"}, claim="old")
    with pytest.raises(CommitError, match=r"rank\(s\) 1 within"):
        _wait_with_claim(tag_dir, "new", timeout_s=0.3)
    write_report(tag_dir, 1, None, error="OSError: old attempt", claim="old")
    with pytest.raises(CommitError, match=r"rank\(s\) 1 within"):
        _wait_with_claim(tag_dir, "new", timeout_s=0.3)
    write_report(tag_dir, 1, {"who": 1}, claim="new")
    assert _wait_with_claim(tag_dir, "new", timeout_s=5) == [{"who": 0}, {"who": 1}]


def _wait_with_claim(tag_dir, claim, timeout_s):
    """wait_for_reports holding ``claim`` (the directory's claim file says the same)."""
    from deepspeed_ext.format.storage import atomic_write_json
    atomic_write_json(os.path.join(tag_dir, CLAIM_NAME), {"claim": claim})
    return wait_for_reports(tag_dir, 2, timeout_s=timeout_s, claim=claim)


def test_commit_outcome_ignores_another_claims_errors(tmp_path):
    from deepspeed_ext.store.commit import commit_outcome, write_failure
    tag_dir = str(tmp_path)
    (tmp_path / CLAIM_NAME).write_text(json.dumps({"claim": "new"}))
    write_report(tag_dir, 1, None, error="OSError: old attempt", claim="old")
    write_failure(tag_dir, "old committer gave up", claim="old")
    assert commit_outcome(tag_dir, 2, claim="new") is None  # still running
    assert commit_outcome(tag_dir, 2, claim="old") == (False, "old committer gave up")
    write_failure(tag_dir, "no report from rank(s) 1", claim="new")
    assert commit_outcome(tag_dir, 2, claim="new") == (False, "no report from rank(s) 1")


def test_commit_outcome_ends_when_the_save_was_superseded(tmp_path):
    """Its committer stood down (the tag saved again under another claim, or the
    directory deleted) and writes no failure record: nothing else would end the wait,
    and every later persist was deferred behind it for the rest of the run."""
    from deepspeed_ext.store import prepare
    from deepspeed_ext.store.commit import commit_outcome
    save_dir = str(tmp_path)
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, "global_step5")
    mine = read_claim(tag_dir)
    assert commit_outcome(tag_dir, 2, claim=mine) is None  # running
    prepare.prepare_checkpoint_dir(save_dir, "global_step5")  # a restarted job claims it
    ok, why = commit_outcome(tag_dir, 2, claim=mine)
    assert not ok and "claimed by another save" in why
    shutil.rmtree(tag_dir)
    ok, why = commit_outcome(tag_dir, 2, claim=mine)
    assert not ok and "is gone" in why
    assert commit_outcome(tag_dir, 2, claim=None) is None  # unchecked without a claim
    commit_two_ranks(save_dir, "global_step6", 6, 6.0)  # committed: the claim is cleaned up after
    assert commit_outcome(os.path.join(save_dir, "global_step6"), 2, claim=mine) == (True, None)


def _persist_job_of(save_dir, tag, rank, claim, image_dir, done_marker):
    """A keeper persist job of one rank: a one-tensor slot image in ``image_dir``."""
    import torch
    from deepspeed_ext.format import assemble
    from deepspeed_ext.format.image import fill_image, layout_of
    tensors = {"w": torch.arange(4, dtype=torch.float32) + rank}
    layout = layout_of(tensors)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    fill_image(buffer, layout, tensors)
    image = os.path.join(image_dir, f"slot{rank}.img")
    with open(image, "wb") as f:
        f.write(buffer.numpy().tobytes())
    with open(done_marker, "w"):
        pass
    spec = assemble.FragmentSpec("w", "fp32", 4 * rank, 4, (8,), "float32")
    return {"image": image, "keys": None, "specs": [spec.to_json()],
            "entries": [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                         "start": e.start, "nbytes": e.nbytes} for e in layout.entries],
            "save_dir": save_dir, "tag": tag, "step": 20, "rank": rank, "claim": claim,
            "objects_tree": None, "objects_in_file": False, "done_marker": done_marker}


def test_a_keeper_job_of_an_earlier_attempt_writes_nothing_into_the_new_save(tmp_path):
    """Rank 1's persist job of the crashed attempt, still queued in its node's keeper when
    the restarted job saved the same tag again: it must not put the old attempt's file or
    report into the new save (the new committer could take them), and it frees its slot."""
    from deepspeed_ext import keeper
    from deepspeed_ext.format import naming
    from deepspeed_ext.store import prepare
    save_dir, tag = str(tmp_path / "ckpt"), "global_step20"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    old_claim = read_claim(tag_dir)
    prepare.prepare_checkpoint_dir(save_dir, tag)  # the restarted job's save of the same tag
    marker = str(tmp_path / "slot1.persisting")
    logged = []
    keeper.run_persist_job(_persist_job_of(save_dir, tag, 1, old_claim, str(tmp_path), marker),
                           log=logged.append)
    assert sorted(os.listdir(tag_dir)) == [CLAIM_NAME]
    assert not os.path.exists(marker)
    assert any("not persisting rank 1's share" in line for line in logged), logged
    # The same job under the directory's own claim writes its file and a report naming it.
    new_claim = read_claim(tag_dir)
    keeper.run_persist_job(_persist_job_of(save_dir, tag, 1, new_claim, str(tmp_path), marker),
                           log=logged.append)
    with open(os.path.join(tag_dir, report_name(1))) as f:
        report = json.load(f)
    assert report["ok"] and report["claim"] == new_claim
    assert os.path.exists(os.path.join(tag_dir, naming.rank_file_name(1)))


def test_a_retention_failure_after_the_commit_does_not_fail_the_save(tmp_path, monkeypatch):
    """The manifest and `latest` are written when retention raises (another attempt's
    retention removed a directory first): the save stays committed, with a warning,
    instead of being reported failed (which stops training on every rank)."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest, prepare, retention

    def failing(save_dir, keep, protect=()):
        raise FileNotFoundError(2, "No such file or directory (injected)")
    monkeypatch.setattr(retention, "apply_retention", failing)
    save_dir, tag = str(tmp_path), "global_step10"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    for rank in range(2):
        write_share(save_dir, tag, rank, 1.0)
    claim, logged = read_claim(tag_dir), []
    commit_checkpoint(save_dir, tag, 10, commit_job(save_dir, tag, 10, claim)["commit"]["layout"],
                      wait_for_reports(tag_dir, 2, timeout_s=5, claim=claim), None, None, None,
                      True, 1, log=logged.append, claim=claim)
    assert latest.read_latest(save_dir) == tag and mf.read_manifest(tag_dir).step == 10
    assert any("retention after committing global_step10 failed" in line for line in logged)


def test_a_late_committer_removes_only_its_own_reports_and_claim(tmp_path):
    """An earlier attempt's committer cleaning up after its (late) manifest must leave the
    reports and the claim of the restarted job's save of the same tag alone."""
    tag_dir = str(tmp_path)
    write_report(tag_dir, 0, {"who": 0}, claim="new")
    write_report(tag_dir, 1, {"who": 1}, claim="old")
    from deepspeed_ext.format.storage import atomic_write_json
    atomic_write_json(os.path.join(tag_dir, CLAIM_NAME), {"claim": "new"})
    remove_reports(tag_dir, 2, claim="old")
    assert sorted(os.listdir(tag_dir)) == sorted([CLAIM_NAME, report_name(0)])
    remove_reports(tag_dir, 2, claim="new")
    assert os.listdir(tag_dir) == []


# ------------------------------------------ untrusted commit records (issue 20, 4/5)

def test_retention_is_decided_and_done_in_one_step_under_the_directory_lock(tmp_path, monkeypatch):
    """The committer asked, unlocked, whether a later attempt had started, and then ran
    retention, unlocked: a restart recording its start (under the lock) and reading
    ``latest`` in between had the checkpoint it resumes from deleted under it. The check
    and the deletion now share one hold of the lock that record_attempt takes."""
    import contextlib
    from deepspeed_ext.store import latest, locking, retention
    holds, seen = [], {}
    real_lock, real_check = locking.locked_dir, latest.later_attempt_started
    real_retention = retention.apply_retention

    @contextlib.contextmanager
    def tracked(path):
        with real_lock(path):
            holds.append(object())
            try:
                yield
            finally:
                holds.pop()

    def check(save_dir, attempt_started):
        seen["check"] = holds[-1] if holds else None
        return real_check(save_dir, attempt_started)

    def tracked_retention(save_dir, keep, protect=()):
        seen["retention"] = holds[-1] if holds else None
        return real_retention(save_dir, keep, protect)
    # Where retain_unless_superseded looks them up.
    monkeypatch.setattr(retention, "locked_dir", tracked)
    monkeypatch.setattr(retention, "later_attempt_started", check)
    monkeypatch.setattr(retention, "apply_retention", tracked_retention)
    save_dir = str(tmp_path)
    commit_keeping(save_dir, "global_step10", 10, 1.0, 100.0, keep=1)
    assert commit_keeping(save_dir, "global_step20", 20, 2.0, 100.0, keep=1) == [
        "retention: removed global_step10"]
    assert seen["check"] is not None and seen["check"] is seen["retention"], seen
    seen.clear()
    latest.record_attempt(save_dir, 200.0)
    logged = commit_keeping(save_dir, "global_step30", 30, 3.0, 100.0, keep=1)
    assert seen["check"] is not None and "retention" not in seen, seen
    assert any("left to the later attempt" in line for line in logged), logged


def test_damaged_commit_records_are_commit_errors(tmp_path, monkeypatch):
    """Reports, claims and failure records nested 100000 deep raised RecursionError out
    of the committer and of every rank's wait, a huge one was read whole, and a report
    payload of the wrong shape raised KeyError/TypeError out of commit_checkpoint. Each
    is now the commit's own error (the save fails cleanly), naming the file or rank."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import commit as cm
    from deepspeed_ext.store import prepare
    from deepspeed_ext.store.commit import commit_outcome
    nested = "[" * 100_000 + "]" * 100_000
    tag_dir = tmp_path / "global_step10"
    tag_dir.mkdir()
    (tag_dir / report_name(0)).write_text(nested)
    with pytest.raises(CommitError, match="nested"):
        wait_for_reports(str(tag_dir), 1, timeout_s=1)
    ok, why = commit_outcome(str(tag_dir), 1)
    assert not ok and report_name(0) in why
    (tag_dir / report_name(0)).unlink()
    (tag_dir / CLAIM_NAME).write_text(nested)
    with pytest.raises(CommitError, match="nested"):
        read_claim(str(tag_dir))
    (tag_dir / CLAIM_NAME).write_text('{"claim": ["not", "a", "string"]}')
    with pytest.raises(CommitError, match=CLAIM_NAME):
        read_claim(str(tag_dir))
    (tag_dir / CLAIM_NAME).unlink()
    (tag_dir / FAILURE_NAME).write_text(nested)
    ok, why = commit_outcome(str(tag_dir), 1)
    assert not ok and FAILURE_NAME in why
    (tag_dir / FAILURE_NAME).unlink()
    write_report(str(tag_dir), 0, {"x": "y" * 100})
    monkeypatch.setattr(cm, "REPORT_MAX_BYTES", 64)
    with pytest.raises(CommitError, match="larger than 64 bytes"):
        wait_for_reports(str(tag_dir), 1, timeout_s=1)
    monkeypatch.undo()
    # A payload of the wrong shape: refused before anything is written.
    save_dir, tag = str(tmp_path / "run"), "global_step10"
    run_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    for rank in range(2):
        write_share(save_dir, tag, rank, 1.0)
    claim = read_claim(run_dir)
    shares = wait_for_reports(run_dir, 2, timeout_s=5, claim=claim)
    layout = commit_job(save_dir, tag, 10, claim)["commit"]["layout"]
    for broken in ({"report": {"rank": 0}}, {"report": "x", "objects": None},
                   dict(shares[1], report=dict(shares[1]["report"], fragments=[{"name": 1}])),
                   dict(shares[1], report=dict(shares[1]["report"], nbytes="12")),
                   "not an object"):
        with pytest.raises(CommitError, match="rank 1"):
            commit_checkpoint(save_dir, tag, 10, layout, [shares[0], broken], None, None, None,
                              True, 0, log=lambda line: None, claim=claim)
    assert not os.path.exists(os.path.join(run_dir, mf.MANIFEST_FILE))


_PIN = r"""
import sys
from deepspeed_ext.store.pins import reading
with reading(sys.argv[1], sys.argv[2]):
    print("pinned", flush=True)
    sys.stdin.readline()
"""


def test_retention_spares_a_checkpoint_another_process_is_verifying(tmp_path):
    """``moc-ckpt verify`` pins each checkpoint it reads (``store.pins.reading``): a
    committer's retention in another process (the keeper) leaves it for a later
    retention. Before, retention deleted it under the reader, which reported a healthy
    directory as damaged."""
    import subprocess
    import sys
    from deepspeed_ext.store import verify
    from tests.launch import REPO
    save_dir = str(tmp_path)
    for step in (10, 20):
        commit_keeping(save_dir, f"global_step{step}", step, step / 10, 1.0, 0)
    reader = subprocess.Popen([sys.executable, "-c", _PIN, save_dir, "global_step10"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert reader.stdout.readline().strip() == "pinned"
        logged = commit_keeping(save_dir, "global_step30", 30, 3.0, 1.0, 1)
        assert logged == ["retention: removed global_step20"]
        assert verify.verify_checkpoint(save_dir, "global_step10") == []
    finally:
        reader.communicate("\n", timeout=60)
    assert reader.returncode == 0
    logged = commit_keeping(save_dir, "global_step40", 40, 4.0, 1.0, 1)
    assert sorted(logged) == ["retention: removed global_step10",
                              "retention: removed global_step30"]


def test_retention_never_deletes_the_checkpoint_just_committed_nor_latest(tmp_path):
    """A commit that finished late (its step older than one the same attempt committed
    since) leaves ``latest`` on the newer one; its retention then counted it as old and
    deleted it right after writing its manifest, so the trainer's wait on it found the
    directory gone and failed a save that had succeeded. The committer now protects the
    tag it just committed; ``latest``'s target is kept as before."""
    from deepspeed_ext.store import latest, verify
    from deepspeed_ext.store.commit import commit_outcome
    save_dir = str(tmp_path)
    commit_keeping(save_dir, "global_step20", 20, 2.0, 1.0, 1)
    assert commit_keeping(save_dir, "global_step40", 40, 4.0, 1.0, 1) == [
        "retention: removed global_step20"]
    logged = commit_keeping(save_dir, "global_step30", 30, 3.0, 1.0, 1)  # the late one
    assert not any(line.startswith("retention: removed") for line in logged), logged
    assert latest.read_latest(save_dir) == "global_step40"
    assert verify.verify_checkpoint(save_dir, "global_step40") == []
    assert verify.verify_checkpoint(save_dir, "global_step30") == []
    assert commit_outcome(os.path.join(save_dir, "global_step30"), 2) == (True, None)
    # The next commit's retention removes it like any old checkpoint.
    assert commit_keeping(save_dir, "global_step50", 50, 5.0, 1.0, 1) == [
        "retention: removed global_step30", "retention: removed global_step40"]
