"""The report-file commit protocol, without processes."""

import os
import shutil
import threading
import time

import pytest

from deepspeed_ext.commit import (CLAIM_NAME, FAILURE_NAME, CommitError, Superseded, check_claim,
                                  claim_dir, commit_checkpoint, read_claim, remove_reports,
                                  report_name, wait_for_reports, write_report)


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

def _write_share(save_dir, tag, rank, value):
    """One rank's file and report in ``<save_dir>/<tag>`` as a writer leaves them; rank 0
    also writes the objects. ``value`` fills the rank's one tensor (tells saves apart)."""
    import torch
    from deepspeed_ext import manifest as mf
    from deepspeed_ext.objects import encode, write_objects_file
    from deepspeed_ext.storage import write_fragment_file
    tag_dir = os.path.join(save_dir, tag)
    spec = mf.FragmentSpec("w", "fp32", 2 * rank, 2, (4,), "float32")
    record = write_fragment_file(os.path.join(tag_dir, mf.rank_file_name(rank)),
                                 {spec.key: torch.full((2,), float(value))})
    objects = None
    if rank == 0:
        tree, _ = encode({"value": value})
        objects = write_objects_file(tag_dir, tree, None).to_json()
    report = mf.RankReport.from_record(rank, mf.rank_file_name(rank), record, [spec])
    write_report(tag_dir, rank, {"report": report.to_json(), "objects": objects})


def _commit_job(save_dir, tag, step, claim, timeout_s=30.0):
    """The keeper's commit of rank 0's job (two ranks, no MoE)."""
    return {"save_dir": save_dir, "tag": tag, "commit": {
        "step": step, "previous_tag": None, "selected": None, "pec_k": None,
        "save_latest": True, "keep": 0, "timeout_s": timeout_s, "claim": claim,
        "layout": {"world_size": 2, "ep_size": 1, "zero_stage": 2, "num_moe_layers": 0,
                   "num_experts": 0}}}


def test_a_committer_of_an_earlier_attempt_stands_down_when_the_tag_is_saved_again(tmp_path):
    """A keeper commit waiting for a dead rank's report while the restarted job saves the
    same tag: the old commit must neither commit the new files under its own record nor
    mark the new save failed; the new save commits."""
    from deepspeed_ext import keeper
    from deepspeed_ext import manifest as mf
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = mf.prepare_checkpoint_dir(save_dir, tag)
    old_claim = read_claim(tag_dir)
    _write_share(save_dir, tag, 0, 1.0)  # rank 1 died before its report
    logged = []
    old = threading.Thread(target=keeper._commit_job,
                           args=(_commit_job(save_dir, tag, 20, old_claim), tag_dir, logged.append))
    old.start()
    time.sleep(0.3)
    # The restarted job: prepare empties the crashed save and claims it again.
    assert mf.prepare_checkpoint_dir(save_dir, tag) == tag_dir
    new_claim = read_claim(tag_dir)
    assert new_claim not in (None, old_claim)
    _write_share(save_dir, tag, 0, 2.0)
    _write_share(save_dir, tag, 1, 2.0)
    old.join(timeout=10)
    assert not old.is_alive()  # it noticed, long before its 30 s timeout
    assert not os.path.exists(os.path.join(tag_dir, FAILURE_NAME))
    assert not os.path.exists(os.path.join(tag_dir, mf.MANIFEST_FILE))
    assert any("claimed by another save" in line for line in logged), logged
    keeper._commit_job(_commit_job(save_dir, tag, 20, new_claim), tag_dir, logged.append)
    manifest = mf.read_manifest(tag_dir)
    assert manifest.step == 20 and mf.read_latest(save_dir) == tag
    assert os.listdir(tag_dir) and CLAIM_NAME not in os.listdir(tag_dir)  # cleaned with reports


def test_a_committer_whose_directory_was_deleted_writes_nothing(tmp_path):
    from deepspeed_ext import keeper
    from deepspeed_ext import manifest as mf
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = mf.prepare_checkpoint_dir(save_dir, tag)
    claim = read_claim(tag_dir)
    _write_share(save_dir, tag, 0, 1.0)
    shutil.rmtree(tag_dir)  # retention of the restarted job removed the crashed save
    logged = []
    keeper._commit_job(_commit_job(save_dir, tag, 20, claim, timeout_s=5), tag_dir, logged.append)
    assert not os.path.exists(tag_dir)  # not recreated by a failure file
    assert any("was deleted" in line for line in logged), logged


def test_a_commit_that_fails_on_its_own_directory_is_marked_failed(tmp_path):
    from deepspeed_ext import keeper
    from deepspeed_ext import manifest as mf
    save_dir, tag = str(tmp_path), "global_step20"
    tag_dir = mf.prepare_checkpoint_dir(save_dir, tag)
    _write_share(save_dir, tag, 0, 1.0)
    keeper._commit_job(_commit_job(save_dir, tag, 20, read_claim(tag_dir), timeout_s=0.3),
                       tag_dir, lambda line: None)
    assert "rank(s) 1 within" in open(os.path.join(tag_dir, FAILURE_NAME)).read()


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


def _commit(save_dir, tag, step, value, attempt_started=None):
    from deepspeed_ext import manifest as mf
    tag_dir = mf.prepare_checkpoint_dir(save_dir, tag)
    for rank in range(2):
        _write_share(save_dir, tag, rank, value)
    logged = []
    claim = read_claim(tag_dir)
    commit_checkpoint(save_dir, tag, step, _commit_job(save_dir, tag, step, claim)["commit"]["layout"],
                      wait_for_reports(tag_dir, 2, timeout_s=5, claim=claim), None, None, None,
                      True, 0, log=logged.append, claim=claim, attempt_started=attempt_started)
    return logged


def test_latest_is_not_moved_over_a_later_attempts_checkpoint(tmp_path):
    from deepspeed_ext import manifest as mf
    save_dir = str(tmp_path)
    assert _commit(save_dir, "global_step30", 30, 3.0, attempt_started=200.0) == []
    # The first attempt's keeper finishes its commit of 20 only now.
    logged = _commit(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)
    assert mf.read_latest(save_dir) == "global_step30"
    assert len(logged) == 1 and "latest stays at global_step30" in logged[0]
    assert mf.read_manifest(os.path.join(save_dir, "global_step20")).step == 20  # still committed
    assert mf.read_manifest(os.path.join(save_dir, "global_step30")).extra["attempt_started"] == 200.0
    assert _commit(save_dir, "global_step40", 40, 4.0, attempt_started=200.0) == []
    assert mf.read_latest(save_dir) == "global_step40"
    # A later attempt may move it back: it resumed from an older checkpoint, or is a new
    # run writing into this directory.
    assert _commit(save_dir, "global_step10", 10, 1.0, attempt_started=300.0) == []
    assert mf.read_latest(save_dir) == "global_step10"
    # Unknown attempts (a caller that does not say): moved, as before.
    assert _commit(save_dir, "global_step5", 5, 0.5) == []
    assert mf.read_latest(save_dir) == "global_step5"


def test_latest_naming_nothing_loadable_is_replaced(tmp_path):
    from deepspeed_ext import manifest as mf
    save_dir = str(tmp_path)
    _commit(save_dir, "global_step30", 30, 3.0, attempt_started=200.0)
    os.remove(os.path.join(save_dir, "global_step30", mf.MANIFEST_FILE))
    _commit(save_dir, "global_step20", 20, 2.0, attempt_started=100.0)
    assert mf.read_latest(save_dir) == "global_step20"


def test_a_crashed_save_with_its_claim_is_removed_by_retention(tmp_path):
    """The claim file is one of MoC's own names: a crashed save holding it is still
    recognised as a leftover (else retention would leave it forever)."""
    from deepspeed_ext import manifest as mf
    save_dir = str(tmp_path)
    tag_dir = mf.prepare_checkpoint_dir(save_dir, "global_step10")
    _write_share(save_dir, "global_step10", 0, 1.0)  # crashed: no manifest
    assert CLAIM_NAME in os.listdir(tag_dir)
    old = time.time() - 100
    for name in os.listdir(tag_dir):
        os.utime(os.path.join(tag_dir, name), (old, old))
    _commit(save_dir, "global_step20", 20, 2.0)
    assert "global_step10" in mf.apply_retention(save_dir, 1)
    assert not os.path.exists(tag_dir)
