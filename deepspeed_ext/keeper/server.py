"""The keeper process: its state (:class:`Keeper`), the socket loop (:func:`serve`), and
its exit (:func:`leave`).

Requests (JSON lines, :mod:`deepspeed_ext.keeper.protocol`): ``{"op": "ping"}``,
``{"op": "hello", "pid": N}``, ``{"op": "persist", "job": {...}}`` (a job with an ``id``
already queued is not queued again), ``{"op": "drain", "attempt_started": T}`` and
``{"op": "shutdown", "attempt_started": T}``; a keeper started for a job (``--run-id``)
answers the last four only when they carry that ``run_id``.

Trust: a connection from another user's process is dropped (``SO_PEERCRED``); a request
is at most :data:`~deepspeed_ext.keeper.protocol.MAX_MESSAGE_BYTES` and must arrive
within :data:`~deepspeed_ext.keeper.protocol.CONNECTION_TIMEOUT_S`; a persist job whose
paths leave its directories is refused (:mod:`deepspeed_ext.keeper.job_checks`); and
liveness counts only this user's processes.
"""

import argparse
import collections
import fcntl
import importlib
import json
import os
import queue
import shutil
import socket
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

from deepspeed_ext.jobs import Job
import deepspeed_ext.keeper.commits as commits
from deepspeed_ext.keeper.job_checks import JobRefused, check_job
from deepspeed_ext.keeper.lock import lock_node
from deepspeed_ext.keeper.log import keeper_log
from deepspeed_ext.keeper.persist import run_persist_job
from deepspeed_ext.keeper.protocol import (CONNECTION_TIMEOUT_S, KeeperError, peer_credentials,
                                           read_line, socket_path)
from deepspeed_ext.private_dir import UnsafeDirectoryError, check_private_dir

RECENT_JOB_IDS = 4096
"""Persist job ids a keeper remembers to drop retried requests (see
:func:`deepspeed_ext.keeper.client.hand_over`)."""


def _warm_imports() -> None:
    # The writers import torch: loaded here, on a side thread, never at the keeper's start.
    for module in ("deepspeed_ext.format.image", "deepspeed_ext.store.commit",
                   "deepspeed_ext.format.manifest"):
        importlib.import_module(module)


class Keeper:
    """The keeper's state: registered clients, the persist queue, the stop flag.

    Its :meth:`handle` runs on one thread per connection; :meth:`persist_loop` on the
    persist thread; the rest on the serve loop's thread."""

    def __init__(self, directory: str, idle_timeout_s: float, run_id: Optional[str] = None,
                 save_dir: Optional[str] = None):
        self.directory = directory
        self.idle_timeout_s = idle_timeout_s
        self.run_id = run_id
        """The job this keeper serves (None: any job of its user, as before run ids)."""
        self.save_dir = save_dir
        """The only save directory it persists into (None: each job's own)."""
        self.clients: List[int] = []
        self.clients_lock = threading.Lock()
        self.clients_at_stop: set = set()
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.ids_lock = threading.Lock()
        self.job_ids: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        """``id`` of the last :data:`RECENT_JOB_IDS` persist jobs queued (a retry of
        ``hand_over`` comes seconds after its first request; a keeper that lives for
        weeks must not keep every id)."""
        self.busy = threading.Event()
        self.stop = threading.Event()
        self.last_client_seen = time.monotonic()

    def handle(self, message: Dict[str, Any], peer_pid: Optional[int] = None) -> Dict[str, Any]:
        """Answer one request. ``peer_pid``: the connecting process (its credentials),
        None where the platform cannot tell."""
        if not isinstance(message, dict):
            return {"ok": False, "error": "a request must be a JSON object"}
        op = message.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op in ("hello", "persist", "shutdown", "drain") and self.run_id is not None \
                and message.get("run_id") != self.run_id:
            return {"ok": False, "error": f"this keeper serves run {self.run_id}, not "
                                          f"{message.get('run_id')!r}"}
        if op == "hello":
            return self._hello(message, peer_pid)
        if op == "persist":
            return self._persist(message)
        attempt = message.get("attempt_started")
        if not isinstance(attempt, (int, float)) or isinstance(attempt, bool):
            attempt = None
        if op == "drain":
            # The training side's final wait: every persist asked for written, and every
            # commit of its attempt done (manifest, ``latest``, retention), before it
            # returns; otherwise ``latest`` and retention still changed after the job had
            # ended (a reader or the next job saw the directory mid-commit).
            self.jobs.join()
            commits.drain_commits(attempt)
            return {"ok": True}
        if op == "shutdown":
            self.jobs.join()  # finish every persist already asked for
            commits.join_finishing_commits(attempt)
            with self.clients_lock:
                self.clients_at_stop = set(self.clients)
            self.stop.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _hello(self, message: Dict[str, Any], peer_pid: Optional[int]) -> Dict[str, Any]:
        # Liveness counts the process that connected, not a pid it names: another
        # process's pid would keep the keeper (and its memory) alive for ever.
        pid = peer_pid if peer_pid is not None else message.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return {"ok": False, "error": f"bad pid {pid!r}"}
        with self.clients_lock:
            self.clients.append(pid)
        self.last_client_seen = time.monotonic()
        return {"ok": True}

    def _persist(self, message: Dict[str, Any]) -> Dict[str, Any]:
        try:
            # Parsed and checked before it is queued: a malformed field failed the
            # persist only once the keeper ran it (a KeyError in its log), and a
            # path outside its directories was read or written.
            job = check_job(message.get("job"), self.directory, self.save_dir)
        except JobRefused as e:
            keeper_log(f"refused a persist job: {e}")
            return {"ok": False, "error": f"job refused: {e}"}
        # Each connection has its own thread: a retry can be handled while the slow
        # first request still is, so checking and recording an id is one step.
        with self.ids_lock:
            if job.id is not None:
                if job.id in self.job_ids:  # a retry of a request that did arrive
                    return {"ok": True, "queued": self.jobs.qsize(), "duplicate": True}
                self.job_ids[job.id] = None
                while len(self.job_ids) > RECENT_JOB_IDS:
                    self.job_ids.popitem(last=False)
            self.jobs.put(job)
        return {"ok": True, "queued": self.jobs.qsize()}

    def persist_loop(self) -> None:
        """The persist thread: run the queued jobs in order until a None."""
        # Import the writers now, while training starts up: the first persist would
        # otherwise pay seconds of imports (torch) and fall behind the snapshots. On a
        # side thread, so that frame jobs (plain file copies) need not wait for it.
        threading.Thread(target=_warm_imports, name="imports", daemon=True).start()
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                run_persist_job(job, log=keeper_log, background_commit=True)
            except Exception:
                traceback.print_exc()
            finally:
                self.jobs.task_done()

    def any_client_alive(self) -> bool:
        """Whether a registered process of this user still lives (the dead are forgotten)."""
        with self.clients_lock:  # a registration arriving meanwhile must not be lost
            living = []
            for pid in self.clients:
                # Only a living process of this user counts (a pid reused by another
                # user's process must not keep the keeper and its memory).
                try:
                    if os.stat(f"/proc/{pid}").st_uid == os.geteuid():
                        living.append(pid)
                except FileNotFoundError:
                    pass
                except OSError:  # no /proc: signal 0 tells the same for this user
                    try:
                        os.kill(pid, 0)
                        living.append(pid)
                    except OSError:
                        pass
            self.clients = living
            return bool(living)

    def clients_since_stop(self) -> List[int]:
        """Living processes that registered after the shutdown request (a new job's)."""
        self.any_client_alive()
        with self.clients_lock:
            return [pid for pid in self.clients if pid not in self.clients_at_stop]

    def commits_running(self) -> bool:
        return commits.commits_running()


def serve_connection(keeper: Keeper, conn: socket.socket) -> None:
    """One connection's thread: check the peer, read one request, answer it."""
    with conn:
        conn.settimeout(CONNECTION_TIMEOUT_S)
        peer = peer_credentials(conn)
        if peer is not None and peer[1] != os.geteuid():
            # Another user's process (the directory is 0700, but a socket passed on or
            # a looser parent must not make this keeper obey it).
            keeper_log(f"refused a connection from pid {peer[0]} of uid {peer[1]}")
            return
        try:
            data = read_line(conn)
        except (OSError, KeeperError) as e:  # silent past the timeout, or too long
            keeper_log(f"dropped a connection: {e}")
            return
        if not data.endswith(b"\n"):
            return  # closed early (a connect-only probe of is_dead, or a client that died)
        try:
            reply = keeper.handle(json.loads(data), peer[0] if peer is not None else None)
        except Exception as e:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


def serve(directory: str, idle_timeout_s: float, run_id: Optional[str] = None,
          save_dir: Optional[str] = None) -> int:
    """The keeper's main loop; returns when shut down or idle.

    Refuses to start (exit status 2) when ``directory`` is not private to this user.
    """
    try:
        check_private_dir(directory)
    except (OSError, UnsafeDirectoryError) as e:
        keeper_log(f"not serving: {e}")
        return 2
    keeper = Keeper(directory, idle_timeout_s, run_id, save_dir)
    server = _listen(directory)
    worker = threading.Thread(target=keeper.persist_loop, name="persist", daemon=True)
    worker.start()
    keeper_log(f"serving {directory} (idle timeout {idle_timeout_s:.0f} s)")
    while True:
        if keeper.stop.is_set():  # every queued job and finishing commit done (handle)
            if leave(keeper, directory, server, "shutdown requested"):
                return 0
            keeper.stop.clear()
            commits.reopen_gate()
        try:
            conn, _ = server.accept()
        except socket.timeout:
            if keeper.any_client_alive():
                keeper.last_client_seen = time.monotonic()
            elif (time.monotonic() - keeper.last_client_seen > idle_timeout_s
                  and keeper.jobs.unfinished_tasks == 0 and not keeper.commits_running()):
                # Commits still running wait for other nodes' reports (each bounded by
                # its commit timeout): served on until they end, so that a restarting
                # job meanwhile finds a keeper that answers.
                if leave(keeper, directory, server,
                         f"no training process alive for {idle_timeout_s:.0f} s"):
                    return 0
            continue
        threading.Thread(target=serve_connection, args=(keeper, conn), daemon=True).start()


def _listen(directory: str) -> socket.socket:
    """The keeper's listening socket (mode 0600), replacing a dead keeper's."""
    path = socket_path(directory)
    if os.path.lexists(path):
        os.remove(path)  # a dead keeper's socket: nobody answers on it
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(64)
    server.settimeout(0.5)
    return server


def leave(keeper: Keeper, directory: str, server: socket.socket, reason: str) -> bool:
    """Close the socket and delete the node directory, under the node's lock: a training
    process attaching takes it too (and registers under it), so the keeper neither
    leaves a process that has just attached nor deletes a new keeper's files. Returns
    False (serve on) when a process registered that this exit would strand: any, for an
    idle exit; one that is not of the job that asked, for a requested shutdown; and
    when the lock is held: a process attaching holds it while it waits for this thread
    to answer its ping, so waiting for it here would stall both until its start
    timeout."""
    try:
        lock = lock_node(directory, wait=False, make=False)
    except OSError as e:  # the directory vanished or was replaced: nothing of ours to delete
        server.close()
        keeper_log(f"exiting ({reason}); cannot lock {directory} ({e}), leaving it")
        return True
    if lock is None:
        keeper_log(f"not exiting ({reason}): a training process is attaching")
        keeper.last_client_seen = time.monotonic()
        return False
    with lock:
        try:
            newcomers = keeper.clients_since_stop() if keeper.stop.is_set() else \
                (keeper.clients if keeper.any_client_alive() else [])
            if newcomers:
                keeper_log(f"not exiting ({reason}): training process(es) "
                           f"{', '.join(map(str, newcomers))} registered meanwhile")
                keeper.last_client_seen = time.monotonic()
                return False
            server.close()
            keeper_log(f"exiting ({reason}); removing {directory}")
            shutil.rmtree(directory, ignore_errors=True)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: Optional[List[str]] = None) -> int:
    """The keeper process's command line (``--dir``, ``--idle-timeout``, ``--run-id``,
    ``--save-dir``); returns its exit status."""
    parser = argparse.ArgumentParser(description="MoC per-node snapshot keeper (started by MoC).")
    parser.add_argument("--dir", required=True, help="the node's shared-memory directory")
    parser.add_argument("--idle-timeout", type=float, default=600.0,
                        help="exit when no registered training process is alive for this long")
    parser.add_argument("--run-id", default=None, help="the only job this keeper serves")
    parser.add_argument("--save-dir", default=None,
                        help="the only save directory this keeper persists into")
    opts = parser.parse_args(argv)
    return serve(opts.dir, opts.idle_timeout, opts.run_id, opts.save_dir)
