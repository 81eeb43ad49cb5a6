"""The job's event file and progress record (megatron.training.events)."""

import json
import os

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import parse_args, validate_args
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
    monkeypatch.setenv("MOC_ROUND", "2")  # an in-job round: a restart within the attempt
    assert restart_count(parse_args(BASE + ["--moc-restart-count", "0"])) == 2
    assert restart_count(parse_args(BASE)) == 4
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("MOC_RESTART_COUNT")
    assert restart_count(parse_args(BASE)) == 2
    monkeypatch.setenv("MOC_RECOVERIES", "1")  # round 2 after a refill round: 1 recovery
    assert restart_count(parse_args(BASE)) == 1
    with pytest.raises(ConfigError, match="--moc-restart-count must be >= 0"):
        validate_args(parse_args(BASE + ["--moc-restart-count", "-1"]), 1)


def _timed_loop(iteration_s):
    """A LoopTime fed iterations that took ``iteration_s`` seconds each, back to back
    from t = 100 (perf_counter readings), and stopped after the last."""
    from megatron.training.recovery import LoopTime
    loop, now = LoopTime(), 100.0
    for s in iteration_s:
        loop.top(now)
        now += s
    loop.stop(now)
    return loop


def test_ettr_counts_measured_iteration_time_and_never_passes_1():
    """Varying iteration times: six slow ones and four fast ones. A count times the
    median (1.0 s x 10 = 10 s) claimed more than the 6.04 s the loop took (the old line
    said ETTR 1.53 here); the sum of the measured times cannot."""
    from megatron.training.recovery import ettr_figures
    times = [0.01, 1.0, 0.01, 1.0, 1.0, 0.01, 1.0, 1.0, 0.01, 1.0]
    loop = _timed_loop(times)
    assert loop.iterations == 10 and loop.seconds() == pytest.approx(sum(times))
    start = {"kind": "start", "restart": 0, "iteration": 100, "time": 1000.0}
    wall_end = 1000.0 + sum(times) + 0.5  # the loop plus half a second around it
    figures = ettr_figures([start], 110, loop.record(), wall_end)
    assert figures["measured_s"] == pytest.approx(6.04)
    assert figures["counted_s"] == pytest.approx(6.04)
    assert figures["ettr"] == pytest.approx(6.04 / 6.54) and figures["ettr"] < 1
    assert figures["iterations"] == figures["iterations_run"] == 10
    # no start event of the job's first attempt, or no iteration yet: nothing to report
    assert ettr_figures([dict(start, restart=1)], 110, loop.record(), wall_end) is None
    assert ettr_figures([start], 100, _timed_loop([]).record(), wall_end) is None


def test_ettr_of_a_restarted_job_counts_only_the_iterations_gained():
    """Attempt 0 ran iterations 0-12 in 12 s (measured) and crashed; attempt 1 resumed at
    8 (4 iterations lost) and ran 8-16 with slower iterations, 8 of them in 16 s. Of the
    20 iterations run, 16 were gained: 16/20 of the 28 s measured count. The failed run's
    record reaches the ETTR through its recovery event; a run of an earlier job (its loop
    began before this job's first start) and a second copy of one run do not count."""
    from megatron.training.recovery import ettr_figures
    events = [
        {"kind": "start", "restart": 0, "iteration": 0, "time": 1000.0},
        {"kind": "recovery", "time": 1015.0, "iteration": 8, "failed_run": "h:1:1",
         "failed_run_loop": {"started": 1000.1, "iterations": 12, "seconds": 12.0}},
        {"kind": "recovery", "time": 1016.0, "iteration": 8, "failed_run": "h:1:1",
         "failed_run_loop": {"started": 1000.1, "iterations": 12, "seconds": 12.0}},
        {"kind": "recovery", "time": 1016.5, "iteration": 8, "failed_run": "h:0:0",
         "failed_run_loop": {"started": 900.0, "iterations": 50, "seconds": 50.0}},
        {"kind": "start", "restart": 1, "iteration": 8, "time": 1017.0},
    ]
    attempt = _timed_loop([2.0] * 8).record()
    figures = ettr_figures(events, 16, attempt, 1034.0)
    assert figures["iterations"] == 16 and figures["iterations_run"] == 20
    assert figures["measured_s"] == pytest.approx(28.0)
    assert figures["counted_s"] == pytest.approx(28.0 * 16 / 20)
    assert figures["ettr"] == pytest.approx(22.4 / 34.0) and figures["recoveries"] == 3
    # every iteration run twice or more at wildly different speeds: still at most 1
    for seconds in (0.001, 5.0, 16.9):
        attempt = dict(attempt, seconds=seconds)
        assert ettr_figures(events, 16, attempt, 1017.0 + seconds)["ettr"] <= 1
