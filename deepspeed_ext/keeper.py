"""The per-node keeper: owns the snapshot memory of a node and persists it in the background.

One keeper process runs per node (per ``--moc-ranks-per-node`` group when nodes are
simulated on one machine). It is separate from the training processes, so a training
process that crashes (a software failure) loses nothing: its snapshots stay in the
keeper's directory in shared memory (``/dev/shm``), and the restarted process finds them
there. The keeper also writes snapshots to storage, so training never waits for storage.

Lifecycle:

* :func:`ensure_keeper` is called by every rank of the node at start-up; the first one
  to get the directory lock starts the keeper when nothing listens on its socket
  (``python -c <bootstrap> ... deepspeed_ext.keeper --dir ...``, see :data:`_BOOTSTRAP`,
  in a new session so the launcher's kill of the
  workers does not reach it); the others wait until it answers. A keeper that is only
  slow to answer is waited for: a second keeper would take over the socket, and the
  first would later delete the directory under it.
* Every rank registers its pid (``hello``). The keeper exits on its own when none of
  its registered processes has been alive for ``idle_timeout_s`` (a crashed job
  whose launcher gave up), after finishing its persist queue.
* :func:`shutdown_keeper` (end of training) finishes the queue and the job's commits,
  deletes the whole directory and stops the keeper, and returns once the keeper's
  process has exited: no shared memory is left behind, and nothing of the job is still
  writing when the training process returns. A keeper whose job died (no shutdown) may
  still finish its persists and commits later, under the same rules (manifest before
  ``latest``, claims, :func:`deepspeed_ext.store.latest.advance_latest`).

Protocol: JSON lines over the Unix socket ``<dir>/keeper.sock`` (never pickle). Requests:
``{"op": "ping"}``, ``{"op": "hello", "pid": N}``, ``{"op": "persist", "job": {...}}``
(see :func:`run_persist_job`; a job with an ``id`` already queued is not queued again),
``{"op": "drain", "attempt_started": T}`` (answered once every queued job and the commits
:func:`commits_to_finish` names are done: :func:`drain_keeper`), ``{"op": "shutdown",
"attempt_started": T}``; a keeper started for a job (``--run-id``) answers the last four
only when they carry that ``run_id``. Every reply is a JSON object with ``"ok"``.

Trust: the directory is private (mode 0700, this user's: :mod:`deepspeed_ext.private_dir`)
and bound to one job (:mod:`deepspeed_ext.job_identity`); a connection from another
user's process is dropped (``SO_PEERCRED``); a request is at most
:data:`MAX_MESSAGE_BYTES` and must arrive within :data:`CONNECTION_TIMEOUT_S`; a persist
job whose paths leave the keeper's directory or the job's save directory is refused
(:mod:`deepspeed_ext.keeper_jobs`); liveness counts only this user's processes; and a
snapshot is persisted only if its memory checksum still matches.
"""

import argparse
import collections
import importlib
import fcntl
import json
import logging
import mmap
import os
import queue
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

from deepspeed_ext import memsum
from deepspeed_ext.jobs import FrameJob, Job, PersistJob, job_from_json
from deepspeed_ext.keeper_faults import crash_in_persist_if_due
from deepspeed_ext.keeper_jobs import JobRefused, check_job
from deepspeed_ext.private_dir import make_private_dir, open_private, open_private_file
from deepspeed_ext.runtime.log import log_line
from deepspeed_ext.runtime.retry import Backoff, poll_until

SOCKET_NAME = "keeper.sock"
LOG_NAME = "keeper.log"
LOCK_NAME = "keeper.lock"
RECENT_JOB_IDS = 4096
"""Persist job ids a keeper remembers to drop retried requests (see :func:`hand_over`)."""
MAX_MESSAGE_BYTES = 256 << 20
"""Longest request or reply (a persist job lists every tensor of a rank's image: about
200 bytes each). A longer one is cut off and refused: a client that never ends its
line must not grow the keeper's memory without bound."""
CONNECTION_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long is closed (one thread per connection:
clients that open connections and go silent must not pile threads up)."""
SUN_PATH_MAX = 107
"""Longest Unix socket path Linux accepts (``sun_path`` is 108 bytes with its NUL)."""


class KeeperError(RuntimeError):
    """The keeper could not be started or reached."""


logger = logging.getLogger(__name__)


def _log(directory: str, message: str) -> None:
    """One line of the keeper's, stamped with its pid and the time: several keepers may
    have served ``directory`` and append to its ``keeper.log`` (their stdout)."""
    log_line(logger, f"[moc keeper {os.getpid()} {time.strftime('%H:%M:%S')}] {message}")


# ---------------------------------------------------------------------------- client side

def read_line(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """Bytes from ``sock`` up to and including the first newline (a protocol message),
    or what came before the peer closed (no newline then).

    Raises:
        KeeperError: more than ``limit`` bytes came without a newline.
    """
    parts: List[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > limit:
            raise KeeperError(f"a message longer than {limit} bytes")
    return b"".join(parts)


def socket_path(directory: str) -> str:
    """The keeper's socket in ``directory``.

    Raises:
        KeeperError: the path is too long for a Unix socket (the bind would fail, and a
            rank would wait its whole start timeout for a keeper that never ran).
    """
    path = os.path.join(directory, SOCKET_NAME)
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise KeeperError(f"the keeper's socket {path} is {len(os.fsencode(path))} bytes long; "
                          f"Unix sockets allow {SUN_PATH_MAX}: choose a shorter --moc-shm-dir")
    return path


def peer_credentials(sock: socket.socket) -> Optional[Tuple[int, int, int]]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (Linux's
    ``SO_PEERCRED``); None where the platform has no such option."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def request(directory: str, message: Dict[str, Any], timeout_s: float = 10.0) -> Dict[str, Any]:
    """Send one request to the keeper of ``directory`` and return its reply.

    Raises:
        KeeperError: no keeper listens there (it died or was never started), or it
            answered with an error.
    """
    path = socket_path(directory)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(json.dumps(message).encode() + b"\n")
            data = read_line(sock)
    except OSError as err:
        raise KeeperError(f"no keeper at {path}: {err}") from None
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        raise KeeperError(f"keeper at {path} sent a malformed reply") from None
    if not isinstance(reply, dict):
        raise KeeperError(f"keeper at {path} sent a malformed reply")
    if not reply.get("ok"):
        raise KeeperError(f"keeper at {path}: {reply.get('error')}")
    return reply


def hand_over(directory: str, job: Dict[str, Any], patience_s: float = 600.0,
              timeout_s: float = 10.0) -> bool:
    """Queue a persist job with the keeper of ``directory``; the training process calls
    it from its copy thread.

    A keeper that does not answer in time but still listens is busy, not dead: the
    request is sent again until ``patience_s`` (the keeper queues a job ``id`` once, so
    a first request that did arrive is not persisted twice). Only a dead keeper lets
    the caller persist the job itself: a busy one may still have it queued, and two
    writers of one slot let the slower one read a slot the next snapshot had already
    reused, publishing wrong bytes under a matching checksum.

    Returns:
        True once the keeper has the job; False when it is dead (nothing listens).

    Raises:
        KeeperError: it still listens but took no request within ``patience_s``: the
            job may be in its queue, so the caller must fail this persist, not write it.
    """
    last_error: List[KeeperError] = []

    def attempt() -> Optional[bool]:
        try:
            message = {"op": "persist", "job": job}
            if job.get("run_id") is not None:
                message["run_id"] = job["run_id"]
            request(directory, message, timeout_s=timeout_s)
            return True
        except KeeperError as e:
            if is_dead(directory):
                return False
            last_error[:] = [e]
            return None

    def timed_out() -> bool:
        raise KeeperError(f"the keeper of {directory} still listens but took no "
                          f"request within {patience_s:.0f} s ({last_error[0]})") from None

    # The backoff: a request failing fast (a full backlog) would otherwise spin for
    # patience_s, taking the GIL from the training step.
    return poll_until(attempt, patience_s, HAND_OVER_BACKOFF, timed_out)


HAND_OVER_BACKOFF = Backoff(first_s=0.05, max_s=1.0)
"""Sleeps between the requests of :func:`hand_over` to a keeper that does not answer."""

PROCESS_TOKEN = uuid.uuid4().hex[:12]
"""Part of every job ``id`` a training process sends (:func:`job_id`)."""


def job_id(name: str, rank: int) -> str:
    """The ``id`` of a job (``name``: a tag or frame) this process hands over: the same
    for its retries, new in every process. Names repeat across attempts (a restarted
    job saving a tag, or taking a frame, again), and the keeper, which outlives them,
    dropped the new attempt's job as a retry of the old one: that save never
    committed, and every later persist waited behind it."""
    return f"{name}:{PROCESS_TOKEN}:rank{rank}"


def alive(directory: str) -> bool:
    try:
        request(directory, {"op": "ping"}, timeout_s=2.0)
        return True
    except KeeperError:
        return False


def is_dead(directory: str) -> bool:
    """True only when nothing listens on the keeper's socket (refused or no socket file).

    A keeper that is merely busy (a slow or timed-out answer) is not dead: declaring it
    dead would abandon a persist it is still writing.
    """
    path = socket_path(directory)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        try:
            sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


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
    lock = _lock_node(directory)
    with lock:
        try:
            if run_id is not None:
                from deepspeed_ext.job_identity import bind_node_dir
                bind_node_dir(directory, run_id)
            # Start one only when nothing listens. A keeper that is slow to answer (busy
            # persisting on a loaded node) is still the node's keeper: a second one would
            # take over its socket, and the first would later delete the directory.
            if is_dead(directory):
                _spawn(directory, idle_timeout_s, run_id, save_dir)
            deadline = time.monotonic() + start_timeout_s
            while not alive(directory):
                if time.monotonic() > deadline:
                    raise KeeperError(f"the keeper for {directory} did not answer within "
                                      f"{start_timeout_s:.0f} s; see "
                                      f"{os.path.join(directory, LOG_NAME)}")
                time.sleep(0.05)
            # Registered under the lock: a keeper exiting for idleness takes the same lock
            # and looks at its clients once more, so it cannot leave between the check
            # above and this registration.
            hello: Dict[str, Any] = {"op": "hello", "pid": os.getpid()}
            if run_id is not None:
                hello["run_id"] = run_id
            request(directory, hello)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    lock = _lock_node(directory)
    with lock:
        try:
            if run_id is not None:
                from deepspeed_ext.job_identity import bind_node_dir
                bind_node_dir(directory, run_id)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_node(directory: str, wait: bool = True, make: bool = True):
    """The node directory's lock file, open and exclusively locked (None: another
    process holds it and ``wait`` is False). Retried when the file was replaced while
    this process waited (an exiting keeper deleted the directory): a lock on the
    deleted file would exclude nobody who comes later.

    The directory and its parent (the job's ``--moc-shm-dir``) are made private or
    checked to be, every time: a directory another user created first (they are
    predictable names in a world-writable ``/dev/shm``) is refused before anything is
    written into it. ``make`` False (the keeper leaving): only the lock file is
    opened, never through a link."""
    while True:
        if make:
            make_private_dir(directory, root=os.path.dirname(os.path.abspath(directory)))
        path = os.path.join(directory, LOCK_NAME)
        lock = os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(path).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()


_BOOTSTRAP = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
              "sys.path.insert(0, sys.argv[1]); from deepspeed_ext.keeper import main; "
              "sys.exit(main(sys.argv[3:]))")
"""The keeper's start: ``python -c`` with the working directory taken off the import path
(``python -m`` would put it first, and the job's working directory could hold another
``deepspeed_ext`` that the keeper would then run). ``argv[1]`` is the package root,
``argv[2]`` the name ``deepspeed_ext.keeper`` (for ``ps`` and ``pkill -f``)."""


def _spawn(directory: str, idle_timeout_s: float, run_id: Optional[str] = None,
           save_dir: Optional[str] = None) -> None:
    log = open_private_file(os.path.join(directory, LOG_NAME), "a")
    env = dict(os.environ)
    # The keeper imports deepspeed_ext from wherever this process did, and from nowhere
    # else: relative or empty PYTHONPATH entries (the working directory) are dropped.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env["PYTHONPATH"] = os.pathsep.join([package_root] + inherited)
    command = [sys.executable, "-c", _BOOTSTRAP, package_root, "deepspeed_ext.keeper",
               "--dir", os.path.abspath(directory), "--idle-timeout", str(idle_timeout_s)]
    if run_id is not None:
        command += ["--run-id", run_id]
    if save_dir:
        command += ["--save-dir", os.path.abspath(save_dir) if "://" not in save_dir else save_dir]
    subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True, close_fds=True, env=env)
    log.close()


def drain_keeper(directory: str, timeout_s: float = 600.0, run_id: Optional[str] = None,
                 attempt_started: Optional[float] = None) -> bool:
    """The first rank of a node, at the end of a two-level wait: return once the node's
    keeper has run every persist job queued so far and finished every commit of the
    attempt ``attempt_started`` (manifest, ``latest``, retention) and every commit past
    its reports (:func:`commits_to_finish`). The keeper serves on.

    Returns:
        True when the keeper answered; False when none listens (nothing is running).

    Raises:
        KeeperError: it still listens but did not answer within ``timeout_s``.
    """
    message: Dict[str, Any] = {"op": "drain", "attempt_started": attempt_started}
    if run_id is not None:
        message["run_id"] = run_id
    try:
        request(directory, message, timeout_s=timeout_s)
    except KeeperError:
        if is_dead(directory):
            return False
        raise
    return True


def _keeper_pid(directory: str) -> Optional[int]:
    """The pid the node's keeper answers a ping with (None: none answers)."""
    try:
        pid = request(directory, {"op": "ping"}, timeout_s=2.0).get("pid")
    except KeeperError:
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def has_exited(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie (not yet reaped by the rank
    that started it; its exit is under way, none of its code runs any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def shutdown_keeper(directory: str, timeout_s: float = 600.0,
                    run_id: Optional[str] = None,
                    attempt_started: Optional[float] = None) -> bool:
    """Ask the keeper to finish its queue, delete ``directory`` and exit; returns once it
    has exited (or after 30 s more).

    The keeper first finishes every persist queued and every commit
    :func:`commits_to_finish` names for ``attempt_started``; other commits stand down.
    Waiting for the process itself, not only for its directory to go: a trainer that
    returned while its keeper still ran could be followed by a reader or the next job
    that saw the keeper's last writes land.

    Args:
        run_id: the job asking (a keeper of another job refuses); None: the job the
            directory is bound to (tools and tests that stop whatever this user left).
        attempt_started: the asking job attempt's start (its commits are waited for).

    Returns:
        True when a keeper answered; False when none was running (its directory, if
        any, is then deleted here so no shared memory is left, but only when it is
        this job's: private, and bound to ``run_id`` or to no job).
    """
    if run_id is None:
        from deepspeed_ext.job_identity import node_run_id
        run_id = node_run_id(directory)
    message: Dict[str, Any] = {"op": "shutdown", "attempt_started": attempt_started}
    if run_id is not None:
        message["run_id"] = run_id
    pid = _keeper_pid(directory)
    try:
        request(directory, message, timeout_s=timeout_s)
    except KeeperError:
        if is_dead(directory) and _ours(directory, run_id):
            shutil.rmtree(directory, ignore_errors=True)
        # else: alive but slow (its queue or a commit outlasted the timeout): deleting the
        # directory under it would remove the snapshots it is still persisting; it exits
        # on its own once no training process is alive.
        return False
    # The keeper deletes the directory right after answering; wait for it, so that a
    # caller checking for leftovers (or starting the next job) sees it gone.
    deadline = time.monotonic() + 30
    while (os.path.exists(directory) or (pid is not None and not has_exited(pid))) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def _ours(directory: str, run_id: Optional[str]) -> bool:
    """Whether ``directory`` may be deleted by this job: private to this user and not
    bound to another job (:mod:`deepspeed_ext.job_identity`)."""
    from deepspeed_ext.job_identity import NODE_RECORD, ForeignJobError, bind_node_dir
    from deepspeed_ext.private_dir import UnsafeDirectoryError, check_private_dir
    try:
        check_private_dir(directory)
    except (OSError, UnsafeDirectoryError):
        return False
    if run_id is None or not os.path.lexists(os.path.join(directory, NODE_RECORD)):
        return True
    try:
        bind_node_dir(directory, run_id)  # the record exists: only checked
        return True
    except (ForeignJobError, OSError):
        return False


# ------------------------------------------------------------------------- persist jobs

def write_image_subset(path: str, image_path: str, entries: List[Dict[str, Any]],
                       keys: Optional[List[str]], checksum: Optional[str] = None) -> Dict[str, Any]:
    """Write the tensors ``keys`` of the image file ``image_path`` as a safetensors file.

    ``entries`` is the image's layout (``key``, ``dtype``, ``shape``, ``start``,
    ``nbytes``); ``keys`` None writes every tensor. The output is written atomically
    (temp, fsync, rename) and its record returned.

    Args:
        checksum: the image's memory checksum (:mod:`deepspeed_ext.memsum`); when given,
            the image is verified first, so that damaged memory is never written to
            storage under a fresh SHA-256 that would vouch for it.

    Raises:
        RuntimeError: the image does not match ``checksum``, or is shorter than its layout.
    """
    from deepspeed_ext.format.image import layout_image
    from deepspeed_ext.format.storage import FileRecord, write_image_file
    chosen = [e for e in entries if keys is None or e["key"] in set(keys)]
    layout = layout_image([(e["key"], tuple(e["shape"]), e["dtype"]) for e in chosen])
    by_key = {e["key"]: e for e in chosen}
    end = max((e["start"] + e["nbytes"] for e in entries), default=0)
    with open(image_path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                if len(view) < end:
                    raise RuntimeError(f"{image_path} holds {len(view)} bytes, its layout {end}")
                if checksum is not None:
                    problem = memsum.verify(view[:end], checksum)
                    if problem is not None:
                        raise RuntimeError(f"the snapshot in {image_path} is damaged in memory "
                                           f"({problem}); not persisting it")
                if keys is None:
                    # The image itself is already this file: write it as is.
                    total = max((e["start"] + e["nbytes"] for e in entries), default=0)
                    return write_image_file(path, view[:max(total, len(layout.header))]).to_json()
                out = bytearray(layout.nbytes)
                out[:len(layout.header)] = layout.header
                for entry in layout.entries:
                    src = by_key[entry.key]
                    out[entry.start:entry.start + entry.nbytes] = \
                        view[src["start"]:src["start"] + src["nbytes"]]
                record = write_image_file(path, memoryview(out))
                return FileRecord(record.nbytes, record.sha256).to_json()
            finally:
                view.release()


def persist_frame(job: FrameJob) -> None:
    """Copy one exact-recovery frame of one rank from memory to storage: the data file
    (temp file, fsync, rename), then its marker, last (``deepspeed_ext.exact``).

    ``job``: ``data`` and ``marker`` (the files in memory), ``dst_data`` and
    ``dst_marker`` (their storage paths). Once both are on storage, a
    ``.copied`` file beside the marker in memory tells the rank it may retire the memory
    copy (``deepspeed_ext.exact``). A frame whose memory copy was already deleted (a lost
    node, or retired after waiting too long for this copy) is skipped, with a line in the
    keeper's log: its window stays incomplete on storage and recovery does not use it.
    """
    try:
        with open(job.data, "rb") as f:
            data = f.read()
        with open(job.marker, "rb") as f:
            marker = f.read()
    except FileNotFoundError:
        logger.warning(f"[moc keeper {os.getpid()}] WARNING: {job.marker} was gone before it "
                       f"reached storage; its window stays incomplete there")
        return
    frame_dir = os.path.dirname(job.dst_data)
    if not os.path.isdir(frame_dir):
        os.makedirs(frame_dir, exist_ok=True)
        # The new frame directory's own entry: without this fsync a power cut could lose
        # the directory with the durably written files in it.
        _fsync_dir(os.path.dirname(frame_dir))
    _write_durably(job.dst_data, data)
    _write_durably(job.dst_marker, marker)
    try:
        with open(copied_marker(job.marker), "w"):
            pass
    except FileNotFoundError:  # retired meanwhile: nothing left to tell
        pass


def copied_marker(marker: str) -> str:
    """The file that says a frame's memory copy (its marker ``marker``) is on storage."""
    return marker[:-len(".json")] + ".copied" if marker.endswith(".json") else marker + ".copied"


def _write_durably(path: str, data: bytes) -> None:
    """Temp file, fsync, rename, fsync the directory; plain ``os`` on purpose: a frame
    job must not wait for the keeper's import of torch (seconds), or a node lost in
    the first seconds of a job would take frames with it that storage never got."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_persist_job(job: Union[Job, Dict[str, Any]], log=None,
                    background_commit: bool = False) -> None:
    """Persist one rank's snapshot and, for the committing rank, commit the checkpoint;
    a :class:`~deepspeed_ext.jobs.FrameJob` is copied (:func:`persist_frame`). A plain
    dict is parsed first (:func:`deepspeed_ext.jobs.job_from_json`).

    The job's fields are described on :class:`~deepspeed_ext.jobs.PersistJob`: the slot
    image and the tensors of it to write, the rank file's specs, the save's claim, the
    objects (rank 0), the slot's done marker, and rank 0's
    :class:`~deepspeed_ext.jobs.CommitSpec` (the arguments of
    :func:`deepspeed_ext.store.commit.commit_checkpoint` plus ``timeout_s``).

    Args:
        background_commit: wait for the other ranks' reports on a separate thread. The
            keeper needs it: the reports of its other local ranks are written by jobs
            queued behind this one, so waiting here would deadlock its queue.
    """
    if log is None:
        log = lambda line: log_line(logger, line)  # noqa: E731
    if not isinstance(job, (PersistJob, FrameJob)):
        job = job_from_json(job)
    if isinstance(job, FrameJob):
        persist_frame(job)
        return
    from deepspeed_ext.format import assemble, naming
    from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE, write_objects_file
    from deepspeed_ext.store import claims, commit
    tag_dir = os.path.join(job.save_dir, job.tag)
    rank = job.rank
    claim = job.claim
    entries = [e.to_json() for e in job.entries]
    file_name = naming.rank_file_name(rank)
    try:
        # A job of an earlier attempt still queued when the restarted job saved the same
        # tag again: writing now would put the old attempt's file into the new save.
        claims.check_claim(tag_dir, claim)
        record = write_image_subset(os.path.join(tag_dir, file_name), job.image, entries,
                                    list(job.keys) if job.keys is not None else None,
                                    job.checksum)
        extra_files = dict(job.extra_files or {})
        objects_in = file_name if job.objects_in_file else None  # an older job
        if job.object_keys:
            # Their own small file: in rank 0's share, every rank of a load checksummed
            # that whole file to read its RNG state.
            extra_files[OBJECTS_TENSOR_FILE] = write_image_subset(
                os.path.join(tag_dir, OBJECTS_TENSOR_FILE), job.image, entries,
                list(job.object_keys))
            objects_in = OBJECTS_TENSOR_FILE
        _remove_quietly(job.done_marker)  # the slot is read: it may be reused
        # --moc-fault persist-crash, armed through the environment (keeper_faults);
        # returns at once in normal runs.
        crash_in_persist_if_due(job.step)
        if job.step >= int(os.environ.get(HANG_PERSIST_ENV, "-1")) >= 0:
            _hang(f"{HANG_PERSIST_ENV}: hanging after writing rank {rank}'s file of {job.tag}")
        objects_record = job.objects_record  # rank 0 wrote the objects itself
        if job.objects_tree is not None:
            objects_record = write_objects_file(tag_dir, job.objects_tree, objects_in).to_json()
        specs = [assemble.FragmentSpec.from_json(s) for s in job.specs]
        report = assemble.RankReport(rank, file_name, record["nbytes"], record["sha256"], specs)
        claims.check_claim(tag_dir, claim)  # the write took long: still this save's?
        commit.write_report(tag_dir, rank, {"report": report.to_json(), "objects": objects_record,
                                            "extra_files": extra_files}, claim=claim)
    except claims.Superseded as e:
        _remove_quietly(job.done_marker)
        log(f"not persisting rank {rank}'s share of {job.tag}: {e}")
        return
    except Exception as e:
        traceback.print_exc()
        _remove_quietly(job.done_marker)
        if _still_ours(tag_dir, claim):
            commit.write_report(tag_dir, rank, None, error=f"{type(e).__name__}: {e}",
                                claim=claim)
        return
    if job.commit is None:
        return
    if background_commit:
        reports_in = threading.Event()
        thread = threading.Thread(target=_commit_job, args=(job, tag_dir, log, reports_in),
                                  daemon=True, name=f"commit-{job.tag}")
        with _GATE.lock:
            _COMMITS[:] = [c for c in _COMMITS if c[0].is_alive()]  # a keeper lives for weeks
            _COMMITS.append(CommitRun(thread, reports_in, job.commit.attempt_started))
        thread.start()
    else:
        _commit_job(job, tag_dir, log)


HANG_PERSIST_ENV = "MOC_FAULT_HANG_PERSIST_STEP"
"""Fault injection: a persist of this step or a later one stops after writing a rank's
file and before its report, until the process is killed (tests SIGKILL a keeper in the
middle of a persist this way). The keeper inherits it from the rank that starts it."""


def _hang(message: str) -> None:
    logger.info(f"[moc keeper {os.getpid()}] {message}")
    while True:
        time.sleep(3600)


class CommitRun(NamedTuple):
    """One background commit of the keeper."""

    thread: threading.Thread
    reports_in: threading.Event
    """Set once every report is in and the gate let it write (manifest, ``latest``,
    retention)."""
    attempt_started: Optional[float] = None
    """The job attempt whose save it commits (None: unknown)."""


_COMMITS: List[CommitRun] = []
"""The keeper's background commits; :func:`commits_to_finish` says which a drain or a
shutdown waits for."""


class _CommitGate:
    """Whether a commit whose reports are all in may start writing, decided under one lock
    with a shutdown's choice of the commits it waits for.

    The failure it prevents: a requested shutdown waited only for the commits whose
    reports were in when it was asked; one whose reports arrived a moment later (another
    node's keeper finishing an earlier attempt's share) went on writing its manifest,
    ``latest`` and retention while the keeper exited under it, after the training side
    had been told that nothing was running any more. Once :meth:`close` ran, a commit
    not chosen then writes nothing (its directory stays a manifest-less leftover for
    retention, as a commit killed with its keeper would)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.closed = False
        self.allowed: set = set()
        """Threads a closing shutdown waits for: they may still write."""

    def enter(self, reports_in: threading.Event) -> bool:
        """A commit thread with every report in: True (``reports_in`` set) to write."""
        with self.lock:
            if self.closed and threading.current_thread() not in self.allowed:
                return False
            reports_in.set()
            return True

    def close(self, attempt_started: Optional[float]) -> List[threading.Thread]:
        """A shutdown: from now on only the returned commits write; join them."""
        with self.lock:
            self.closed = True
            chosen = commits_to_finish(attempt_started)
            self.allowed = set(chosen)
            return chosen

    def reopen(self) -> None:
        """The shutdown was called off (a new job attached): commits write again."""
        with self.lock:
            self.closed = False
            self.allowed = set()


_GATE = _CommitGate()


def commits_to_finish(attempt_started: Optional[float]) -> List[threading.Thread]:
    """The running commits a drain or shutdown asked by attempt ``attempt_started`` waits
    for: those past their reports (writing the manifest, ``latest``, retention), and every
    commit of that attempt (one still waiting for reports is bounded by its commit
    timeout: the training side gave up on it, but it may still commit). A commit of
    another attempt still waiting for reports (a crashed attempt's, waiting for a dead
    node) is not: it would hold the caller for its whole timeout."""
    return [c.thread for c in _COMMITS if c.thread.is_alive() and (
        c.reports_in.is_set()
        or (attempt_started is not None and c.attempt_started == attempt_started))]


def _commit_job(job: PersistJob, tag_dir: str, log,
                reports_in: Optional[threading.Event] = None) -> None:
    from deepspeed_ext.store import claims, commit
    info = job.commit
    claim = job.claim  # rank 0's, from preparing the directory (None: unchecked)
    try:
        shares = commit.wait_for_reports(tag_dir, info.world_size, info.timeout_s, claim=claim)
        if reports_in is not None and not _GATE.enter(reports_in):
            log(f"not committing {tag_dir}: the keeper is shutting down (its reports came "
                f"in after the shutdown was asked for)")
            return
        commit.commit_checkpoint(job.save_dir, job.tag, info.step, dict(info.layout), shares,
                                 info.previous_tag,
                                 [list(p) for p in info.selected]
                                 if info.selected is not None else None,
                                 info.pec_k, info.save_latest, info.keep, log=log,
                                 claim=claim, attempt_started=info.attempt_started)
        commit.remove_reports(tag_dir, info.world_size, claim)
        log(f"committed {tag_dir}")
    except claims.Superseded as e:
        # A restarted job claimed the tag (or retention removed it) while this commit of
        # an earlier attempt waited: its directory is not ours to mark failed.
        log(f"not committing: {e}")
    except Exception as e:
        traceback.print_exc()
        if _still_ours(tag_dir, claim):
            commit.write_failure(tag_dir, f"{type(e).__name__}: {e}", claim=claim)


def join_finishing_commits(attempt_started: Optional[float] = None) -> None:
    """On a requested shutdown: close the gate (:class:`_CommitGate`) and wait for the
    commits :func:`commits_to_finish` names.

    A commit goes on after its manifest (``latest``, retention), and exiting under it
    left ``latest`` at the previous checkpoint and a stray ``latest.tmp.<pid>``: those
    are waited for. A commit of another attempt still waiting for reports is not, and
    stands down should its reports still arrive. (An idle keeper serves on until every
    commit has ended.)
    """
    for thread in _GATE.close(attempt_started):
        thread.join()


def drain_commits(attempt_started: Optional[float] = None) -> None:
    """A drain: wait for the commits :func:`commits_to_finish` names; the keeper serves on."""
    with _GATE.lock:
        chosen = commits_to_finish(attempt_started)
    for thread in chosen:
        thread.join()


def _still_ours(tag_dir: str, claim: Optional[str]) -> bool:
    """Whether a failed writer or commit may mark ``tag_dir`` failed: it was not claimed
    by another save since. An unreadable claim counts as ours: saying that the save
    failed beats leaving the training side to wait for it until the commit timeout."""
    from deepspeed_ext.store import claims
    try:
        claims.check_claim(tag_dir, claim)
        return True
    except claims.Superseded:
        return False
    except claims.CommitError:
        return True


def _remove_quietly(path: Optional[str]) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


# ------------------------------------------------------------------------- keeper process

def _warm_imports() -> None:
    for module in ("deepspeed_ext.format.image", "deepspeed_ext.store.commit",
                   "deepspeed_ext.format.manifest"):
        importlib.import_module(module)


class Keeper:
    """The keeper's state: registered clients, the persist queue, the stop flag."""

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
        :func:`hand_over` comes seconds after its first request; a keeper that lives for
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
            # Liveness counts the process that connected, not a pid it names: another
            # process's pid would keep the keeper (and its memory) alive for ever.
            pid = peer_pid if peer_pid is not None else message.get("pid")
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                return {"ok": False, "error": f"bad pid {pid!r}"}
            with self.clients_lock:
                self.clients.append(pid)
            self.last_client_seen = time.monotonic()
            return {"ok": True}
        if op == "persist":
            try:
                # Parsed and checked before it is queued: a malformed field failed the
                # persist only once the keeper ran it (a KeyError in its log), and a
                # path outside its directories was read or written.
                job = check_job(message.get("job"), self.directory, self.save_dir)
            except JobRefused as e:
                _log(self.directory, f"refused a persist job: {e}")
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
        attempt = message.get("attempt_started")
        if not isinstance(attempt, (int, float)) or isinstance(attempt, bool):
            attempt = None
        if op == "drain":
            # The training side's final wait: every persist asked for written, and every
            # commit of its attempt done (manifest, ``latest``, retention), before it
            # returns; otherwise ``latest`` and retention still changed after the job had
            # ended (a reader or the next job saw the directory mid-commit).
            self.jobs.join()
            drain_commits(attempt)
            return {"ok": True}
        if op == "shutdown":
            self.jobs.join()  # finish every persist already asked for
            join_finishing_commits(attempt)
            with self.clients_lock:
                self.clients_at_stop = set(self.clients)
            self.stop.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def persist_loop(self) -> None:
        # Import the writers now, while training starts up: the first persist would
        # otherwise pay seconds of imports (torch) and fall behind the snapshots. On a
        # side thread, so that frame jobs (plain file copies) need not wait for it.
        threading.Thread(target=_warm_imports, name="imports", daemon=True).start()
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                run_persist_job(job, log=lambda m: _log(self.directory, m), background_commit=True)
            except Exception:
                traceback.print_exc()
            finally:
                self.jobs.task_done()

    def any_client_alive(self) -> bool:
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
        return any(c.thread.is_alive() for c in _COMMITS)


def _serve_connection(keeper: Keeper, conn: socket.socket) -> None:
    with conn:
        conn.settimeout(CONNECTION_TIMEOUT_S)
        peer = peer_credentials(conn)
        if peer is not None and peer[1] != os.geteuid():
            # Another user's process (the directory is 0700, but a socket passed on or
            # a looser parent must not make this keeper obey it).
            _log(keeper.directory, f"refused a connection from pid {peer[0]} of uid {peer[1]}")
            return
        try:
            data = read_line(conn)
        except (OSError, KeeperError) as e:  # silent past the timeout, or too long
            _log(keeper.directory, f"dropped a connection: {e}")
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
    from deepspeed_ext.private_dir import UnsafeDirectoryError, check_private_dir
    try:
        check_private_dir(directory)
    except (OSError, UnsafeDirectoryError) as e:
        _log(directory, f"not serving: {e}")
        return 2
    keeper = Keeper(directory, idle_timeout_s, run_id, save_dir)
    path = socket_path(directory)
    if os.path.lexists(path):
        os.remove(path)  # a dead keeper's socket: nobody answers on it
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(64)
    server.settimeout(0.5)
    worker = threading.Thread(target=keeper.persist_loop, name="persist", daemon=True)
    worker.start()
    _log(directory, f"serving {directory} (idle timeout {idle_timeout_s:.0f} s)")
    while True:
        if keeper.stop.is_set():  # every queued job and finishing commit done (handle)
            if _leave(keeper, directory, server, "shutdown requested"):
                return 0
            keeper.stop.clear()
            _GATE.reopen()
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
                if _leave(keeper, directory, server,
                          f"no training process alive for {idle_timeout_s:.0f} s"):
                    return 0
            continue
        threading.Thread(target=_serve_connection, args=(keeper, conn), daemon=True).start()


def _leave(keeper: Keeper, directory: str, server: socket.socket, reason: str) -> bool:
    """Close the socket and delete the node directory, under the node's lock: a training
    process attaching takes it too (and registers under it), so the keeper neither
    leaves a process that has just attached nor deletes a new keeper's files. Returns
    False (serve on) when a process registered that this exit would strand: any, for an
    idle exit; one that is not of the job that asked, for a requested shutdown; and
    when the lock is held: a process attaching holds it while it waits for this thread
    to answer its ping, so waiting for it here would stall both until its start
    timeout."""
    try:
        lock = _lock_node(directory, wait=False, make=False)
    except OSError as e:  # the directory vanished or was replaced: nothing of ours to delete
        server.close()
        _log(directory, f"exiting ({reason}); cannot lock {directory} ({e}), leaving it")
        return True
    if lock is None:
        _log(directory, f"not exiting ({reason}): a training process is attaching")
        keeper.last_client_seen = time.monotonic()
        return False
    with lock:
        try:
            newcomers = keeper.clients_since_stop() if keeper.stop.is_set() else \
                (keeper.clients if keeper.any_client_alive() else [])
            if newcomers:
                _log(directory, f"not exiting ({reason}): training process(es) "
                                f"{', '.join(map(str, newcomers))} registered meanwhile")
                keeper.last_client_seen = time.monotonic()
                return False
            server.close()
            _log(directory, f"exiting ({reason}); removing {directory}")
            shutil.rmtree(directory, ignore_errors=True)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="MoC per-node snapshot keeper (started by MoC).")
    parser.add_argument("--dir", required=True, help="the node's shared-memory directory")
    parser.add_argument("--idle-timeout", type=float, default=600.0,
                        help="exit when no registered training process is alive for this long")
    parser.add_argument("--run-id", default=None, help="the only job this keeper serves")
    parser.add_argument("--save-dir", default=None,
                        help="the only save directory this keeper persists into")
    opts = parser.parse_args(argv)
    return serve(opts.dir, opts.idle_timeout, opts.run_id, opts.save_dir)


if __name__ == "__main__":
    sys.exit(main())
