"""The supervisor's pieces that start nothing: its command line, each process's
environment and the order of its store writes (the contract the trainer reads)."""

import dataclasses
import signal
import sys
import time

import pytest

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, SLOT_ENV, STORE_ENV,
                                          RoundAssignment, first_round, next_round, round_key)
from deepspeed_ext.supervisor.children import NCCL_ERROR_HANDLING, child_env, describe_exit
from deepspeed_ext.supervisor.options import SupervisorOptions, parse_options, program_argv
from deepspeed_ext.supervisor.store import write_done, write_round

TRAIN = __file__  # a .py file that exists


def test_the_defaults_and_the_command_after_the_double_dash():
    options = parse_options(["--nproc", "4", "--spares", "1", "--", TRAIN, "--nproc", "9"],
                            environ={})
    assert options == SupervisorOptions(nproc=4, spares=1, command=(TRAIN, "--nproc", "9"),
                                        max_rounds=3, port=0, grace_s=10.0, host="127.0.0.1")
    assert options.launched == 5


def test_the_port_is_the_flag_then_master_port_then_a_free_one():
    argv = ["--nproc", "1", "--spares", "0", "--", TRAIN]
    assert parse_options(argv, environ={"MASTER_PORT": "29501"}).port == 29501
    assert parse_options(argv + [], environ={"MASTER_PORT": ""}).port == 0
    assert parse_options(["--port", "1234"] + argv, environ={"MASTER_PORT": "29501"}).port == 1234


@pytest.mark.parametrize("argv, environ, needle", [
    (["--nproc", "0", "--spares", "0"], {}, "error: --nproc 0: at least 1"),
    (["--nproc", "1", "--spares", "-2"], {}, "error: --spares -2: not negative"),
    (["--nproc", "1", "--spares", "0", "--max-rounds", "-1"], {}, "error: --max-rounds -1"),
    (["--nproc", "1", "--spares", "0", "--grace-s", "nan"], {}, "error: --grace-s nan"),
    (["--nproc", "1", "--spares", "0", "--port", "70000"], {}, "error: --port 70000: not a port"),
    (["--nproc", "1", "--spares", "0"], {"MASTER_PORT": "x1"}, "error: --port not given and "
     "MASTER_PORT='x1' is not a port"),
    (["--spares", "0"], {}, "error: the following arguments are required: --nproc"),
    (["--nproc", "1", "--spares", "0", "--max-round", "1"], {}, "error: unrecognized arguments"),
])
def test_bad_input_names_the_flag_and_exits_2(capsys, argv, environ, needle):
    with pytest.raises(SystemExit) as stop:
        parse_options(argv + ["--", TRAIN], environ=environ)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and len(err.splitlines()) == 1, err


def test_a_python_program_runs_with_this_python_and_another_as_given():
    assert program_argv(["train.py", "--x"]) == [sys.executable, "train.py", "--x"]
    assert program_argv(["bash", "run.sh"]) == ["bash", "run.sh"]


def test_a_training_slot_gets_torchrun_s_variables_and_a_spare_no_rank():
    base = {"PATH": "/bin", "RANK": "7", "LOCAL_RANK": "7", "MASTER_PORT": "1"}
    one_node = SupervisorOptions(2, 1, ("train.py",))
    trainer = child_env(base, 1, one_node, 4242)
    assert trainer == {"PATH": "/bin", STORE_ENV: "127.0.0.1:4242", SLOT_ENV: "1",
                       "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "4242", NCCL_ERROR_HANDLING: "2"}
    spare = child_env(base, 2, one_node, 4242)
    assert "RANK" not in spare and "LOCAL_RANK" not in spare  # not the supervisor's own
    assert (spare[SLOT_ENV], spare["WORLD_SIZE"], spare[STORE_ENV]) == ("2", "2", "127.0.0.1:4242")
    assert base["RANK"] == "7"  # the supervisor's environment is not changed


@pytest.mark.parametrize("given, gets", [(None, "2"), ("1", "2"), ("3", "2"), ("0", "0"),
                                         ("2", "2")])
def test_nccl_errors_leave_a_survivor_alive(given, gets):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING: its default (3) and 1 end the process on its first
    NCCL error, a survivor's too; the processes get 2 (abort the communicators, raise)
    unless it is 0 or 2."""
    base = {} if given is None else {NCCL_ERROR_HANDLING: given}
    env = child_env(base, 0, SupervisorOptions(2, 1, ("train.py",)), 4242)
    assert env[NCCL_ERROR_HANDLING] == gets


def test_a_second_node_s_slots_train_as_the_ranks_after_the_first_node_s():
    node_1 = SupervisorOptions(2, 1, ("train.py",), host="10.0.0.1", nnodes=2, node_rank=1)
    assert list(node_1.own_slots) == [3, 4, 5] and node_1.world_size == 4
    second = child_env({}, 4, node_1, 4242)
    assert (second["RANK"], second["LOCAL_RANK"], second["WORLD_SIZE"],
            second["LOCAL_WORLD_SIZE"], second[STORE_ENV], second["MASTER_ADDR"]) == \
        ("3", "1", "4", "2", "10.0.0.1:4242", "10.0.0.1")
    assert "RANK" not in child_env({}, 5, node_1, 4242)  # its spare


def test_an_exit_reads_as_a_status_or_a_signal():
    assert describe_exit(3) == "status 3"
    assert describe_exit(-signal.SIGKILL) == "signal 9"


class RecordingStore:
    """A store that keeps its writes in order."""

    def __init__(self):
        self.writes = []

    def set(self, key, value):
        self.writes.append((key, value))


def test_a_round_s_record_is_written_before_current_names_it():
    store = RecordingStore()
    one = next_round(first_round(2, 1), {0})
    write_round(store, first_round(2, 1))
    write_round(store, one)
    write_done(store, "ok")
    assert [key for key, _ in store.writes] == [round_key(0), CURRENT_KEY, round_key(1),
                                               CURRENT_KEY, DONE_KEY]
    rounds = {round_key(0), round_key(1)}
    written = [RoundAssignment.from_json(v) for k, v in store.writes if k in rounds]
    # each stamped with the time it was written, and otherwise the round given
    assert [dataclasses.replace(r, at=0.0) for r in written] == [first_round(2, 1), one]
    assert all(0 < time.time() - r.at < 60 for r in written)
    assert [v for k, v in store.writes if k not in rounds] == ["0", "1", "ok"]
