"""scripts/launch_cluster.sh's restart loop, host exclusion, master address and remote
environment, with DeepSpeed's own runner standing in for the ``deepspeed`` command: it
resolves the arguments, the hostfile and the exports as the real command does and records
the launch instead of starting it (tests/fake_deepspeed.py; this machine has no cluster).
And scripts/quickstart.sh's device line, in a sandbox with stand-ins for torch and the
launcher."""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO as _REPO

REPO = Path(_REPO)

HOSTS = ("node-a", "node-b", "node-c")
# What the caller's shell may set that these tests set themselves.
CLEARED = ("MASTER_ADDR", "MASTER_PORT", "DS_ENV_FILE", "EXCLUDE_SUSPECTS", "MOC_EVENT_FILE",
           "NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "DS_ACCELERATOR")


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in CLEARED and not k.startswith(("MOC_", "TORCH_NCCL_"))}
    env.update(extra)
    return env


def _run(tmp_path, exit_codes, max_restarts, extra_env=None, hosts=HOSTS, nodes=2, gpus=8,
         flags=("--save", "ckpt")):
    """launch_cluster.sh HOSTFILE corpus configs/tiny.yaml NODES GPUS 8 --save ckpt; returns
    the process, each launch's arguments, and what DeepSpeed's runner made of each."""
    tmp_path.mkdir(exist_ok=True)
    bin_dir, state, home = tmp_path / "bin", tmp_path / "state", tmp_path / "home"
    for d in (bin_dir, state, home):
        d.mkdir(exist_ok=True)
    fake = _executable(bin_dir / "deepspeed", f'#!/bin/sh\nexec "{sys.executable}" '
                       f'"{REPO}/tests/fake_deepspeed.py" "$@"\n')
    data = tmp_path / "corpus"
    for suffix in (".idx", ".bin"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"x")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the cluster\n" + "".join(f"{h} slots=8\n" for h in hosts))
    env = _clean_env(DEEPSPEED=str(fake), STATE=str(state), HOME=str(home),
                     EXIT_CODES=" ".join(map(str, exit_codes)), MAX_RESTARTS=str(max_restarts),
                     RESTART_DELAY="0", **(extra_env or {}))
    proc = subprocess.run(["bash", "scripts/launch_cluster.sh", str(hostfile), str(data),
                           "configs/tiny.yaml", str(nodes), str(gpus), "8", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    launches = (state / "launches").read_text().splitlines() if (state / "launches").exists() else []
    records = [json.loads(line) for line in (state / "launches.jsonl").read_text().splitlines()] \
        if (state / "launches.jsonl").exists() else []
    assert hostfile.read_text() == "# the cluster\n" + "".join(f"{h} slots=8\n" for h in hosts)
    return proc, launches, records


def _ranks(*hosts, gpus=8):
    return {h: list(range(gpus)) for h in hosts}


def test_failed_job_is_relaunched_until_it_succeeds(tmp_path):
    proc, launches, records = _run(tmp_path, [1, 1, 0], max_restarts=3)
    assert proc.returncode == 0, proc.stderr
    # the attempt travels as a flag, the last one (wins over a user's copy of it)
    assert [line.split()[-2:] for line in launches] == [
        ["--moc-restart-count", str(n)] for n in range(3)]
    assert all("pretrain_gpt_moe.py" in line and "--save ckpt" in line for line in launches)
    assert "restart 2 of 3" in proc.stderr
    # NODES x GPUS_PER_NODE out of the hostfile, as DeepSpeed's runner resolves it
    assert [r["resources"] for r in records] == [_ranks("node-a", "node-b")] * 3


def test_restarts_are_bounded_and_bad_input_is_not_retried(tmp_path):
    proc, launches, _ = _run(tmp_path, [1, 1, 1, 1], max_restarts=1)
    assert proc.returncode == 1 and len(launches) == 2
    proc, launches, _ = _run(tmp_path / "second", [2, 0], max_restarts=3)
    assert proc.returncode == 2 and len(launches) == 1  # exit 2: the flags are wrong


def test_hosts_named_by_hang_events_are_excluded(tmp_path):
    """An event of an earlier launch is ignored; the host the first attempt's watchdog
    named is left out of the second attempt, which runs on the next spare with the same
    layout (2 nodes x 4 of their 8 slots), as DeepSpeed's real runner resolves the
    arguments: it refuses --exclude next to --num_nodes/--num_gpus."""
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"kind": "hang", "host": "old-host",
                                  "time": time.time() - 3600}) + "\n")
    env = {"EXCLUDE_SUSPECTS": "1", "MOC_EVENT_FILE": str(events),
           "FIRST_ATTEMPT_EVENTS": "node-b"}
    proc, launches, records = _run(tmp_path, [1, 0], max_restarts=2, extra_env=env,
                                   hosts=("node-a", "node-b", "node-c", "node-d"), gpus=4)
    assert proc.returncode == 0, proc.stderr + "".join(map(str, records))
    assert [r.get("error") for r in records] == [None, None]
    assert records[0]["resources"] == _ranks("node-a", "node-b", gpus=4)
    assert records[1]["resources"] == _ranks("node-a", "node-c", gpus=4)
    assert len(launches) == 2 and "old-host" not in proc.stderr
    assert "without node-b" in proc.stderr


def test_exclusion_matches_short_names_and_stops_when_no_host_is_left(tmp_path):
    """An event names a host by its hostname: node-c stands for node-c.example.org; a
    name the hostfile lacks is reported, not fatal. With every host left out, no attempt."""
    events = tmp_path / "events.jsonl"
    env = {"EXCLUDE_SUSPECTS": "1", "MOC_EVENT_FILE": str(events),
           "FIRST_ATTEMPT_EVENTS": "node-c node-x"}
    proc, _, records = _run(tmp_path, [1, 0], max_restarts=1, extra_env=env,
                            hosts=("node-a", "node-c.example.org", "node-d"))
    assert proc.returncode == 0, proc.stderr + "".join(map(str, records))
    assert records[0]["resources"] == _ranks("node-a", "node-c.example.org")
    assert records[1]["resources"] == _ranks("node-a", "node-d")
    assert "node-x, named by an event, is not in" in proc.stderr

    events = tmp_path / "second" / "events.jsonl"
    events.parent.mkdir()
    env.update(MOC_EVENT_FILE=str(events), FIRST_ATTEMPT_EVENTS="node-a node-b")
    proc, launches, _ = _run(tmp_path / "second", [1, 0], max_restarts=3, extra_env=env,
                             hosts=("node-a", "node-b"))
    assert proc.returncode == 1 and len(launches) == 1
    assert "no host of" in proc.stderr and "is left without node-a, node-b" in proc.stderr


def test_master_address_and_port_reach_the_launcher(tmp_path):
    """Without MASTER_ADDR, DeepSpeed takes the first address of `hostname -I` on the first
    host (the stand-in answers docker0's first, as many GPU nodes do)."""
    _, _, records = _run(tmp_path / "default", [0], max_restarts=0)
    assert records[0]["master_addr"] == "172.17.0.1" and records[0]["master_port"] == 29500
    events = tmp_path / "events.jsonl"
    env = {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29999", "EXCLUDE_SUSPECTS": "1",
           "MOC_EVENT_FILE": str(events), "FIRST_ATTEMPT_EVENTS": "node-a"}
    proc, _, records = _run(tmp_path, [1, 0], max_restarts=1, extra_env=env)
    assert proc.returncode == 0, proc.stderr + "".join(map(str, records))
    assert (records[0]["master_addr"], records[0]["master_port"]) == ("10.9.9.9", 29999)
    # node-a, whose address MASTER_ADDR was, is left out: rank 0 is on node-b now
    assert records[1]["resources"] == _ranks("node-b", "node-c")
    assert records[1]["probed_host"] == "node-b" and records[1]["master_port"] == 29999
    assert "MASTER_ADDR=10.9.9.9 is node-a's" in proc.stderr
    proc, launches, _ = _run(tmp_path / "bad", [0], max_restarts=0,
                             extra_env={"MASTER_PORT": "29k"})
    assert proc.returncode == 2 and not launches and "MASTER_PORT must be an integer" in proc.stderr


IN_JOB = ("--moc-checkpoint", "--save", "ckpt", "--load", "ckpt", "--moc-restart", "in-job",
          "--moc-spares", "1")
# The stand-ins run at once, one per host: each call is one append of one line, a single
# write (two print() calls' lines interleaved, and the file could not be read back).
RECORD = ("import json, os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT);"
          " os.write(fd, (json.dumps(sys.argv[2:]) + chr(10)).encode())")
FAKE_SSH = """#!/bin/sh
RECORD='{record}'
"{python}" -c "$RECORD" "{state}/ssh.jsonl" "$@"
case "$2" in *":29500 "*) exit 1 ;; esac
"""


def test_an_in_job_launch_runs_one_supervisor_per_host_and_relaunches_on_the_next_port(
        tmp_path):
    """--moc-restart in-job: each of the first NODES hosts runs run_elastic.sh over ssh (a
    stand-in records each call; every call of the first attempt fails, as every node's
    supervisor does when the job cannot go on in place) with its node rank, node 0's
    address and the attempt's port, the MOC_* variables and the trainer's flags; the
    relaunch uses the next port. DeepSpeed's launcher is not used."""
    import shlex
    state = tmp_path / "state"
    ssh = _executable(tmp_path / "ssh",
                      FAKE_SSH.format(python=sys.executable, state=state, record=RECORD))
    proc, launches, _ = _run(tmp_path, [], max_restarts=1, gpus=3, flags=IN_JOB,
                             extra_env={"SSH": str(ssh), "MOC_TEST_VALUE": "a b"})
    assert proc.returncode == 0, proc.stderr
    assert launches == []  # no deepspeed launcher
    calls = [json.loads(line) for line in (state / "ssh.jsonl").read_text().splitlines()]
    assert sorted(host for host, _ in calls) == ["node-a", "node-a", "node-b", "node-b"]
    for host, remote in calls:
        words = shlex.split(remote)
        assert words[:4] == ["cd", str(REPO), "&&", "env"], remote
        attempt = int(words[-1])
        node = {"node-a": "0", "node-b": "1"}[host]
        assert "MOC_TEST_VALUE=a b" in words and "NNODES=2" in words
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in words  # in-job: survivors live on
        assert f"NODE_RANK={node}" in words
        assert f"RDZV_ENDPOINT=node-a:{29500 + attempt}" in words
        start = words.index("bash")
        assert words[start:start + 6] == ["bash", "scripts/run_elastic.sh", "3", "0",
                                          "--config", "configs/tiny.yaml"]
        assert words[-len(IN_JOB) - 2:] == [*IN_JOB, "--moc-restart-count", str(attempt)]
    assert sorted(int(shlex.split(r)[-1]) for _, r in calls) == [0, 0, 1, 1]
    assert "restart 1 of 1" in proc.stderr
    proc, _, _ = _run(tmp_path / "bad", [], max_restarts=0, gpus=3,
                      flags=(*IN_JOB[:-1], "3"), extra_env={"SSH": str(ssh)})
    assert proc.returncode == 2
    assert "--moc-spares 3 leaves no training process of GPUS_PER_NODE 3" in proc.stderr


COORDINATED_SSH = """#!/bin/sh
RECORD='{record}'
"{python}" -c "$RECORD" "{state}/ssh.jsonl" "$@"
case "$1 $2" in
    "head-1 "*":29500 "*) exec sleep 30 ;;
    "head-2 "*) exit 255 ;;
    "node-c "*":29502 "*) exit 255 ;;
    *":29500 "*|*":29501 "*) exit 1 ;;
esac
"""


def test_an_in_job_launch_starts_spare_nodes_and_a_coordinator_and_moves_a_lost_one(
        tmp_path):
    """SPARE_NODES=1 adds the host after the first NODES as a spare node (NNODES counts
    it); COORDINATOR_HOST runs the coordinator over ssh (COORDINATOR=serve) and every
    node joins its store (COORDINATOR=join, RDZV_ENDPOINT the coordinator's). Attempt 0's
    coordinator still runs after every node ended (killed after COORDINATOR_GRACE),
    attempt 1's ssh exits 255: each moves the next attempt to the next host of the list,
    and attempt 2 runs on head-1 again. There node-c's ssh exits 255 (a node lost, its
    ranks taken by the spare node) and the coordinator's 0 (the job finished): the launch
    ends 0, with no fourth attempt."""
    import shlex
    state = tmp_path / "state"
    ssh = _executable(tmp_path / "ssh", COORDINATED_SSH.format(python=sys.executable,
                                                               state=state, record=RECORD))
    env = {"SSH": str(ssh), "SPARE_NODES": "1", "COORDINATOR_HOST": "head-1,head-2",
           "COORDINATOR_GRACE": "1", "NODE_TIMEOUT": "7"}
    proc, launches, _ = _run(tmp_path, [], max_restarts=2, gpus=3, flags=IN_JOB,
                             hosts=("node-a", "node-b", "node-c", "node-d"), extra_env=env)
    assert proc.returncode == 0, proc.stderr
    assert launches == []
    by_attempt = {}
    for host, remote in (json.loads(line) for line in
                         (state / "ssh.jsonl").read_text().splitlines()):
        words = shlex.split(remote)
        by_attempt.setdefault(int(words[-1]), {})[host] = words
    assert sorted(by_attempt) == [0, 1, 2]
    for attempt, coordinator in ((0, "head-1"), (1, "head-2"), (2, "head-1")):
        calls = by_attempt[attempt]
        assert sorted(calls) == sorted([coordinator, "node-a", "node-b", "node-c"]), calls
        for host, words in calls.items():
            assert "NNODES=3" in words and "SPARE_NODES=1" in words and "NODE_TIMEOUT=7" in words
            assert f"RDZV_ENDPOINT={coordinator}:{29500 + attempt}" in words
            assert words[words.index("bash"):][:4] == ["bash", "scripts/run_elastic.sh", "3", "0"]
        assert "COORDINATOR=serve" in calls[coordinator]
        assert not any(w.startswith("NODE_RANK=") for w in calls[coordinator])
        for node, host in enumerate(("node-a", "node-b", "node-c")):
            assert "COORDINATOR=join" in calls[host] and f"NODE_RANK={node}" in calls[host]
    assert "the coordinator on head-1 was lost (ssh still waiting 1 s" in proc.stderr
    assert "the coordinator on head-2 was lost (ssh exit 255)" in proc.stderr
    assert proc.stderr.count("the next attempt's coordinator runs on") == 2
    assert ("the job finished (head-1's supervisor ended 0); lost and replaced on the way: "
            "node-c (exit 255)") in proc.stderr


UNREACHABLE_SSH = """#!/bin/sh
RECORD='{record}'
"{python}" -c "$RECORD" "{state}/ssh.jsonl" "$@"
case "$1 $2" in
    "node-b "*":29500 "*) exit 255 ;;
    *":29500 "*) exit 1 ;;
esac
"""


def test_a_host_whose_ssh_failed_is_left_out_of_the_next_attempt(tmp_path):
    """Attempt 0: node-b's ssh exits 255 (the host down), node-a's supervisor 1 (the job
    could not go on). Attempt 1 runs on node-a and node-c, node-b left out: a node that
    never starts would hold the next round 0 until its group timed out."""
    import shlex
    state = tmp_path / "state"
    ssh = _executable(tmp_path / "ssh", UNREACHABLE_SSH.format(python=sys.executable,
                                                               state=state, record=RECORD))
    proc, _, _ = _run(tmp_path, [], max_restarts=1, gpus=3, flags=IN_JOB,
                      hosts=("node-a", "node-b", "node-c"), extra_env={"SSH": str(ssh)})
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in (state / "ssh.jsonl").read_text().splitlines()]
    by_attempt = {}
    for host, remote in calls:
        by_attempt.setdefault(int(shlex.split(remote)[-1]), []).append(host)
    assert sorted(by_attempt[0]) == ["node-a", "node-b"]
    assert sorted(by_attempt[1]) == ["node-a", "node-c"]
    assert "restart 1 of 1 in 0 s, without node-b" in proc.stderr


@pytest.mark.parametrize("env, nodes, flags, needle", [
    ({"SPARE_NODES": "1"}, 2, ("--save", "ckpt"),
     "error: SPARE_NODES and COORDINATOR_HOST need --moc-restart in-job"),
    ({"COORDINATOR_HOST": "head"}, 2, ("--save", "ckpt"),
     "error: SPARE_NODES and COORDINATOR_HOST need --moc-restart in-job"),
    ({"COORDINATOR_HOST": "node-b"}, 2, IN_JOB,
     "error: COORDINATOR_HOST names node-b, a host of"),
    ({"COORDINATOR_HOST": "head"}, 1, IN_JOB,
     "error: COORDINATOR_HOST needs NODES + SPARE_NODES >= 2"),
    ({"SPARE_NODES": "one"}, 2, IN_JOB, "error: SPARE_NODES must be an integer"),
])
def test_spare_nodes_and_a_coordinator_are_refused_where_they_cannot_work(
        tmp_path, env, nodes, flags, needle):
    """Nothing starts (no ssh, no launcher), exit 2, a line naming the variable."""
    state = tmp_path / "state"
    ssh = _executable(tmp_path / "ssh",
                      FAKE_SSH.format(python=sys.executable, state=state, record=RECORD))
    proc, launches, _ = _run(tmp_path, [0], max_restarts=0, nodes=nodes, gpus=3, flags=flags,
                             extra_env={"SSH": str(ssh), **env})
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert launches == [] and not (state / "ssh.jsonl").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--moc-restart", "in-job", "--moc-spares", "2"],
     "error: --moc-spares 2 leaves no training process of NPROC_PER_NODE 2"),
    (["--moc-restart=in-job", "--moc-spares=-1"],
     "error: --moc-spares must be an integer >= 0, got '-1'"),
])
def test_run_elastic_refuses_spares_that_leave_no_training_process(flags, needle):
    """scripts/run_elastic.sh reads the in-job flags as launch_cluster.sh does
    (scripts/lib/in_job_flags.sh) and stops before anything starts."""
    proc = subprocess.run(["bash", "scripts/run_elastic.sh", "2", "0", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 2 and proc.stderr.strip() == needle, proc.stderr


def test_moc_omp_and_torch_nccl_variables_reach_other_nodes(tmp_path):
    """DeepSpeed's runner exports to other nodes only some prefixes and its .deepspeed_env
    files; the script adds MOC_*, OMP_NUM_THREADS and TORCH_NCCL_* (the current name of
    the async error handling) and keeps the user's file: its lines still apply, and win."""
    home = tmp_path / "home"
    home.mkdir(parents=True)
    user_file = home / ".deepspeed_env"
    # (the blank line would stop DeepSpeed's runner: the script drops it)
    user_file.write_text("OMP_NUM_THREADS=5\nUCX_TLS=rc,tcp\n\n")
    repo_file = REPO / ".deepspeed_env"
    repo_file_before = repo_file.read_bytes() if repo_file.exists() else None
    env = {"MOC_FAULT_STATE": "/tmp/faults", "OMP_NUM_THREADS": "3",
           "TORCH_NCCL_BLOCKING_WAIT": "1", "MOC_NOTE": "two words"}
    proc, _, records = _run(tmp_path, [0], max_restarts=0, extra_env=env)
    assert proc.returncode == 0, proc.stderr + "".join(map(str, records))
    exports = records[0]["exports"]
    assert exports["MOC_FAULT_STATE"] == "/tmp/faults" and exports["MOC_NOTE"] == "two words"
    assert exports["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert exports["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "NCCL_ASYNC_ERROR_HANDLING" not in exports  # the deprecated name
    assert exports["OMP_NUM_THREADS"] == "5" and exports["UCX_TLS"] == "rc,tcp"
    assert user_file.read_text() == "OMP_NUM_THREADS=5\nUCX_TLS=rc,tcp\n\n"
    assert (repo_file.read_bytes() if repo_file.exists() else None) == repo_file_before
    assert not os.path.exists(records[0]["env_file"])  # this launch's file, removed at exit

    # a value under the deprecated name still sets the current one
    proc, _, records = _run(tmp_path / "old_name", [0], max_restarts=0,
                            extra_env={"NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert records[0]["exports"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


FAKE_TORCH = """import os
class cuda:
    is_available = staticmethod(lambda: int(os.environ["FAKE_GPUS"]) > 0)
    device_count = staticmethod(lambda: int(os.environ["FAKE_GPUS"]))
"""

FAKE_LAUNCHER = """#!/usr/bin/env bash
# records its arguments and DS_ACCELERATOR; writes the metrics and checkpoint directory
# the script reads
printf '%s\\n' "$*" >> "$STATE/launches"
printf '%s\\n' "${DS_ACCELERATOR-unset}" >> "$STATE/accelerators"
while [ $# -gt 0 ]; do
    case "$1" in
        --metrics-file) echo '{"kind": "train", "lm_loss": 5.0, "iteration": 1}' >> "$2" ;;
        --save) mkdir -p "$2" ;;
    esac
    shift
done
"""


def _quickstart(tmp_path, **env):
    """scripts/quickstart.sh in a sandbox: a stub setup_env.sh puts a stand-in torch
    (FAKE_GPUS GPUs) and launcher first on the paths; the corpus is there already."""
    repo, fake_bin, fake_py, state = (tmp_path / d for d in ("repo", "bin", "py", "state"))
    for d in (repo / "scripts", repo / "data", fake_bin, fake_py / "torch", state):
        d.mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "quickstart.sh", repo / "scripts" / "quickstart.sh")
    (repo / "scripts" / "setup_env.sh").write_text(
        'export PATH="$FAKE_BIN:$PATH" PYTHONPATH="$FAKE_PY"\n')
    (repo / "data" / "stdlib_text_document.idx").write_bytes(b"x")
    (fake_py / "torch" / "__init__.py").write_text(FAKE_TORCH)
    _executable(fake_bin / "deepspeed", FAKE_LAUNCHER)
    os.symlink(sys.executable, fake_bin / "python")
    proc = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=repo, capture_output=True,
                          text=True, timeout=60, env=_clean_env(
                              FAKE_BIN=str(fake_bin), FAKE_PY=str(fake_py), STATE=str(state),
                              QUICKSTART_DIR=str(tmp_path / "run"), **env))
    launches, accelerators = ((state / name).read_text().splitlines()
                              if (state / name).exists() else []
                              for name in ("launches", "accelerators"))
    return proc, launches, accelerators


@pytest.mark.parametrize("gpus, accelerator, device", [
    ("0", None, "CPU"), ("2", None, "GPU"), ("2", "cpu", "CPU"), ("4", "cuda", "GPU")])
def test_quickstart_says_which_device_its_ranks_use(tmp_path, gpus, accelerator, device):
    env = {"FAKE_GPUS": gpus, **({"DS_ACCELERATOR": accelerator} if accelerator else {})}
    proc, launches, accelerators = _quickstart(tmp_path, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[quickstart] device: {device} (" in proc.stdout
    assert f"of 200 on 2 {device} ranks, then stopping" in proc.stdout
    if device == "GPU":
        assert f"cuda:0-1 of the {gpus} torch sees" in proc.stdout
    # the same launches whatever the device, with the caller's DS_ACCELERATOR
    assert [line.split()[:4] for line in launches] == [
        ["--num_gpus", "2", "--master_port", "29561"]] * 2
    assert accelerators == [accelerator or "unset"] * 2


@pytest.mark.parametrize("gpus, ranks", [("1", None), ("2", "4")])
def test_quickstart_with_fewer_gpus_than_ranks_runs_them_on_the_cpu(tmp_path, gpus, ranks):
    """A one-GPU workstation (2 ranks, 1 GPU): the quickstart's job, unchanged, on CPU ranks
    (the CPU job is the one whose resumed losses are checked bitwise), and one line says
    so; before, it stopped with an error."""
    env = {"FAKE_GPUS": gpus, **({"QUICKSTART_RANKS": ranks} if ranks else {})}
    ranks = ranks or "2"
    proc, launches, accelerators = _quickstart(tmp_path, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plural = "" if gpus == "1" else "s"
    assert (f"[quickstart] device: CPU ({ranks} ranks and torch sees {gpus} GPU{plural}: the "
            "ranks run on the CPU, DS_ACCELERATOR=cpu; with a GPU per rank they use GPUs)\n"
            in proc.stdout), proc.stdout
    assert f"on {ranks} CPU ranks, then stopping" in proc.stdout
    assert [line.split()[:2] for line in launches] == [["--num_gpus", ranks]] * 2
    assert accelerators == ["cpu"] * 2  # the launcher and its ranks get the CPU accelerator


def test_quickstart_refuses_cuda_asked_for_with_fewer_gpus_than_ranks(tmp_path):
    proc, launches, _ = _quickstart(tmp_path, FAKE_GPUS="1", DS_ACCELERATOR="cuda")
    assert proc.returncode == 2 and not launches
    assert ("error: DS_ACCELERATOR=cuda with 2 ranks needs 2 GPUs and torch sees 1: "
            "DS_ACCELERATOR=cpu (or unset) runs them on the CPU") in proc.stderr
