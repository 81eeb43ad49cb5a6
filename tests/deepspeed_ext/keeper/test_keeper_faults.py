"""The keeper's persist-crash fault point works from the library alone: armed through
the environment, it records the firing in the job's fault state file, then SIGKILLs."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from deepspeed_ext.keeper import faults as keeper_faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

KEEPER = """
    import sys
    sys.modules["megatron"] = None  # the keeper must not need the trainer's package
    from deepspeed_ext import keeper  # noqa: F401  (what the keeper process imports)
    from deepspeed_ext.keeper.faults import crash_in_persist_if_due
    crash_in_persist_if_due(4)
    print("persisted 4", flush=True)
    crash_in_persist_if_due(6)
    print("persisted 6", flush=True)
"""


def _keeper(env):
    inherited = {k: v for k, v in os.environ.items()
                 if k not in (keeper_faults.PERSIST_CRASH_ENV, keeper_faults.FAULT_STATE_ENV,
                              keeper_faults.FAULT_KEY_ENV)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(KEEPER)], cwd=REPO,
                          env=dict(inherited, PYTHONPATH=REPO, **env),
                          capture_output=True, text=True, timeout=120)


def test_an_armed_keeper_records_the_crash_then_dies_without_the_trainer(tmp_path):
    state = str(tmp_path / "faults.json")
    run = _keeper({keeper_faults.PERSIST_CRASH_ENV: "5", keeper_faults.FAULT_STATE_ENV: state,
                   keeper_faults.FAULT_KEY_ENV: "persist-crash@5:rank=1"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert "persisted 4" in run.stdout and "persisted 6" not in run.stdout
    # logged, and flushed out of the logger before the SIGKILL
    assert ("injected persist-crash while persisting iteration 6 "
            "(--moc-fault persist-crash@5:rank=1)") in run.stdout, run.stdout
    with open(state) as f:
        fired = json.load(f)["fired"]
    assert fired["persist-crash@5:rank=1"]["iteration"] == 6
    assert keeper_faults.read_state(state)["fired"] == fired


@pytest.mark.parametrize("env", [{}, {keeper_faults.PERSIST_CRASH_ENV: ""}])
def test_an_unarmed_keeper_persists_on(tmp_path, env):
    run = _keeper(env)
    assert run.returncode == 0, run.stderr
    assert "persisted 6" in run.stdout


def test_record_fired_keeps_the_other_records(tmp_path):
    state = str(tmp_path / "faults.json")
    keeper_faults.record_fired(state, "a", {"kind": "crash"})
    keeper_faults.record_fired(state, "b", {"kind": "raise"})
    assert keeper_faults.read_state(state)["fired"] == {"a": {"kind": "crash"},
                                                        "b": {"kind": "raise"}}
