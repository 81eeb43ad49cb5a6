"""The keeper's start-up rule: one keeper per node directory, even when it answers slowly."""

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from deepspeed_ext import keeper
from deepspeed_ext.keeper import bootstrap, client, commits
from deepspeed_ext.keeper import server as keeper_server


class _FakeKeeper:
    """Listens on ``<dir>/keeper.sock`` like a keeper; the first answer comes ``delay_s`` late
    (a keeper busy persisting on a loaded node), the later ones at once."""

    def __init__(self, directory, delay_s):
        self.path = os.path.join(directory, keeper.SOCKET_NAME)
        if os.path.exists(self.path):
            os.remove(self.path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(8)
        self.delay_s = delay_s
        self.ops = []
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            # A thread per connection, as the keeper does: a slow answer holds up no other.
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            data = keeper.read_line(conn)
            if not data:
                return  # a connect-only probe (keeper.is_dead), as the keeper allows
            with self.lock:
                self.ops.append(json.loads(data)["op"])
                first = len(self.ops) == 1
            if first:
                time.sleep(self.delay_s)
            try:
                conn.sendall(json.dumps({"ok": True, "pid": os.getpid()}).encode() + b"\n")
            except OSError:
                pass

    def close(self):
        self.server.close()


def _job(directory, job_id, tag="global_step3"):
    """A well-formed persist job of ``directory``'s keeper (its checks refuse others)."""
    return {"id": job_id, "tag": tag, "rank": 0, "step": 3, "save_dir": str(directory),
            "image": os.path.join(str(directory), "rank00000", "slot0.img"), "entries": [],
            "keys": None, "specs": []}


def test_a_keeper_slow_to_answer_is_not_replaced(tmp_path, monkeypatch):
    """The running keeper answers its first ping after 2.5 s, past the ping's 2 s timeout:
    ensure_keeper must wait for it, not start a second keeper on the same directory."""
    spawned = []
    monkeypatch.setattr(bootstrap, "spawn", lambda d, t, *rest: spawned.append(d))
    fake = _FakeKeeper(str(tmp_path), delay_s=2.5)
    try:
        start = time.monotonic()
        keeper.ensure_keeper(str(tmp_path), start_timeout_s=30)
        assert spawned == []
        assert time.monotonic() - start >= 2.0  # it did wait through the slow answer
        assert fake.ops[-1] == "hello"  # and registered with the running keeper
    finally:
        fake.close()


def test_a_dead_keepers_socket_gets_a_new_keeper(tmp_path, monkeypatch):
    """A socket file nobody listens on (its keeper was SIGKILLed): a new keeper is started,
    and ensure_keeper returns once it answers."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.path.join(str(tmp_path), keeper.SOCKET_NAME))
    dead.close()  # the file stays, nothing listens: connect is refused
    started = []

    def spawn(directory, idle_timeout_s, *rest):
        started.append(_FakeKeeper(directory, delay_s=0))
    monkeypatch.setattr(bootstrap, "spawn", spawn)
    try:
        keeper.ensure_keeper(str(tmp_path), start_timeout_s=30)
        assert len(started) == 1 and started[0].ops[-1] == "hello"
    finally:
        for fake in started:
            fake.close()


def test_a_persist_handed_to_a_slow_keeper_is_sent_again_and_queued_once(tmp_path):
    """The keeper's first answer comes after the request's timeout: hand_over asks again
    instead of giving the keeper up, and the keeper queues the job's id once."""
    fake = _FakeKeeper(str(tmp_path), delay_s=1.0)
    try:
        job = _job(tmp_path, "global_step3:rank0")
        assert keeper.hand_over(str(tmp_path), job, patience_s=30, timeout_s=0.3)
        assert fake.ops == ["persist", "persist"]
    finally:
        fake.close()
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
    for _ in range(2):
        assert real.handle({"op": "persist", "job": job})["ok"]
    assert real.jobs.qsize() == 1
    assert real.handle({"op": "persist", "job": _job(tmp_path, "global_step4:rank0")})["queued"] == 2
    for i in range(keeper.RECENT_JOB_IDS):  # only recent ids are kept
        real.handle({"op": "persist", "job": _job(tmp_path, f"later{i}")})
    assert len(real.job_ids) == keeper.RECENT_JOB_IDS and job["id"] not in real.job_ids


def test_a_persist_is_not_handed_to_a_dead_keeper(tmp_path, monkeypatch):
    """Nothing listens: hand_over gives up after one request, without the retries a
    busy keeper gets (the caller persists itself)."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.path.join(str(tmp_path), keeper.SOCKET_NAME))
    dead.close()
    real, sent = keeper.request, []

    def counting(directory, message, timeout_s=10.0):
        sent.append(message["op"])
        return real(directory, message, timeout_s)
    monkeypatch.setattr(client, "request", counting)
    assert not keeper.hand_over(str(tmp_path), {"id": "x"}, patience_s=30, timeout_s=5)
    assert sent == ["persist"]


def test_a_shutdown_waits_for_commits_past_their_reports_only(tmp_path, monkeypatch):
    """The training side asks for the shutdown once it has seen its last manifest, but the
    commit goes on after it (``latest``, retention): the keeper answers only when that
    commit is done. A commit still waiting for reports (a crashed attempt's) is not
    waited for: it would hold the shutdown for its whole timeout."""
    from deepspeed_ext.store import commit
    finished = []

    def slow_commit(save_dir, tag, *args, **kwargs):
        time.sleep(0.5)  # writing latest, running retention
        finished.append(tag)

    monkeypatch.setattr(commit, "commit_checkpoint", slow_commit)
    monkeypatch.setattr(commits, "COMMITS", [])
    monkeypatch.setattr(commits, "GATE", commits.CommitGate())

    def job(tag):
        return _commit_of(tmp_path, tag, None)

    for tag in ("global_step1", "global_step2"):
        reports_in = threading.Event()
        thread = threading.Thread(target=keeper.commit_job,
                                  args=(job(tag), str(tmp_path / tag), print, reports_in),
                                  daemon=True)
        commits.COMMITS.append(keeper.CommitRun(thread, reports_in))
        thread.start()
    commit.write_report(str(tmp_path / "global_step1"), 0, {"report": None})  # step 2 never
    for _ in range(200):
        if commits.COMMITS[0][1].is_set():
            break
        time.sleep(0.01)
    start = time.monotonic()
    reply = keeper.Keeper(str(tmp_path), 60.0).handle({"op": "shutdown"})
    assert reply == {"ok": True}
    assert finished == ["global_step1"]
    assert time.monotonic() - start < 30


def test_a_keeper_that_listens_but_never_answers_fails_the_hand_over(tmp_path):
    """Alive but silent past the patience: the job may sit in its queue, so the caller
    must fail the persist instead of writing the slot itself as well (two writers of one
    slot let the slower read a slot the next snapshot reused). Before, hand_over
    returned False after two requests and the caller persisted in-process."""
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listens, never accepts
    stuck.bind(os.path.join(str(tmp_path), keeper.SOCKET_NAME))
    stuck.listen(64)
    try:
        start = time.monotonic()
        with pytest.raises(keeper.KeeperError, match="still listens but took no request"):
            keeper.hand_over(str(tmp_path), {"id": "x"}, patience_s=0.5, timeout_s=0.2)
        assert time.monotonic() - start < 10
    finally:
        stuck.close()


def test_job_ids_repeat_for_retries_but_not_across_processes(tmp_path):
    """A restarted attempt saving a tag (or taking a frame) again: the keeper that
    outlived the first attempt must queue its job, not drop it as a retry; in another
    process, or in the same one (an in-job restart's survivor) with a later attempt."""
    ours = keeper.job_id("global_step150", 3)
    assert keeper.job_id("global_step150", 3) == ours  # a retry of this process
    theirs = subprocess.run([sys.executable, "-c", "from deepspeed_ext import keeper; "
                             "print(keeper.job_id('global_step150', 3))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert theirs.startswith("global_step150:") and theirs != ours
    # an in-job restart's survivor: the same process, a new attempt (its start time)
    assert keeper.job_id("global_step150", 3, 1700000000.25) != \
        keeper.job_id("global_step150", 3, 1700000042.5)
    assert keeper.job_id("global_step150", 3, 1700000000.25) == \
        keeper.job_id("global_step150", 3, 1700000000.25)
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
    for job_id in (theirs, ours, ours):
        assert real.handle({"op": "persist", "job": _job(tmp_path, job_id)})["ok"]
    assert real.jobs.qsize() == 2


def test_an_idle_keeper_serves_on_while_a_commit_runs_then_leaves(tmp_path, monkeypatch):
    """No training process alive past the idle timeout, but a commit still waits for
    other nodes' reports: the keeper used to stop answering (its socket still there)
    while it joined it, so a restarting job's ranks failed to attach for a minute. It
    now answers until the commit ends, then deletes its directory."""
    node = tmp_path / "node0"
    node.mkdir(mode=0o700)
    done = threading.Event()
    commit = threading.Thread(target=done.wait, args=(30,), daemon=True)
    commit.start()
    monkeypatch.setattr(commits, "COMMITS", [keeper.CommitRun(commit, threading.Event())])
    served = threading.Thread(target=keeper.serve, args=(str(node), 0.2), daemon=True)
    served.start()
    deadline = time.monotonic() + 30
    while not keeper.alive(str(node)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2.0)  # long past the idle timeout
    assert keeper.alive(str(node)) and served.is_alive()
    done.set()
    served.join(30)
    assert not served.is_alive() and not node.exists()


def test_a_process_registering_during_a_shutdown_keeps_the_keeper(tmp_path):
    """A new job's rank attaches while the previous job's shutdown is under way: the
    keeper must not delete the directory under it (attaching and leaving both take the
    node's lock; the newcomer is seen)."""
    node = tmp_path / "node0"
    node.mkdir(mode=0o700)
    real = keeper.Keeper(str(node), idle_timeout_s=60)
    old_job = subprocess.Popen(["sleep", "30"])
    try:
        real.handle({"op": "hello", "pid": old_job.pid})
        real.handle({"op": "shutdown"})
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        real.handle({"op": "hello", "pid": os.getpid()})  # the new job's rank
        assert not keeper.leave(real, str(node), server, "shutdown requested")
        assert node.exists()
        real.clients.remove(os.getpid())  # only the old job's process remains
        assert keeper.leave(real, str(node), server, "shutdown requested")
        assert not node.exists()
    finally:
        old_job.kill()
        old_job.wait()


def test_attaching_retries_a_lock_file_deleted_while_it_waited(tmp_path):
    """An exiting keeper deletes the directory while a rank waits for its lock: the rank
    must lock the new file, not the deleted one (which would exclude nobody after it)."""
    node = tmp_path / "node0"
    held = keeper.lock_node(str(node))
    got = []
    waiter = threading.Thread(target=lambda: got.append(keeper.lock_node(str(node))),
                              daemon=True)  # a rank stuck on the lock must not hold pytest
    waiter.start()
    time.sleep(0.3)
    shutil.rmtree(node)
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()
    waiter.join(10)
    assert got, "the waiting rank never got the new lock"
    lock = got[0]
    assert os.fstat(lock.fileno()).st_ino == os.stat(node / keeper.LOCK_NAME).st_ino
    lock.close()


def test_an_exiting_keeper_serves_on_while_a_process_attaches(tmp_path):
    """A rank attaching holds the node's lock while it waits for the keeper to answer its
    ping; a keeper deciding to exit then must not wait for that lock (it would answer no
    one until the rank's start timeout, and the restart would fail)."""
    from types import SimpleNamespace
    node = tmp_path / "node0"
    attaching = keeper.lock_node(str(node))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle = SimpleNamespace(last_client_seen=0.0)
    left = []
    try:
        leaving = threading.Thread(  # a daemon: a keeper stuck on the lock fails, not hangs
            target=lambda: left.append(keeper.leave(idle, str(node), server, "idle")),
            daemon=True)
        leaving.start()
        leaving.join(5)
        assert left == [False], "the exiting keeper waited for the attaching process's lock"
        assert node.is_dir() and server.fileno() != -1  # still serving
        assert idle.last_client_seen > 0
    finally:
        server.close()
        attaching.close()


# --------------------------------------------------------------------- shared-node safety

def test_jobs_whose_paths_leave_their_directories_are_refused(tmp_path):
    """A job may name only files in the keeper's directory (memory) and in its own save
    directory (storage): today's attack copied /etc/hostname to a path of the caller's
    choice and created /etc/hostname.copied."""
    from deepspeed_ext.keeper.job_checks import JobRefused, check_job
    node, save = str(tmp_path / "node0"), str(tmp_path / "ckpt")
    os.makedirs(node)
    good = {"tag": "global_step3", "rank": 0, "step": 3, "save_dir": save, "specs": [],
            "image": os.path.join(node, "rank00000", "slot0.img"), "keys": None,
            "entries": [{"key": "w", "dtype": "float32", "shape": [2], "start": 0, "nbytes": 8}]}
    check_job(good, node)
    frame = {"kind": "frame", "data": os.path.join(node, "exact", "frame00000003", "rank00000.safetensors"),
             "marker": os.path.join(node, "exact", "frame00000003", "rank00000.json"),
             "dst_data": os.path.join(save, "exact", "frame00000003", "rank00000.safetensors"),
             "dst_marker": os.path.join(save, "exact", "frame00000003", "rank00000.json"),
             "save_dir": save}
    check_job(frame, node)
    os.symlink("/etc", os.path.join(node, "escape"))
    bad = [dict(good, image="/etc/hostname"),
           dict(good, image=os.path.join(node, "..", "other", "slot0.img")),
           dict(good, image=os.path.join(node, "escape", "hostname")),  # a link out
           dict(good, done_marker="/etc/passwd"),
           dict(good, tag="../../etc"),
           dict(good, tag="/etc"),
           dict(good, save_dir=None),
           dict(good, entries=[{"key": "w", "dtype": "float32", "shape": [2], "start": -8,
                                "nbytes": 8}]),
           dict(good, extra_files={"../x": {}}),
           dict(frame, data="/etc/hostname"),
           dict(frame, marker="/etc/hostname"),
           dict(frame, dst_data="/tmp/anywhere"),
           dict(frame, dst_marker=os.path.join(save, "elsewhere.json")),
           "not a job"]
    for job in bad:
        with pytest.raises(JobRefused):
            check_job(job, node)
    with pytest.raises(JobRefused, match="not this job's save directory"):
        check_job(good, node, save_dir=str(tmp_path / "another"))
    real = keeper.Keeper(node, idle_timeout_s=60)
    reply = real.handle({"op": "persist", "job": dict(frame, data="/etc/hostname")})
    assert not reply["ok"] and "refused" in reply["error"] and real.jobs.qsize() == 0


def test_a_keeper_started_for_a_job_answers_only_that_job(tmp_path):
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60, run_id="a" * 32)
    assert real.handle({"op": "ping"})["ok"]
    for op in ("hello", "persist", "shutdown"):
        for run in (None, "b" * 32):
            message = {"op": op, "pid": os.getpid(), "job": _job(tmp_path, op)}
            if run:
                message["run_id"] = run
            assert not real.handle(message)["ok"]
    assert real.handle({"op": "hello", "pid": os.getpid(), "run_id": "a" * 32})["ok"]
    assert not real.stop.is_set() and real.jobs.qsize() == 0


def test_liveness_counts_only_this_users_processes(tmp_path):
    """Another user's process (or a pid reused by one) must not keep the keeper and its
    memory alive: root may signal it, so signal 0 alone said 'alive'."""
    from tests.other_user import start_as_other_user
    theirs = start_as_other_user(["sleep", "60"])
    try:
        real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
        real.handle({"op": "hello", "pid": theirs.pid})
        assert not real.any_client_alive()
        real.handle({"op": "hello", "pid": os.getpid()})
        assert real.any_client_alive() and real.clients == [os.getpid()]
    finally:
        theirs.kill()
        theirs.wait()


def test_hello_registers_the_connecting_process_not_the_pid_it_names(tmp_path):
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
    real.handle({"op": "hello", "pid": 1}, peer_pid=os.getpid())
    assert real.clients == [os.getpid()]


def test_requests_are_bounded_in_size_and_time(tmp_path, monkeypatch):
    """A request that never ends its line is cut off (it grew the keeper's memory without
    bound), and a connection that sends nothing is closed (its thread lived for ever)."""
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x" * 5000)
        with pytest.raises(keeper.KeeperError, match="longer than"):
            keeper.read_line(right, limit=1000)
    monkeypatch.setattr(keeper_server, "CONNECTION_TIMEOUT_S", 0.5)
    node = tmp_path / "node0"
    node.mkdir(mode=0o700)
    served = threading.Thread(target=keeper.serve, args=(str(node), 60), daemon=True)
    served.start()
    try:
        deadline = time.monotonic() + 30
        while not keeper.alive(str(node)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.settimeout(10)
            silent.connect(str(node / keeper.SOCKET_NAME))
            start = time.monotonic()
            assert silent.recv(1) == b""  # closed by the keeper, not by this timeout
            assert time.monotonic() - start < 5
    finally:
        keeper.shutdown_keeper(str(node), 30)


def test_a_connection_from_another_user_is_refused(tmp_path):
    """Peer credentials: even when the socket is reachable (a looser directory, a socket
    passed on), a process of another user gets no answer and nothing is queued."""
    from tests.other_user import other_user, run_as_other_user, shared_tmp
    other_user()
    shared = shared_tmp()
    os.mkdir(os.path.join(shared, "shm"), 0o700)
    node = os.path.join(shared, "shm", "node0")
    os.mkdir(node, 0o700)
    served = threading.Thread(target=keeper.serve, args=(node, 60), daemon=True)
    served.start()
    try:
        deadline = time.monotonic() + 30
        while not keeper.alive(node):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for directory in (os.path.dirname(node), node):  # reachable by path (checked at start only)
            os.chmod(directory, 0o711)
        os.chmod(os.path.join(node, keeper.SOCKET_NAME), 0o666)
        job = {"kind": "frame", "data": "/etc/hostname", "marker": "/etc/hostname",
               "dst_data": os.path.join(shared, "stolen"), "dst_marker": os.path.join(shared, "m"),
               "save_dir": shared}
        tried = run_as_other_user(
            "import json, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
            "try:\n"
            "    s.sendall(json.dumps({'op': 'persist', 'job': json.loads(sys.argv[2])}).encode() + b'\\n')\n"
            "    print(repr(s.recv(4096)))\n"
            "except (ConnectionResetError, BrokenPipeError):\n"
            "    print(repr(b''))\n",
            os.path.join(node, keeper.SOCKET_NAME), json.dumps(job))
        assert tried.returncode == 0, tried.stderr
        assert tried.stdout.strip() == "b''"  # no answer at all
        time.sleep(0.5)
        assert not os.path.exists(os.path.join(shared, "stolen"))
    finally:
        for directory in (os.path.dirname(node), node):
            os.chmod(directory, 0o700)
        keeper.shutdown_keeper(node, 30)
        shutil.rmtree(shared, ignore_errors=True)


def test_the_keeper_does_not_import_a_deepspeed_ext_from_the_working_directory(tmp_path, monkeypatch):
    """``python -m deepspeed_ext.keeper`` put the job's working directory first on the path:
    a ``deepspeed_ext`` there ran in place of ours."""
    evil = tmp_path / "cwd" / "deepspeed_ext"
    evil.mkdir(parents=True)
    marker = tmp_path / "imported"
    (evil / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (evil / "keeper.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PYTHONPATH", "")
    node = tmp_path / "shm" / "node0"
    try:
        keeper.ensure_keeper(str(node), idle_timeout_s=60, start_timeout_s=60)
        assert keeper.alive(str(node))
        assert not marker.exists()
    finally:
        keeper.shutdown_keeper(str(node), 30)


def test_a_damaged_snapshot_is_not_persisted(tmp_path):
    """A bit flipped in memory after the snapshot: the keeper used to write it with a
    fresh SHA-256 that vouched for the damage; it checks the memory checksum first."""
    from deepspeed_ext.format import memsum
    image = tmp_path / "slot0.img"
    data = bytearray(b"\x01" * 64)
    image.write_bytes(bytes(data))
    entries = [{"key": "w", "dtype": "float32", "shape": [16], "start": 0, "nbytes": 64}]
    checksum = memsum.digest(bytes(data))
    data[5] ^= 0x10
    image.write_bytes(bytes(data))
    out = tmp_path / "rank00000.safetensors"
    with pytest.raises(RuntimeError, match="damaged in memory"):
        keeper.write_image_subset(str(out), str(image), entries, None, checksum)
    assert not out.exists()


def _commit_of(tmp_path, tag, attempt_started, timeout_s=60.0, claim=None, world_size=1):
    """A keeper commit job of a save ``tag`` of ``world_size`` ranks (its directory made)."""
    from deepspeed_ext.jobs import PersistJob
    os.makedirs(tmp_path / tag, exist_ok=True)
    return PersistJob.from_json({
        "save_dir": str(tmp_path), "tag": tag, "claim": claim, "step": 1, "rank": 0,
        "image": str(tmp_path / "unused.img"), "entries": [], "keys": None, "specs": [],
        "commit": {"step": 1, "previous_tag": None, "selected": None, "pec_k": None,
                   "save_latest": True, "keep": 0, "timeout_s": timeout_s,
                   "attempt_started": attempt_started,
                   "layout": {"world_size": world_size, "ep_size": 1, "zero_stage": 2,
                              "num_moe_layers": 0, "num_experts": 0}}})


def _start_commit(tmp_path, tag, attempt_started):
    """Run the keeper's background commit of ``tag`` as run_persist_job starts it."""
    reports_in = threading.Event()
    thread = threading.Thread(target=keeper.commit_job,
                              args=(_commit_of(tmp_path, tag, attempt_started),
                                    str(tmp_path / tag), print, reports_in), daemon=True)
    commits.COMMITS.append(keeper.CommitRun(thread, reports_in, attempt_started))
    thread.start()
    return thread


def test_a_drain_returns_once_every_commit_of_its_attempt_is_done(tmp_path, monkeypatch):
    """The training side's final wait drains its keeper: the reply comes only once every
    commit of its attempt has written ``latest`` and run retention, also one whose last
    report arrives during the drain. Before, the wait ended at the manifest and the
    committer went on writing after the job had returned. A commit of an earlier
    attempt still waiting for a dead rank is not waited for."""
    from deepspeed_ext.store import commit
    finished = []

    def slow_commit(save_dir, tag, *args, **kwargs):
        time.sleep(0.3)  # writing latest, running retention
        finished.append(tag)

    monkeypatch.setattr(commit, "commit_checkpoint", slow_commit)
    monkeypatch.setattr(commits, "COMMITS", [])
    monkeypatch.setattr(commits, "GATE", commits.CommitGate())
    commit.write_report(str(tmp_path / "global_step1"), 0, {"report": None})
    _start_commit(tmp_path, "global_step1", 5.0)
    _start_commit(tmp_path, "global_step2", 5.0)  # its report comes during the drain
    old = _start_commit(tmp_path, "global_step0", 1.0)  # a crashed attempt's, never
    late = threading.Timer(0.3, commit.write_report,
                           args=(str(tmp_path / "global_step2"), 0, {"report": None}))
    late.start()
    reply = keeper.Keeper(str(tmp_path), 60.0).handle({"op": "drain", "attempt_started": 5.0})
    late.join()
    assert reply == {"ok": True}
    assert sorted(finished) == ["global_step1", "global_step2"]
    assert old.is_alive()


def test_a_commit_whose_reports_arrive_after_a_shutdown_writes_nothing(tmp_path, monkeypatch):
    """A shutdown waits for the commits past their reports; one of an earlier attempt
    whose reports come in a moment later used to go on writing its manifest, ``latest``
    and retention while the keeper exited under it, after the training side had been
    told nothing ran any more. It now stands down."""
    from deepspeed_ext.store import commit
    finished = []
    monkeypatch.setattr(commit, "commit_checkpoint",
                        lambda save_dir, tag, *a, **k: finished.append(tag))
    monkeypatch.setattr(commits, "COMMITS", [])
    monkeypatch.setattr(commits, "GATE", commits.CommitGate())
    old = _start_commit(tmp_path, "global_step3", 1.0)
    reply = keeper.Keeper(str(tmp_path), 60.0).handle({"op": "shutdown", "attempt_started": 5.0})
    assert reply == {"ok": True}
    commit.write_report(str(tmp_path / "global_step3"), 0, {"report": None})
    old.join(30)
    assert not old.is_alive() and finished == []
    assert not (tmp_path / "global_step3" / commit.FAILURE_NAME).exists()


def test_a_save_given_up_with_its_keeper_is_never_committed(tmp_path):
    """A rank whose node keeper died marks the pending save failed
    (``fail_unless_committed``) while its committer, run in that process since the
    keeper's death, still waits for a report that died with the keeper: the committer
    stops at the failure record (not at its 60 s timeout) and writes nothing. A
    committer whose reports were all in when the record landed writes no manifest
    either (before, the save could be committed behind the back of the ranks that had
    settled it as failed). A committed save is not marked failed."""
    from deepspeed_ext.store import commit, prepare
    from deepspeed_ext.store.claims import read_claim
    from tests.deepspeed_ext.commit_helpers import commit_two_ranks, write_share
    save_dir, tag = str(tmp_path), "global_step2"
    tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag)
    claim = read_claim(tag_dir)
    write_share(save_dir, tag, 0, 1.0)  # rank 1's share died with the keeper
    logged = []
    committer = threading.Thread(target=keeper.commit_job, args=(
        _commit_of(tmp_path, tag, None, claim=claim, world_size=2), tag_dir, logged.append))
    committer.start()
    assert commit.fail_unless_committed(tag_dir, "the keeper of node 0 died", claim)
    committer.join(30)
    assert not committer.is_alive() and "was marked failed" in logged[0], logged
    write_share(save_dir, tag, 1, 1.0)
    shares = [json.load(open(os.path.join(tag_dir, commit.report_name(r))))["payload"]
              for r in range(2)]
    layout = {"world_size": 2, "ep_size": 1, "zero_stage": 2, "num_moe_layers": 0,
              "num_experts": 0}
    with pytest.raises(commit.MarkedFailed):
        commit.commit_checkpoint(save_dir, tag, 2, layout, shares, None, None, None, True, 0,
                                 claim=claim)
    assert not os.path.exists(os.path.join(tag_dir, "manifest.json"))
    assert commit.commit_outcome(tag_dir, 2, claim) == (False, "the keeper of node 0 died")
    commit_two_ranks(save_dir, "global_step4", 4, 2.0)
    assert not commit.fail_unless_committed(os.path.join(save_dir, "global_step4"), "late")
    assert commit.commit_outcome(os.path.join(save_dir, "global_step4"), 2) == (True, None)


_SLOW_EXIT_KEEPER = r"""
import json, os, shutil, socket, sys, time
directory = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(os.path.join(directory, "keeper.sock"))
server.listen(8)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            line += chunk
        if not line.endswith(b"\n"):
            continue
        op = json.loads(line)["op"]
        conn.sendall(json.dumps({"ok": True, "pid": os.getpid()}).encode() + b"\n")
    if op == "shutdown":
        shutil.rmtree(directory)
        time.sleep(1.5)  # still running (a commit thread finishing) after its directory went
        sys.exit(0)
"""


def test_shutting_a_keeper_down_returns_once_its_process_has_exited(tmp_path):
    """The end of a job waited for the keeper's directory to go, not for the keeper:
    the training process returned while the keeper was still running."""
    node = tmp_path / "node0"
    node.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_EXIT_KEEPER, str(node)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert keeper.shutdown_keeper(str(node), timeout_s=30)
        assert keeper.has_exited(proc.pid), "shutdown_keeper returned while the keeper still ran"
        assert not node.exists()
    finally:
        proc.kill()
        proc.wait()


_FRAME_COPY = r"""
import json, os, sys
from deepspeed_ext import keeper
src, dst = sys.argv[1], sys.argv[2]
keeper.run_persist_job({"kind": "frame", "data": os.path.join(src, "f.bin"),
                        "marker": os.path.join(src, "f.json"),
                        "dst_data": os.path.join(dst, "frames", "f.bin"),
                        "dst_marker": os.path.join(dst, "frames", "f.json"), "save_dir": dst})
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def test_a_frame_is_copied_without_importing_torch(tmp_path):
    """A frame job must not wait for torch's import (seconds): a node lost in the first
    seconds of a job would take frames with it that storage never got. The copy
    (fs.atomic_write_local) and the job's records (jobs, format.image_entry) are
    torch-free."""
    src, dst = tmp_path / "mem", tmp_path / "ckpt"
    src.mkdir()
    dst.mkdir()
    (src / "f.bin").write_bytes(b"frame bytes")
    (src / "f.json").write_text("{}")
    from tests.launch import REPO
    run = subprocess.run([sys.executable, "-c", _FRAME_COPY, str(src), str(dst)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
    assert (dst / "frames" / "f.bin").read_bytes() == b"frame bytes"
    assert sorted(os.listdir(dst / "frames")) == ["f.bin", "f.json"]  # no temp file left
    assert os.path.exists(src / "f.copied")
