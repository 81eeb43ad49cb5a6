"""One supervisor's copy of the job's rounds: the ones it wrote and the ones other nodes'
supervisors wrote, read back from the store, and the claim that lets exactly one of
them write each round number.

Every node's supervisor keeps one. The order of a recovery, in the supervisor that saw
the deaths: :meth:`RoundBook.claim_next` (catch up, build the next round, claim its
number with ``store.add``; when another node's claimed it first, wait for that round
and build on it), then :meth:`RoundBook.publish` (the record, then ``current``).
"""

import time
from typing import List, Optional, Set

import torch.distributed as dist

from deepspeed_ext.runtime.rounds import (CURRENT_KEY, RoundAssignment, claim_key, next_round,
                                          recoveries, refill_round, round_key)
from deepspeed_ext.supervisor.store import STORE_TIMEOUT, write_round

WAIT_POLL_S = 0.1
"""Between two reads of ``current`` while waiting for a round another node claimed."""


class RoundBook:
    """The rounds as this supervisor knows them.

    Args:
        store: the job's store.
        first: round 0 (every supervisor computes the same).
        launched: processes per node (a dead slot's rank goes to a spare of its node).
        max_rounds: recoveries in place allowed; a round past it is built, never claimed.
    """

    def __init__(self, store: dist.Store, first: RoundAssignment, launched: int,
                 max_rounds: int):
        self.store, self.launched, self.max_rounds = store, launched, max_rounds
        self.current = first
        self.rounds: List[RoundAssignment] = [first]
        """Every round known, oldest first."""

    def follow(self) -> None:
        """Read every round newer than :attr:`current` (written by another node's
        supervisor: one supervisor never misses its own)."""
        newest = int(self.store.get(CURRENT_KEY))
        while self.current.round < newest:
            self.current = RoundAssignment.from_json(
                self.store.get(round_key(self.current.round + 1)))
            self.rounds.append(self.current)

    def recoveries_with(self, after: RoundAssignment) -> int:
        """Recoveries in place once ``after`` is written (refill rounds do not count)."""
        return recoveries(self.rounds + [after])

    def claim_next(self, dead: Set[int]) -> Optional[RoundAssignment]:
        """The round after the newest once the slots ``dead`` died, claimed for this
        supervisor to write; None when no spare can take a rank, and past ``max_rounds``
        recoveries the unclaimed round (the caller fails either way)."""
        while True:
            self.follow()
            after = next_round(self.current, dead, self.launched)
            if after is None or self.recoveries_with(after) > self.max_rounds:
                return after
            if self.store.add(claim_key(after.round), 1) == 1:
                return after
            self.wait_for(after.round)

    def claim_refill(self, slot: int) -> Optional[RoundAssignment]:
        """The round that makes ``slot`` (restarted) a waiting spare again, claimed; None
        when it is in the job already."""
        while True:
            self.follow()
            after = refill_round(self.current, slot)
            if after is None or self.store.add(claim_key(after.round), 1) == 1:
                return after
            self.wait_for(after.round)

    def wait_for(self, number: int) -> None:
        """Wait until round ``number`` is current (another node's supervisor claimed it
        and writes it at once).

        Raises:
            dist.DistError: not within the store's timeout (that supervisor died between
                its claim and its write): the job cannot agree on a round.
        """
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while int(self.store.get(CURRENT_KEY)) < number:
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"round {number} was claimed but never written")
            time.sleep(WAIT_POLL_S)

    def publish(self, after: RoundAssignment) -> None:
        """Write ``after`` (claimed) and make it the current round."""
        write_round(self.store, after)
        self.current = after
        self.rounds.append(after)


def change_text(before: RoundAssignment, after: RoundAssignment, dead: Set[int]) -> str:
    """The ranks ``after`` moves, ``rank 2 -> slot 4, rank 3 -> slot 5``, and the live
    slots it displaces (a node moved whole to a spare node), for a supervisor's line;
    ``""`` when no rank moved (a spare was dropped)."""
    text = ", ".join(f"rank {rank} -> slot {slot}" for rank, slot in enumerate(after.slots)
                     if before.slots[rank] != slot)
    displaced = sorted(set(after.failed) - dead)
    return text + (f" (slot(s) {displaced} displaced)" if displaced else "")
