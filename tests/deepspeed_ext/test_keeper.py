"""The keeper's start-up rule: one keeper per node directory, even when it answers slowly."""

import json
import os
import socket
import threading
import time

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
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                if not data:
                    continue  # a connect-only probe (keeper.is_dead), as the keeper allows
                self.ops.append(json.loads(data)["op"])
                if len(self.ops) == 1:
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
