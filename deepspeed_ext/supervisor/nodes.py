"""The store server's watch over the nodes' supervisors (node 0's over the others, or a
``--coordinator``'s over every node, node 0 too): a node whose supervisor stopped
beating is lost (the machine, its processes and its keeper's memory with it), and its
ranks must go to a spare node before the survivors give up waiting for a round.

Each supervisor adds 1 to its node's beat counter in the store at every look (every
``POLL_S``, :func:`~deepspeed_ext.runtime.rounds.node_beat_key`); the server reads the
counters and keeps, per node, when it last saw one move, on its own monotonic clock (no
two machines' clocks are compared). Pure bookkeeping here, no store and no clock of its
own: the supervisor feeds it.
"""

from typing import Dict, List, Set


class NodeWatch:
    """Which nodes' supervisors have been silent too long.

    Args:
        timeout_s: a node whose counter has not moved for longer than this is lost.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.counts: Dict[int, int] = {}
        """Per node, its counter when it last moved."""
        self.seen: Dict[int, float] = {}
        """Per node, when its counter last moved (the caller's clock)."""
        self.lost: Set[int] = set()
        """Nodes found lost (never looked at again)."""

    def look(self, counts: Dict[int, int], now: float) -> List[int]:
        """Take the counters read at ``now``; returns the nodes found lost by this look.
        A node whose counter is still 0 has not started its watch yet (nodes start
        minutes apart on a cluster): it is not timed until its first beat."""
        newly = []
        for node, count in sorted(counts.items()):
            if node in self.lost or count <= 0:
                continue
            if count != self.counts.get(node):
                self.counts[node], self.seen[node] = count, now
            elif now - self.seen[node] > self.timeout_s:
                self.lost.add(node)
                newly.append(node)
        return newly

    def silent_s(self, node: int, now: float) -> float:
        """How long ``node``'s counter has not moved, at ``now``."""
        return now - self.seen.get(node, now)
