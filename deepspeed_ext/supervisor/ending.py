"""How one node's supervisor ends: the job done, failed here or on another node, its
store gone, or the supervisor stopped by a signal; and how it leaves the store.

A mixin of :class:`~deepspeed_ext.supervisor.job.Supervisor`: its methods use the
supervisor's ``options``, ``store``, ``port``, ``children``, ``current``, ``nodes``,
``stop_signal`` and ``prefix``. Each method is called once, at the end of the watch, by
the supervisor's own thread; each returns the supervisor's exit status where it has one.
"""

import logging
import signal

import torch.distributed as dist

from deepspeed_ext.supervisor.children import kill_children, stop_children, wait_children
from deepspeed_ext.supervisor.store import leave_store, write_done

LOG = logging.getLogger(__name__)
RELAUNCH = "stopping every process: the job must be relaunched"


class JobEnding:
    """The ends of a supervisor's job (module docstring)."""

    def finish(self) -> int:
        """Every training process of the round exited 0: release the spares; returns 0."""
        write_done(self.store, "ok")
        self.release_spares("every training process exited 0 (round "
                            f"{self.current.round}, slots {list(self.current.slots)})")
        return 0

    def release_spares(self, why: str) -> None:
        """The job is done (``why``): the spares still running get ``grace_s`` to exit on
        their own (they read ``done``), then they are stopped."""
        spares = [c for c in self.children if c.running]
        LOG.info(f"{self.prefix}{why}: job done; releasing {len(spares)} spare(s)")
        late = wait_children(spares, self.options.grace_s)
        if late:
            stop_children(late, self.options.grace_s)
            LOG.warning(f"{self.prefix}WARNING: slot(s) {[c.slot for c in late]} did not exit "
                        f"within --grace-s {self.options.grace_s:g} of the job's end: stopped")

    def ended_elsewhere(self, outcome: str) -> int:
        """Another node's supervisor ended the job with ``outcome`` (``done``): release
        this node's spares (``ok``: returns 0) or stop every process here (returns 1)."""
        if outcome == "ok":
            self.release_spares("every training process of the job exited 0")
            return 0
        LOG.error(f"{self.prefix}ERROR: the job ended on another node ({outcome}); "
                  "stopping this node's processes")
        stop_children(self.children, self.options.grace_s)
        return 1

    def lost_store(self, err: Exception) -> int:
        """The job's store cannot be reached (node 0's supervisor is gone, its node with
        it): no round can be agreed on, so every process here is stopped; returns 1."""
        LOG.error(f"{self.prefix}ERROR: the job's store at {self.options.host}:{self.port} "
                  f"is gone ({err}); {RELAUNCH}")
        stop_children(self.children, self.options.grace_s)
        return 1

    def leave(self) -> None:
        """Leave the store (:func:`~deepspeed_ext.supervisor.store.leave_store`); its
        server waits for every node's not found lost (and a coordinator's own), each
        giving its processes ``grace_s``."""
        try:
            leave_store(self.store, self.options.nnodes - len(self.nodes.lost)
                        + int(self.options.coordinator),
                        self.options.serves_store, 2 * self.options.grace_s + 10.0)
        except dist.DistError as err:  # leaving cannot fail the job: it ended already
            LOG.warning(f"{self.prefix}WARNING: could not leave the job's store ({err})")

    def fail(self, why: str, status: int = 1, relaunch: str = RELAUNCH) -> int:
        """No round can go on: ``done`` says why, every process is stopped; returns
        ``status`` (1; :data:`BAD_INPUT` when a process refused its flags)."""
        write_done(self.store, f"failed: {why}")
        LOG.error(f"{self.prefix}ERROR: {why}; {relaunch}")
        killed = stop_children(self.children, self.options.grace_s)
        if killed:
            LOG.warning(f"{self.prefix}WARNING: slot(s) {[c.slot for c in killed]} did not end "
                        f"within --grace-s {self.options.grace_s:g} of SIGTERM: killed")
        return status

    def stopped(self) -> int:
        """The supervisor was told to stop: every process got the signal; they get
        ``grace_s`` to end, then SIGKILL; returns 128 + the signal's number."""
        name = signal.Signals(self.stop_signal).name
        write_done(self.store, f"failed: the supervisor was stopped by {name}")
        LOG.error(f"{self.prefix}ERROR: stopped by {name}, passed on to every process; "
                  "the job must be relaunched")
        kill_children(wait_children(self.children, self.options.grace_s))
        return 128 + self.stop_signal
