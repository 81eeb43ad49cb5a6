"""Recovery rounds of an in-job restart: which launched process runs which training rank,
kept in the job's store by the node's supervisor (``deepspeed_ext.supervisor``).

A launch starts ``world_size`` training processes and ``spares`` hot spares (on several
nodes: that many on each); each has a *slot*, its index in the launch (``MOC_SLOT``).
Round 0 gives slot ``i`` rank ``i`` and keeps the last ``spares`` slots waiting (several
nodes: :func:`first_round`). When a training process dies, its node's supervisor writes
the next round: the dead slot's rank goes to the first waiting spare (of its node), the
survivors keep their ranks (and with them their expert placement, data position and
snapshot slots), a dead spare is dropped. Every process of a round forms its process
group on the store under the round's own prefix (:func:`group_prefix`), so nothing of an
earlier round's rendezvous is read again.

The store keys (all under :data:`PREFIX`): ``round/<r>`` the round's
:class:`RoundAssignment` as JSON, written once; ``current`` the newest round's number;
``done`` the job's end (``ok`` or ``failed: why``), which releases the waiting spares;
``kill/<r>/<rank>`` a request to kill round ``r``'s training rank ``rank`` (a watchdog
found it hung; the value says why) and ``kill/<r>`` their count, which the supervisor
polls; ``claim/<r>`` which node's supervisor writes round ``r``; ``finished`` the training
processes that exited 0, ``left`` the supervisors done with the store and
``node/<n>/beats`` node ``n``'s supervisor's heartbeat. Plain data and
pure functions here (the supervisor writes, the trainer reads); nothing
from the store is trusted before :meth:`RoundAssignment.from_json` checks it.
"""

import json
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

PREFIX = "moc/restart/"
CURRENT_KEY = PREFIX + "current"
DONE_KEY = PREFIX + "done"
FINISHED_KEY = PREFIX + "finished"
"""How many training processes exited 0 (``store.add``, by every node's supervisor): the
job is done when it reaches the world size."""
LEFT_KEY = PREFIX + "left"
"""How many supervisors are done with the store (``store.add``): the one serving it
keeps it until every node's has left."""
STORE_ENV = "MOC_RESTART_STORE"
"""``host:port`` of the job's store, set by the supervisor for every process it starts."""
SLOT_ENV = "MOC_SLOT"
"""This process's slot in the launch, set by the supervisor."""
ROUND_ENV = "MOC_ROUND"
"""The round this process trains in, set by the trainer's in-job loop before it forms
the round's process group."""
RECOVERIES_ENV = "MOC_RECOVERIES"
"""How many of the rounds up to that one were recoveries (refill rounds are not), set
beside :data:`ROUND_ENV`: the restart number of the event file and the ETTR."""
MAX_REASON_BYTES = 1000
"""At most this much of a kill request's reason is read (and written)."""
MAX_JSON_BYTES = 1 << 20
"""A round's record larger than this is refused (a million slots would not fit either)."""


def kill_key(round_number: int, rank: int) -> str:
    """Where a process asks the supervisor to kill round ``round_number``'s training rank
    ``rank`` (its value: why, at most :data:`MAX_REASON_BYTES` read)."""
    return f"{PREFIX}kill/{round_number}/{rank}"


def kill_count_key(round_number: int) -> str:
    """The number of kill requests made in round ``round_number`` (``store.add``): one
    read tells the supervisor whether to look at :func:`kill_key`'s keys."""
    return f"{PREFIX}kill/{round_number}"


def request_kill(store, round_number: int, rank: int, why: str) -> None:
    """Ask the supervisor to SIGKILL round ``round_number``'s rank ``rank``: its reason
    first, then the count the supervisor polls. Asking twice is harmless."""
    store.set(kill_key(round_number, rank), why.encode("utf-8")[:MAX_REASON_BYTES])
    store.add(kill_count_key(round_number), 1)


def joined_key(round_number: int) -> str:
    """How many of round ``round_number``'s training processes are at its rendezvous
    (``store.add``; :func:`await_round`)."""
    return f"{PREFIX}joined/{round_number}"


class RoundSuperseded(RuntimeError):
    """A newer round named a training process of this one failed before every one of
    them reached its rendezvous: the group would never fill; join the newer round."""


def superseded(store, mine: "RoundAssignment") -> Optional[int]:
    """The first round after ``mine`` that names one of ``mine``'s training slots failed
    (None: none yet)."""
    newest = int(store.get(CURRENT_KEY))
    for number in range(mine.round + 1, newest + 1):
        later = RoundAssignment.from_json(store.get(round_key(number)))
        if set(later.failed) & set(mine.slots):
            return number
    return None


def await_round(store, mine: "RoundAssignment", timeout_s: float, poll_s: float = 0.02) -> None:
    """Every training process of round ``mine``, before it forms the round's process
    group: count itself in, and wait until all ``mine.world_size`` have.

    A process that joined a round another death made stale (its spare, say, read round
    1 while the survivors, a moment later, read round 2) would otherwise wait in a
    rendezvous nobody else comes to until the group's timeout, and the newer round,
    which needs it, with it.

    Raises:
        RoundSuperseded: a newer round named one of ``mine``'s training slots failed
            before all arrived.
        TimeoutError: not all arrived within ``timeout_s``.
    """
    import time
    deadline = time.monotonic() + timeout_s
    arrived = store.add(joined_key(mine.round), 1)
    while arrived < mine.world_size:
        newer = superseded(store, mine)
        if newer is not None:
            raise RoundSuperseded(f"round {newer} named a training process of round "
                                  f"{mine.round} failed before all {mine.world_size} reached "
                                  f"its rendezvous ({arrived} did)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of round {mine.round}'s {mine.world_size} training "
                               f"processes reached its rendezvous within {timeout_s:g} s")
        time.sleep(poll_s)
        arrived = store.add(joined_key(mine.round), 0)


def claim_key(round_number: int) -> str:
    """Which supervisor writes round ``round_number`` (``store.add``: the one that reads
    1). With one supervisor per node, two deaths on two nodes at once would otherwise
    write two different records under one round number."""
    return f"{PREFIX}claim/{round_number}"


def node_beat_key(node: int) -> str:
    """Node ``node``'s supervisor's beat counter (``store.add``), which node 0's watches."""
    return f"{PREFIX}node/{node}/beats"


def round_key(round_number: int) -> str:
    """The store key of round ``round_number``'s assignment."""
    return f"{PREFIX}round/{round_number}"


def store_address(value: str):
    """``(host, port)`` of a ``host:port`` value (:data:`STORE_ENV`).

    Raises:
        ValueError: not ``host:port`` with a port number.
    """
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{STORE_ENV}={value!r} is not host:port")
    return host, int(port)


def group_prefix(round_number: int) -> str:
    """The store prefix round ``round_number``'s process group is formed under."""
    return f"{PREFIX}group/{round_number}/"


class BadRound(ValueError):
    """A round's record is not one this module wrote (wrong types, ranks not a
    permutation of distinct slots, a slot both training and waiting)."""


@dataclass(frozen=True)
class RoundAssignment:
    """Who trains in one round."""

    round: int
    """0 for the launch, then one more per recovery."""
    slots: Tuple[int, ...]
    """``slots[rank]``: the slot running training rank ``rank``; its length is the world size."""
    spares: Tuple[int, ...]
    """Slots waiting, in the order they will be used."""
    failed: Tuple[int, ...] = ()
    """Slots whose death started this round, and live slots it displaced (a node moved
    whole to a spare node: their supervisor ends them); empty for round 0."""
    at: float = 0.0
    """Wall-clock time (``time.time()``) the supervisor wrote the round: for a recovery,
    right after it saw the death; 0.0 when not stamped."""

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def rank_of(self, slot: int) -> Optional[int]:
        """The training rank of ``slot`` in this round; None: it waits (or is gone)."""
        try:
            return self.slots.index(slot)
        except ValueError:
            return None

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "slots": list(self.slots),
                           "spares": list(self.spares), "failed": list(self.failed),
                           "at": self.at})

    @classmethod
    def from_json(cls, text) -> "RoundAssignment":
        """The record in ``text`` (str or bytes, as the store returns it).

        Raises:
            BadRound: not JSON, or not a valid assignment.
        """
        if isinstance(text, (bytes, bytearray)):
            if len(text) > MAX_JSON_BYTES:
                raise BadRound(f"a round record of {len(text)} bytes (at most {MAX_JSON_BYTES})")
            text = text.decode("utf-8", "replace")
        try:
            data = json.loads(text)
        except ValueError as err:
            raise BadRound(f"a round record is not JSON ({err})") from None
        fields = ("slots", "spares", "failed")
        if not (isinstance(data, dict) and type(data.get("round")) is int and data["round"] >= 0
                and all(isinstance(data.get(k), list)
                        and all(type(x) is int and x >= 0 for x in data[k]) for k in fields)):
            raise BadRound("a round record without an int round and int lists slots, spares "
                           "and failed")
        at = data.get("at", 0.0)
        if type(at) not in (int, float) or not math.isfinite(at) or at < 0:
            raise BadRound(f"round {data['round']}: at {at!r} is not a time")
        record = cls(data["round"], tuple(data["slots"]), tuple(data["spares"]),
                     tuple(data["failed"]), float(at))
        taken = record.slots + record.spares
        if not record.slots or len(set(taken)) != len(taken):
            raise BadRound(f"round {record.round}: a slot twice, or no training slot, in "
                           f"{list(record.slots)} + spares {list(record.spares)}")
        return record


def first_round(nproc: int, spares: int, nodes: int = 1, spare_nodes: int = 0) -> RoundAssignment:
    """Round 0 of a launch of ``nodes`` nodes, each starting ``nproc + spares`` processes:
    node ``n``'s slots are ``n * (nproc + spares)`` onwards, its first ``nproc`` train as
    ranks ``n * nproc`` onwards (ranks fill nodes in order, as the keepers and the
    redundancy placement expect) and its last ``spares`` wait; the last ``spare_nodes``
    nodes train nothing (every slot of theirs waits, to take a lost node's ranks). One
    node: slot ``i`` trains as rank ``i``."""
    if nproc < 1 or spares < 0 or nodes < 1 or not 0 <= spare_nodes < nodes:
        raise ValueError(f"{nproc} training processes and {spares} spares on {nodes} nodes, "
                         f"{spare_nodes} of them spare")
    launched, training = nproc + spares, nodes - spare_nodes
    return RoundAssignment(
        0, tuple(n * launched + i for n in range(training) for i in range(nproc)),
        tuple(n * launched + nproc + j for n in range(training) for j in range(spares))
        + tuple(range(training * launched, nodes * launched)))


def node_of_slot(slot: int, launched: int) -> int:
    """The node of ``slot`` when every node starts ``launched`` processes."""
    return slot // launched


def next_round(previous: RoundAssignment, dead: Iterable[int],
               launched: Optional[int] = None) -> Optional[RoundAssignment]:
    """The round after ``previous`` once the slots ``dead`` died: each dead training slot's
    rank goes to the first waiting spare that is alive, in rank order; dead spares leave
    the waiting list. With ``launched`` (processes per node), only a spare of the dead
    slot's own node may take its rank (its state is in that node's keeper, and the rank
    stays where the node layout puts it). When a node's own live spares are fewer than
    its dead ranks, a spare node (every slot of it waiting) takes *all* of that node's
    ranks in order, its other slots becoming that node's spares: the node's live
    processes are *displaced* (listed as failed, so that their supervisor ends them; a
    node's ranks never straddle two machines). None when no spare can take a dead rank
    (the job cannot go on in place: relaunch it)."""
    dead = set(dead)
    waiting = [s for s in previous.spares if s not in dead]
    slots = list(previous.slots)
    displaced: Set[int] = set()
    if launched is not None:
        moves, displaced = _spare_node_moves(previous, dead, waiting, launched)
        for rank, slot in moves.items():
            slots[rank] = slot
        waiting = [s for s in waiting if s not in set(moves.values()) | displaced]
    for rank, slot in enumerate(slots):
        if slot in dead:
            usable = [s for s in waiting if launched is None
                      or node_of_slot(s, launched) == node_of_slot(slot, launched)]
            if not usable:
                return None
            slots[rank] = usable[0]
            waiting.remove(usable[0])
    failed = {s for s in dead if s in previous.slots or s in previous.spares} | displaced
    return RoundAssignment(previous.round + 1, tuple(slots), tuple(waiting),
                           tuple(sorted(failed)))


def refill_round(previous: RoundAssignment, slot: int) -> Optional[RoundAssignment]:
    """The round after ``previous`` that lists ``slot`` (its process dead, a new one
    started in it) as a waiting spare again, last in line; nobody's rank moves and no
    slot failed, so no training process leaves its run for it. None when ``slot`` is in
    the job already."""
    if slot in previous.slots or slot in previous.spares:
        return None
    return RoundAssignment(previous.round + 1, previous.slots, previous.spares + (slot,))


def recoveries(rounds: Iterable[RoundAssignment]) -> int:
    """How many of ``rounds`` are recoveries (some slot failed), not refills."""
    return sum(1 for r in rounds if r.failed)


def _spare_node_moves(previous: RoundAssignment, dead: Set[int], waiting: List[int],
                      launched: int) -> Tuple[Dict[int, int], Set[int]]:
    """``({rank: slot}, displaced)``: each node with more dead ranks than live spares of
    its own moved whole onto a spare node's first slots (lowest spare node first), and
    the node's live slots (training and waiting) that the move displaces."""
    moves: Dict[int, int] = {}
    displaced: Set[int] = set()
    free = [n for n in sorted({node_of_slot(s, launched) for s in waiting})
            if all(n * launched + i in waiting for i in range(launched))]
    by_node: Dict[int, List[int]] = {}
    for rank, slot in enumerate(previous.slots):
        by_node.setdefault(node_of_slot(slot, launched), []).append(rank)
    for node, ranks in sorted(by_node.items()):
        own = [s for s in waiting if node_of_slot(s, launched) == node]
        lost = [r for r in ranks if previous.slots[r] in dead]
        if not free or not lost or len(own) >= len(lost):
            continue
        target = free.pop(0)
        moves.update({rank: target * launched + i for i, rank in enumerate(ranks)})
        displaced |= {previous.slots[r] for r in ranks if r not in lost} | set(own)
    return moves, displaced
