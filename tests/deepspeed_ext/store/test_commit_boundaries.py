"""Boundaries of :mod:`deepspeed_ext.store.commit` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import json
import os
import time

import pytest

from deepspeed_ext.format.manifest import MANIFEST_MAX_BYTES, ExpertVersion, read_manifest
from deepspeed_ext.format.objects import OBJECTS_FILE
from deepspeed_ext.store.claims import CommitError, claim_dir
from deepspeed_ext.store.commit import (FAILURE_NAME, REPORT_MAX_BYTES, MarkedFailed,
                                        commit_checkpoint, remove_reports,
                                        report_name, wait_for_reports, write_report)


def test_a_report_may_be_as_large_as_a_manifest_and_no_larger():
    # A report lists one rank's fragments: never more than the manifest of all of them.
    assert REPORT_MAX_BYTES == MANIFEST_MAX_BYTES


def test_a_higher_ranks_report_in_a_lower_ranks_file_is_refused(tmp_path):
    write_report(str(tmp_path), 1, {})
    (tmp_path / report_name(1)).replace(tmp_path / report_name(0))
    with pytest.raises(CommitError, match="not a report of rank 0"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)


def test_the_first_poll_for_reports_comes_after_a_hundredth_of_a_second(tmp_path, monkeypatch):
    sleeps = []

    def sleep(seconds):   # the missing report arrives during the first sleep
        sleeps.append(seconds)
        write_report(str(tmp_path), 1, {"who": 1})
    monkeypatch.setattr(time, "sleep", sleep)
    write_report(str(tmp_path), 0, {"who": 0})
    assert wait_for_reports(str(tmp_path), 2, timeout_s=10) == [{"who": 0}, {"who": 1}]
    assert sleeps == [0.01]


def test_a_wait_for_hundreds_of_reports_ends_when_the_last_arrives(tmp_path):
    # 300 ranks: a count compared by identity would only match below CPython's small ints.
    for rank in range(300):   # as write_report writes them, without its 300 fsyncs
        (tmp_path / report_name(rank)).write_text(json.dumps(
            {"rank": rank, "ok": True, "payload": {"who": rank}, "error": None, "claim": None}))
    assert wait_for_reports(str(tmp_path), 300, timeout_s=0.5)[299] == {"who": 299}


def test_removing_reports_passes_over_a_damaged_one(tmp_path):
    claim = claim_dir(str(tmp_path))
    write_report(str(tmp_path), 1, {}, claim=claim)
    (tmp_path / report_name(0)).write_text("{not json")
    remove_reports(str(tmp_path), 2, claim=claim)
    assert sorted(p.name for p in tmp_path.iterdir()) == [report_name(0)]


def _commit_moe(save_dir, tag, step, experts, previous_tag):
    """A one-rank checkpoint of one MoE layer of two experts holding ``experts``' weights
    (no moments yet), committed as rank 0's writer commits it."""
    import torch
    from deepspeed_ext.format import assemble, naming
    from deepspeed_ext.format.objects import encode, write_objects_file
    from deepspeed_ext.format.storage import write_fragment_file
    from deepspeed_ext.store import prepare
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    specs = [assemble.FragmentSpec(f"layers.1.mlp.experts.{e}.w1", "fp32", 0, 2, (2,),
                                   "float32", (0, e)) for e in experts]
    record = write_fragment_file(os.path.join(tag_dir, naming.rank_file_name(0)),
                                 {s.key: torch.full((2,), float(step)) for s in specs})
    tree, _ = encode({"step": step})
    objects = write_objects_file(tag_dir, tree, None).to_json()
    report = assemble.RankReport.from_record(0, naming.rank_file_name(0), record, specs)
    share = {"report": report.to_json(), "objects": objects}
    layout = {"world_size": 1, "ep_size": 1, "zero_stage": 2, "num_moe_layers": 1,
              "num_experts": 2}
    commit_checkpoint(save_dir, tag, step, layout, [share], previous_tag,
                      [(0, e) for e in experts], 1, True, 0, log=lambda line: None)
    return read_manifest(tag_dir)


def test_a_moe_commit_extends_the_previous_checkpoints_expert_index(tmp_path):
    first = _commit_moe(str(tmp_path), "global_step10", 10, [0, 1], None)
    assert first.validate() == []
    second = _commit_moe(str(tmp_path), "global_step20", 20, [1], "global_step10")
    assert second.expert_index == {"0/0": ExpertVersion(10, "global_step10"),
                                   "0/1": ExpertVersion(20, "global_step20")}
    # rank 0 writes the objects file: the manifest says so.
    assert second.files[OBJECTS_FILE].rank == 0


def test_an_unreadable_failure_record_ends_the_wait_as_marked_failed(tmp_path):
    write_report(str(tmp_path), 0, {})
    (tmp_path / FAILURE_NAME).write_text("{not json")
    with pytest.raises(MarkedFailed, match="unreadable failure record"):
        wait_for_reports(str(tmp_path), 2, timeout_s=1)
