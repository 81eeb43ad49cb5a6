"""Polling with exponential backoff until a deadline: the one wait loop of the library.

Three waits share it: handing a persist job to a node keeper that is busy
(:mod:`deepspeed_ext.keeper`), the committer waiting for every rank's report
(:mod:`deepspeed_ext.store.commit`), and the ranks waiting for a persist's commit
(:mod:`deepspeed_ext.two_level`). Each polls something cheap that a slow process may
not have produced yet; sleeping a fixed short time would take the GIL from the
training step for the whole wait, and a fixed long one would make every fast wait slow.

The loop, on whichever rank or thread calls :func:`poll_until` (no collective)::

    deadline = now + timeout_s
    repeat: result = attempt()            -> not None: return it
            now >= deadline               -> return on_timeout()
            sleep(delay); delay = min(max_s, 2 * delay)     (first delay: first_s)

An exception from ``attempt`` or ``on_timeout`` ends the wait and reaches the caller
unchanged: which errors are worth another poll is the attempt's decision (it catches
them and returns None), so each caller keeps its own exceptions and messages.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How long to sleep between polls: ``first_s``, then doubled after each poll up to
    ``max_s`` (the first sleep is ``first_s`` even when it exceeds ``max_s``)."""

    first_s: float
    max_s: float

    def delays(self) -> Iterator[float]:
        """The endless sequence of sleeps: first_s, min(max_s, 2 first_s), ..."""
        delay = self.first_s
        while True:
            yield delay
            delay = min(self.max_s, delay * 2)


def poll_until(attempt: Callable[[], Optional[T]], timeout_s: float, backoff: Backoff,
               on_timeout: Callable[[], T], *, sleep: Optional[Callable[[float], None]] = None,
               clock: Optional[Callable[[], float]] = None) -> T:
    """Call ``attempt`` until it returns something other than None, sleeping per
    ``backoff`` in between; once ``timeout_s`` has passed after a None, return
    ``on_timeout()`` (which may raise) instead of sleeping again.

    ``attempt`` always runs at least once, and once more after every sleep, so a wait
    never ends on a timeout without a poll right before it.

    Args:
        attempt: one poll; None means "not yet".
        timeout_s: seconds from the call after which no further poll is made.
        backoff: the sleeps between polls.
        on_timeout: the result (or the exception) of a wait that ran out of time.
        sleep: ``time.sleep`` (tests pass a fake one).
        clock: ``time.monotonic`` (tests pass a fake one).

    Raises:
        Whatever ``attempt`` or ``on_timeout`` raises, unchanged.
    """
    sleep = time.sleep if sleep is None else sleep
    clock = time.monotonic if clock is None else clock
    deadline = clock() + timeout_s
    for delay in backoff.delays():
        result = attempt()
        if result is not None:
            return result
        if clock() >= deadline:
            return on_timeout()
        sleep(delay)
    raise AssertionError("unreachable: Backoff.delays() is endless")
