"""The supervisor, run as a user runs it (``python -m deepspeed_ext.supervisor``), over
the test's child program (child.py): the test watches the job's store while it runs,
tells each process what to do, and reads what every process recorded.

Each job is a few processes that import torch (5 to 12 s on a loaded 2-core machine), so
only what needs real processes runs here: a rank's death handed to a spare while the
survivors run on, two deaths close together (a spare's and a rank's), and a death that
stops the job. The supervisor's other decisions (--max-rounds, a process's bad input, a
dead spare then a rank in turn, deaths seen in one look, a signal to the supervisor, a
port in use) run in process, with stand-in processes: test_job.py.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from typing import Dict, List, Optional

import pytest
import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, RoundAssignment, first_round,
                                          round_key)
from tests.deepspeed_ext.supervisor.child import act_key, joined_key
from tests.launch import REPO, free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
SUPERVISOR = [sys.executable, "-m", "deepspeed_ext.supervisor"]
TIMEOUT_S = 90  # a loaded 2-core machine takes seconds per torch import
STORE_WAIT = timedelta(seconds=TIMEOUT_S)


class Job:
    """One supervisor over child.py: started, watched through its store, ended."""

    def __init__(self, tmp_path, nproc: int, spares: int, *flags: str, act: str = ""):
        self.records_path = tmp_path / "records.jsonl"
        self.port = free_port()
        env = dict(os.environ, MOC_TEST_RECORDS=str(self.records_path), MOC_TEST_ACT=act,
                   PYTHONPATH=REPO)
        self.proc = subprocess.Popen(
            [*SUPERVISOR, "--nproc", str(nproc), "--spares", str(spares), "--port",
             str(self.port), "--grace-s", "3", *flags, "--", CHILD],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=STORE_WAIT)
        self.stderr = ""

    def joined(self, round_number: int, slot: int) -> dict:
        """What slot ``slot`` recorded on reading round ``round_number`` (waits for it)."""
        key = joined_key(round_number, slot)
        self.store.wait([key], STORE_WAIT)
        return json.loads(self.store.get(key))

    def round(self, round_number: int) -> RoundAssignment:
        """Round ``round_number`` as written, less its time stamp (waits for it)."""
        self.store.wait([round_key(round_number)], STORE_WAIT)
        written = RoundAssignment.from_json(self.store.get(round_key(round_number)))
        return dataclasses.replace(written, at=0.0)

    def tell(self, slot: int, act: str) -> None:
        self.store.set(act_key(slot), act)

    def end(self) -> int:
        """Wait for the supervisor and for every process that shares its output (a process
        left running keeps the pipes open: the wait fails); returns its exit status."""
        try:
            _, self.stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
            raise AssertionError(f"the job did not end:\n{self.stderr[-4000:]}") from None
        return self.proc.returncode

    def records(self, event: Optional[str] = None) -> List[dict]:
        lines = self.records_path.read_text().splitlines() if self.records_path.exists() else []
        found = [json.loads(line) for line in lines]
        return [r for r in found if event is None or r["event"] == event]

    def lines(self) -> List[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("[moc supervisor")]


@pytest.fixture
def jobs(tmp_path):
    """Start jobs; any still running at the test's end is killed with its processes'
    pipes (they end when their store is gone)."""
    started = []

    def start(*args, **kwargs) -> Job:
        started.append(Job(tmp_path, *args, **kwargs))
        return started[-1]
    yield start
    for job in started:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.communicate()


def _by_slot(records: List[dict]) -> Dict[int, dict]:
    return {r["slot"]: r for r in records}


def test_a_killed_rank_goes_to_a_spare_the_survivors_keep_running_and_the_other_is_released(
        jobs):
    """The documented launch (docs/failures.md) with a training process SIGKILLed: round 1
    gives its rank to the first spare; the survivor is the same process, still running,
    and follows round 1; the job then ends well and the second spare, never used, leaves
    on its own when ``done`` says ``ok``."""
    job = jobs(2, 2)
    assert job.round(0) == first_round(2, 2)
    assert job.store.get(CURRENT_KEY) == b"0"
    before = {slot: job.joined(0, slot) for slot in range(4)}
    assert [(before[s]["rank"], before[s]["env_rank"]) for s in range(4)] == \
        [(0, "0"), (1, "1"), (None, None), (None, None)]  # a spare has no RANK of its own
    job.tell(1, "kill")
    assert job.round(1) == RoundAssignment(1, (0, 2), (3,), (1,))
    after = {slot: job.joined(1, slot) for slot in (0, 2, 3)}
    assert after[0]["pid"] == before[0]["pid"] and after[0]["rank"] == 0
    assert after[2]["pid"] == before[2]["pid"] and after[2]["rank"] == 1
    assert after[3]["pid"] == before[3]["pid"] and after[3]["rank"] is None
    os.kill(before[0]["pid"], 0)  # still there (raises when it is not)
    assert job.store.get(CURRENT_KEY) == b"1" and not job.store.check([DONE_KEY])
    job.tell(0, "finish")
    job.tell(2, "finish")
    assert job.end() == 0, job.stderr
    pid = before[1]["pid"]
    assert f"[moc supervisor] slot 1 (rank 1, pid {pid}) exited with signal 9: round 1, " \
           "rank 1 -> slot 2 (spare); 1 spare left" in job.lines(), job.stderr
    assert _by_slot(job.records("finish")).keys() == {0, 2}
    released = job.records("released")
    assert [(r["slot"], r["pid"], r["done"]) for r in released] == [(3, before[3]["pid"], "ok")]
    assert job.records("terminated") == []  # it left on its own, within the grace time
    assert any("every training process exited 0" in line for line in job.lines()), job.stderr


def test_a_spare_and_a_rank_dying_together_are_two_rounds(jobs):
    """A spare and a training process die at once (told at start, maybe before the others
    read round 0): each death is a round, in the order seen. Whichever comes first, the
    dead spare is dropped, the other spare takes the rank, the survivor trains on in the
    process it started in and the job ends well."""
    job = jobs(2, 2, act="3=kill,1=kill")
    last = job.round(2)
    assert (last.slots, last.spares) == ((0, 2), ())
    assert set(job.round(1).failed) | set(last.failed) == {1, 3}
    survivor = job.joined(2, 0)
    assert survivor["rank"] == 0 and job.joined(2, 2)["rank"] == 1
    job.tell(0, "finish")
    job.tell(2, "finish")
    assert job.end() == 0, job.stderr
    assert f"started slot 0 pid {survivor['pid']} (rank 0)," in job.lines()[0], job.stderr
    deaths = [line for line in job.lines() if "exited with" in line]
    assert len(deaths) == 2, job.stderr
    assert any("slot 3 (spare, pid " in line and "the spare is dropped;" in line
               for line in deaths), job.stderr
    assert any("slot 1 (rank 1, pid " in line and "rank 1 -> slot 2 (spare)" in line
               for line in deaths), job.stderr


def test_a_death_without_a_spare_stops_every_process_and_the_job_fails(jobs, monkeypatch):
    """And TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (a survivor torn down on its first NCCL
    error) reaches the processes as 2, with one line saying so."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    job = jobs(2, 0)
    survivor = job.joined(0, 0)
    assert survivor["nccl_handling"] == "2"
    job.joined(0, 1)
    job.tell(1, "kill")
    assert job.end() == 1, job.stderr
    stopped = job.records("terminated")
    assert [(r["slot"], r["pid"]) for r in stopped] == [(0, survivor["pid"])]
    assert stopped[0]["done"].startswith("failed: slot 1 (rank 1, pid ")  # done before SIGTERM
    (line,) = [line for line in job.lines() if "ERROR:" in line]
    assert "no spare is left to take rank 1" in line and "must be relaunched" in line
    assert not any("round 1" in line for line in job.lines()), job.stderr
    assert ("[moc supervisor] TORCH_NCCL_ASYNC_ERROR_HANDLING=2 for the processes, not 1 (which "
            "tears a survivor down on its first NCCL error)") in job.lines(), job.stderr


@pytest.mark.parametrize("flags, flag", [
    (["--nproc", "0", "--spares", "1"], "--nproc"),
    (["--nproc", "2", "--spares", "-1"], "--spares"),
    (["--nproc", "2", "--spares", "1", "--max-rounds", "-1"], "--max-rounds"),
    (["--nproc", "2", "--spares", "1", "--grace-s", "-1"], "--grace-s"),
    (["--nproc", "two", "--spares", "1"], "--nproc"),
    (["--nproc", "2"], "--spares"),
])
def test_bad_flags_exit_2_naming_the_flag_and_start_nothing(tmp_path, flags, flag):
    records = tmp_path / "records.jsonl"
    proc = subprocess.run([*SUPERVISOR, *flags, "--", CHILD], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, MOC_TEST_RECORDS=str(records), PYTHONPATH=REPO))
    assert proc.returncode == 2, proc.stderr
    assert re.match(rf"error: .*{flag}", proc.stderr), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not records.exists()


@pytest.mark.parametrize("command, needle", [
    ([], "no PROGRAM"), (["--"], "no PROGRAM"),
    (["--", "no/such/train.py"], "PROGRAM no/such/train.py: file not found"),
    (["--", "no-such-program-here"], "PROGRAM no-such-program-here: no such program"),
])
def test_no_program_or_a_missing_one_exits_2(command, needle):
    proc = subprocess.run([*SUPERVISOR, "--nproc", "1", "--spares", "0", *command], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {needle}"), proc.stderr
