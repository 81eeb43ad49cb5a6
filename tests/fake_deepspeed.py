"""Stand-in for the ``deepspeed`` command in tests/test_launch_scripts.py: DeepSpeed's
own runner (``deepspeed.launcher.runner.main``, the function behind the command) with
everything it does to its arguments, the hostfile, --include/--exclude,
--num_nodes/--num_gpus, the master address and the environment it exports to other
nodes, up to the command it would start, which is recorded instead of run. Its ssh
probes are answered here: every host is reachable, and ``hostname -I`` lists a docker0
address first, as on many GPU nodes.

Environment: STATE, a directory: ``count`` (launches so far), ``launches`` (each launch's
arguments, one line each) and ``launches.jsonl`` (what each launch resolved to: the
ranks per host, the master address and port, the exports to other nodes, or the error
the runner raised). EXIT_CODES: the exit status of each launch's job, space-separated
(0 beyond the list). FIRST_ATTEMPT_EVENTS: hosts the first job's watchdog reports in a
hang event, appended to MOC_EVENT_FILE while the job runs.
"""

import base64
import json
import os
import re
import subprocess
import sys
import time
import types

DOCKER0 = "172.17.0.1"


def host_address(host: str) -> str:
    return f"10.0.0.{sum(map(ord, host)) % 250 + 1}"


def main(argv):
    state = os.environ["STATE"]
    count_path = os.path.join(state, "count")
    attempt = int(open(count_path).read()) if os.path.exists(count_path) else 0
    with open(count_path, "w") as f:
        f.write(str(attempt + 1))
    with open(os.path.join(state, "launches"), "a") as f:
        f.write(" ".join(argv) + "\n")
    codes = os.environ.get("EXIT_CODES", "").split()
    exit_code = int(codes[attempt]) if attempt < len(codes) else 0
    record = {"argv": argv}

    from deepspeed.launcher import runner

    class Job:  # what subprocess.Popen would have started: the job "runs" in wait()
        def __init__(self, cmd, env=None, **_):
            record["cmd"] = cmd
            record["env_file"] = os.environ.get("DS_ENV_FILE")
            self.returncode = None

        def wait(self):
            if attempt == 0:
                for host in os.environ.get("FIRST_ATTEMPT_EVENTS", "").split():
                    with open(os.environ["MOC_EVENT_FILE"], "a") as f:
                        f.write(json.dumps({"kind": "hang", "host": host, "time": time.time()}) + "\n")
            self.returncode = exit_code
            return exit_code

        def send_signal(self, _):
            pass

    def check_output(cmd, *_, **__):  # ssh HOST hostname -I
        record["probed_host"] = cmd[-3]
        return f"{DOCKER0} {host_address(cmd[-3])}\n".encode()

    probes = types.ModuleType("subprocess")  # the runner's subprocess, less the processes
    probes.__dict__.update(vars(subprocess))
    probes.Popen, probes.check_call, probes.check_output = Job, lambda *a, **k: 0, check_output
    runner.subprocess = probes
    runner.PDSHRunner.backend_exists = lambda self: True
    status = 0
    try:
        runner.main(argv)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 -- the deepspeed command dies with a traceback
        record["error"] = f"{type(e).__name__}: {e}"
        status = 1
    cmd = record.get("cmd", [])
    flags = dict(re.match(r"--(\w+)=(.*)", a).groups() for a in cmd if re.match(r"--\w+=", a))
    if "world_info" in flags:
        record["resources"] = json.loads(base64.urlsafe_b64decode(flags["world_info"]))
        record["master_addr"] = flags["master_addr"]
        record["master_port"] = int(flags["master_port"])
    exports = next((a for a in cmd if a.startswith("export ")), "")
    record["exports"] = {k: v.strip('"') for k, v in
                         re.findall(r'export (\w+)=("[^"]*"|[^;]*); ', exports)}
    with open(os.path.join(state, "launches.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
