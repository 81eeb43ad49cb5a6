"""A training process's watch on the job's rounds while it trains (``--moc-restart in-job``
on NCCL).

On gloo a peer's death closes its connections, and every survivor's collective with it
raises within a fraction of a second. On NCCL nothing may: a kernel waiting for a peer
on the same node (NVLink, shared memory) spins until the group's timeout, and with the
default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` the watchdog then tears the survivor down.
So beside each run a :class:`RoundWatcher` thread reads the store the supervisor writes
its rounds to; once a newer round names one of this round's training processes failed,
it calls ``abort`` (:func:`megatron.training.process.abort_communicators`) once. The
blocked kernel ends, the main thread's run raises, and the process joins the newer round
as it does on gloo (:mod:`megatron.training.in_job`). Nothing of a checkpoint is touched:
a snapshot or a persist in flight fails as with any other failure and never counts.
"""

import threading
from typing import Callable, Optional

from deepspeed_ext.runtime import rounds

WATCH_POLL_S = 0.1
"""Between two reads of the store (a death is acted on within it; one small request per
read, on a connection of the thread's own)."""


class RoundWatcher:
    """One round's watch, as a context around the run: started on entry, stopped (and
    joined) on exit. Called by the main thread of a training process; the work runs on a
    daemon thread of its own.

    Args:
        connect: opens the thread's own client of the job's store (a TCPStore client is
            not shared between threads).
        mine: the round this process trains in.
        abort: called at most once, from the thread, when a newer round names one of
            ``mine``'s training slots failed; returns whether it aborted anything.
        log: one line to the user, when ``abort`` did.
        poll_s: between two reads of the store.
    """

    def __init__(self, connect: Callable[[], object], mine: rounds.RoundAssignment,
                 abort: Callable[[], bool], log: Callable[[str], None],
                 poll_s: float = WATCH_POLL_S):
        self.connect, self.mine, self.abort, self.log = connect, mine, abort, log
        self.poll_s = poll_s
        self.acted_on: Optional[int] = None
        """The newer round that made the thread call ``abort`` (None: none did)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moc-round-watch",
                                        daemon=True)

    @property
    def watching(self) -> bool:
        """Whether the thread still reads the store."""
        return self._thread.is_alive()

    def __enter__(self) -> "RoundWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.poll_s + 5.0)

    def _watch(self) -> None:
        store = None
        while not self._stop.wait(self.poll_s):
            try:
                store = store if store is not None else self.connect()
                newer = rounds.superseded(store, self.mine)
            except Exception:  # noqa: BLE001  (the store gone: the job ended, nothing to abort for)
                return
            if newer is not None and not self._stop.is_set():
                self.acted_on = newer
                if self.abort():
                    self.log(f"[moc] round {newer} names a process of round {self.mine.round} "
                             "failed: this process's NCCL communicators aborted, leaving the "
                             "run")
                return
