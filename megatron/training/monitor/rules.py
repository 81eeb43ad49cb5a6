"""The hang and straggler rules: pure functions of the ranks' last heartbeats.

**Hang** (:func:`find_hang`). Once every rank has beaten at least once (each publishes a
*ready* beat of the iteration it resumes from before the loop), the job hangs when no
rank that is not finished has made progress (a new heartbeat; a *touch* after each
evaluation step and before a save counts) for ``hang_timeout_s`` seconds. In synchronous
training a rank cannot run more than one iteration ahead of the others, so the hung
rank is the one whose heartbeat lags: it last beat at the start of iteration ``i`` and
never started ``i + 1``, while the others beat ``i + 1`` and then blocked in its first
collective. When all ranks stalled in the same iteration (a hang inside an iteration)
the culprit is unknown, unless some of them are *frozen*: their watchdog thread, which
polls while the main thread waits in a collective, stopped too (the whole process is
stopped), while the others' still poll; the frozen ones are then the suspects and the
others wait for them. Otherwise the finding names the rank silent the longest and lists
every suspect.

**Straggler** (:func:`find_stragglers`). In synchronous training every rank's
*wall-clock* iteration time is the same: the fast ranks wait inside the collectives for
the slow one. So the rule compares each rank's median ``own_s`` (its time outside
collectives) with the others'; for rank ``r``::

    excess_r   = median_own_r - median(median_own_s for every other rank s)
    slowdown_r = median_iter_r / (median_iter_r - excess_r)
    straggler when slowdown_r > straggler_factor

``slowdown`` is how much faster the job would iterate without ``r``'s extra time; with
``own_s == iter_s`` it is simply ``median_iter_r / median of the others' medians``. The
baseline excludes ``r`` itself: with two ranks a median including the straggler would
halve its apparent slowdown. Because it compares medians of ``window`` beats, a rank is
flagged only after more than half of its last ``window`` iterations were slow; one (or
up to ``(window - 1) // 2``) slow iterations never flag it.

Both are called by :class:`~megatron.training.monitor.watchdog.Watchdog` on every rank,
at each poll, with no side effect; tests call them on scripted beats.
"""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

from megatron.training.monitor.beats import Beat


@dataclass(frozen=True)
class HangFinding:
    """What :func:`find_hang` concluded."""

    rank: int
    """The rank blamed: the lagging rank, or (no rank lags) the one silent longest."""
    seconds: float
    """How long the blamed rank's heartbeat has not advanced."""
    iteration: int
    """The iteration the blamed rank was starting at its last beat."""
    suspects: List[int]
    """Every stalled rank at the lowest iteration (one rank when the culprit is known)."""
    waiting: List[int]
    """Ranks that started a later iteration, or whose watchdog still polls while the
    suspects' froze: they wait for the suspects in a collective."""
    frozen: bool = False
    """The suspects are frozen processes (their watchdog stopped polling too)."""


def find_hang(beats: Mapping[int, Beat], ages: Mapping[int, float], world_size: int,
              timeout_s: float,
              alive_ages: Optional[Mapping[int, float]] = None) -> Optional[HangFinding]:
    """The hang rule (see the module doc); pure.

    Args:
        beats: each rank's last beat (ranks that never beat are missing).
        ages: seconds since each rank's heartbeat last advanced, as the caller observed.
        world_size: ranks in the job; no hang is found before all of them beat once.
        timeout_s: ``hang_timeout_s``.
        alive_ages: seconds since each rank's watchdog last polled, as the caller
            observed (None, or a rank missing: unknown); a rank silent for more than
            half of ``timeout_s`` is frozen.
    """
    if len(beats) < world_size:
        return None  # not every rank is training yet: start-up is not watched
    active = {r: b for r, b in beats.items() if not b.done}
    # A per-rank timeout would add nothing but false alarms: no rank can progress more
    # than one iteration without the others, so while any rank progresses, all do.
    if not active or min(ages[r] for r in active) <= timeout_s:
        return None
    low = min(b.iteration for b in active.values())
    suspects = sorted(r for r, b in active.items() if b.iteration == low)
    waiting = sorted(r for r, b in active.items() if b.iteration > low)
    if not waiting and alive_ages:
        frozen = [r for r in suspects if alive_ages.get(r, 0.0) > timeout_s / 2]
        if frozen and len(frozen) < len(suspects):
            waiting = [r for r in suspects if r not in frozen]
            culprit = max(frozen, key=lambda r: (ages[r], -r))
            return HangFinding(rank=culprit, seconds=ages[culprit], iteration=low,
                               suspects=frozen, waiting=waiting, frozen=True)
    culprit = max(suspects, key=lambda r: (ages[r], -r))
    return HangFinding(rank=culprit, seconds=ages[culprit], iteration=low,
                       suspects=suspects, waiting=waiting)


def find_stragglers(beats: Mapping[int, Beat], factor: float) -> Dict[int, float]:
    """The straggler rule (see the module doc); pure.

    Returns:
        ``{rank: slowdown}`` of every rank whose slowdown exceeds ``factor``; ranks
        without a full window, and finished ranks, are neither judged nor compared.
    """
    medians = {r: (b.median_iter_s, b.median_own_s) for r, b in beats.items()
               if not b.done and b.median_iter_s is not None and b.median_own_s is not None}
    out = {}
    for r, (m_iter, m_own) in medians.items():
        others = [own for s, (_, own) in medians.items() if s != r]
        if not others:
            continue
        excess = m_own - statistics.median(others)
        if excess <= 0:
            continue
        slowdown = m_iter / max(m_iter - excess, 1e-9)
        if slowdown > factor:
            out[r] = slowdown
    return out
