"""The per-node keeper: owns the snapshot memory of a node and persists it in the background.

One keeper process runs per node (per ``--moc-ranks-per-node`` group when nodes are
simulated on one machine). It is separate from the training processes, so a training
process that crashes (a software failure) loses nothing: its snapshots stay in the
keeper's directory in shared memory (``/dev/shm``), and the restarted process finds them
there. The keeper also writes snapshots to storage, so training never waits for storage.

Lifecycle:

* :func:`ensure_keeper` is called by every rank of the node at start-up; the first one
  to get the directory lock starts the keeper when nothing listens on its socket
  (``python -m deepspeed_ext.keeper``, in a new session so the launcher's kill of the
  workers does not reach it); the others wait until it answers. A keeper that is only
  slow to answer is waited for: a second keeper would take over the socket, and the
  first would later delete the directory under it.
* Every rank registers its pid (``hello``). The keeper exits on its own when none of
  its registered processes has been alive for ``idle_timeout_s`` (a crashed job
  whose launcher gave up), after finishing its persist queue.
* :func:`shutdown_keeper` (end of training) finishes the queue, deletes the whole
  directory and stops the keeper: no shared memory is left behind.

Protocol: JSON lines over the Unix socket ``<dir>/keeper.sock`` (never pickle). Requests:
``{"op": "ping"}``, ``{"op": "hello", "pid": N}``, ``{"op": "persist", "job": {...}}``
(see :func:`run_persist_job`; a job with an ``id`` already queued is not queued again),
``{"op": "shutdown"}``. Every reply is a JSON object with
``"ok"``.
"""

import argparse
import collections
import importlib
import fcntl
import json
import mmap
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Dict, List, Optional, Tuple

SOCKET_NAME = "keeper.sock"
LOG_NAME = "keeper.log"
LOCK_NAME = "keeper.lock"
RECENT_JOB_IDS = 4096
"""Persist job ids a keeper remembers to drop retried requests (see :func:`hand_over`)."""


class KeeperError(RuntimeError):
    """The keeper could not be started or reached."""


def _log(directory: str, message: str) -> None:
    print(f"[moc keeper {os.getpid()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------- client side

def read_line(sock: socket.socket) -> bytes:
    """Bytes from ``sock`` up to and including the first newline (a protocol message),
    or what came before the peer closed (no newline then)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def request(directory: str, message: Dict[str, Any], timeout_s: float = 10.0) -> Dict[str, Any]:
    """Send one request to the keeper of ``directory`` and return its reply.

    Raises:
        KeeperError: no keeper listens there (it died or was never started), or it
            answered with an error.
    """
    path = os.path.join(directory, SOCKET_NAME)
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
    except ValueError:
        raise KeeperError(f"keeper at {path} sent a malformed reply") from None
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
    deadline = time.monotonic() + patience_s
    delay = 0.05
    while True:
        try:
            request(directory, {"op": "persist", "job": job}, timeout_s=timeout_s)
            return True
        except KeeperError as e:
            if is_dead(directory):
                return False
            if time.monotonic() >= deadline:
                raise KeeperError(f"the keeper of {directory} still listens but took no "
                                  f"request within {patience_s:.0f} s ({e})") from None
        # A request failing fast (a full backlog) would otherwise spin for patience_s,
        # taking the GIL from the training step.
        time.sleep(delay)
        delay = min(1.0, delay * 2)


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
    path = os.path.join(directory, SOCKET_NAME)
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
                  start_timeout_s: float = 60.0) -> None:
    """Make sure a keeper serves ``directory`` and register this process with it.

    Every rank of the node calls it; a file lock makes exactly one of them start the
    keeper when nothing listens on its socket (the others, and later restarts, attach
    to it; a keeper that is only slow to answer is waited for, never replaced).

    Raises:
        KeeperError: the keeper did not answer within ``start_timeout_s`` (its log is
            named).
    """
    lock = _lock_node(directory)
    with lock:
        try:
            # Start one only when nothing listens. A keeper that is slow to answer (busy
            # persisting on a loaded node) is still the node's keeper: a second one would
            # take over its socket, and the first would later delete the directory.
            if is_dead(directory):
                _spawn(directory, idle_timeout_s)
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
            request(directory, {"op": "hello", "pid": os.getpid()})
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_node(directory: str, wait: bool = True):
    """The node directory's lock file, open and exclusively locked (None: another
    process holds it and ``wait`` is False). Retried when the file was replaced while
    this process waited (an exiting keeper deleted the directory): a lock on the
    deleted file would exclude nobody who comes later."""
    while True:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        lock = open(path, "a")
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


def _spawn(directory: str, idle_timeout_s: float) -> None:
    log = open(os.path.join(directory, LOG_NAME), "a")
    env = dict(os.environ)
    # The keeper must import deepspeed_ext from wherever this process did.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.Popen([sys.executable, "-m", "deepspeed_ext.keeper", "--dir", directory,
                      "--idle-timeout", str(idle_timeout_s)],
                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True, close_fds=True, env=env)
    log.close()


def shutdown_keeper(directory: str, timeout_s: float = 600.0) -> bool:
    """Ask the keeper to finish its queue, delete ``directory`` and exit.

    Returns:
        True when a keeper answered; False when none was running (its directory, if
        any, is then deleted here so no shared memory is left).
    """
    try:
        request(directory, {"op": "shutdown"}, timeout_s=timeout_s)
    except KeeperError:
        if is_dead(directory):
            shutil.rmtree(directory, ignore_errors=True)
        # else: alive but slow (its queue or a commit outlasted the timeout): deleting the
        # directory under it would remove the snapshots it is still persisting; it exits
        # on its own once no training process is alive.
        return False
    # The keeper deletes the directory right after answering; wait for it, so that a
    # caller checking for leftovers (or starting the next job) sees it gone.
    deadline = time.monotonic() + 30
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------------- persist jobs

def write_image_subset(path: str, image_path: str, entries: List[Dict[str, Any]],
                       keys: Optional[List[str]]) -> Dict[str, Any]:
    """Write the tensors ``keys`` of the image file ``image_path`` as a safetensors file.

    ``entries`` is the image's layout (``key``, ``dtype``, ``shape``, ``start``,
    ``nbytes``); ``keys`` None writes every tensor. The output is written atomically
    (temp, fsync, rename) and its record returned.
    """
    from deepspeed_ext.image import layout_image
    from deepspeed_ext.storage import write_image_file, FileRecord
    chosen = [e for e in entries if keys is None or e["key"] in set(keys)]
    layout = layout_image([(e["key"], tuple(e["shape"]), e["dtype"]) for e in chosen])
    by_key = {e["key"]: e for e in chosen}
    with open(image_path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
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


def persist_frame(job: Dict[str, Any]) -> None:
    """Copy one exact-recovery frame of one rank from memory to storage: the data file
    (temp file, fsync, rename), then its marker, last (``deepspeed_ext.exact``).

    ``job`` fields: ``kind`` ``"frame"``, ``data`` and ``marker`` (the files in memory),
    ``dst_data`` and ``dst_marker`` (their storage paths). Once both are on storage, a
    ``.copied`` file beside the marker in memory tells the rank it may retire the memory
    copy (``deepspeed_ext.exact``). A frame whose memory copy was already deleted (a lost
    node, or retired after waiting too long for this copy) is skipped, with a line in the
    keeper's log: its window stays incomplete on storage and recovery does not use it.
    """
    try:
        with open(job["data"], "rb") as f:
            data = f.read()
        with open(job["marker"], "rb") as f:
            marker = f.read()
    except FileNotFoundError:
        print(f"[moc keeper {os.getpid()}] WARNING: {job['marker']} was gone before it "
              f"reached storage; its window stays incomplete there", flush=True)
        return
    os.makedirs(os.path.dirname(job["dst_data"]), exist_ok=True)
    _write_durably(job["dst_data"], data)
    _write_durably(job["dst_marker"], marker)
    try:
        with open(copied_marker(job["marker"]), "w"):
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
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_persist_job(job: Dict[str, Any], log=print, background_commit: bool = False) -> None:
    """Persist one rank's snapshot and, for the committing rank, commit the checkpoint.

    ``job`` fields: ``image`` (slot file), ``entries`` (its layout), ``keys`` (the
    tensors to persist, None: all), ``specs`` (their manifest fragment specs),
    ``save_dir``, ``tag``, ``step``, ``rank``, ``claim`` (the save's claim on the tag
    directory, from rank 0; None: unchecked), ``objects_tree`` (rank 0, else None),
    ``object_keys`` (rank 0: the image's tensors of the objects, written to
    ``objects.safetensors``; ``objects_in_file`` in jobs of older versions: they are in
    the rank file), ``objects_record`` and ``extra_files`` (rank 0, when it wrote the
    objects itself: their records), ``done_marker`` (a file deleted once the slot has been read,
    so the training side may reuse it), and for rank 0 ``commit`` (arguments of
    :func:`deepspeed_ext.commit.commit_checkpoint` plus ``timeout_s``).

    Args:
        background_commit: wait for the other ranks' reports on a separate thread. The
            keeper needs it: the reports of its other local ranks are written by jobs
            queued behind this one, so waiting here would deadlock its queue.
    """
    if job.get("kind") == "frame":
        persist_frame(job)
        return
    from deepspeed_ext import commit
    from deepspeed_ext import manifest as mf
    from deepspeed_ext.objects import OBJECTS_TENSOR_FILE, write_objects_file
    tag_dir = os.path.join(job["save_dir"], job["tag"])
    rank = job["rank"]
    claim = job.get("claim")
    file_name = mf.rank_file_name(rank)
    try:
        # A job of an earlier attempt still queued when the restarted job saved the same
        # tag again: writing now would put the old attempt's file into the new save.
        commit.check_claim(tag_dir, claim)
        record = write_image_subset(os.path.join(tag_dir, file_name), job["image"],
                                    job["entries"], job["keys"])
        extra_files = dict(job.get("extra_files") or {})
        objects_in = file_name if job.get("objects_in_file") else None  # an older job
        if job.get("object_keys"):
            # Their own small file: in rank 0's share, every rank of a load checksummed
            # that whole file to read its RNG state.
            extra_files[OBJECTS_TENSOR_FILE] = write_image_subset(
                os.path.join(tag_dir, OBJECTS_TENSOR_FILE), job["image"], job["entries"],
                job["object_keys"])
            objects_in = OBJECTS_TENSOR_FILE
        _remove_quietly(job.get("done_marker"))  # the slot is read: it may be reused
        if os.environ.get(CRASH_PERSIST_ENV):
            # The trainer's --moc-fault persist-crash armed this keeper (never in normal
            # runs, so the keeper does not depend on the trainer's package otherwise).
            from megatron.training.faults import crash_in_persist_if_due
            crash_in_persist_if_due(job["step"])
        if job["step"] >= int(os.environ.get(HANG_PERSIST_ENV, "-1")) >= 0:
            _hang(f"{HANG_PERSIST_ENV}: hanging after writing rank {rank}'s file of {job['tag']}")
        objects_record = job.get("objects_record")  # rank 0 wrote the objects itself
        if job.get("objects_tree") is not None:
            objects_record = write_objects_file(tag_dir, job["objects_tree"], objects_in).to_json()
        specs = [mf.FragmentSpec.from_json(s) for s in job["specs"]]
        report = mf.RankReport(rank, file_name, record["nbytes"], record["sha256"], specs)
        commit.check_claim(tag_dir, claim)  # the write took long: still this save's?
        commit.write_report(tag_dir, rank, {"report": report.to_json(), "objects": objects_record,
                                            "extra_files": extra_files}, claim=claim)
    except commit.Superseded as e:
        _remove_quietly(job.get("done_marker"))
        log(f"not persisting rank {rank}'s share of {job['tag']}: {e}")
        return
    except Exception as e:
        traceback.print_exc()
        _remove_quietly(job.get("done_marker"))
        if _still_ours(tag_dir, claim):
            commit.write_report(tag_dir, rank, None, error=f"{type(e).__name__}: {e}",
                                claim=claim)
        return
    if job.get("commit") is None:
        return
    if background_commit:
        reports_in = threading.Event()
        thread = threading.Thread(target=_commit_job, args=(job, tag_dir, log, reports_in),
                                  daemon=True, name=f"commit-{job['tag']}")
        _COMMITS[:] = [c for c in _COMMITS if c[0].is_alive()]  # a keeper lives for weeks
        _COMMITS.append((thread, reports_in))
        thread.start()
    else:
        _commit_job(job, tag_dir, log)


CRASH_PERSIST_ENV = "MOC_FAULT_CRASH_PERSIST_STEP"
"""Fault injection (``--moc-fault persist-crash@N``, armed by
:meth:`megatron.training.faults.FaultInjector.persist_env`): the keeper SIGKILLs itself
while persisting the snapshot of step N or later, once per job."""

HANG_PERSIST_ENV = "MOC_FAULT_HANG_PERSIST_STEP"
"""Fault injection: a persist of this step or a later one stops after writing a rank's
file and before its report, until the process is killed (tests SIGKILL a keeper in the
middle of a persist this way). The keeper inherits it from the rank that starts it."""


def _hang(message: str) -> None:
    print(f"[moc keeper {os.getpid()}] {message}", flush=True)
    while True:
        time.sleep(3600)


_COMMITS: List[Tuple[threading.Thread, threading.Event]] = []
"""The keeper's background commits, each with the event set once every report is in (it
is then writing the manifest, ``latest`` and retention); :func:`serve` decides at exit
which to wait for."""


def _commit_job(job: Dict[str, Any], tag_dir: str, log,
                reports_in: Optional[threading.Event] = None) -> None:
    from deepspeed_ext import commit
    info = job["commit"]
    claim = job.get("claim")  # rank 0's, from preparing the directory (None: unchecked)
    try:
        shares = commit.wait_for_reports(tag_dir, info["layout"]["world_size"], info["timeout_s"],
                                         claim=claim)
        if reports_in is not None:
            reports_in.set()
        commit.commit_checkpoint(job["save_dir"], job["tag"], info["step"], info["layout"],
                                 shares, info["previous_tag"], info["selected"],
                                 info["pec_k"], info["save_latest"], info["keep"], log=log,
                                 claim=claim, attempt_started=info.get("attempt_started"))
        commit.remove_reports(tag_dir, info["layout"]["world_size"], claim)
        log(f"committed {tag_dir}")
    except commit.Superseded as e:
        # A restarted job claimed the tag (or retention removed it) while this commit of
        # an earlier attempt waited: its directory is not ours to mark failed.
        log(f"not committing: {e}")
    except Exception as e:
        traceback.print_exc()
        if _still_ours(tag_dir, claim):
            commit.write_failure(tag_dir, f"{type(e).__name__}: {e}", claim=claim)


def join_finishing_commits() -> None:
    """On a requested shutdown: wait for the background commits whose reports are all in.

    The training processes have seen the manifest of every commit they asked for, so a
    commit still waiting for reports belongs to an attempt that crashed, and would hold
    the exiting keeper for its whole timeout; but a commit goes on after its manifest
    (``latest``, retention), and exiting under it left ``latest`` at the previous
    checkpoint and a stray ``latest.tmp.<pid>``: those are waited for. (An idle keeper
    serves on until every commit has ended.)
    """
    for thread, reports_in in list(_COMMITS):
        if reports_in.is_set():
            thread.join()


def _still_ours(tag_dir: str, claim: Optional[str]) -> bool:
    """Whether a failed writer or commit may mark ``tag_dir`` failed: it was not claimed
    by another save since. An unreadable claim counts as ours: saying that the save
    failed beats leaving the training side to wait for it until the commit timeout."""
    from deepspeed_ext import commit
    try:
        commit.check_claim(tag_dir, claim)
        return True
    except commit.Superseded:
        return False
    except commit.CommitError:
        return True


def _remove_quietly(path: Optional[str]) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


# ------------------------------------------------------------------------- keeper process

def _warm_imports() -> None:
    for module in ("deepspeed_ext.image", "deepspeed_ext.commit", "deepspeed_ext.manifest"):
        importlib.import_module(module)


class Keeper:
    """The keeper's state: registered clients, the persist queue, the stop flag."""

    def __init__(self, directory: str, idle_timeout_s: float):
        self.directory = directory
        self.idle_timeout_s = idle_timeout_s
        self.clients: List[int] = []
        self.clients_lock = threading.Lock()
        self.clients_at_stop: set = set()
        self.jobs: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
        self.ids_lock = threading.Lock()
        self.job_ids: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        """``id`` of the last :data:`RECENT_JOB_IDS` persist jobs queued (a retry of
        :func:`hand_over` comes seconds after its first request; a keeper that lives for
        weeks must not keep every id)."""
        self.busy = threading.Event()
        self.stop = threading.Event()
        self.last_client_seen = time.monotonic()

    def handle(self, message: Dict[str, Any]) -> Dict[str, Any]:
        op = message.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "hello":
            with self.clients_lock:
                self.clients.append(int(message["pid"]))
            self.last_client_seen = time.monotonic()
            return {"ok": True}
        if op == "persist":
            job = message["job"]
            # Each connection has its own thread: a retry can be handled while the slow
            # first request still is, so checking and recording an id is one step.
            with self.ids_lock:
                if job.get("id") is not None:
                    if job["id"] in self.job_ids:  # a retry of a request that did arrive
                        return {"ok": True, "queued": self.jobs.qsize(), "duplicate": True}
                    self.job_ids[job["id"]] = None
                    while len(self.job_ids) > RECENT_JOB_IDS:
                        self.job_ids.popitem(last=False)
                self.jobs.put(job)
            return {"ok": True, "queued": self.jobs.qsize()}
        if op == "shutdown":
            self.jobs.join()  # finish every persist already asked for
            join_finishing_commits()
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
                try:
                    os.kill(pid, 0)
                    living.append(pid)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    living.append(pid)
            self.clients = living
            return bool(living)

    def clients_since_stop(self) -> List[int]:
        """Living processes that registered after the shutdown request (a new job's)."""
        self.any_client_alive()
        with self.clients_lock:
            return [pid for pid in self.clients if pid not in self.clients_at_stop]

    def commits_running(self) -> bool:
        return any(thread.is_alive() for thread, _ in _COMMITS)


def _serve_connection(keeper: Keeper, conn: socket.socket) -> None:
    with conn:
        data = read_line(conn)
        if not data.endswith(b"\n"):
            return  # closed early (a connect-only probe of is_dead, or a client that died)
        try:
            reply = keeper.handle(json.loads(data))
        except Exception as e:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


def serve(directory: str, idle_timeout_s: float) -> int:
    """The keeper's main loop; returns when shut down or idle."""
    keeper = Keeper(directory, idle_timeout_s)
    path = os.path.join(directory, SOCKET_NAME)
    if os.path.exists(path):
        os.remove(path)  # a dead keeper's socket: nobody answers on it
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
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
    lock = _lock_node(directory, wait=False)
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
    opts = parser.parse_args(argv)
    return serve(opts.dir, opts.idle_timeout)


if __name__ == "__main__":
    sys.exit(main())
