"""The supervisor's command line, checked before anything starts (no store, no process):

    python -m deepspeed_ext.supervisor --nproc N --spares S [--max-rounds R] [--port P]
        [--grace-s G] [--nnodes M --node-rank I --master-addr HOST [--spare-nodes K]
        [--node-timeout S] [--coordinator | --store-elsewhere]] -- PROGRAM [ARGS...]

Several nodes: the same command on every node, each with its ``--node-rank``; node 0's
supervisor serves the job's store at ``--master-addr:--port``, the others join it; the
last ``--spare-nodes`` nodes wait whole to take a lost node's ranks. With a
``--coordinator`` (the same command on a host that does not train) serving the store
and watching every node, the nodes run with ``--store-elsewhere``, and node 0 is lost
and replaced like any other node.

Bad input prints ``error: ...`` naming the flag on stderr and exits 2. Nothing here
imports torch, so a mistyped flag answers at once.
"""

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

PROG = "python -m deepspeed_ext.supervisor"
USAGE = (f"{PROG} --nproc N --spares S [--refill-spares] [--max-rounds R] [--port P] "
         "[--grace-s G] [--nnodes M --node-rank I --master-addr HOST [--spare-nodes K] "
         "[--node-timeout S] [--coordinator | --store-elsewhere]] -- PROGRAM [ARGS...]")
LOCALHOST = "127.0.0.1"
"""The store's address on one node (``--master-addr``'s default there)."""
MAX_PORT = 65535


@dataclass(frozen=True)
class SupervisorOptions:
    """What one node's supervisor runs (every node's runs the same but ``node_rank``)."""

    nproc: int
    """Training processes on this node (one node: the world size)."""
    spares: int
    """Hot spares on this node, started after its training processes."""
    command: Tuple[str, ...]
    """The program and its arguments, as given after ``--``."""
    max_rounds: int = 3
    """Recoveries in place before the job stops to be relaunched (0: none)."""
    port: int = 0
    """The store's port; 0: a free one, chosen when the store starts."""
    grace_s: float = 10.0
    """How long a process is given to end on its own before it is killed."""
    host: str = LOCALHOST
    """The store's address as every process reaches it (node 0's supervisor serves it)."""
    nnodes: int = 1
    """Nodes of the job, one supervisor each."""
    node_rank: int = 0
    """This node's index: its slots are ``node_rank * launched`` onwards."""
    spare_nodes: int = 0
    """The last this many nodes train nothing: each waits whole to take a lost node's ranks."""
    node_timeout_s: float = 5.0
    """Node 0's supervisor finds a node lost once its supervisor has not beaten for this long."""
    refill_spares: bool = False
    """Start a new process in a dead process's slot as a waiting spare (``--refill-spares``)."""
    coordinator: bool = False
    """Start no process: serve the job's store and watch every node's supervisor, node 0's
    too (``--coordinator``, on a host that does not train)."""
    store_elsewhere: bool = False
    """A coordinator serves the store: node 0's supervisor joins it as the others do."""

    @property
    def launched(self) -> int:
        """How many processes this supervisor starts: training ones and spares."""
        return self.nproc + self.spares

    @property
    def world_size(self) -> int:
        """Training processes of the whole job."""
        return self.nproc * (self.nnodes - self.spare_nodes)

    @property
    def spare_node(self) -> bool:
        """Whether this node is a spare node (every process of it waits)."""
        return self.node_rank >= self.nnodes - self.spare_nodes

    @property
    def own_slots(self) -> range:
        """The slots this supervisor starts and watches (a coordinator's: none)."""
        if self.coordinator:
            return range(0)
        return range(self.node_rank * self.launched, (self.node_rank + 1) * self.launched)

    @property
    def serves_store(self) -> bool:
        """Whether this supervisor serves the job's store (a coordinator, else node 0's)
        or joins it."""
        return self.coordinator or (self.node_rank == 0 and not self.store_elsewhere)

    @property
    def watched_nodes(self) -> range:
        """The nodes whose supervisors' beats this one watches: none unless it serves the
        store; every node but its own for node 0's, every node for a coordinator's."""
        if not self.serves_store or self.nnodes == 1:
            return range(0)
        return range(0 if self.coordinator else 1, self.nnodes)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors read ``error: ...`` (the project's form for bad
    input, which names the flag) instead of a usage block and ``prog: error: ...``."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, usage=USAGE, description=(
        "Start N training processes and S hot spares of PROGRAM on this node, keep "
        "the job's store, and when a process dies hand its rank to a spare instead of "
        "stopping the survivors."))
    parser.add_argument("--nproc", type=int, required=True, metavar="N",
                        help="training processes on this node (one node: the world size)")
    parser.add_argument("--spares", type=int, required=True, metavar="S",
                        help="hot spares on this node, started after them, waiting to take "
                             "a dead rank of this node")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="nodes of the job, one supervisor each (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="I",
                        help="this node's index, 0 to M-1; node 0 serves the store (default 0)")
    parser.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                        help="the last K of the M nodes are spare nodes: every process of "
                             "theirs waits, and one takes a lost node's ranks (default 0)")
    parser.add_argument("--node-timeout", type=float, default=5.0, metavar="S",
                        help="node 0's supervisor finds a node lost once its supervisor has "
                             "been silent this long (default 5; below the trainers' 15 s "
                             "wait for a round)")
    parser.add_argument("--master-addr", default=None, metavar="HOST",
                        help="node 0's address, where every process reaches the store "
                             f"(default: MASTER_ADDR, else {LOCALHOST})")
    parser.add_argument("--coordinator", action="store_true",
                        help="start no process: serve the job's store at --master-addr and "
                             "watch every node's supervisor, node 0's too (run it on a host "
                             "that does not train; the nodes run with --store-elsewhere): "
                             "losing node 0 is then recovered like losing any node")
    parser.add_argument("--store-elsewhere", action="store_true",
                        help="a --coordinator serves the job's store at --master-addr: node "
                             "0's supervisor joins it too instead of serving it")
    parser.add_argument("--refill-spares", action="store_true",
                        help="after each recovery, start a new process in the dead one's slot "
                             "as a waiting spare of this node (a later failure is recovered "
                             "in place too; --max-rounds still bounds the recoveries)")
    parser.add_argument("--max-rounds", type=int, default=3, metavar="R",
                        help="recoveries in place before the job stops to be relaunched "
                             "(default 3; 0: none)")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="the store's port (default: MASTER_PORT, else a free port)")
    parser.add_argument("--grace-s", type=float, default=10.0, metavar="G",
                        help="seconds a process is given to end on its own before it is "
                             "killed (default 10)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS...]",
                        help="the program (a .py file runs with this Python) and its arguments")
    return parser


def parse_options(argv: Optional[Sequence[str]] = None,
                  environ: Optional[Mapping[str, str]] = None) -> SupervisorOptions:
    """The options of ``argv`` (default ``sys.argv[1:]``), the port defaulting to
    ``environ``'s ``MASTER_PORT`` (default ``os.environ``).

    Raises:
        SystemExit: 2 after ``error: ...`` on stderr naming the flag (or 0 after --help).
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    command = list(ns.command)
    if command[:1] == ["--"]:
        command = command[1:]
    problem = (_count_problem(ns) or _port_problem(ns, environ)
               or _nodes_problem(ns, environ) or _program_problem(command))
    if problem:
        parser.error(problem)
    return SupervisorOptions(nproc=ns.nproc, spares=ns.spares, command=tuple(command),
                             max_rounds=ns.max_rounds, port=_port(ns, environ),
                             grace_s=ns.grace_s, host=_host(ns, environ),
                             nnodes=ns.nnodes, node_rank=ns.node_rank,
                             spare_nodes=ns.spare_nodes, node_timeout_s=ns.node_timeout,
                             refill_spares=ns.refill_spares, coordinator=ns.coordinator,
                             store_elsewhere=ns.store_elsewhere)


def _count_problem(ns: argparse.Namespace) -> str:
    if ns.nproc < 1:
        return f"--nproc {ns.nproc}: at least 1 training process"
    if ns.spares < 0:
        return f"--spares {ns.spares}: not negative (0: no spare)"
    if ns.max_rounds < 0:
        return f"--max-rounds {ns.max_rounds}: not negative (0: no recovery in place)"
    if not ns.grace_s >= 0:  # also refuses nan
        return f"--grace-s {ns.grace_s}: not negative"
    return ""


def _port(ns: argparse.Namespace, environ: Mapping[str, str]) -> int:
    if ns.port is not None:
        return ns.port
    return int(environ.get("MASTER_PORT") or 0)


def _port_problem(ns: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if ns.port is not None:
        return "" if 0 <= ns.port <= MAX_PORT else \
            f"--port {ns.port}: not a port (0 to {MAX_PORT}; 0: a free one)"
    text = environ.get("MASTER_PORT") or "0"
    if not (text.isdigit() and int(text) <= MAX_PORT):
        return f"--port not given and MASTER_PORT={text!r} is not a port (0 to {MAX_PORT})"
    return ""


def _host(ns: argparse.Namespace, environ: Mapping[str, str]) -> str:
    return ns.master_addr or environ.get("MASTER_ADDR") or LOCALHOST


def _nodes_problem(ns: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if ns.nnodes < 1:
        return f"--nnodes {ns.nnodes}: at least 1"
    if not 0 <= ns.node_rank < ns.nnodes:
        return f"--node-rank {ns.node_rank}: 0 to --nnodes - 1 ({ns.nnodes - 1})"
    if not 0 <= ns.spare_nodes < ns.nnodes:
        return (f"--spare-nodes {ns.spare_nodes}: 0 to --nnodes - 1 ({ns.nnodes - 1}): at "
                "least one node must train")
    if ns.coordinator and ns.store_elsewhere:
        return ("--coordinator with --store-elsewhere: the coordinator is where the store "
                "is served; give --store-elsewhere to the nodes' supervisors")
    if (ns.coordinator or ns.store_elsewhere) and ns.nnodes < 2:
        flag = "--coordinator" if ns.coordinator else "--store-elsewhere"
        return (f"{flag} with --nnodes {ns.nnodes}: a coordinator watches several nodes "
                "(one node serves its own store)")
    if not (ns.node_timeout > 0 and ns.node_timeout < 1e6):  # also refuses nan
        return f"--node-timeout {ns.node_timeout}: a positive number of seconds"
    if ns.nnodes > 1 and _port(ns, environ) == 0:
        # a free port chosen on node 0 could not be known to the other nodes
        return (f"--port not given (nor MASTER_PORT) with --nnodes {ns.nnodes}: every "
                "node's supervisor must reach node 0's store on the same port")
    if ns.nnodes > 1 and not (ns.master_addr or environ.get("MASTER_ADDR")):
        return (f"--master-addr not given (nor MASTER_ADDR) with --nnodes {ns.nnodes}: "
                "the other nodes reach node 0's store there, not on their own loopback")
    return ""


def _program_problem(command: List[str]) -> str:
    """Why ``command`` cannot start, checked before any process does: a launch that
    failed in its first process would leave the others to be stopped."""
    if not command:
        return "no PROGRAM: give it after -- (python -m deepspeed_ext.supervisor --nproc N " \
               "--spares S -- PROGRAM [ARGS...])"
    program = command[0]
    if program.endswith(".py"):
        return "" if os.path.isfile(program) else f"PROGRAM {program}: file not found"
    return "" if shutil.which(program) else f"PROGRAM {program}: no such program"


def program_argv(command: Sequence[str]) -> List[str]:
    """The command line that runs ``command``: a ``.py`` program with this Python (the
    environment the supervisor runs in), any other as given."""
    if command and command[0].endswith(".py"):
        return [sys.executable, *command]
    return list(command)
