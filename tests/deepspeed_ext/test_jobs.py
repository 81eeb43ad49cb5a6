"""The keeper's job records (deepspeed_ext.jobs): the JSON they send is exactly what
today's trainers send and today's keepers read (keepers outlive restarts, so both
directions must work), and every field that arrives over the socket is checked."""

import copy
import json
import os

import pytest

from deepspeed_ext import exact, keeper
from deepspeed_ext.jobs import CommitSpec, FrameJob, JobRefused, PersistJob, job_from_json

# Captured from the code before these records (TwoLevel._persist_job for a 2-rank MoE
# save, completed as the copy thread and the hand-over did: checksum, done_marker, id),
# after its JSON round trip: what a trainer of that code sends to a keeper.
TODAYS_RANK0 = {
    "checksum": "xxh3_64:0123456789abcdef", "claim": "claim-abc",
    "commit": {"attempt_started": 1700000000.5, "keep": 3,
               "layout": {"ep_size": 2, "num_experts": 2, "num_moe_layers": 1,
                          "world_size": 2, "zero_stage": 2},
               "pec_k": 1, "previous_tag": "global_step2", "save_latest": True,
               "selected": [[0, 1]], "step": 3, "timeout_s": 600.0},
    "done_marker": "/dev/shm/moc/node0/rank00000/slot1.persisting",
    "entries": [{"dtype": "float32", "key": "w", "nbytes": 16, "shape": [2, 2], "start": 64},
                {"dtype": "bfloat16", "key": "e.0", "nbytes": 8, "shape": [4], "start": 80},
                {"dtype": "uint8", "key": "obj/0", "nbytes": 3, "shape": [3], "start": 88}],
    "id": "global_step3:4deb2f672393:rank0",
    "image": "/dev/shm/moc/node0/rank00000/slot1.img",
    "keys": ["w"], "object_keys": ["obj/0"],
    "objects_tree": {"rng": {"__tensor__": "obj/0"}, "step": 3},
    "rank": 0, "run_id": "run-1", "save_dir": "/ckpt",
    "specs": [{"dtype": "float32", "expert": None, "kind": "fp32", "length": 4, "name": "w",
               "offset": 0, "shape": [2, 2]}],
    "step": 3, "tag": "global_step3"}
TODAYS_RANK1 = {
    "checksum": "xxh3_64:0123456789abcdef", "claim": "claim-abc",
    "done_marker": "/dev/shm/moc/node0/rank00001/slot1.persisting",
    "entries": TODAYS_RANK0["entries"], "id": "global_step3:4deb2f672393:rank1",
    "image": "/dev/shm/moc/node0/rank00001/slot1.img", "keys": ["e.0"], "object_keys": [],
    "objects_tree": None, "rank": 1, "run_id": "run-1", "save_dir": "/ckpt",
    "specs": [{"dtype": "bfloat16", "expert": [0, 1], "kind": "fp32", "length": 4, "name": "e",
               "offset": 0, "shape": [4]}],
    "step": 3, "tag": "global_step3"}
# TwoLevel._persist_newest's rank 0 job when rank 0 wrote the objects itself (the
# snapshot held only its own RNG state): its _write_objects_with fields added.
TODAYS_NEWEST_RANK0 = dict(
    TODAYS_RANK0, objects_tree=None, object_keys=[],
    objects_record={"nbytes": 120, "sha256": "ab" * 32},
    extra_files={"objects.safetensors": {"nbytes": 96, "sha256": "cd" * 32}})
# A job of an older version still queued in a keeper: objects in the rank file, no
# checksum, run id, object keys or done marker.
OLDER_JOB = {"image": "/dev/shm/moc/node0/rank00001/slot0.img", "keys": None, "specs": [],
             "entries": [{"key": "w", "dtype": "float32", "shape": [4], "start": 64,
                          "nbytes": 16}],
             "save_dir": "/ckpt", "tag": "global_step20", "step": 20, "rank": 1,
             "claim": None, "objects_tree": None, "objects_in_file": True}
# NodeMemory.hand_over's job (deepspeed_ext.exact.memory) of frame 7, rank 1, before these records.
TODAYS_FRAME = {"data": "/dev/shm/moc/node0/exact/frame00000007/rank00001.safetensors",
                "dst_data": "/ckpt/exact/frame00000007/rank00001.safetensors",
                "dst_marker": "/ckpt/exact/frame00000007/rank00001.json",
                "id": "frame7:fbc958529d30:rank1", "kind": "frame",
                "marker": "/dev/shm/moc/node0/exact/frame00000007/rank00001.json",
                "run_id": "run-1", "save_dir": "/ckpt"}


@pytest.mark.parametrize("today", [TODAYS_RANK0, TODAYS_RANK1, TODAYS_NEWEST_RANK0],
                         ids=["rank0", "rank1", "newest-rank0"])
def test_a_job_of_todays_trainer_is_parsed_and_sent_back_unchanged(today):
    """A keeper of this code accepts today's trainer's job, and the record's JSON has
    exactly today's keys and values (so today's keeper accepts this trainer's job)."""
    job = PersistJob.from_json(copy.deepcopy(today))
    assert job.to_json() == today
    assert json.loads(json.dumps(job.to_json())) == today
    assert job_from_json(today) == job
    if "commit" in today:
        assert job.commit.world_size == 2 and job.commit.selected == ((0, 1),)
        assert CommitSpec.from_json(today["commit"]).to_json() == today["commit"]


def test_a_job_of_an_older_trainer_is_still_run():
    """An older job (objects in the rank file, fewer keys) parses; its JSON keeps every
    key it had and adds today's optional ones with their empty values."""
    job = PersistJob.from_json(OLDER_JOB)
    assert job.objects_in_file and job.keys is None and job.checksum is None
    assert job.to_json() == dict(OLDER_JOB, checksum=None, object_keys=[], run_id=None)


def test_a_frame_job_is_todays_frame_job():
    """exact's frame job sends today's keys; a frame job of today's trainer parses."""
    built = exact.frame_job("/dev/shm/moc/node0", "/ckpt", 7, 1, "run-1",
                            "frame7:fbc958529d30:rank1")
    assert built.to_json() == TODAYS_FRAME
    assert FrameJob.from_json(dict(TODAYS_FRAME)) == built == job_from_json(TODAYS_FRAME)
    without_id = {k: v for k, v in TODAYS_FRAME.items() if k != "id"}
    assert FrameJob.from_json(without_id).to_json() == without_id


def _in(node, save, job):
    """``job`` with its memory paths in ``node`` and its storage paths in ``save``."""
    return json.loads(json.dumps(job).replace("/dev/shm/moc/node0", node)
                      .replace('"/ckpt', json.dumps(save)[:-1]))


def test_a_keeper_queues_todays_jobs_as_typed_records(tmp_path):
    """The keeper's persist request parses the job before queuing it: its queue holds
    the records, and a retry with the same id is still dropped."""
    node, save = str(tmp_path / "node0"), str(tmp_path / "ckpt")
    os.makedirs(node)
    server = keeper.Keeper(node, idle_timeout_s=60)
    for today, kind in ((TODAYS_RANK0, PersistJob), (TODAYS_FRAME, FrameJob)):
        job = _in(node, save, today)
        assert server.handle({"op": "persist", "job": job})["ok"]
        assert server.handle({"op": "persist", "job": job})["duplicate"]
        queued = server.jobs.get_nowait()
        assert isinstance(queued, kind) and queued.to_json() == job
    assert server.jobs.empty()


def _without(job, path):
    out = copy.deepcopy(job)
    *parents, last = path
    target = out
    for p in parents:
        target = target[p]
    del target[last]
    return out


def _with(job, path, value):
    out = copy.deepcopy(job)
    *parents, last = path
    target = out
    for p in parents:
        target = target[p]
    target[last] = value
    return out


@pytest.mark.parametrize("path", [("image",), ("entries",), ("keys",), ("specs",),
                                  ("save_dir",), ("tag",), ("step",), ("rank",),
                                  ("commit", "step"), ("commit", "layout"),
                                  ("commit", "layout", "world_size"), ("commit", "keep"),
                                  ("commit", "timeout_s"), ("commit", "save_latest"),
                                  ("entries", 0, "start")])
def test_a_missing_required_key_is_refused_by_name(path):
    with pytest.raises(JobRefused, match=f"missing required key '{path[-1]}'"):
        PersistJob.from_json(_without(TODAYS_RANK0, path))


@pytest.mark.parametrize("path, value, named", [
    (("image",), 3, "image"), (("image",), "", "image"),
    (("entries",), {}, "entries"), (("entries",), [7], "entries[0]"),
    (("entries", 0, "start"), -8, "entries[0].start"),
    (("entries", 1, "nbytes"), 2.5, "entries[1].nbytes"),
    (("entries", 0, "shape"), [2, "2"], "entries[0].shape"),
    (("entries", 0, "key"), None, "entries[0].key"),
    (("keys",), "w", "keys"), (("keys",), [1], "keys"),
    (("specs",), ["w"], "specs"),
    (("save_dir",), None, "save_dir"), (("tag",), ["x"], "tag"),
    (("step",), "3", "step"), (("step",), True, "step"), (("rank",), -1, "rank"),
    (("objects_tree",), [1], "objects_tree"), (("object_keys",), [0], "object_keys"),
    (("claim",), 5, "claim"), (("run_id",), {}, "run_id"), (("checksum",), 1, "checksum"),
    (("done_marker",), 0, "done_marker"), (("id",), 9, "id"),
    (("objects_record",), "x", "objects_record"), (("extra_files",), [], "extra_files"),
    (("objects_in_file",), "yes", "objects_in_file"),
    (("commit",), "now", "commit"),
    (("commit", "step"), -3, "commit.step"),
    (("commit", "layout"), [2], "commit.layout"),
    (("commit", "layout", "world_size"), 0, "commit.layout.world_size"),
    (("commit", "layout", "num_experts"), "2", "commit.layout.num_experts"),
    (("commit", "previous_tag"), 2, "commit.previous_tag"),
    (("commit", "selected"), [[0]], "commit.selected"),
    (("commit", "selected"), [[0, -1]], "commit.selected"),
    (("commit", "pec_k"), "1", "commit.pec_k"),
    (("commit", "save_latest"), 1, "commit.save_latest"),
    (("commit", "keep"), -1, "commit.keep"),
    (("commit", "timeout_s"), 0, "commit.timeout_s"),
    (("commit", "timeout_s"), float("nan"), "commit.timeout_s"),
    (("commit", "attempt_started"), "t", "commit.attempt_started"),
])
def test_each_bad_field_is_refused_by_name(path, value, named):
    with pytest.raises(JobRefused) as refused:
        PersistJob.from_json(_with(TODAYS_RANK0, path, value))
    assert str(refused.value).startswith(named), str(refused.value)


@pytest.mark.parametrize("field, value", [("data", None), ("marker", 1), ("dst_data", ""),
                                          ("dst_marker", []), ("save_dir", None),
                                          ("run_id", 3), ("id", 4), ("kind", "snapshot")])
def test_each_bad_frame_field_is_refused_by_name(field, value):
    with pytest.raises(JobRefused) as refused:
        FrameJob.from_json(dict(TODAYS_FRAME, **{field: value}))
    assert str(refused.value).startswith(field)


@pytest.mark.parametrize("field", ["data", "marker", "dst_data", "dst_marker", "save_dir"])
def test_a_frame_job_missing_a_required_key_is_refused_by_name(field):
    with pytest.raises(JobRefused, match=f"missing required key '{field}'"):
        FrameJob.from_json({k: v for k, v in TODAYS_FRAME.items() if k != field})


def test_unknown_keys_are_ignored_for_newer_trainers():
    """A newer trainer may add optional fields: this keeper runs the job without them
    (as today's keeper did), and does not send them on."""
    newer = _with(_with(TODAYS_RANK0, ("priority",), 5), ("commit", "pec_scope"), "w")
    assert PersistJob.from_json(newer).to_json() == TODAYS_RANK0
    assert FrameJob.from_json(dict(TODAYS_FRAME, hint=1)).to_json() == TODAYS_FRAME


def test_a_keeper_refuses_a_malformed_job_before_queuing_it(tmp_path):
    """Before, a job with a malformed commit record was queued and failed only in the
    keeper's commit thread (a TypeError in its log, the save waiting for its timeout)."""
    node, save = str(tmp_path / "node0"), str(tmp_path / "ckpt")
    os.makedirs(node)
    server = keeper.Keeper(node, idle_timeout_s=60)
    bad = _with(_in(node, save, TODAYS_RANK0), ("commit", "layout", "world_size"), "2")
    reply = server.handle({"op": "persist", "job": bad})
    assert not reply["ok"] and "commit.layout.world_size" in reply["error"]
    assert server.jobs.qsize() == 0
    with pytest.raises(JobRefused, match="unknown job kind"):
        job_from_json(dict(TODAYS_RANK0, kind="tarball"))
