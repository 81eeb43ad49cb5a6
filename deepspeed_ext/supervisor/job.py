"""One node's supervisor of an in-job restart: it starts the training processes and the
hot spares, watches them, and when one dies writes the next recovery round into the job's
store instead of stopping the survivors (torchrun's agent stops every process of the job
about 0.3 s after one death, so nothing survives to recover in place).

The order, in one process (the supervisor; the children only read the store):

1. :meth:`Supervisor.run` writes round 0 (``first_round(nproc, spares)``) and ``current``,
   then starts slot 0, 1, ... (:func:`~deepspeed_ext.supervisor.children.child_env`).
2. :meth:`Supervisor.watch` looks for exits every ``POLL_S``. A training process that
   exits 0 is done; once every training slot of the current round is, ``done`` is ``ok``,
   the spares get ``grace_s`` to exit on their own and are then stopped: exit status 0.
3. Any other exit (non-zero, a signal; a spare ending before the job does) is a death:
   round ``r + 1`` (:func:`~deepspeed_ext.runtime.rounds.next_round`) is written, its
   record before ``current``, and one line is logged. Deaths close together are one
   round each, in the order they are seen.
4. No round possible (no spare left, a training process already finished, more than
   ``max_rounds`` recoveries): ``done`` is ``failed: why``, one line says why and that
   the job must be relaunched, every process gets SIGTERM, then SIGKILL ``grace_s``
   later: exit status 1. A process that exits 2 refused its flags (the trainer's bad
   input): every process is stopped the same way, exit status 2 (a relaunch would not
   help either).
5. A process whose watchdog found a training rank of the current round hung asks for its
   end in the store (:func:`~deepspeed_ext.runtime.rounds.request_kill`); the watch
   SIGKILLs that rank's process (which ends a stopped process, or one holding the GIL,
   too) and logs who asked and why; its death is then handled as in 3.
6. SIGINT or SIGTERM to the supervisor (:meth:`Supervisor.request_stop`) is passed on to
   every process; ``done`` is ``failed: ...``, the processes get ``grace_s`` to end, then
   SIGKILL: exit status 128 + the signal's number.
"""

import logging
import os
import signal
import time
from typing import Dict, List, Optional, Set

import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (MAX_REASON_BYTES, RoundAssignment, first_round,
                                          kill_count_key, kill_key, next_round)
from deepspeed_ext.supervisor.children import (POLL_S, Child, child_env, describe_exit,
                                               kill_children, signal_children, start_child,
                                               stop_children, wait_children)
from deepspeed_ext.supervisor.options import SupervisorOptions, program_argv
from deepspeed_ext.supervisor.store import write_done, write_round

LOG = logging.getLogger(__name__)
PREFIX = "[moc supervisor] "
RELAUNCH = "stopping every process: the job must be relaunched"
BAD_INPUT = 2
"""A process's exit status for bad input (the trainer's ``ConfigError``): the same flags
would stop every replacement the same way, so no round follows; the supervisor stops
the job with this status too."""


def _spares_left(count: int) -> str:
    return f"{count} spare{'' if count == 1 else 's'} left"


class Supervisor:
    """The processes of one launch and the rounds that say who trains.

    Args:
        options: what to start (checked: :func:`~deepspeed_ext.supervisor.options.parse_options`).
        store: the job's store (this process serves it: ``store.host_store``).
        port: the port the processes reach the store on (``store.port``).
    """

    def __init__(self, options: SupervisorOptions, store: dist.Store, port: int):
        self.options = options
        self.store = store
        self.port = port
        self.current: RoundAssignment = first_round(options.nproc, options.spares)
        self.children: List[Child] = []
        self.finished: Set[int] = set()
        """Training slots that exited 0."""
        self.stop_signal: Optional[int] = None
        self.rounds: List[RoundAssignment] = [self.current]
        """Every round written, oldest first."""
        self.kills_seen: Dict[int, int] = {}
        """Per round, the kill requests counted so far."""

    def run(self) -> int:
        """Write round 0, start every process, watch until the job ends; returns the
        supervisor's exit status (module docstring)."""
        write_round(self.store, self.current)
        failure = self.start()
        if failure:
            return self.fail(failure)
        return self.watch()

    def start(self) -> str:
        """Start every slot, in order; returns why one could not start ("" when all did)."""
        argv = program_argv(self.options.command)
        base = dict(os.environ)
        for slot in range(self.options.launched):
            if self.stop_signal is not None:  # stopped while starting: start no more
                return ""
            env = child_env(base, slot, self.options.nproc, self.options.host, self.port)
            try:
                self.children.append(start_child(argv, env, slot))
            except OSError as err:
                return f"slot {slot} could not start {argv[0]} ({err})"
        started = ", ".join(f"slot {c.slot} pid {c.pid} ({self._role(c.slot)})"
                            for c in self.children)
        LOG.info(f"{PREFIX}store {self.options.host}:{self.port}, up to "
                 f"{self.options.max_rounds} recoveries in place; started {started}: "
                 f"{' '.join(self.options.command)}")
        return ""

    def request_stop(self, signum: int) -> None:
        """The supervisor got ``signum`` (SIGINT, SIGTERM): pass it on to every process and
        end the job at the watch's next look. Safe in a signal handler (no store call)."""
        self.stop_signal = signum
        signal_children(self.children, signum)

    def watch(self) -> int:
        """Look for exits every ``POLL_S`` until the job ends; returns the exit status."""
        while True:
            if self.stop_signal is not None:
                return self.stopped()
            for child in [c for c in self.children if c.poll()]:
                status = self.on_exit(child)
                if status is not None:
                    return status
            self.kill_requested()
            time.sleep(POLL_S)

    def kill_requested(self) -> List[int]:
        """SIGKILL each process another process asked to end
        (:func:`~deepspeed_ext.runtime.rounds.request_kill`: a hang), in the current round
        or an earlier one (a survivor stuck in the failed round's collective never
        joined the new one; its own watchdog asks in the round it is still in); returns
        the slots killed. A death is seen by the watch's next look."""
        killed = []
        for assignment in self.rounds:
            count = self.store.add(kill_count_key(assignment.round), 0)
            if count <= self.kills_seen.get(assignment.round, 0):
                continue
            self.kills_seen[assignment.round] = count
            for rank, slot in enumerate(assignment.slots):
                key = kill_key(assignment.round, rank)
                if not self.store.check([key]):
                    continue
                why = self.store.get(key)[:MAX_REASON_BYTES].decode("utf-8", "replace")
                self.store.delete_key(key)
                child = next((c for c in self.children if c.slot == slot), None)
                if child is None or not child.running:
                    continue
                LOG.warning(f"{PREFIX}slot {slot} (rank {rank} of round {assignment.round}, "
                            f"pid {child.pid}) is hung ({why}): killing it (SIGKILL)")
                signal_children([child], signal.SIGKILL)
                killed.append(slot)
        return killed

    def on_exit(self, child: Child) -> Optional[int]:
        """``child`` ended: a training process done, or a death (a new round); returns the
        exit status when the job ends with it, else None."""
        if self.stop_signal is not None:  # its end is the signal passed on: no round
            return self.stopped()
        rank = self.current.rank_of(child.slot)
        if child.returncode == 0 and rank is not None:
            self.finished.add(child.slot)
            if self.finished.issuperset(self.current.slots):
                return self.finish()
            return None
        if child.returncode == BAD_INPUT:
            return self.fail(f"slot {child.slot} ({self._role(child.slot)}, pid {child.pid}) "
                             f"refused its input (exit {BAD_INPUT}): a replacement would too",
                             status=BAD_INPUT, relaunch="stopping every process")
        return self.recover(child, rank)

    def recover(self, child: Child, rank: Optional[int]) -> Optional[int]:
        """Write the round after ``child``'s death; returns 1 when no round can be (the
        job then stopped), else None."""
        how = f"exited with {describe_exit(child.returncode)}"
        if child.returncode == 0:
            how += " before the job ended"
        who = f"slot {child.slot} ({self._role(child.slot)}, pid {child.pid}) {how}"
        if rank is not None and self.finished:
            return self.fail(f"{who} after slot(s) {sorted(self.finished)} finished: "
                             "no round can go on without them")
        after = next_round(self.current, {child.slot})
        if after is None:
            return self.fail(f"{who} and no spare is left to take rank {rank}")
        if after.round > self.options.max_rounds:
            return self.fail(f"{who}: round {after.round} would be more than --max-rounds "
                             f"{self.options.max_rounds} recoveries in place")
        write_round(self.store, after)
        self.current = after
        self.rounds.append(after)
        change = (f"rank {rank} -> slot {after.slots[rank]} (spare)" if rank is not None
                  else "the spare is dropped")
        LOG.info(f"{PREFIX}{who}: round {after.round}, {change}; "
                 f"{_spares_left(len(after.spares))}")
        return None

    def finish(self) -> int:
        """Every training process of the round exited 0: release the spares; returns 0."""
        write_done(self.store, "ok")
        spares = [c for c in self.children if c.running]
        LOG.info(f"{PREFIX}every training process exited 0 (round {self.current.round}, "
                 f"slots {list(self.current.slots)}): job done; releasing {len(spares)} "
                 "spare(s)")
        late = wait_children(spares, self.options.grace_s)
        if late:
            stop_children(late, self.options.grace_s)
            LOG.warning(f"{PREFIX}WARNING: slot(s) {[c.slot for c in late]} did not exit "
                        f"within --grace-s {self.options.grace_s:g} of the job's end: stopped")
        return 0

    def fail(self, why: str, status: int = 1, relaunch: str = RELAUNCH) -> int:
        """No round can go on: ``done`` says why, every process is stopped; returns
        ``status`` (1; :data:`BAD_INPUT` when a process refused its flags)."""
        write_done(self.store, f"failed: {why}")
        LOG.error(f"{PREFIX}ERROR: {why}; {relaunch}")
        killed = stop_children(self.children, self.options.grace_s)
        if killed:
            LOG.warning(f"{PREFIX}WARNING: slot(s) {[c.slot for c in killed]} did not end "
                        f"within --grace-s {self.options.grace_s:g} of SIGTERM: killed")
        return status

    def stopped(self) -> int:
        """The supervisor was told to stop: every process got the signal; they get
        ``grace_s`` to end, then SIGKILL; returns 128 + the signal's number."""
        name = signal.Signals(self.stop_signal).name
        write_done(self.store, f"failed: the supervisor was stopped by {name}")
        LOG.error(f"{PREFIX}ERROR: stopped by {name}, passed on to every process; "
                  "the job must be relaunched")
        kill_children(wait_children(self.children, self.options.grace_s))
        return 128 + self.stop_signal

    def _role(self, slot: int) -> str:
        rank = self.current.rank_of(slot)
        return "spare" if rank is None else f"rank {rank}"
