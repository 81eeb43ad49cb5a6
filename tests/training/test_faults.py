"""Fault injection: the flag syntax, its checks, the MTBF schedule, fire-once across
restarts, and that each kind really does what it says (a crash is a SIGKILL)."""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from megatron.errors import ConfigError
from megatron.training import faults
from megatron.training.faults import FaultInjector, FaultSpec, InjectedFault, parse_fault

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, expected", [
    ("crash@12:rank=1", FaultSpec("crash", 1, 12)),
    ("slow@5:rank=0:slow=0.3", FaultSpec("slow", 0, 5, slow_s=0.3)),
    ("slow@5:slow=2:rank=3", FaultSpec("slow", 3, 5, slow_s=2.0)),
    ("slow-compute@4:rank=1:slow=0.1", FaultSpec("slow-compute", 1, 4, slow_s=0.1)),
    ("hang@3", FaultSpec("hang", 0, 3)),
    ("raise@1:rank=7", FaultSpec("raise", 7, 1)),
    ("snapshot-crash@4:rank=2", FaultSpec("snapshot-crash", 2, 4)),
    ("persist-crash@9", FaultSpec("persist-crash", 0, 9)),
    ("lose-memory@6:rank=1", FaultSpec("lose-memory", 1, 6)),
])
def test_parse_fault_accepts_the_documented_syntax(text, expected):
    spec = parse_fault(text)
    assert spec == expected
    assert parse_fault(spec.text) == spec  # the canonical text (the state key) round-trips


@pytest.mark.parametrize("text", [
    "crash", "crash12", "boom@3", "@3", "crash@x", "crash@3:rank=a", "crash@3:node=1",
    "crash@3:rank", "crash@3:rank=1:rank=2", "crash@0", "crash@-2", "crash@3:rank=-1",
    "crash@3:slow=1", "slow@3:slow=0", "slow@3:slow=-1", "slow@3:slow=fast",
])
def test_parse_fault_rejects_bad_text_quoting_it_and_listing_kinds(text):
    with pytest.raises(ValueError) as e:
        parse_fault(text)
    message = str(e.value)
    assert repr(text) in message and "--moc-fault" in message
    assert all(kind in message for kind in faults.KINDS), message


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(kind="boom", rank=0, iteration=1), "unknown kind"),
    (dict(kind="crash", rank=-1, iteration=1), "rank must be >= 0"),
    (dict(kind="crash", rank=0, iteration=0), "iteration must be >= 1"),
    (dict(kind="slow", rank=0, iteration=1, slow_s=0.0), "slow must be > 0"),
    (dict(kind="crash", rank=0, iteration=2.5), "iteration must be an integer"),
])
def test_fault_spec_checks_its_fields(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        FaultSpec(**kwargs)


# ------------------------------------------------------------------- validation

def test_validate_faults_accepts_a_valid_job():
    faults.validate_faults([parse_fault("crash@10:rank=3"), parse_fault("slow@1")], 30.0,
                           world_size=4, train_iters=10)


@pytest.mark.parametrize("spec, mtbf, flag, value", [
    (FaultSpec("crash", 4, 3), None, "--moc-fault", "crash@3:rank=4"),
    (SimpleNamespace(kind="crash", rank=-1, iteration=3, slow_s=0.5, text="crash@3:rank=-1"),
     None, "--moc-fault", "crash@3:rank=-1"),
    (FaultSpec("hang", 1, 11), None, "--moc-fault", "hang@11:rank=1"),
    (SimpleNamespace(kind="slow", rank=0, iteration=2, slow_s=0.0, text="slow@2:rank=0:slow=0"),
     None, "--moc-fault", "slow@2:rank=0:slow=0"),
    (None, 0.0, "--moc-fault-mtbf", "0.0"),
    (None, -5.0, "--moc-fault-mtbf", "-5.0"),
])
def test_validate_faults_names_the_flag_and_value(spec, mtbf, flag, value):
    with pytest.raises(ConfigError) as e:
        faults.validate_faults([spec] if spec else [], mtbf, world_size=4, train_iters=10)
    assert str(e.value).startswith(f"{flag} {value}:"), str(e.value)


def test_fault_flags_parse_and_validate():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int)
    faults.add_fault_args(parser)
    args = parser.parse_args(["--train-iters", "20", "--moc-fault", "crash@3:rank=1",
                              "--moc-fault", "slow@2:slow=0.1", "hang@5", "--moc-fault-mtbf", "60"])
    specs = faults.faults_from_args(args, world_size=2)
    assert [s.text for s in specs] == ["crash@3:rank=1", "slow@2:rank=0:slow=0.1", "hang@5:rank=0"]
    args = parser.parse_args(["--train-iters", "20", "--moc-fault", "crash@3:rank=2"])
    with pytest.raises(ConfigError, match="world size 2"):
        faults.faults_from_args(args, world_size=2)


# ----------------------------------------------------------------- MTBF schedule

def test_mtbf_schedule_is_reproducible_and_seed_dependent():
    a = faults.mtbf_schedule(10.0, seed=7, horizon_s=1000.0, world_size=4)
    assert a == faults.mtbf_schedule(10.0, seed=7, horizon_s=1000.0, world_size=4)
    assert a != faults.mtbf_schedule(10.0, seed=8, horizon_s=1000.0, world_size=4)
    assert len(a) > 50
    times = [t for t, _ in a]
    assert times == sorted(times) and 0 < times[0] and times[-1] <= 1000.0
    assert {r for _, r in a} == {0, 1, 2, 3}
    # A longer horizon extends the schedule without changing what came before.
    longer = faults.mtbf_schedule(10.0, seed=7, horizon_s=2000.0, world_size=4)
    assert longer[:len(a)] == a and len(longer) > len(a)


def test_mtbf_schedule_has_the_requested_mean_and_spreads_over_ranks():
    mtbf, horizon = 10.0, 500_000.0
    events = faults.mtbf_schedule(mtbf, seed=1, horizon_s=horizon, world_size=4)
    gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
    # ~50000 exponential gaps: the standard error of their mean is 10/sqrt(50000) = 0.045,
    # so 2% (4.5 sigma) fails a wrong distribution (e.g. a rate/mean mix-up) but not noise.
    assert abs(statistics.mean(gaps) - mtbf) < 0.02 * mtbf
    assert abs(statistics.stdev(gaps) - mtbf) < 0.05 * mtbf  # exponential: stdev == mean
    counts = [sum(1 for _, r in events if r == rank) for rank in range(4)]
    assert all(abs(c - len(events) / 4) < 0.05 * len(events) / 4 for c in counts), counts


# ------------------------------------------------------- in-process fault firing

class _Log(list):
    def __call__(self, line):
        self.append(line)


def _fired(path):
    with open(path) as f:
        return json.load(f)["fired"]


def test_raise_fires_once_per_job_across_a_restart(tmp_path):
    state = str(tmp_path / "faults.json")
    specs = [parse_fault("raise@3:rank=1"), parse_fault("raise@2:rank=0")]
    log = _Log()
    first = FaultInjector(specs, rank=1, world_size=2, state_path=state, log=log)
    first.before_iteration(1)
    first.before_iteration(2)  # rank 0's fault: not this rank's
    with pytest.raises(InjectedFault, match="rank 1 at iteration 3"):
        first.before_iteration(3)
    assert log == ["[fault] rank 1: injected raise at iteration 3 (--moc-fault raise@3:rank=1)"]
    assert _fired(state)["raise@3:rank=1"]["iteration"] == 3
    # The restarted job resumes from a checkpoint before iteration 3: no second firing.
    second = FaultInjector(specs, rank=1, world_size=2, state_path=state, log=log)
    for it in range(1, 8):
        second.before_iteration(it)
    assert len(log) == 1


def test_a_fault_whose_iteration_was_skipped_fires_at_the_first_later_one(tmp_path):
    injector = FaultInjector([parse_fault("raise@3")], 0, 1, str(tmp_path / "f.json"), log=_Log())
    with pytest.raises(InjectedFault):
        injector.before_iteration(7)  # e.g. resumed from a checkpoint at iteration 6


def test_slow_sleeps_every_iteration_from_its_iteration_on(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    state = str(tmp_path / "faults.json")
    spec = parse_fault("slow@3:rank=0:slow=0.25")
    injector = FaultInjector([spec], 0, 2, state, log=_Log())
    for it in (1, 2):
        injector.before_iteration(it)
    assert slept == []
    for it in (3, 4, 5):
        injector.before_iteration(it)
    assert slept == [0.25, 0.25, 0.25]
    assert "slow@3:rank=0:slow=0.25" in _fired(state)
    # A restart does not slow down again: the straggling node counts as replaced.
    restarted = FaultInjector([spec], 0, 2, state, log=_Log())
    restarted.before_iteration(6)
    assert slept == [0.25, 0.25, 0.25]


def test_hang_records_first_then_sleeps_forever(tmp_path, monkeypatch):
    state = str(tmp_path / "faults.json")

    class Woken(Exception):
        pass

    def sleep(seconds):
        assert "hang@2:rank=0" in _fired(state)  # recorded before the rank stops answering
        assert seconds >= 60
        raise Woken

    monkeypatch.setattr(faults.time, "sleep", sleep)
    injector = FaultInjector([parse_fault("hang@2")], 0, 1, state, log=_Log())
    injector.before_iteration(1)
    with pytest.raises(Woken):
        injector.before_iteration(2)


def test_lose_memory_needs_a_callback(tmp_path):
    with pytest.raises(ConfigError, match="lose-memory"):
        FaultInjector([parse_fault("lose-memory@2:rank=1")], 1, 2, str(tmp_path / "f.json"))
    # another rank's lose-memory fault does not concern this rank
    FaultInjector([parse_fault("lose-memory@2:rank=1")], 0, 2, str(tmp_path / "f.json"))


class _Killed(Exception):
    pass


def _no_sigkill(monkeypatch):
    def kill():
        raise _Killed
    monkeypatch.setattr(faults, "sigkill_self", kill)


def test_mtbf_crashes_fire_on_schedule_once_and_skip_downtime(tmp_path, monkeypatch):
    _no_sigkill(monkeypatch)
    state = str(tmp_path / "faults.json")
    mtbf, seed, start = 5.0, 3, 1000.0
    schedule = faults.mtbf_schedule(mtbf, seed, 200.0, 2)
    mine = [t for t, r in schedule if r == 1]
    first = next(i for i, (_, r) in enumerate(schedule) if r == 1)
    assert len(mine) >= 3
    now = [start]
    log = _Log()
    injector = FaultInjector([], 1, 2, state, mtbf_s=mtbf, seed=seed, job_start_time=start,
                             log=log, clock=lambda: now[0])
    now[0] = start + mine[0] - 0.01
    injector.before_iteration(1)
    assert log == []
    now[0] = start + mine[0] + 0.01
    with pytest.raises(_Killed):
        injector.before_iteration(2)
    assert len(log) == 1 and "--moc-fault-mtbf 5 --moc-fault-seed 3" in log[0]
    assert log[0].startswith("[fault] rank 1: injected crash at iteration 2")
    assert list(_fired(state)) == [f"mtbf=5:seed=3:#{first}"]
    # The restart comes up after the second crash was due: it is skipped, not fired at once.
    now[0] = start + mine[1] + 0.01
    log.clear()
    restarted = FaultInjector([], 1, 2, state, mtbf_s=mtbf, seed=seed, job_start_time=start,
                              log=log, clock=lambda: now[0])
    assert len(log) == 1 and "skipping MTBF crash" in log[0]
    restarted.training_starts()  # nothing more fell due during the load
    assert len(log) == 1
    restarted.before_iteration(3)
    now[0] = start + mine[2] + 0.01
    with pytest.raises(_Killed):
        restarted.before_iteration(4)


def test_mtbf_job_start_survives_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.JOB_START_ENV, raising=False)
    state = str(tmp_path / "faults.json")
    a = FaultInjector([], 0, 2, state, mtbf_s=100.0, clock=lambda: 5000.0)
    b = FaultInjector([], 1, 2, state, mtbf_s=100.0, clock=lambda: 5100.0)  # a later restart
    assert a.job_start == b.job_start == 5000.0
    monkeypatch.setenv(faults.JOB_START_ENV, "4000.5")
    assert FaultInjector([], 0, 2, state, mtbf_s=100.0, clock=lambda: 4001.0).job_start == 4000.5


def test_in_snapshot_fires_snapshot_crash_only(tmp_path, monkeypatch):
    _no_sigkill(monkeypatch)
    state = str(tmp_path / "faults.json")
    injector = FaultInjector([parse_fault("snapshot-crash@4")], 0, 1, state, log=_Log())
    for it in range(1, 9):
        injector.before_iteration(it)  # the loop hook never fires a snapshot fault
    injector.in_snapshot(2)
    with pytest.raises(_Killed):
        injector.in_snapshot(5)  # the first snapshot at or after iteration 4
    assert _fired(state)["snapshot-crash@4:rank=0"]["iteration"] == 5


# ------------------------------------------------------------ real SIGKILLs

def _python(code, state, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), state], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


CRASH = """
    import sys
    from megatron.training.faults import FaultInjector, parse_fault
    injector = FaultInjector([parse_fault("crash@2:rank=1")], rank=1, world_size=2,
                             state_path=sys.argv[1])
    injector.before_iteration(1)
    print("survived 1", flush=True)
    injector.before_iteration(2)
    print("survived 2", flush=True)
"""


def test_crash_kills_the_process_with_sigkill_once(tmp_path):
    state = str(tmp_path / "faults.json")
    run = _python(CRASH, state)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert "survived 1" in run.stdout and "survived 2" not in run.stdout
    assert ("[fault] rank 1: injected crash at iteration 2 (--moc-fault crash@2:rank=1)"
            in run.stdout)
    assert _fired(state)["crash@2:rank=1"]["rank"] == 1
    rerun = _python(CRASH, state)  # the automatic restart
    assert rerun.returncode == 0, rerun.stderr
    assert "survived 2" in rerun.stdout


def test_lose_memory_calls_the_callback_then_sigkills(tmp_path):
    state, marker = str(tmp_path / "faults.json"), str(tmp_path / "lost")
    run = _python(f"""
        import sys
        from megatron.training.faults import FaultInjector, parse_fault
        def lose():
            open({marker!r}, "w").close()
        injector = FaultInjector([parse_fault("lose-memory@1")], 0, 1, sys.argv[1], lose_memory=lose)
        injector.before_iteration(1)
        print("survived", flush=True)
    """, state)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert os.path.exists(marker) and "survived" not in run.stdout
    assert "lose-memory@1:rank=0" in _fired(state)


def test_persist_crash_arms_the_keeper_which_records_and_dies(tmp_path):
    state = str(tmp_path / "faults.json")
    spec = parse_fault("persist-crash@5:rank=1")
    assert FaultInjector([spec], 0, 2, state).persist_env() == {}
    env = FaultInjector([spec], 1, 2, state).persist_env()
    assert env[faults.PERSIST_CRASH_ENV] == "5"
    keeper = _python("""
        from deepspeed_ext.keeper.faults import crash_in_persist_if_due
        crash_in_persist_if_due(4)
        print("persisted 4", flush=True)
        crash_in_persist_if_due(6)
        print("persisted 6", flush=True)
    """, state, env=env)
    assert keeper.returncode == -signal.SIGKILL, keeper.stderr
    assert "persisted 4" in keeper.stdout and "persisted 6" not in keeper.stdout
    assert _fired(state)["persist-crash@5:rank=1"]["iteration"] == 6
    # The restarted rank does not arm its keeper again.
    assert FaultInjector([spec], 1, 2, state).persist_env() == {}


def test_slow_compute_calls_the_model_hook_once_when_due(tmp_path):
    calls = []
    spec = parse_fault("slow-compute@3:rank=0:slow=0.25")
    with pytest.raises(ConfigError, match="slow-compute needs"):
        FaultInjector([spec], 0, 1, str(tmp_path / "f.json"), log=_Log())
    injector = FaultInjector([spec], 0, 1, str(tmp_path / "f.json"), log=_Log(),
                             slow_compute=calls.append)
    injector.before_iteration(2)
    assert calls == []
    injector.before_iteration(3)
    injector.before_iteration(4)
    assert calls == [0.25]  # the hook slows every later forward; it is installed once


def test_mtbf_crash_due_during_the_load_is_skipped_not_fired(tmp_path, monkeypatch):
    """The injector exists before the checkpoint load; a crash falling due while the
    job loads must be skipped when the loop starts, not fired at its first iteration."""
    _no_sigkill(monkeypatch)
    mtbf, seed, start = 5.0, 3, 1000.0
    mine = [t for t, r in faults.mtbf_schedule(mtbf, seed, 200.0, 2) if r == 1]
    now = [start + mine[0] - 0.5]
    log = _Log()
    injector = FaultInjector([], 1, 2, str(tmp_path / "f.json"), mtbf_s=mtbf, seed=seed,
                             job_start_time=start, log=log, clock=lambda: now[0])
    assert log == []
    now[0] = start + mine[0] + 0.1  # the load took a second
    injector.training_starts()
    assert len(log) == 1 and "skipping MTBF crash" in log[0] and "loading" in log[0]
    injector.before_iteration(1)  # not killed
    now[0] = start + mine[1] + 0.01
    with pytest.raises(_Killed):
        injector.before_iteration(2)
