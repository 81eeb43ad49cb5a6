"""A fork server for the suite's ranks: the heavy imports done once, each rank forked.

Every rank process of a test used to be a new interpreter that imported torch,
megatron.core and deepspeed (about 4 s of CPU here before the rank's own code ran), and
the suite starts several hundred of them on a 2-core machine. This server imports them
once per test process; ``tests.launch.run_ranks`` asks it to fork each rank, which then
runs its script as ``python SCRIPT ARGS`` would (``runpy`` as ``__main__``, with its own
environment, working directory, umask, argv, stdin from /dev/null, stdout and stderr
into one file). Nothing of a rank's own starts before the fork: no process group, no
thread of ours; of this repository only the helpers that defer torch.compile at import.

Protocol (one JSON object per line):

* client -> server, on stdin: ``{"script", "args", "env", "cwd", "umask", "output"}``;
  the server answers ``{"pid": P}`` once forked.
* server -> client, on stdout, whenever a child ends: ``{"exited": P, "returncode": R}``
  (``-N`` for a signal, as ``subprocess`` reports it).

The server exits when its stdin closes (the test process ended). Only environments that
agree with the server's on what an interpreter reads at start-up (``startup_env``) are
forked; ``tests.launch`` starts any other rank as a new interpreter.
"""

import json
import os
import select
import signal
import sys

STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "LD_", "MALLOC_",
                    "DS_", "NVTE_", "CUDA", "NCCL_", "MEGATRON")
"""Variables read when an interpreter starts or imports torch, megatron.core or deepspeed:
a rank whose values differ from the server's is not forked (it would not see them)."""


def startup_env(env: dict) -> dict:
    """The part of ``env`` a forked rank would inherit from the server instead."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def _child(request: dict, keep_closed: tuple) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` and run it; never returns."""
    import runpy
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep_closed:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    # sys.stdout/stderr (and the handlers the imported libraries' loggers bound to them)
    # write to descriptors 1 and 2: now the rank's output file.
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # SystemExit from the script ends this process the normal way (atexit, flush).
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def serve(log: str) -> None:
    """Import, then fork a child per request until stdin closes. ``log``: the server's own
    output (what the imports print), kept off the protocol's descriptor."""
    protocol = os.dup(1)
    logfd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(logfd)
    # What every rank imports first and what takes its time, the way the trainer imports
    # it: torch, megatron.core and deepspeed with their import-time torch.compile calls
    # deferred (megatron.lazy_compile; a plain import loads TorchDynamo and Inductor,
    # which then also made each forked rank's exit 1.7 s slower).
    import torch  # noqa: F401
    from megatron.data.compat import quiet_core_import
    from megatron.lazy_compile import DEEPSPEED_COMPILING_MODULES, import_deferring_compile
    with quiet_core_import():
        import megatron.core  # noqa: F401
    import deepspeed  # noqa: F401
    import_deferring_compile(*DEEPSPEED_COMPILING_MODULES)

    def send(message: dict) -> None:
        os.write(protocol, (json.dumps(message) + "\n").encode())

    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = set()
    pending = b""
    stdin = 0
    send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([stdin, wakeup_r], [], [])
        if wakeup_r in readable:
            try:
                os.read(wakeup_r, 4096)
            except BlockingIOError:
                pass
        while children:  # reap every child that ended (one SIGCHLD may stand for several)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if stdin not in readable:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            return  # the test process ended: children already running finish on their own
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()  # nothing of the server's may reach a rank's output
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, (protocol, wakeup_r, wakeup_w))
            children.add(pid)
            send({"pid": pid})


if __name__ == "__main__":
    serve(sys.argv[1])
