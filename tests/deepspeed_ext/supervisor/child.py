"""A process of the supervisor's tests: it joins the job's store as a trainer would, says
what it sees, and does what the test tells it.

It connects to ``MOC_RESTART_STORE`` as slot ``MOC_SLOT`` and follows the rounds: each
time ``current`` names a new round it reads that round and records itself (slot, pid,
round, rank; rank None while it waits as a spare). Records go to the store, key
``moc/test/joined/<round>/<slot>`` (the test waits on them while the job runs), and as
one JSON line each to the file ``MOC_TEST_RECORDS`` (read after the supervisor, and its
store, are gone).

What it does, told by the store key ``moc/test/act/<slot>`` (set by the test at any time)
or at start by ``MOC_TEST_ACT`` (``"<slot>=<act>,..."``): ``finish`` exit 0, ``exit2``
exit 2 (bad input), ``exit3`` exit 3, ``kill`` SIGKILL itself. Untold, it waits: a spare
until a round gives it a rank (then it is told like any other) or the job's ``done``
(recorded as ``released``, exit 0). SIGTERM is recorded with the ``done`` it finds (``terminated``), then exit 143. It
exits 5 after ``LIFETIME_S`` whatever happens, and 4 when the store is gone: a broken
test leaves nothing behind.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import torch.distributed as dist  # noqa: E402

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, SLOT_ENV,  # noqa: E402
                                          STORE_ENV, RoundAssignment, round_key)

LIFETIME_S = 60.0
POLL_S = 0.05
ACTS = {"finish", "exit2", "exit3", "kill"}


def joined_key(round_number: int, slot: int) -> str:
    return f"moc/test/joined/{round_number}/{slot}"


def act_key(slot: int) -> str:
    return f"moc/test/act/{slot}"


class Child:
    def __init__(self) -> None:
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        self.slot = int(os.environ[SLOT_ENV])
        self.store = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=timedelta(seconds=10))
        told = dict(pair.split("=") for pair in os.environ.get("MOC_TEST_ACT", "").split(",")
                    if pair)
        self.act = told.get(str(self.slot))
        self.round, self.rank = -1, None

    def record(self, event: str, **fields) -> None:
        line = {"event": event, "slot": self.slot, "pid": os.getpid(), "round": self.round,
                "rank": self.rank, "env_rank": os.environ.get("RANK"),
                "nccl_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), **fields}
        text = json.dumps(line)
        with open(os.environ["MOC_TEST_RECORDS"], "a") as f:
            f.write(text + "\n")  # one short write: lines of processes do not mix
        if event == "joined":
            self.store.set(joined_key(self.round, self.slot), text)

    def done(self):
        return self.store.get(DONE_KEY).decode() if self.store.check([DONE_KEY]) else None

    def follow(self) -> None:
        """Record the newest round when ``current`` moved on."""
        newest = int(self.store.get(CURRENT_KEY))
        if newest != self.round:
            assignment = RoundAssignment.from_json(self.store.get(round_key(newest)))
            self.round, self.rank = newest, assignment.rank_of(self.slot)
            self.record("joined", world_size=assignment.world_size)

    def told(self):
        if self.act is None and self.store.check([act_key(self.slot)]):
            self.act = self.store.get(act_key(self.slot)).decode()
        return self.act

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        deadline = time.monotonic() + LIFETIME_S
        while time.monotonic() < deadline:
            self.follow()
            act = self.told()
            if act in ACTS:
                self.record(act)
                if act == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                return {"exit2": 2, "exit3": 3}.get(act, 0)
            done = self.done() if self.rank is None else None  # a trainer is stopped by SIGTERM
            if done is not None:
                self.record("released", done=done)
                return 0
            time.sleep(POLL_S)
        self.record("lifetime")
        return 5

    def on_sigterm(self, signum, frame) -> None:
        try:
            done = self.done()
        except Exception:  # the store is gone: record what is known
            done = "unknown"
        self.record("terminated", done=done)
        os._exit(143)


def main() -> int:
    try:
        child = Child()
    except Exception as err:  # the store is gone: nothing to follow
        print(f"child: no store ({err})", file=sys.stderr)
        return 4
    try:
        return child.run()
    except Exception as err:
        print(f"child slot {child.slot}: store lost ({err})", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
