"""Hang and straggler detection: the pure rules on scripted heartbeats, the watchdog on
an in-process store with a fake clock, and real gloo jobs in which one rank hangs
before a collective (the others blocked in it must still detect it) or straggles."""

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.training.monitor import watchdog as watchdog_module
from megatron.training.monitor.beats import Beat, Heartbeat, WindowMedian, heartbeat_key
from megatron.training.monitor.clock import CollectiveClock, DeviceTimer
from megatron.training.monitor.config import MonitorConfig, add_monitor_args
from megatron.training.monitor.exits import EXIT_HANG, EXIT_STRAGGLER
from megatron.training.monitor.rules import find_hang, find_stragglers
from megatron.training.monitor.watchdog import Watchdog
from tests.launch import describe, run_ranks

WORKER = "tests/training/monitor_worker.py"


# ------------------------------------------------------------------------ config

@pytest.mark.parametrize("kwargs, flag", [
    (dict(hang_timeout_s=0), "--moc-hang-timeout"),
    (dict(hang_timeout_s=-1), "--moc-hang-timeout"),
    (dict(straggler_factor=1.0), "--moc-straggler-factor"),
    (dict(straggler_factor=0.5), "--moc-straggler-factor"),
    (dict(straggler_window=2), "--moc-straggler-window"),
    (dict(straggler_action="kill"), "--moc-straggler-action"),
    (dict(poll_s=0), "--moc-monitor-poll"),
    (dict(hang_timeout_s=2, poll_s=3), "--moc-monitor-poll"),
])
def test_config_names_the_flag_of_a_bad_value(kwargs, flag):
    with pytest.raises(ValueError) as e:
        MonitorConfig(**kwargs)
    assert isinstance(e.value, ConfigError) and str(e.value).startswith(flag), str(e.value)


def test_config_from_flags():
    import argparse
    parser = argparse.ArgumentParser()
    add_monitor_args(parser)
    args = parser.parse_args(["--moc-monitor", "--moc-hang-timeout", "30",
                              "--moc-straggler-action", "stop"])
    config = MonitorConfig.from_args(args)
    assert args.moc_monitor and config.hang_timeout_s == 30 and config.straggler_action == "stop"
    assert config.straggler_window == MonitorConfig().straggler_window


# ------------------------------------------------------------------ pure rules

def test_window_median_waits_for_a_full_window():
    m = WindowMedian(3)
    m.push(1.0)
    m.push(9.0)
    assert m.value is None
    m.push(2.0)
    assert m.value == 2.0
    m.push(8.0)  # window now 9, 2, 8
    assert m.value == 8.0


def _beats_from(store, world):
    return {r: Beat.from_json(r, store.get(heartbeat_key(r))) for r in range(world)}


def _first_flagged(iter_times, own_times=None, window=5, factor=2.0):
    """Beat scripted per-rank times through real Heartbeats; return
    ``[(iteration, {rank: slowdown})]`` for every iteration at which the rule fires."""
    store = dist.HashStore()
    world = len(iter_times)
    hbs = [Heartbeat(store, r, window=window) for r in range(world)]
    fired = []
    for it in range(len(iter_times[0])):
        for r in range(world):
            own = None if own_times is None else own_times[r][it]
            hbs[r].beat(it + 1, iter_s=iter_times[r][it], own_s=own)
        found = find_stragglers(_beats_from(store, world), factor)
        if found:
            fired.append((it + 1, found))
    return fired


def test_straggler_rule_ignores_isolated_slow_iterations_and_fires_on_a_persistent_one():
    fast, slow = 0.1, 0.5
    straggler = [fast] * 30
    straggler[5] = slow                 # one outlier
    straggler[10] = straggler[12] = slow  # two in one window of 5: still a minority
    for it in range(20, 30):            # slow from iteration 21 on
        straggler[it] = slow
    fired = _first_flagged([[fast] * 30, [fast] * 30, straggler])
    assert fired, "the persistent straggler was never flagged"
    first_iteration, found = fired[0]
    # Iteration 23 is the 3rd slow beat of 21.., the first window of 5 with a slow majority.
    assert first_iteration == 23
    assert list(found) == [2] and found[2] == pytest.approx(slow / fast)
    assert all(list(f) == [2] for _, f in fired)


def test_straggler_rule_on_synchronous_iterations_uses_own_time():
    # Synchronous training: every rank's wall time per iteration is the same 0.5 s;
    # rank 1 spends 0.45 s of it on its own, the others 0.05 s (then wait for rank 1).
    n = 8
    iters = [[0.5] * n for _ in range(3)]
    own = [[0.05] * n, [0.45] * n, [0.05] * n]
    fired = _first_flagged(iters, own, window=3)
    assert fired and list(fired[0][1]) == [1]
    assert fired[0][1][1] == pytest.approx(0.5 / 0.1)  # the job would run 5x faster
    # Wall times alone cannot tell: every rank looks the same.
    assert _first_flagged(iters, window=3) == []


def test_straggler_rule_ignores_small_absolute_differences():
    # Rank 0 writes logs and metrics: 2 ms of own time versus 0.1 ms elsewhere is a
    # 20x ratio of own times, but slows 100 ms iterations by 2% only.
    n = 6
    iters = [[0.1] * n for _ in range(3)]
    own = [[0.002] * n, [0.0001] * n, [0.0001] * n]
    assert _first_flagged(iters, own, window=3) == []


def test_straggler_baseline_excludes_the_rank_itself():
    # Two ranks: a median including the straggler itself would be 0.2 and its
    # slowdown 1.5 < 2; against the other rank it is 3.
    fired = _first_flagged([[0.1] * 5, [0.3] * 5], window=3)
    assert fired and fired[0][1] == {1: pytest.approx(3.0)}


def _beat(rank, iteration, done=False):
    return Beat(rank=rank, t=0.0, iteration=iteration, iter_s=None, own_s=None,
                median_iter_s=None, median_own_s=None, host="h", pid=100 + rank, done=done)


def test_hang_rule():
    beats = {0: _beat(0, 5), 1: _beat(1, 5), 2: _beat(2, 4)}
    stale = {0: 9.0, 1: 9.0, 2: 10.0}
    # not every rank beat yet: start-up is not judged
    assert find_hang({0: beats[0], 1: beats[1]}, stale, 3, 5.0) is None
    # some rank progressed recently: no hang
    assert find_hang(beats, {0: 1.0, 1: 9.0, 2: 10.0}, 3, 5.0) is None
    hang = find_hang(beats, stale, 3, 5.0)
    assert (hang.rank, hang.iteration, hang.suspects, hang.waiting) == (2, 4, [2], [0, 1])
    assert hang.seconds == 10.0
    # every rank stalled in the same iteration: suspects all, blame the longest silent
    same = {0: _beat(0, 5), 1: _beat(1, 5), 2: _beat(2, 5)}
    hang = find_hang(same, {0: 7.0, 1: 8.0, 2: 6.0}, 3, 5.0)
    assert (hang.rank, hang.suspects, hang.waiting) == (1, [0, 1, 2], [])
    # ... unless some of them are frozen (their watchdog stopped polling too): those are
    # the suspects, and the ones still polling wait for them
    hang = find_hang(same, {0: 7.0, 1: 8.0, 2: 6.0}, 3, 5.0, {0: 0.2, 1: 0.3, 2: 6.0})
    assert (hang.rank, hang.suspects, hang.waiting, hang.seconds) == (2, [2], [0, 1], 6.0)
    assert hang.frozen
    # at half the timeout exactly a watchdog is not frozen yet; every one frozen (the
    # whole machine stopped) or none known tells nothing either
    for alive in ({0: 0.2, 1: 0.3, 2: 2.5}, {0: 6.0, 1: 6.0, 2: 6.0}, {}, None):
        hang = find_hang(same, {0: 7.0, 1: 8.0, 2: 6.0}, 3, 5.0, alive)
        assert (hang.rank, hang.suspects, hang.waiting) == (1, [0, 1, 2], []), alive
    # a lagging rank is the culprit whatever the watchdogs say
    hang = find_hang(beats, stale, 3, 5.0, {0: 9.0, 1: 0.1, 2: 0.1})
    assert (hang.suspects, hang.waiting) == ([2], [0, 1])
    # a finished rank is not hung, and neither are ranks that only outlived it
    done = {0: _beat(0, 9, done=True), 1: _beat(1, 9, done=True), 2: _beat(2, 9)}
    assert find_hang(done, {0: 60.0, 1: 60.0, 2: 1.0}, 3, 5.0) is None
    assert find_hang({r: _beat(r, 9, done=True) for r in range(3)}, stale, 3, 5.0) is None


# --------------------------------------------------- watchdog, in-process store

class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _watchdogs(store, world, config, clock, **kwargs):
    calls = {"emit": [], "hang": [], "straggler": [], "log": []}
    dogs = [Watchdog(store, r, world, config, clock=clock,
                     emit=calls["emit"].append, on_hang=calls["hang"].append,
                     on_straggler=calls["straggler"].append, log=calls["log"].append, **kwargs)
            for r in range(world)]
    return dogs, calls


def test_watchdog_finds_the_lagging_rank_and_one_rank_emits():
    store, clock = dist.HashStore(), _Clock()
    config = MonitorConfig(hang_timeout_s=5.0, poll_s=1.0)
    hbs = [Heartbeat(store, r) for r in range(3)]
    dogs, calls = _watchdogs(store, 3, config, clock)
    for hb in hbs[:2]:
        hb.beat(1)
    assert [d.poll_once() for d in dogs] == [[], [], []]
    clock.now += 60  # rank 2 never beat: start-up is not watched
    assert [d.poll_once() for d in dogs] == [[], [], []]
    for it in (1, 2, 3):
        for hb in hbs:
            hb.beat(it)
        clock.now += 1
        assert [d.poll_once() for d in dogs] == [[], [], []]
    hbs[0].beat(4)
    hbs[1].beat(4)  # rank 2 hangs before starting iteration 4
    for d in dogs:
        d.poll_once()
    clock.now += 5.0
    assert [d.poll_once() for d in dogs] == [[], [], []]  # not longer than the timeout
    clock.now += 0.5
    for d in dogs:
        d.poll_once()
    assert [e["rank"] for e in calls["hang"]] == [2, 2, 2]
    assert [e["detected_by"] for e in calls["hang"]] == [0, 1, 2]
    assert len(calls["emit"]) == 1 and calls["emit"][0]["kind"] == "hang"
    event = calls["emit"][0]
    assert event["iteration"] == 3 and event["pid"] == os.getpid()
    assert event["waiting"] == [0, 1] and event["seconds_since_progress"] == pytest.approx(5.5)
    assert "HANG: rank 2" in calls["log"][0] and "never started iteration 4" in calls["log"][0]
    clock.now += 10
    for d in dogs:
        d.poll_once()
    assert len(calls["hang"]) == 3  # reported once per watchdog


def test_a_frozen_process_inside_an_iteration_is_the_culprit():
    """Every rank beat iteration 4, then rank 1's whole process stopped inside it (its
    watchdog polls no more) while ranks 0 and 2 wait for it in a collective (theirs
    still poll): rank 1 alone is the suspect. Before, all three were."""
    store, clock = dist.HashStore(), _Clock()
    hbs = [Heartbeat(store, r) for r in range(3)]
    dogs, calls = _watchdogs(store, 3, MonitorConfig(hang_timeout_s=5.0, poll_s=1.0), clock)
    for hb in hbs:
        hb.beat(4)
    for d in dogs:
        d.poll_once()
    for _ in range(6):  # 6 s: rank 1's watchdog is frozen with its process
        clock.now += 1.0
        for d in (dogs[0], dogs[2]):
            d.poll_once()
    assert [(e["rank"], e["suspects"], e["waiting"]) for e in calls["hang"]] == \
        [(1, [1], [0, 2])] * 2
    assert "is frozen: no progress for 6.00 s in iteration 4 and its watchdog stopped " \
        "polling too; ranks 0,2 wait for it" in calls["log"][0]


def test_a_rank_hanging_before_its_first_beat_is_found():
    """Each rank beats *ready* (the iteration it resumes from) before the loop: a rank
    that hangs before its first iteration's beat (a fault injected there, work between
    the load and the loop) lags behind the others, which beat and wait in their first
    collective. Without the ready beat the job was never watched and waited forever."""
    store, clock = dist.HashStore(), _Clock()
    hbs = [Heartbeat(store, r) for r in range(3)]
    dogs, calls = _watchdogs(store, 3, MonitorConfig(hang_timeout_s=5.0, poll_s=1.0), clock)
    for hb in hbs:
        hb.ready(10)  # resumed from iteration 10
    for d in dogs:
        d.poll_once()
    hbs[0].beat(11)
    hbs[2].beat(11)
    for d in dogs:
        d.poll_once()
    clock.now += 6.0
    for d in dogs:
        d.poll_once()
    assert [e["rank"] for e in calls["hang"]] == [1, 1, 1]
    assert calls["emit"][0]["iteration"] == 10 and calls["emit"][0]["waiting"] == [0, 2]
    assert "never started iteration 11" in calls["log"][0]


def test_progress_touches_split_the_timeout_between_phases():
    """An evaluation of many steps after an iteration (each step a touch) is progress: the
    hang timeout bounds each step, not the iteration and the evaluation together. Once
    the touches stop, the hang is found."""
    store, clock = dist.HashStore(), _Clock()
    hbs = [Heartbeat(store, r, window=3) for r in range(2)]
    dogs, calls = _watchdogs(store, 2, MonitorConfig(hang_timeout_s=5.0, poll_s=1.0), clock)
    for hb in hbs:
        hb.beat(1)
    for _ in range(10):  # 30 s of evaluation in 3 s steps
        clock.now += 3.0
        for hb in hbs:
            hb.touch()
        for d in dogs:
            d.poll_once()
    assert calls["hang"] == []
    beat = Beat.from_json(0, store.get(heartbeat_key(0)))
    assert beat.iteration == 1 and beat.iter_s is None  # a touch is not an iteration
    clock.now += 5.5
    for d in dogs:
        d.poll_once()
    assert len(calls["hang"]) == 2


def test_watchdog_ignores_finished_ranks():
    store, clock = dist.HashStore(), _Clock()
    hbs = [Heartbeat(store, r) for r in range(2)]
    dogs, calls = _watchdogs(store, 2, MonitorConfig(hang_timeout_s=5.0, poll_s=1.0), clock)
    for hb in hbs:
        hb.beat(1)
    dogs[0].poll_once()
    for hb in hbs:
        hb.finish()
    clock.now += 100
    assert dogs[0].poll_once() == [] and calls["hang"] == []


def _straggle(store, world, slow_rank, iterations, window=3):
    hbs = [Heartbeat(store, r, window=window) for r in range(world)]
    for it in range(iterations):
        for r, hb in enumerate(hbs):
            hb.beat(it + 1, iter_s=0.5 if r == slow_rank else 0.1)


def test_watchdog_reports_a_straggler_once_and_goes_on():
    store, clock = dist.HashStore(), _Clock()
    _straggle(store, 3, slow_rank=1, iterations=4)
    dogs, calls = _watchdogs(store, 3, MonitorConfig(straggler_window=3, poll_s=1.0), clock)
    for d in dogs:
        d.poll_once()
    for d in dogs:
        assert d.poll_once() == []  # already reported
    assert [e["rank"] for e in calls["straggler"]] == [1, 1, 1]
    assert len(calls["emit"]) == 1 and calls["emit"][0]["slowdown"] == pytest.approx(5.0)
    assert calls["hang"] == [] and "STRAGGLER: rank 1" in calls["log"][0]


def test_straggler_action_stop_exits_after_every_rank_acknowledged(monkeypatch):
    store, clock = dist.HashStore(), _Clock()
    _straggle(store, 3, slow_rank=2, iterations=4)
    exits, registered = [], []

    class Exited(Exception):
        pass

    def exit_now(status):
        exits.append(status)
        raise Exited

    monkeypatch.setattr(watchdog_module, "exit_now", exit_now)
    monkeypatch.setattr(watchdog_module.atexit, "register", lambda f, *a: registered.append(a))
    store.add("moc/ack/straggler", 2)  # the two other ranks detected it already
    dog = Watchdog(store, 0, 3, MonitorConfig(straggler_window=3, straggler_action="stop",
                                              poll_s=1.0), emit=lambda e: None, log=lambda m: None,
                   clock=clock)
    start = time.monotonic()
    with pytest.raises(Exited):
        dog.poll_once()
    assert exits == [EXIT_STRAGGLER] and registered == [(EXIT_STRAGGLER,)]
    assert time.monotonic() - start < 1.0  # did not wait out the grace period


class _DeadStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_an_unreachable_store_counts_as_a_hang():
    hung = threading.Event()
    events = []
    dog = Watchdog(_DeadStore(), 1, 2, MonitorConfig(hang_timeout_s=0.3, poll_s=0.05),
                   emit=events.append, on_hang=lambda e: hung.set(), log=lambda m: None)
    dog.start()
    try:
        assert hung.wait(5.0), "the watchdog thread never gave up on the dead store"
    finally:
        dog.stop()
    assert events[0]["rank"] == -1 and "unreachable" in events[0]["reason"]


def test_a_hang_whose_event_cannot_be_recorded_still_stops_the_rank():
    """The event file cannot be written (its disk full) when this rank reports a hang:
    it must still stop (on_hang), or it would go on while the others wait for it."""
    store, clock = dist.HashStore(), _Clock()
    hung, logged = [], []

    def full(event):
        raise OSError(28, "No space left on device (injected)")
    hbs = [Heartbeat(store, r) for r in range(2)]
    dog = Watchdog(store, 0, 2, MonitorConfig(hang_timeout_s=5.0, poll_s=1.0), clock=clock,
                   emit=full, on_hang=hung.append, log=logged.append)
    for it in (1, 2):
        for hb in hbs:
            hb.beat(it)
        clock.now += 1
        dog.poll_once()
    hbs[0].beat(3)  # rank 1 hangs
    dog.poll_once()
    clock.now += 6.0
    dog.poll_once()
    assert [e["rank"] for e in hung] == [1]
    assert any("cannot record the hang event" in line for line in logged), logged


# --------------------------------------------------------- real gloo ranks

def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _events(out):
    path = os.path.join(out, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("hung, collective", [(0, "all_reduce"), (2, "all_to_all")])
def test_ranks_blocked_in_a_collective_detect_the_hung_rank(tmp_path, hung, collective):
    """The watchdog thread runs while the main thread waits inside a gloo collective
    (gloo releases the GIL), and finds the hung rank, even when it is rank 0 (which
    also hosts the store), within the timeout plus a poll."""
    # A 0.5 s poll also gives the ranks 2 s to acknowledge the first detection before
    # the job stops (a rank that detects later, as on a loaded machine, would otherwise
    # die in gloo without its own report).
    timeout, poll = 3.0, 0.5
    out = str(tmp_path)
    results = run_ranks(3, ["--out", out, "--fault", f"hang@4:rank={hung}", "--iters", "50",
                            "--collective", collective, "--hang-timeout", str(timeout),
                            "--poll", str(poll)], script=WORKER, timeout=120)
    assert [r.returncode for r in results] == [EXIT_HANG] * 3, describe(results)
    latencies = []
    for rank in range(3):
        found = _read_json(os.path.join(out, f"detect-rank{rank}.json"))
        event = found["event"]
        assert event["rank"] == hung and event["suspects"] == [hung], describe(results)
        assert event["waiting"] == sorted({0, 1, 2} - {hung})
        # The hung rank last beat at the start of iteration 3 and never started iteration 4.
        assert event["iteration"] == 3 and event["detected_by"] == rank
        latency = found["detected_at"] - event["last_beat_time"]
        latencies.append(latency)
        # two polls plus a margin for a loaded machine's scheduling
        assert timeout <= latency <= timeout + 2 * poll + 2.0, describe(results)
        assert f"HANG: rank {hung}" in results[rank].output
    print(f"hang detection latency after the hung rank's last heartbeat "
          f"(timeout {timeout} s, poll {poll} s): " + ", ".join(f"{x:.2f} s" for x in latencies))
    emitted = _events(out)
    assert len(emitted) == 1 and emitted[0]["rank"] == hung, emitted
    assert not any(os.path.exists(os.path.join(out, f"done-rank{r}.json")) for r in range(3))


def test_a_straggler_is_reported_and_the_job_goes_on(tmp_path):
    out = str(tmp_path)
    # Iterations of 50 ms: a healthy rank descheduled for a few tens of ms (a loaded
    # machine) must not look like a straggler; rank 1 loses 250 ms per iteration.
    results = run_ranks(3, ["--out", out, "--fault", "slow@4:rank=1:slow=0.25", "--iters", "20",
                            "--compute-s", "0.05", "--window", "3", "--factor", "2",
                            "--poll", "0.1", "--hang-timeout", "10"], script=WORKER, timeout=120)
    assert [r.returncode for r in results] == [0, 0, 0], describe(results)
    assert all(_read_json(os.path.join(out, f"done-rank{r}.json"))["iterations"] == 20
               for r in range(3))
    emitted = _events(out)
    assert [(e["kind"], e["rank"]) for e in emitted] == [("straggler", 1)], emitted
    # (0.05 + 0.25) / 0.05 = 6 in theory; scheduling noise on a loaded machine lowers it
    assert emitted[0]["slowdown"] > 2.5, emitted
    assert all("STRAGGLER: rank 1" in r.output for r in results), describe(results)
    assert "[fault] rank 1: injected slow at iteration 4" in results[1].output


def test_collective_clock_times_outermost_collectives_and_uninstalls(tmp_path, monkeypatch):
    """One gloo rank: each collective's wall time counts once, work outside collectives
    does not, a wrapped call inside a wrapped call is not counted twice, and uninstall
    restores the original functions."""
    import torch
    # Another in-process test may have left its one-rank group; use it (and keep it).
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                                world_size=1)
    assert dist.get_world_size() == 1
    try:
        original = dist.all_reduce
        clock = CollectiveClock().install()
        assert dist.all_reduce is not original and clock.install() is clock
        real = time.perf_counter
        fake = iter([0.0, 0.5, 10.0, 10.25]).__next__  # two outermost calls
        monkeypatch.setattr(time, "perf_counter", fake)
        dist.all_reduce(torch.ones(3))
        out = [None]
        dist.all_gather_object(out, {"x": 1})
        monkeypatch.setattr(time, "perf_counter", real)
        assert out == [{"x": 1}]
        assert clock.take() == (0.75, 2)
        assert clock.take() == (0.0, 0)
        nested = clock.wrap(lambda: dist.all_reduce(torch.ones(1)))  # wraps a wrapped call
        fake = iter([0.0, 2.0]).__next__  # the inner call must not read the clock
        monkeypatch.setattr(time, "perf_counter", fake)
        nested()
        monkeypatch.setattr(time, "perf_counter", real)
        assert clock.take() == (2.0, 1)
        time.sleep(0.5)  # outside any collective: not counted
        dist.barrier()  # a one-rank barrier: far below 0.5 s even on a loaded machine
        seconds, calls = clock.take()
        assert calls == 1 and seconds < 0.5
        clock.uninstall()
        assert dist.all_reduce is original
    finally:
        if own:
            dist.destroy_process_group()


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo default group (another in-process test may have left one: reuse it)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                                world_size=1)
    assert dist.get_world_size() == 1
    yield
    if own:
        dist.destroy_process_group()


class _ScriptedDeviceTimer(DeviceTimer):
    """A device whose collectives return at once (as NCCL's do) and whose stream times are
    scripted: each mark is the next stamp; every tensor counts as on the device."""

    def __init__(self, stamps):
        self._stamps = iter(stamps)
        self.resolved = []

    def device_of(self, args, kwargs):
        tensors = [t for v in (*args, *kwargs.values())
                   for t in (v if isinstance(v, (list, tuple)) else (v,))]
        return "dev" if any(isinstance(t, torch.Tensor) for t in tensors) else None

    def mark(self, device):
        assert device == "dev"
        return next(self._stamps)

    def seconds(self, start, end):
        self.resolved.append((start, end))
        return end - start


def test_collective_clock_counts_an_async_collectives_wait(one_rank_group, monkeypatch):
    """gloo, async_op=True: the rank is held by the collective at its launch and at its
    wait(), which comes later; the old clock counted only the launch. The handle is still
    a Work and forwards the rest (is_completed, get_future) to the real one."""
    clock = CollectiveClock().install()
    try:
        real = time.perf_counter
        fake = iter([0.0, 0.25, 5.0, 7.0]).__next__  # launch 0.25 s, wait 2 s
        monkeypatch.setattr(time, "perf_counter", fake)
        t = torch.ones(3)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        monkeypatch.setattr(time, "perf_counter", real)
        assert isinstance(work, dist.Work) and work.is_completed()
        assert work.get_future().wait()[0].tolist() == [1.0, 1.0, 1.0]
        assert clock.take() == (2.25, 1)
    finally:
        clock.uninstall()


def test_collective_clock_times_device_collectives_on_the_stream(one_rank_group, monkeypatch):
    """On a device whose collectives return once queued (NCCL), the time counted is the
    stream's inside the call (and inside an async handle's wait), resolved only at take()
    (resolving earlier would stall the launch queue); the host's time inside the call
    (the launch) is not counted. Host collectives (no tensor) keep the host clock."""
    timer = _ScriptedDeviceTimer([0.0, 3.0,      # all_reduce: the stream waited 3 s in it
                                  5.0, 5.0,      # async launch: the stream does not wait
                                  20.0, 22.5])   # its wait(): the stream waited 2.5 s
    clock = CollectiveClock(device_timer=timer).install()
    try:
        real = time.perf_counter
        monkeypatch.setattr(time, "perf_counter", iter([100.0, 100.25]).__next__)
        dist.all_reduce(torch.ones(2))
        work = dist.all_reduce(torch.ones(2), async_op=True)
        work.wait()
        out = [None]
        dist.all_gather_object(out, "x")  # no tensor: a host collective (0.25 s)
        monkeypatch.setattr(time, "perf_counter", real)
        assert timer.resolved == []  # nothing waited for the device before the heartbeat
        assert clock.take() == (5.75, 3)
        assert timer.resolved == [(0.0, 3.0), (5.0, 5.0), (20.0, 22.5)]
        assert clock.take() == (0.0, 0)
    finally:
        clock.uninstall()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_straggler_means_the_same_on_both_backends(one_rank_group, monkeypatch, backend):
    """Three ranks' clocks through one iteration pattern: rank 1 computes 0.3 s longer, so
    ranks 0 and 2 wait 0.3 s inside the collective; every iteration takes 0.4 s. On gloo
    the wait is host time inside the call; on NCCL the call returns at once and the wait
    is the stream's (the host waits at .tolist() instead). Both must find rank 1 with the
    same slowdown (4x); the old clock saw no wait on NCCL and no straggler."""
    iters, window, iter_s = 5, 3, 0.5
    waits = {0: 0.375, 1: 0.0, 2: 0.375}  # dyadic: exact sums
    store = dist.HashStore()
    real = time.perf_counter
    for rank, wait in waits.items():
        if backend == "gloo":
            host = [x for i in range(iters) for x in (10.0 * i, 10.0 * i + wait)]
            clock = CollectiveClock()  # CPU tensors: host collectives
        else:
            host = [0.0] * (2 * iters)  # the launch: no time
            clock = CollectiveClock(device_timer=_ScriptedDeviceTimer(
                [x for i in range(iters) for x in (10.0 * i, 10.0 * i + wait)]))
        clock.install()
        hb = Heartbeat(store, rank, window=window)
        try:
            monkeypatch.setattr(time, "perf_counter", iter(host).__next__)
            for i in range(iters):
                dist.all_reduce(torch.ones(1))
                comm_s, calls = clock.take()
                hb.beat(i + 2, iter_s=iter_s, own_s=iter_s - comm_s, comm_s=comm_s,
                        collectives=calls)
        finally:
            monkeypatch.setattr(time, "perf_counter", real)
            clock.uninstall()
    found = find_stragglers(_beats_from(store, 3), factor=2.0)
    assert found == {1: 4.0}, found


def _busy(a, n):
    for _ in range(n):
        a = a @ a / a.shape[0]
    return a


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_event_clock_splits_device_waits_from_compute(one_rank_group):
    """A real one-rank NCCL group (gloo on CUDA tensors without NCCL): compute queued
    before a collective is the rank's own time although the host waits for both at
    .tolist(); an async collective stuck behind a busy stream counts at its wait()."""
    torch.cuda.set_device(0)
    group = dist.new_group([0], backend="nccl" if dist.is_nccl_available() else "gloo")
    a = torch.randn(2048, 2048, device="cuda")
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x, group=group)  # communicator set-up, outside the clock
    _busy(a, 2)  # cuBLAS set-up happens on the host at the first product: keep it out of busy_s
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    _busy(a, 200)
    end.record()
    end.synchronize()
    busy_s = begin.elapsed_time(end) / 1000.0  # what 200 products take on this device
    clock = CollectiveClock().install()
    try:
        _busy(a, 200)                       # compute queued before the collective
        dist.all_reduce(x, group=group)    # returns once queued (NCCL)
        x.tolist()                         # the host waits for both here
        seconds, calls = clock.take()
        assert calls == 1 and seconds < 0.5 * busy_s, (seconds, busy_s)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _busy(a, 200)                   # the collective's input stream is busy ...
            work = dist.all_reduce(x, group=group, async_op=True)
        work.wait()                        # ... so the current stream waits here
        x.tolist()
        seconds, calls = clock.take()
        assert calls == 1 and seconds > 0.5 * busy_s, (seconds, busy_s)
    finally:
        clock.uninstall()
        dist.destroy_process_group(group)
