"""One node's supervisor of an in-job restart: it starts the node's training processes
and hot spares, watches them, and when one dies writes the next recovery round into the
job's store instead of stopping the survivors (torchrun's agent stops every process of the
job about 0.3 s after one death, so nothing survives to recover in place).

The order, in each node's supervisor (the children only read the store; with several
nodes node 0's serves the store and the others join it, or a ``--coordinator`` on a host
that does not train serves it and watches every node, and starts no process):

1. :meth:`Supervisor.run` writes round 0 (``first_round(nproc, spares, nnodes)``) and
   ``current`` (the store's server; the others wait for it), then starts the node's slots in order
   (:func:`~deepspeed_ext.supervisor.children.child_env`).
2. :meth:`Supervisor.watch` looks every ``POLL_S`` for the rounds and the end other nodes
   wrote (:meth:`Supervisor.follow`) and for its own processes' exits. A training process
   that exits 0 is counted in the store; once every training process of the job has,
   ``done`` is ``ok``, the spares of every node get ``grace_s`` to exit on their own and
   are then stopped: exit status 0.
3. Any other exit (non-zero, a signal; a spare ending before the job does) is a death:
   round ``r + 1`` (:func:`~deepspeed_ext.runtime.rounds.next_round`: a spare of the dead
   slot's own node takes its rank) is claimed in the store (two nodes' deaths at once
   must not write two rounds under one number; the later builds on the earlier) and
   written, its record before ``current``, and one line is logged. Deaths close together
   are one round each, in the order they are seen. With ``--refill-spares`` a new
   process is then started in the dead slot and a refill round lists it as a waiting
   spare (:func:`~deepspeed_ext.runtime.rounds.refill_round`; not a recovery for
   ``--max-rounds``).
4. No round possible (no spare left on the node, a training process already finished,
   more than ``max_rounds`` recoveries): ``done`` is ``failed: why``, one line says why
   and that the job must be relaunched, every process gets SIGTERM, then SIGKILL
   ``grace_s`` later: exit status 1; the other nodes' supervisors read ``done`` and stop
   theirs the same way (exit status 1). A process that exits 2 refused its flags (the
   trainer's bad input): every process is stopped the same way, exit status 2 (a
   relaunch would not help either).
5. A process whose watchdog found a training rank of the current round hung asks for its
   end in the store (:func:`~deepspeed_ext.runtime.rounds.request_kill`); the supervisor
   of that rank's node SIGKILLs its process (which ends a stopped process, or one holding
   the GIL, too) and logs who asked and why; its death is then handled as in 3.
6. SIGINT or SIGTERM to the supervisor (:meth:`Supervisor.request_stop`) is passed on to
   every process; ``done`` is ``failed: ...``, the processes get ``grace_s`` to end, then
   SIGKILL: exit status 128 + the signal's number.
7. A store that cannot be reached any more (its server's host gone: node 0, or the
   coordinator's): every process of the node is stopped, exit status 1 (relaunch). Last,
   each supervisor leaves the store; the server keeps serving it until every node's has
   left.
"""

import logging
import os
import signal
import time
from typing import Dict, List, Optional, Set

import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, DONE_KEY, FINISHED_KEY,
                                          MAX_REASON_BYTES, RoundAssignment, first_round,
                                          kill_count_key, kill_key, node_beat_key)
from deepspeed_ext.supervisor.children import (NCCL_ERROR_HANDLING, POLL_S, SURVIVABLE_HANDLING,
                                               Child, child_env, describe_exit,
                                               kill_children, signal_children, start_child)
from deepspeed_ext.supervisor.ending import JobEnding
from deepspeed_ext.supervisor.nodes import NodeWatch
from deepspeed_ext.supervisor.options import SupervisorOptions, program_argv
from deepspeed_ext.supervisor.round_book import RoundBook, change_text
from deepspeed_ext.supervisor.store import STORE_TIMEOUT, write_round

LOG = logging.getLogger(__name__)
PREFIX = "[moc supervisor] "
LEFT_JOB = 3
"""This node's exit status when every slot of it was given away (its ranks went to a
spare node): not a failure of the job, which goes on on the other nodes; no relaunch."""
BAD_INPUT = 2
"""A process's exit status for bad input (the trainer's ``ConfigError``): the same flags
would stop every replacement the same way, so no round follows; the supervisor stops
the job with this status too."""


def _spares_left(count: int) -> str:
    return f"{count} spare{'' if count == 1 else 's'} left"


class Supervisor(JobEnding):
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
        self.book = RoundBook(store, first_round(options.nproc, options.spares,
                                                 options.nnodes, options.spare_nodes),
                              options.launched, options.max_rounds)
        self.children: List[Child] = []
        self.finished: Set[int] = set()
        """This node's training slots that exited 0."""
        self.stop_signal: Optional[int] = None
        self.kills_seen: Dict[int, int] = {}
        """Per round, the kill requests counted so far."""
        self.nodes = NodeWatch(options.node_timeout_s)
        """The store server's: the watched nodes' supervisors' beats."""
        self.fenced: Set[int] = set()
        """This node's slots a round named failed while they ran (their node was found
        lost): killed, and their deaths start no round."""
        self.prefix = PREFIX if options.nnodes == 1 else \
            "[moc supervisor, coordinator] " if options.coordinator else \
            f"[moc supervisor, node {options.node_rank}] "

    @property
    def current(self) -> RoundAssignment:
        """The newest round this supervisor knows."""
        return self.book.current

    def run(self) -> int:
        """Write round 0 (node 0; the other nodes wait for it), start this node's
        processes, watch until the job ends, then leave the store (node 0, which serves
        it, waits for every node's to leave); returns the supervisor's exit status
        (module docstring)."""
        try:
            if self.options.serves_store:
                write_round(self.store, self.current)
            else:
                self.store.wait([CURRENT_KEY], STORE_TIMEOUT)
            failure = self.start()
            status = self.fail(failure) if failure else self.watch()
        except dist.DistError as err:  # node 0's supervisor, and the store, are gone
            return self.lost_store(err)
        self.leave()
        return status

    def start(self) -> str:
        """Start every slot, in order; returns why one could not start ("" when all did)."""
        if self.options.coordinator:
            LOG.info(f"{self.prefix}store {self.options.host}:{self.port} for "
                     f"{self.options.nnodes} nodes, up to {self.options.max_rounds} recoveries "
                     f"in place; starting no process, watching every node's supervisor "
                     f"(node 0's too; lost after {self.options.node_timeout_s:g} s of silence)")
            return ""
        argv = program_argv(self.options.command)
        base = dict(os.environ)
        if base.get(NCCL_ERROR_HANDLING, SURVIVABLE_HANDLING[0]) not in SURVIVABLE_HANDLING:
            LOG.info(f"{self.prefix}{NCCL_ERROR_HANDLING}={SURVIVABLE_HANDLING[0]} for the "
                     f"processes, not {base[NCCL_ERROR_HANDLING]} (which tears a survivor down "
                     "on its first NCCL error)")
        for slot in self.options.own_slots:
            if self.stop_signal is not None:  # stopped while starting: start no more
                return ""
            env = child_env(base, slot, self.options, self.port)
            try:
                self.children.append(start_child(argv, env, slot))
            except OSError as err:
                return f"slot {slot} could not start {argv[0]} ({err})"
        started = ", ".join(f"slot {c.slot} pid {c.pid} ({self._role(c.slot)})"
                            for c in self.children)
        LOG.info(f"{self.prefix}store {self.options.host}:{self.port}, up to "
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
            if self.options.nnodes > 1 and not self.options.coordinator:
                # the store server's NodeWatch reads it
                self.store.add(node_beat_key(self.options.node_rank), 1)
            status = self.follow()
            status = self.watch_nodes() if status is None else status
            if status is not None:
                return status
            for child in [c for c in self.children if c.poll()]:
                status = self.on_exit(child)
                if status is not None:
                    return status
            self.kill_requested()
            time.sleep(POLL_S)

    def follow(self) -> Optional[int]:
        """Catch up with the store: the rounds other nodes' supervisors wrote, and the
        job's end when another one ended it; returns this supervisor's exit status then
        (0: the job is done; 1: it failed there), else None."""
        if self.store.check([DONE_KEY]):
            return self.ended_elsewhere(self.store.get(DONE_KEY).decode("utf-8", "replace"))
        self.book.follow()
        return self.fence()

    def fence(self) -> Optional[int]:
        """SIGKILL this node's processes a round named failed while they run (node 0 found
        this node lost, or a death moved the node's ranks to a spare node: a machine whose
        ranks were given away must not come back into the job); returns :data:`LEFT_JOB`
        once none of this node's slots is in the job any more."""
        stale = [c for c in self.children if c.running and any(
            c.slot in r.failed for r in self.book.rounds if r.round > c.since_round)]
        if stale:
            self.fenced.update(c.slot for c in stale)
            LOG.warning(f"{self.prefix}slot(s) {[c.slot for c in stale]} were given away "
                        "while running (their ranks went to a spare node): killing them")
            signal_children(stale, signal.SIGKILL)
        taken = set(self.current.slots) | set(self.current.spares)
        if self.fenced and not taken & set(self.options.own_slots):
            kill_children(self.children)
            LOG.warning(f"{self.prefix}no slot of this node is in the job any more: leaving "
                        f"it (exit {LEFT_JOB}); the job goes on on the other nodes")
            return LEFT_JOB
        return None

    def watch_nodes(self) -> Optional[int]:
        """The store server's (node 0's, or a coordinator's, which watches node 0 too):
        find the nodes whose supervisors went silent and give their ranks to a spare
        node; returns 1 when one cannot be (the job then stopped), else None."""
        watched = self.options.watched_nodes
        if not watched:
            return None
        now = time.monotonic()
        counts = {n: self.store.add(node_beat_key(n), 0) for n in watched}
        for node in self.nodes.look(counts, now):
            status = self.node_lost(node, self.nodes.silent_s(node, now))
            if status is not None:
                return status
        return None

    def node_lost(self, node: int, silent_s: float) -> Optional[int]:
        """Node ``node``'s supervisor has been silent ``silent_s`` s: every slot of that
        node still in the job dies at once (one round); returns 1 when no spare node can
        take its ranks (the job then stopped), else None."""
        self.book.follow()
        dead = {s for s in self.current.slots + self.current.spares if s in
                range(node * self.options.launched, (node + 1) * self.options.launched)}
        who = f"node {node}'s supervisor has been silent for {silent_s:.1f} s: node lost"
        ranks = [r for r, s in enumerate(self.current.slots) if s in dead]
        before = self.current
        after = self.advance(dead, who, f"{who} and no spare node can take its ranks {ranks}")
        if after is None:
            return 1
        LOG.warning(f"{self.prefix}{who}; round {after.round}: "
                    f"{change_text(before, after, dead) or 'no rank'}; "
                    f"{_spares_left(len(after.spares))}")
        return None

    def advance(self, dead: Set[int], who: str, none_left: str) -> Optional[RoundAssignment]:
        """Claim and write the round after the slots ``dead`` died (``who``: how, for the
        lines); returns it, or None when no round can be (``none_left``: no spare can
        take a rank; or past ``--max-rounds``): the job then stopped (:meth:`fail`)."""
        after = self.book.claim_next(dead)
        if after is None:
            self.fail(none_left)
            return None
        if self.book.recoveries_with(after) > self.options.max_rounds:
            self.fail(f"{who}: round {after.round} would be more than --max-rounds "
                      f"{self.options.max_rounds} recoveries in place")
            return None
        self.book.publish(after)
        return after

    def kill_requested(self) -> List[int]:
        """SIGKILL each of this node's processes another process asked to end
        (:func:`~deepspeed_ext.runtime.rounds.request_kill`: a hang), in the current round
        or an earlier one (a survivor stuck in the failed round's collective never
        joined the new one; its own watchdog asks in the round it is still in); returns
        the slots killed. A death is seen by the watch's next look."""
        killed = []
        for assignment in self.book.rounds:
            count = self.store.add(kill_count_key(assignment.round), 0)
            if count <= self.kills_seen.get(assignment.round, 0):
                continue
            self.kills_seen[assignment.round] = count
            for rank, slot in enumerate(assignment.slots):
                child = self._child_of(slot)
                key = kill_key(assignment.round, rank)
                if child is None or not self.store.check([key]):  # another node's
                    continue
                if child.since_round > assignment.round:  # about the process it replaced
                    self.store.delete_key(key)
                    continue
                why = self.store.get(key)[:MAX_REASON_BYTES].decode("utf-8", "replace")
                self.store.delete_key(key)
                if not child.running:
                    continue
                LOG.warning(f"{self.prefix}slot {slot} (rank {rank} of round "
                            f"{assignment.round}, pid {child.pid}) is hung ({why}): "
                            "killing it (SIGKILL)")
                signal_children([child], signal.SIGKILL)
                killed.append(slot)
        return killed

    def on_exit(self, child: Child) -> Optional[int]:
        """``child`` ended: a training process done, or a death (a new round); returns the
        exit status when the job ends with it, else None."""
        if self.stop_signal is not None:  # its end is the signal passed on: no round
            return self.stopped()
        if child.slot in self.fenced:  # its round was written when its node was found lost
            return None
        self.book.follow()
        rank = self.current.rank_of(child.slot)
        if child.returncode == 0 and rank is not None:
            self.finished.add(child.slot)
            if self.store.add(FINISHED_KEY, 1) >= self.current.world_size:
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
        if rank is not None and self.store.add(FINISHED_KEY, 0) > 0:
            done = (f"slot(s) {sorted(self.finished)}" if self.finished
                    else "training process(es) of another node")
            return self.fail(f"{who} after {done} finished: no round can go on without them")
        where = " of its node" if self.options.nnodes > 1 else ""
        before = self.current
        after = self.advance({child.slot}, who,
                             f"{who} and no spare{where} is left to take rank {rank}")
        if after is None:
            return 1
        change = change_text(before, after, {child.slot}) or "the spare is dropped"
        if rank is not None and after.failed == (child.slot,):  # one rank, to its node's spare
            change += " (spare)"
        left = _spares_left(len(after.spares))
        if self.options.nnodes > 1:
            left += f", {sum(s in self.options.own_slots for s in after.spares)} on this node"
        LOG.info(f"{self.prefix}{who}: round {after.round}, {change}; {left}")
        if self.options.refill_spares:
            self.refill(child)
        return None

    def refill(self, dead: Child) -> None:
        """``--refill-spares``: start a new process in ``dead``'s slot and make it a
        waiting spare of this node again (a refill round: no rank moves, no slot failed,
        not a recovery for ``--max-rounds``). A slot that cannot start is left empty."""
        argv = program_argv(self.options.command)
        env = child_env(dict(os.environ), dead.slot, self.options, self.port)
        try:
            new = start_child(argv, env, dead.slot)
        except OSError as err:
            LOG.warning(f"{self.prefix}slot {dead.slot} could not be refilled ({err}): "
                        f"{_spares_left(len(self.current.spares))}")
            return
        new.since_round = self.current.round + 1
        self.children[self.children.index(dead)] = new
        after = self.book.claim_refill(dead.slot)
        if after is None:
            return
        self.book.publish(after)
        new.since_round = after.round
        LOG.info(f"{self.prefix}slot {dead.slot} refilled (pid {new.pid}): round "
                 f"{after.round}, a waiting spare; {_spares_left(len(after.spares))}")

    def _child_of(self, slot: int) -> Optional[Child]:
        """This node's newest process in ``slot`` (None: another node's slot)."""
        return next((c for c in reversed(self.children) if c.slot == slot), None)

    def _role(self, slot: int) -> str:
        rank = self.current.rank_of(slot)
        return "spare" if rank is None else f"rank {rank}"
