"""Starting the node's keeper: every rank of a node calls :func:`ensure_keeper` at start-up
(or :func:`claim_node_dir` before it); the first to get the node's lock starts the keeper
process (:func:`spawn`) when nothing listens on its socket, the others attach to it.

The keeper process runs ``python -c`` :data:`BOOTSTRAP` with ``deepspeed_ext.keeper
--dir <dir>`` on its command line (``ps``, and ``pkill -f 'deepspeed_ext.keeper --dir'``
find it there), in a new session so the launcher's kill of the workers does not reach it.
"""

import fcntl
import os
import subprocess
import sys
import time
from typing import Any, Dict, Optional

from deepspeed_ext.job_identity import bind_node_dir
from deepspeed_ext.keeper.client import alive, is_dead
from deepspeed_ext.keeper.lock import lock_node
from deepspeed_ext.keeper.protocol import LOG_NAME, KeeperError, request, socket_path
from deepspeed_ext.private_dir import open_private_file

BOOTSTRAP = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
             "sys.path.insert(0, sys.argv[1]); from deepspeed_ext.keeper import main; "
             "sys.exit(main(sys.argv[3:]))")
"""The keeper's start: ``python -c`` with the working directory taken off the import path
(``python -m`` would put it first, and the job's working directory could hold another
``deepspeed_ext`` that the keeper would then run). ``argv[1]`` is the package root,
``argv[2]`` the name ``deepspeed_ext.keeper`` (for ``ps`` and ``pkill -f``)."""


def ensure_keeper(directory: str, idle_timeout_s: float = 600.0,
                  start_timeout_s: float = 60.0, run_id: Optional[str] = None,
                  save_dir: Optional[str] = None) -> None:
    """Make sure a keeper serves ``directory`` and register this process with it.

    Every rank of the node calls it; a file lock makes exactly one of them start the
    keeper when nothing listens on its socket (the others, and later restarts, attach
    to it; a keeper that is only slow to answer is waited for, never replaced).

    ``directory`` and its parent are created private (mode 0700, this user's; see
    :mod:`deepspeed_ext.private_dir`) or checked to be. With ``run_id``, the directory
    is bound to that job (:func:`deepspeed_ext.job_identity.bind_node_dir`) and the
    keeper serves only it; with ``save_dir`` too, the keeper persists only into it.

    Raises:
        UnsafeDirectoryError: the directory (or its parent) is not private.
        ForeignJobError: it serves another job.
        KeeperError: the keeper did not answer within ``start_timeout_s`` (its log is
            named), or the socket path is too long.
    """
    socket_path(directory)  # too long: say so now, not after the start timeout
    lock = lock_node(directory)
    with lock:
        try:
            if run_id is not None:
                bind_node_dir(directory, run_id)
            # Start one only when nothing listens. A keeper that is slow to answer (busy
            # persisting on a loaded node) is still the node's keeper: a second one would
            # take over its socket, and the first would later delete the directory.
            if is_dead(directory):
                spawn(directory, idle_timeout_s, run_id, save_dir)
            _wait_until_alive(directory, start_timeout_s)
            # Registered under the lock: a keeper exiting for idleness takes the same lock
            # and looks at its clients once more, so it cannot leave between the check
            # above and this registration.
            hello: Dict[str, Any] = {"op": "hello", "pid": os.getpid()}
            if run_id is not None:
                hello["run_id"] = run_id
            request(directory, hello)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_until_alive(directory: str, start_timeout_s: float) -> None:
    deadline = time.monotonic() + start_timeout_s
    while not alive(directory):
        if time.monotonic() > deadline:
            raise KeeperError(f"the keeper for {directory} did not answer within "
                              f"{start_timeout_s:.0f} s; see "
                              f"{os.path.join(directory, LOG_NAME)}")
        time.sleep(0.05)


def claim_node_dir(directory: str, run_id: Optional[str] = None) -> None:
    """Every rank of a node, before training: make ``directory`` (and its parent) private,
    or check that they are, and bind it to the job ``run_id``, under the node's lock;
    starts nothing (:func:`ensure_keeper` does, and checks again).

    Raises:
        UnsafeDirectoryError: the directory (or its parent) is not private.
        ForeignJobError: it serves another job.
        KeeperError: the socket path would be too long.
    """
    socket_path(directory)
    lock = lock_node(directory)
    with lock:
        try:
            if run_id is not None:
                bind_node_dir(directory, run_id)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def spawn(directory: str, idle_timeout_s: float, run_id: Optional[str] = None,
          save_dir: Optional[str] = None) -> None:
    """Start the keeper process for ``directory``, its output appended to ``keeper.log``;
    called under the node's lock by the rank that found nothing listening."""
    log = open_private_file(os.path.join(directory, LOG_NAME), "a")
    env = dict(os.environ)
    # The keeper imports deepspeed_ext from wherever this process did, and from nowhere
    # else: relative or empty PYTHONPATH entries (the working directory) are dropped.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env["PYTHONPATH"] = os.pathsep.join([package_root] + inherited)
    command = [sys.executable, "-c", BOOTSTRAP, package_root, "deepspeed_ext.keeper",
               "--dir", os.path.abspath(directory), "--idle-timeout", str(idle_timeout_s)]
    if run_id is not None:
        command += ["--run-id", run_id]
    if save_dir:
        command += ["--save-dir", os.path.abspath(save_dir) if "://" not in save_dir else save_dir]
    subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True, close_fds=True, env=env)
    log.close()
