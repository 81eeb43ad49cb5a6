"""The supervisor's entry point: check the command line, serve the store, run the job.

    python -m deepspeed_ext.supervisor --nproc N --spares S [--max-rounds R] [--port P]
        [--grace-s G] [--nnodes M --node-rank I --master-addr HOST [--spare-nodes K]
        [--node-timeout S]] -- PROGRAM [ARGS...]

Exit status: 0 every training process exited 0; 1 the job stopped (no round could replace
a dead process: relaunch it); 2 bad input, nothing started (``error: ...`` names the
flag); 3 this node left the job, every slot of it given to a spare node (the job goes on
on the other nodes: no relaunch); 128 + N stopped by signal N (SIGINT, SIGTERM), passed
on to every process.
"""

import logging
import signal
import sys
from typing import Optional, Sequence

from deepspeed_ext.runtime.log import ConsoleFallback
from deepspeed_ext.supervisor.options import parse_options

LOGGER = "deepspeed_ext.supervisor"
"""The logger every line of the supervisor goes through (each module's is a child)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM)
"""Signals the supervisor passes on to its processes (then ends the job)."""


def configure_logging() -> None:
    """Send the supervisor's lines to stderr, as they read, unless the program configured
    logging (a handler on the supervisor's logger, the package's or the root): the
    package's default handler writes to stdout, which the processes share with it."""
    logger = logging.getLogger(LOGGER)
    package = logging.getLogger("deepspeed_ext")
    handlers = logger.handlers + package.handlers + logging.getLogger().handlers
    if any(not isinstance(handler, ConsoleFallback) for handler in handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the supervisor with ``argv`` (default ``sys.argv[1:]``); returns its exit
    status (module docstring)."""
    try:
        options = parse_options(argv)
    except SystemExit as stop:  # argparse's --help (0) and bad input (2, already printed)
        return stop.code if isinstance(stop.code, int) else 2
    configure_logging()
    # torch only now: a mistyped flag is answered without its import (a second or more)
    from deepspeed_ext.supervisor.job import Supervisor
    from deepspeed_ext.supervisor.store import host_store, join_store
    try:
        if options.serves_store:
            store = host_store(options.host, options.port)
        else:
            store = join_store(options.host, options.port)
    except RuntimeError as err:
        how = "served there" if options.serves_store else "reached there from this node"
        print(f"error: --master-addr {options.host} --port {options.port}: the job's store "
              f"cannot be {how} ({err})", file=sys.stderr)
        return 2
    supervisor = Supervisor(options, store, store.port)
    if options.serves_store and options.nnodes > 1 and not options.spare_nodes:
        logging.getLogger(LOGGER).info(
            f"{supervisor.prefix}no spare node (--spare-nodes 0): a lost node, or a crash "
            "on a node with no spare process left, relaunches the job")
    previous = {signum: signal.signal(signum, lambda s, _: supervisor.request_stop(s))
                for signum in FORWARDED}
    try:
        return supervisor.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
