"""The supervisor's command line, checked before anything starts (no store, no process):

    python -m deepspeed_ext.supervisor --nproc N --spares S [--max-rounds R] [--port P]
        [--grace-s G] -- PROGRAM [ARGS...]

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
USAGE = (f"{PROG} --nproc N --spares S [--max-rounds R] [--port P] [--grace-s G] "
         "-- PROGRAM [ARGS...]")
LOCALHOST = "127.0.0.1"
"""The store's address for the processes of this node: one node, one supervisor."""
MAX_PORT = 65535


@dataclass(frozen=True)
class SupervisorOptions:
    """What one node's supervisor runs. One supervisor per node later keeps these fields:
    the slots become the node's share of the launch and the store's address is given
    (``--store HOST:PORT``) instead of hosted here (``--host-store``)."""

    nproc: int
    """Training processes (the world size): slots ``0 .. nproc - 1``."""
    spares: int
    """Hot spares after them: slots ``nproc .. nproc + spares - 1``."""
    command: Tuple[str, ...]
    """The program and its arguments, as given after ``--``."""
    max_rounds: int = 3
    """Recoveries in place before the job stops to be relaunched (0: none)."""
    port: int = 0
    """The store's port; 0: a free one, chosen when the store starts."""
    grace_s: float = 10.0
    """How long a process is given to end on its own before it is killed."""
    host: str = LOCALHOST
    """The store's address as the processes reach it."""

    @property
    def launched(self) -> int:
        """How many processes the supervisor starts: training ones and spares."""
        return self.nproc + self.spares


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
                        help="training processes (the world size)")
    parser.add_argument("--spares", type=int, required=True, metavar="S",
                        help="hot spares started after them, waiting to take a dead rank")
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
               or _program_problem(command))
    if problem:
        parser.error(problem)
    return SupervisorOptions(nproc=ns.nproc, spares=ns.spares, command=tuple(command),
                             max_rounds=ns.max_rounds, port=_port(ns, environ),
                             grace_s=ns.grace_s)


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
