"""The job's event file and progress record (megatron.training.events)."""

import json
import os

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ConfigError
from megatron.training.events import EventLog, Progress, default_event_file
from tests.training.test_arguments import BASE


def test_events_append_read_and_skip_a_torn_line(tmp_path):
    log = EventLog(str(tmp_path / "run" / "moc-events.jsonl"))
    assert log.read() == []
    first = log.append({"kind": "recovery", "iteration": 4})
    log.append({"kind": "hang", "rank": 1, "time": 5.0})
    with open(log.path, "a") as f:
        f.write('{"kind": "recovery", "iter')  # a crash in the middle of a write
    assert [e["kind"] for e in log.read()] == ["recovery", "hang"]
    assert log.read("hang") == [{"kind": "hang", "rank": 1, "time": 5.0}]
    assert first["time"] > 0 and log.read("recovery")[0] == first
    with pytest.raises(ValueError):
        log.append({"kind": "x", "plt": float("nan")})  # strict JSON only


def test_progress_record_round_trip(tmp_path):
    progress = Progress(str(tmp_path / "new" / "moc-progress.json"))
    assert progress.read() is None
    progress.record(7, "host:1:2")
    progress.record(8, "host:1:2")
    assert progress.read()["iteration"] == 8 and progress.read()["run"] == "host:1:2"
    assert os.listdir(tmp_path / "new") == ["moc-progress.json"]  # no temp file left
    (tmp_path / "new" / "moc-progress.json").write_text("{")
    assert progress.read() is None


def test_event_file_default_and_threshold_checks(tmp_path):
    args = validate_args(parse_args(BASE + ["--moc-checkpoint", "--save", str(tmp_path)]), 1)
    assert args.moc_event_file == os.path.join(str(tmp_path), "moc-events.jsonl")
    args = validate_args(parse_args(BASE + ["--save", str(tmp_path)]), 1)
    assert args.moc_event_file is None  # DeepSpeed's own checkpoints: no MoC accounting
    assert default_event_file("s3://bucket/run") is None
    for bad in ("0", "1", "-0.5"):
        with pytest.raises(ConfigError, match="--moc-plt-threshold must be in"):
            validate_args(parse_args(BASE + ["--moc-checkpoint", "--moc-plt-threshold", bad]), 1)
    with pytest.raises(ConfigError, match="--moc-dynamic-k needs --moc-checkpoint"):
        validate_args(parse_args(BASE + ["--moc-dynamic-k"]), 1)
    assert json.dumps(vars(args), default=str)  # the arguments stay serialisable


def test_failure_named_at_a_restart_is_the_newest_since_the_last_recovery():
    from megatron.training.recovery import describe_failure
    crash = {"kind": "fault", "fault": "crash", "rank": 1, "iteration": 6}
    reported = {"kind": "straggler", "rank": 0, "iteration": 9, "action": "report"}
    stopped = dict(reported, action="stop")
    assert describe_failure([crash], 2) == "injected crash on rank 1 at iteration 6"
    # recovered from the crash; a straggler that was only reported stopped nothing
    assert describe_failure([crash, {"kind": "recovery"}, reported], 2).startswith("unknown")
    assert describe_failure([crash, {"kind": "recovery"}, stopped], 2) == \
        "straggler stopped the job on rank 0 at iteration 9"
    assert describe_failure([crash, {"kind": "recovery"}], 0) is None  # a planned restart
    # a hang before the first iteration names its start-up phase, not "iteration None"
    startup = {"kind": "hang", "rank": 1, "host": "n1", "phase": "process group",
               "iteration": None}
    assert describe_failure([startup], 1) == \
        "hang detected on rank 1 (host n1) in start-up phase 'process group'"
    # faults the run trains through never ended it
    for kind in ("slow", "slow-compute", "persist-crash"):
        through = {"kind": "fault", "fault": kind, "rank": 0, "iteration": 8}
        assert describe_failure([crash, through], 1) == "injected crash on rank 1 at iteration 6"
        assert describe_failure([through], 1).startswith("unknown")


def test_restart_count_comes_from_the_flag_before_the_environment(monkeypatch):
    """The DeepSpeed launcher does not carry MOC_RESTART_COUNT to other nodes' ranks:
    scripts/launch_cluster.sh passes --moc-restart-count, which wins."""
    from megatron.training.recovery import restart_count
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("MOC_RESTART_COUNT", raising=False)
    assert restart_count(parse_args(BASE)) == 0
    monkeypatch.setenv("MOC_RESTART_COUNT", "3")
    assert restart_count(parse_args(BASE)) == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count(parse_args(BASE)) == 2
    assert restart_count(parse_args(BASE + ["--moc-restart-count", "5"])) == 5
    with pytest.raises(ConfigError, match="--moc-restart-count must be >= 0"):
        validate_args(parse_args(BASE + ["--moc-restart-count", "-1"]), 1)
