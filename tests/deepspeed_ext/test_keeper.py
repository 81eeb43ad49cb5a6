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


def test_a_keeper_slow_to_answer_is_not_replaced(tmp_path, monkeypatch):
    """The running keeper answers its first ping after 2.5 s, past the ping's 2 s timeout:
    ensure_keeper must wait for it, not start a second keeper on the same directory."""
    spawned = []
    monkeypatch.setattr(keeper, "_spawn", lambda d, t: spawned.append(d))
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

    def spawn(directory, idle_timeout_s):
        started.append(_FakeKeeper(directory, delay_s=0))
    monkeypatch.setattr(keeper, "_spawn", spawn)
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
        job = {"id": "global_step3:rank0", "tag": "global_step3"}
        assert keeper.hand_over(str(tmp_path), job, patience_s=30, timeout_s=0.3)
        assert fake.ops == ["persist", "persist"]
    finally:
        fake.close()
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
    for _ in range(2):
        assert real.handle({"op": "persist", "job": job})["ok"]
    assert real.jobs.qsize() == 1
    assert real.handle({"op": "persist", "job": {"id": "global_step4:rank0"}})["queued"] == 2
    for i in range(keeper.RECENT_JOB_IDS):  # only recent ids are kept
        real.handle({"op": "persist", "job": {"id": f"later{i}"}})
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
    monkeypatch.setattr(keeper, "request", counting)
    assert not keeper.hand_over(str(tmp_path), {"id": "x"}, patience_s=30, timeout_s=5)
    assert sent == ["persist"]


def test_a_shutdown_waits_for_commits_past_their_reports_only(tmp_path, monkeypatch):
    """The training side asks for the shutdown once it has seen its last manifest, but the
    commit goes on after it (``latest``, retention): the keeper answers only when that
    commit is done. A commit still waiting for reports (a crashed attempt's) is not
    waited for: it would hold the shutdown for its whole timeout."""
    from deepspeed_ext import commit
    finished = []

    def slow_commit(save_dir, tag, *args, **kwargs):
        time.sleep(0.5)  # writing latest, running retention
        finished.append(tag)

    monkeypatch.setattr(commit, "commit_checkpoint", slow_commit)
    monkeypatch.setattr(keeper, "_COMMITS", [])

    def job(tag):
        os.makedirs(tmp_path / tag, exist_ok=True)
        return {"save_dir": str(tmp_path), "tag": tag, "claim": None, "commit": {
            "step": 1, "previous_tag": None, "selected": None, "pec_k": None,
            "save_latest": True, "keep": 0, "timeout_s": 60.0,
            "layout": {"world_size": 1, "ep_size": 1, "zero_stage": 2, "num_moe_layers": 0,
                       "num_experts": 0}}}

    for tag in ("global_step1", "global_step2"):
        reports_in = threading.Event()
        thread = threading.Thread(target=keeper._commit_job,
                                  args=(job(tag), str(tmp_path / tag), print, reports_in),
                                  daemon=True)
        keeper._COMMITS.append((thread, reports_in))
        thread.start()
    commit.write_report(str(tmp_path / "global_step1"), 0, {"report": None})  # step 2 never
    for _ in range(200):
        if keeper._COMMITS[0][1].is_set():
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
    outlived the first attempt must queue its job, not drop it as a retry."""
    ours = keeper.job_id("global_step150", 3)
    assert keeper.job_id("global_step150", 3) == ours  # a retry of this process
    theirs = subprocess.run([sys.executable, "-c", "from deepspeed_ext import keeper; "
                             "print(keeper.job_id('global_step150', 3))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert theirs.startswith("global_step150:") and theirs != ours
    real = keeper.Keeper(str(tmp_path), idle_timeout_s=60)
    for job_id in (theirs, ours, ours):
        assert real.handle({"op": "persist", "job": {"id": job_id}})["ok"]
    assert real.jobs.qsize() == 2


def test_an_idle_keeper_serves_on_while_a_commit_runs_then_leaves(tmp_path, monkeypatch):
    """No training process alive past the idle timeout, but a commit still waits for
    other nodes' reports: the keeper used to stop answering (its socket still there)
    while it joined it, so a restarting job's ranks failed to attach for a minute. It
    now answers until the commit ends, then deletes its directory."""
    node = tmp_path / "node0"
    node.mkdir()
    done = threading.Event()
    commit = threading.Thread(target=done.wait, args=(30,), daemon=True)
    commit.start()
    monkeypatch.setattr(keeper, "_COMMITS", [(commit, threading.Event())])
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
    node.mkdir()
    real = keeper.Keeper(str(node), idle_timeout_s=60)
    old_job = subprocess.Popen(["sleep", "30"])
    try:
        real.handle({"op": "hello", "pid": old_job.pid})
        real.handle({"op": "shutdown"})
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        real.handle({"op": "hello", "pid": os.getpid()})  # the new job's rank
        assert not keeper._leave(real, str(node), server, "shutdown requested")
        assert node.exists()
        real.clients.remove(os.getpid())  # only the old job's process remains
        assert keeper._leave(real, str(node), server, "shutdown requested")
        assert not node.exists()
    finally:
        old_job.kill()
        old_job.wait()


def test_attaching_retries_a_lock_file_deleted_while_it_waited(tmp_path):
    """An exiting keeper deletes the directory while a rank waits for its lock: the rank
    must lock the new file, not the deleted one (which would exclude nobody after it)."""
    node = tmp_path / "node0"
    held = keeper._lock_node(str(node))
    got = []
    waiter = threading.Thread(target=lambda: got.append(keeper._lock_node(str(node))),
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
    attaching = keeper._lock_node(str(node))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle = SimpleNamespace(last_client_seen=0.0)
    left = []
    try:
        leaving = threading.Thread(  # a daemon: a keeper stuck on the lock fails, not hangs
            target=lambda: left.append(keeper._leave(idle, str(node), server, "idle")),
            daemon=True)
        leaving.start()
        leaving.join(5)
        assert left == [False], "the exiting keeper waited for the attaching process's lock"
        assert node.is_dir() and server.fileno() != -1  # still serving
        assert idle.last_client_seen > 0
    finally:
        server.close()
        attaching.close()
