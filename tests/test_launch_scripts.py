"""scripts/launch_cluster.sh's restart loop, with a stand-in ``deepspeed`` on PATH that
records each launch (this machine has no cluster to launch on)."""

import json
import os
import stat
import subprocess
import time

from tests.launch import REPO

FAKE = """#!/usr/bin/env bash
# Stand-in for the deepspeed launcher: logs its arguments and attempt, exits as scripted.
n=$(cat "$STATE/count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$STATE/count"
printf '%s\\n' "$*" >> "$STATE/launches"  # not its environment: other nodes do not get it
codes=($EXIT_CODES)
if [ "$n" = 0 ] && [ -n "${FIRST_ATTEMPT_EVENTS:-}" ]; then  # the job's watchdog reports
    for host in $FIRST_ATTEMPT_EVENTS; do
        printf '{"kind": "hang", "host": "%s", "time": %s}\\n' "$host" "$(date +%s)" >> "$MOC_EVENT_FILE"
    done
fi
exit "${codes[$n]:-0}"
"""


def _run(tmp_path, exit_codes, max_restarts, extra_env=None):
    tmp_path.mkdir(exist_ok=True)
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    fake = bin_dir / "deepspeed"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    data = tmp_path / "corpus"
    for suffix in (".idx", ".bin"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"x")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\nnode-c slots=8\n")
    env = dict(os.environ, DEEPSPEED=str(fake), STATE=str(state),
               EXIT_CODES=" ".join(map(str, exit_codes)), MAX_RESTARTS=str(max_restarts),
               RESTART_DELAY="0", **(extra_env or {}))
    proc = subprocess.run(["bash", "scripts/launch_cluster.sh", str(hostfile), str(data),
                           "configs/tiny.yaml", "2", "8", "8", "--save", "ckpt"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    launches = (state / "launches").read_text().splitlines() if (state / "launches").exists() else []
    return proc, launches


def test_failed_job_is_relaunched_until_it_succeeds(tmp_path):
    proc, launches = _run(tmp_path, [1, 1, 0], max_restarts=3)
    assert proc.returncode == 0, proc.stderr
    # the attempt travels as a flag, the last one (wins over a user's copy of it)
    assert [line.split()[-2:] for line in launches] == [
        ["--moc-restart-count", str(n)] for n in range(3)]
    assert all("pretrain_gpt_moe.py" in line and "--save ckpt" in line for line in launches)
    assert "restart 2 of 3" in proc.stderr


def test_restarts_are_bounded_and_bad_input_is_not_retried(tmp_path):
    proc, launches = _run(tmp_path, [1, 1, 1, 1], max_restarts=1)
    assert proc.returncode == 1 and len(launches) == 2
    proc, launches = _run(tmp_path / "second", [2, 0], max_restarts=3)
    assert proc.returncode == 2 and len(launches) == 1  # exit 2: the flags are wrong


def test_hosts_named_by_hang_events_are_excluded(tmp_path):
    """An event of an earlier launch is ignored; the hosts the first attempt's watchdog
    named are left out of the second attempt."""
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"kind": "hang", "host": "old-host",
                                  "time": time.time() - 3600}) + "\n")
    env = {"EXCLUDE_SUSPECTS": "1", "MOC_EVENT_FILE": str(events),
           "FIRST_ATTEMPT_EVENTS": "node-b node-c"}
    proc, launches = _run(tmp_path, [1, 0], max_restarts=2, extra_env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--exclude" not in launches[0]
    assert "--exclude node-b@node-c" in launches[1] and "old-host" not in launches[1]
    assert "without node-b@node-c" in proc.stderr
