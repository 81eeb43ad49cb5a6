"""Committed checkpoints for tests, made in one process through the commit protocol.

Each rank's share (its one-tensor file and report) is written the way a writer leaves
it, then rank 0's commit (:func:`deepspeed_ext.store.commit.commit_checkpoint`) runs on
them. Used by test_commit, test_cli and tests/training/test_checkpointing.
"""

import os

from deepspeed_ext.store.claims import read_claim
from deepspeed_ext.store.commit import commit_checkpoint, wait_for_reports, write_report


def write_share(save_dir, tag, rank, value, claim=None, objects=None):
    """One rank's file and report in ``<save_dir>/<tag>`` as a writer leaves them; rank 0
    also writes the objects (``objects``, default ``{"value": value}``). ``value`` fills
    the rank's one tensor (tells saves apart); ``claim``: the save's claim the report
    carries (None: the directory's current one)."""
    import torch
    from deepspeed_ext.format import assemble, naming
    from deepspeed_ext.format.objects import encode, write_objects_file
    from deepspeed_ext.format.storage import write_fragment_file
    tag_dir = os.path.join(save_dir, tag)
    spec = assemble.FragmentSpec("w", "fp32", 2 * rank, 2, (4,), "float32")
    record = write_fragment_file(os.path.join(tag_dir, naming.rank_file_name(rank)),
                                 {spec.key: torch.full((2,), float(value))})
    record_of_objects = None
    if rank == 0:
        tree, _ = encode(objects if objects is not None else {"value": value})
        record_of_objects = write_objects_file(tag_dir, tree, None).to_json()
    report = assemble.RankReport.from_record(rank, naming.rank_file_name(rank), record, [spec])
    write_report(tag_dir, rank, {"report": report.to_json(), "objects": record_of_objects},
                 claim=claim if claim is not None else read_claim(tag_dir))


def commit_job(save_dir, tag, step, claim, timeout_s=30.0):
    """The keeper's commit of rank 0's job (two ranks, no MoE)."""
    return {"save_dir": save_dir, "tag": tag, "claim": claim, "commit": {
        "step": step, "previous_tag": None, "selected": None, "pec_k": None,
        "save_latest": True, "keep": 0, "timeout_s": timeout_s,
        "layout": {"world_size": 2, "ep_size": 1, "zero_stage": 2, "num_moe_layers": 0,
                   "num_experts": 0}}}


def commit_two_ranks(save_dir, tag, step, value, attempt_started=None, objects=None, keep=0):
    """A committed two-rank checkpoint (rank 0's objects: ``objects``, see
    :func:`write_share`), with retention ``keep``.

    Returns:
        The commit's log lines.
    """
    from deepspeed_ext.store import prepare
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    for rank in range(2):
        write_share(save_dir, tag, rank, value, objects=objects)
    logged, claim = [], read_claim(tag_dir)
    commit_checkpoint(save_dir, tag, step, commit_job(save_dir, tag, step, claim)["commit"]["layout"],
                      wait_for_reports(tag_dir, 2, timeout_s=5, claim=claim), None, None, None,
                      True, keep, log=logged.append, claim=claim, attempt_started=attempt_started)
    return logged


def commit_keeping(save_dir, tag, step, value, attempt_started, keep):
    """:func:`commit_two_ranks` with retention ``keep`` (default objects)."""
    return commit_two_ranks(save_dir, tag, step, value, attempt_started, keep=keep)
