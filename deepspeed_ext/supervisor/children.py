"""The processes one supervisor starts: their environment, their exits, their stop.

Every process of the launch has a *slot* (its index in the whole job, ``MOC_SLOT``; node
``n`` starts slots ``n * (N + S)`` onwards). A node's first ``N`` slots start as training
ranks with the variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); its ``S`` spares after them get
the same less ``RANK`` and ``LOCAL_RANK`` (a spare learns its rank from the round that
gives it one), as does every process of a spare node. Every process gets the store's
address (``MOC_RESTART_STORE``), and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 2 unless it is 0
or 2 (:data:`SURVIVABLE_HANDLING`).
"""

import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from deepspeed_ext.runtime.rounds import SLOT_ENV, STORE_ENV
from deepspeed_ext.supervisor.options import SupervisorOptions

POLL_S = 0.1
"""How often exits are looked for: a death is seen within it, and a waiting supervisor
costs nothing (no busy loop)."""

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""What torch's NCCL watchdog does when a collective fails or times out."""
SURVIVABLE_HANDLING = ("2", "0")
"""Values that leave a survivor alive: 2 (CleanUpOnly: abort the communicators, raise in
the process) and 0 (no handling). The default (3) and 1 tear the process down on the
first error, a survivor's too, and every in-job recovery on NCCL would become a
relaunch; the processes get 2 instead."""

RANK_VARIABLES = ("RANK", "LOCAL_RANK")
"""What a spare must not inherit: a spare that read a stale ``RANK`` from the
supervisor's own environment would join as a rank it does not have."""


@dataclass
class Child:
    """One started process and, once seen, how it ended."""

    slot: int
    process: subprocess.Popen
    returncode: Optional[int] = None
    """None while it runs; then ``Popen.returncode`` (negative: the signal that ended it)."""
    since_round: int = 0
    """The first round this process is in (0: the launch; a refilled spare: its refill
    round): only rounds from then on are about it (a kill request, a later round naming
    its slot failed)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.returncode is None

    def poll(self) -> bool:
        """Whether the process ended since the last look (its status is then kept)."""
        if self.returncode is not None:
            return False
        self.returncode = self.process.poll()
        return self.returncode is not None


def child_env(base: Mapping[str, str], slot: int, options: SupervisorOptions,
              port: int) -> Dict[str, str]:
    """The environment of slot ``slot`` (one of ``options.own_slots``) of the launch
    ``options`` describes, whose store is at ``options.host:port``: ``base`` plus the
    variables of the module docstring."""
    env = dict(base)
    for name in RANK_VARIABLES:
        env.pop(name, None)
    if env.get(NCCL_ERROR_HANDLING) not in SURVIVABLE_HANDLING:
        env[NCCL_ERROR_HANDLING] = SURVIVABLE_HANDLING[0]
    host = options.host
    env.update({STORE_ENV: f"{host}:{port}", SLOT_ENV: str(slot),
                "WORLD_SIZE": str(options.world_size), "LOCAL_WORLD_SIZE": str(options.nproc),
                "MASTER_ADDR": host, "MASTER_PORT": str(port)})
    local = slot - options.own_slots.start
    if local < options.nproc and not options.spare_node:
        env.update(RANK=str(options.node_rank * options.nproc + local), LOCAL_RANK=str(local))
    return env


def start_child(argv: Sequence[str], env: Mapping[str, str], slot: int) -> Child:
    """Start slot ``slot``: ``argv`` with ``env``, its stdout and stderr the supervisor's
    (the ranks' lines interleave on the console as under torchrun)."""
    return Child(slot, subprocess.Popen(list(argv), env=dict(env)))


def describe_exit(returncode: int) -> str:
    """``status 3``, ``signal 9`` (a negative ``Popen.returncode``)."""
    return f"signal {-returncode}" if returncode < 0 else f"status {returncode}"


def signal_children(children: Iterable[Child], signum: int) -> None:
    """Send ``signum`` to each running child (one that ended meanwhile is skipped)."""
    for child in children:
        if child.running and child.process.poll() is None:
            try:
                child.process.send_signal(signum)
            except ProcessLookupError:  # ended between the poll and the signal
                pass


def wait_children(children: Iterable[Child], timeout_s: float) -> List[Child]:
    """Wait up to ``timeout_s`` for the children to end, looking every :data:`POLL_S`;
    returns those still running."""
    children = list(children)
    deadline = time.monotonic() + timeout_s
    while True:
        for child in children:
            child.poll()
        running = [child for child in children if child.running]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def kill_children(children: Iterable[Child]) -> None:
    """SIGKILL every running child and reap it: nothing is left behind."""
    running = [child for child in children if child.running]
    signal_children(running, signal.SIGKILL)
    for child in running:
        child.process.wait()
        child.poll()


def stop_children(children: Iterable[Child], grace_s: float) -> List[Child]:
    """SIGTERM every running child, SIGKILL those still running ``grace_s`` later, and
    reap them all; returns the children that had to be killed."""
    running = [child for child in children if child.running]
    signal_children(running, signal.SIGTERM)
    killed = wait_children(running, grace_s)
    kill_children(killed)
    return killed
