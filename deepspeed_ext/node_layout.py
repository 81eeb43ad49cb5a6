"""How many ranks share a node: from the flag, or from whatever launcher started the job.

Keepers, shared memory, redundancy placement and thread counts are per node. torchrun
sets ``LOCAL_WORLD_SIZE``; DeepSpeed's launcher sets ``LOCAL_SIZE`` (and no
``LOCAL_WORLD_SIZE``); Slurm's ``srun`` sets ``SLURM_NTASKS_PER_NODE``. Reading only the
first made every rank of a DeepSpeed multi-node job count as node 0: one node's
``/dev/shm`` was charged for every rank's slots, ``--moc-redundancy`` was refused as
single-node, and only global rank 0 stopped a keeper. Pure functions of the environment.
"""

import os
import re
from typing import Mapping, Optional

LAUNCHER_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
"""Where launchers put the number of processes on this node, in the order they are read
(torchrun, DeepSpeed, Slurm)."""


def launcher_ranks_per_node(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The ranks on this node as the launcher says (None: no launcher said).

    Slurm's ``SLURM_NTASKS_PER_NODE`` may read ``8(x2)`` (8 on each of 2 nodes): its
    first count is taken. Empty or malformed values are skipped.
    """
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_VARIABLES:
        match = re.match(r"\s*(\d+)", environ.get(name) or "")
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def ranks_per_node(configured: int, world: int,
                   environ: Optional[Mapping[str, str]] = None) -> int:
    """``--moc-ranks-per-node`` when set (> 0), else the launcher's count, else ``world``
    (one node)."""
    if configured and configured > 0:
        return configured
    return launcher_ranks_per_node(environ) or max(1, world)


def node_of(rank: int, per_node: int) -> int:
    """The node of ``rank`` when ranks fill nodes in order, ``per_node`` each."""
    return rank // per_node


def first_of_node(rank: int, per_node: int) -> bool:
    """Whether ``rank`` is its node's first: the one that starts, drains and stops the
    node's keeper (when only global rank 0 did, every other node's keeper outlived the
    job with its shared memory)."""
    return rank % per_node == 0
