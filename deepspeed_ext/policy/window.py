"""Exact recovery, planning half: sparse snapshots over a window of ``W`` iterations.

After MoEtion (DESIGN section 3). The operators of one rank (experts, dense blocks, gates)
are put in a snapshot order (:func:`deepspeed_ext.policy.operators.order_operators`) and
cut into ``W`` consecutive groups (:func:`build_schedule`). A window covers iterations ``s .. s+W-1``; at position
``t`` (iteration ``s+t``):

* group ``t`` is snapshotted *active*: fp32 master weights and optimizer moments;
* groups ``t+1 .. W-1`` (not active yet in this window) are snapshotted *frozen*: their
  low-precision compute weights only;
* groups ``0 .. t-1`` are not copied (their active snapshot is already taken).

Timing: the snapshot at iteration ``i`` is of the state at the *start* of ``i`` (after
iteration ``i-1``'s optimizer step). It overlaps ``i``'s forward/backward and must be
complete before ``i``'s optimizer step overwrites that state, hence the stall of DESIGN
Eq. 10, ``max(0, T_snapshot - T_fwd_bwd)``, that :func:`choose_window` keeps at zero.

Recovery (sparse-to-dense conversion, :func:`replay_plan`) restores the last complete
window and replays its ``W`` iterations, turning group ``j`` active at iteration ``s+j``;
at the end every operator holds exact state, and the iterations from ``s+W`` up to the
failure are replayed as ordinary dense iterations. Replay needs the same micro-batches
(and RNG state) per iteration as the original run; that is the caller's part.

Use, on every rank with the same inputs (everything here is deterministic)::

    ordered = order_operators(my_operators, popularity)
    choice = choose_window(ordered, copy_bytes_per_s, fwd_bwd_s)
    schedule = build_schedule(ordered, choice.window)
    for i in range(start, end):
        snap = snapshot_at(schedule, (i - start) % schedule.window)
        ...                                   # copy snap.active / snap.frozen to host
    # after a failure at iteration f:
    s = last_complete_window(schedule.window, start, f)
    steps = replay_plan(schedule, s, f)

This module is pure: no torch, no torch.distributed, no file I/O.
"""

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from deepspeed_ext.policy.operators import Operator, check_count, index_operators, is_int

WINDOW_FLAG = "--moc-window"


# --- schedule -------------------------------------------------------------------------------

def _check_window(window, num_operators: int) -> int:
    if not is_int(window) or not 1 <= window <= num_operators:
        raise ValueError(f"{WINDOW_FLAG} must be an int in [1, {num_operators}] (one or more "
                         f"operators per iteration's active snapshot), got {window!r}")
    return window


@dataclass(frozen=True)
class Schedule:
    """Which operators each position of a window snapshots active.

    Attributes:
        window: ``W``, iterations per window (``--moc-window``).
        groups: ``W`` non-empty tuples of operator names; group ``t`` is snapshotted active
            at position ``t``. Every operator is in exactly one group.
    """

    window: int
    groups: Tuple[Tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not is_int(self.window) or self.window < 1:
            raise ValueError(f"{WINDOW_FLAG} must be a positive int, got {self.window!r}")
        if len(self.groups) != self.window:
            raise ValueError(f"Schedule has {len(self.groups)} groups for a window of "
                             f"{self.window}")
        seen = set()
        for t, group in enumerate(self.groups):
            # A position with nothing to make active would leave a replay step that only
            # re-runs what the previous one did: a wasted iteration per window.
            if not group:
                raise ValueError(f"Schedule group {t} is empty")
            for name in group:
                if name in seen:
                    raise ValueError(f"operator {name!r} is in two Schedule groups")
                seen.add(name)

    def group_of(self, name: str) -> int:
        """The group (position) whose active snapshot holds ``name``.

        Raises:
            ValueError: ``name`` is in no group.
        """
        for t, group in enumerate(self.groups):
            if name in group:
                return t
        raise ValueError(f"operator {name!r} is in no Schedule group")


def _greedy_groups(sizes: Sequence[int], cap: int, limit: int) -> int:
    """Groups that consecutive packing under ``cap`` needs; stops counting past ``limit``."""
    groups, load = 1, 0
    for size in sizes:
        if load + size > cap:
            groups, load = groups + 1, 0
            if groups > limit:
                break
        load += size
    return groups


def _smallest_cap(sizes: Sequence[int], window: int) -> int:
    """The least ``cap`` under which ``sizes`` fit in ``window`` consecutive groups."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if _greedy_groups(sizes, mid, window) <= window:
            high = mid
        else:
            low = mid + 1
    return low


def _cut(sizes: Sequence[int], cap: int, window: int) -> List[int]:
    """Start index of each of exactly ``window`` non-empty groups, none above ``cap``."""
    starts, load = [0], sizes[0]
    for i in range(1, len(sizes)):
        groups_left = window - len(starts)
        # Once only as many items remain as groups still to open, each must open one, or
        # a trailing group would be empty.
        if len(sizes) - i == groups_left or (groups_left and load + sizes[i] > cap):
            starts.append(i)
            load = 0
        load += sizes[i]
    return starts


def build_schedule(ordered: Sequence[Operator], window: int) -> Schedule:
    """Split the snapshot order into ``window`` consecutive groups balanced by active bytes.

    Minimises the largest group's ``active_bytes`` over all splits into ``window``
    consecutive non-empty groups (binary search on that maximum, greedy packing); a
    deterministic function of the order and ``window``.

    Args:
        ordered: operators in snapshot order
            (:func:`~deepspeed_ext.policy.operators.order_operators`).
        window: ``W`` (``--moc-window``), ``1..len(ordered)``.

    Raises:
        ValueError: ``window`` out of range (the message names ``--moc-window``), or
            duplicate operator names.
    """
    index_operators(ordered)
    _check_window(window, len(ordered))
    sizes = [op.active_bytes for op in ordered]
    starts = _cut(sizes, _smallest_cap(sizes, window), window) + [len(ordered)]
    groups = tuple(tuple(op.name for op in ordered[a:b]) for a, b in zip(starts, starts[1:]))
    return Schedule(window=window, groups=groups)


# --- snapshots per iteration ----------------------------------------------------------------

@dataclass(frozen=True)
class IterationSnapshot:
    """What one position of the window copies.

    Attributes:
        position: ``t``, ``0..W-1``: the iteration's offset from the window start.
        active: names copied with master weights and optimizer moments (group ``t``).
        frozen: names copied with compute weights only (groups ``t+1 .. W-1``, in order).
    """

    position: int
    active: Tuple[str, ...]
    frozen: Tuple[str, ...]


def _check_position(schedule: Schedule, t) -> int:
    if not is_int(t) or not 0 <= t < schedule.window:
        raise ValueError(f"window position must be an int in [0, {schedule.window}), got {t!r}")
    return t


def snapshot_at(schedule: Schedule, t: int) -> IterationSnapshot:
    """The snapshot of position ``t``: group ``t`` active, later groups frozen.

    Raises:
        ValueError: ``t`` is not in ``[0, window)``.
    """
    _check_position(schedule, t)
    frozen = tuple(name for group in schedule.groups[t + 1:] for name in group)
    return IterationSnapshot(position=t, active=schedule.groups[t], frozen=frozen)


def _group_bytes(schedule: Schedule, by_name: Mapping[str, Operator],
                 field: str) -> List[int]:
    totals = []
    for group in schedule.groups:
        missing = [name for name in group if name not in by_name]
        if missing:
            raise ValueError(f"operators_by_name lacks scheduled operator {missing[0]!r}")
        totals.append(sum(getattr(by_name[name], field) for name in group))
    return totals


def iteration_bytes(schedule: Schedule, operators_by_name: Mapping[str, Operator]) -> List[int]:
    """Bytes copied at each position ``0..W-1``: see :func:`bytes_at`."""
    active = _group_bytes(schedule, operators_by_name, "active_bytes")
    frozen = _group_bytes(schedule, operators_by_name, "frozen_bytes")
    result, later_frozen = [0] * schedule.window, 0
    for t in reversed(range(schedule.window)):
        result[t] = active[t] + later_frozen
        later_frozen += frozen[t]
    return result


def bytes_at(schedule: Schedule, operators_by_name: Mapping[str, Operator], t: int) -> int:
    """Bytes the snapshot of position ``t`` copies.

    Group ``t``'s ``active_bytes`` plus the ``frozen_bytes`` of groups ``t+1 .. W-1``.

    Raises:
        ValueError: ``t`` is not in ``[0, window)``, or a scheduled operator is missing
            from ``operators_by_name``.
    """
    _check_position(schedule, t)
    return iteration_bytes(schedule, operators_by_name)[t]


def max_bytes_per_iteration(schedule: Schedule, operators_by_name: Mapping[str, Operator]) -> int:
    """The largest per-position snapshot of the window: what sets the stall."""
    return max(iteration_bytes(schedule, operators_by_name))


def window_host_bytes(schedule: Schedule, operators_by_name: Mapping[str, Operator]) -> int:
    """Host memory one complete window of snapshots takes: the sum over its positions.

    Recovery needs the last complete window while the next one is being filled, so a
    run holds up to twice this; budget for that.
    """
    return sum(iteration_bytes(schedule, operators_by_name))


# --- choosing W -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowChoice:
    """The result of :func:`choose_window`.

    Attributes:
        window: the chosen ``W``.
        snapshot_s: seconds its largest per-position snapshot takes to copy.
        fits: whether that is within the forward/backward time (no stall).
    """

    window: int
    snapshot_s: float
    fits: bool


def _check_rates(copy_bytes_per_s, fwd_bwd_s) -> None:
    # A zero bandwidth would divide by zero; a negative time would make nothing fit.
    if isinstance(copy_bytes_per_s, bool) or not isinstance(copy_bytes_per_s, (int, float)) \
            or not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s must be a positive number, got {copy_bytes_per_s!r}")
    if isinstance(fwd_bwd_s, bool) or not isinstance(fwd_bwd_s, (int, float)) \
            or not fwd_bwd_s >= 0:
        raise ValueError(f"fwd_bwd_s must be a non-negative number, got {fwd_bwd_s!r}")


def choose_window(ordered: Sequence[Operator], copy_bytes_per_s: float, fwd_bwd_s: float,
                  max_window: Optional[int] = None) -> WindowChoice:
    """The smallest ``W`` whose every per-position snapshot hides behind forward/backward.

    DESIGN Eq. 10: stall ``= max(0, T_snapshot - T_fwd_bwd)`` with ``T_snapshot`` the
    largest per-position snapshot of :func:`build_schedule` ``(ordered, W)`` over
    ``copy_bytes_per_s``. That size is not monotone in ``W`` (a larger ``W`` shrinks
    the active group but adds later groups' frozen bytes, and group boundaries move), so
    every ``W`` is evaluated from 1 up. A smaller ``W`` is preferred: recovery replays
    fewer iterations and the host keeps fewer snapshots.

    Args:
        ordered: operators in snapshot order.
        copy_bytes_per_s: device-to-host copy bandwidth, bytes per second.
        fwd_bwd_s: forward plus backward time of one iteration, seconds.
        max_window: the largest ``W`` to consider; default ``len(ordered)``.

    Returns:
        The smallest fitting ``W`` with ``fits=True``; if none fits, the ``W`` with the
        smallest largest snapshot (ties: smaller ``W``) with ``fits=False``.

    Raises:
        ValueError: no operators, a non-positive bandwidth, a negative time, or
            ``max_window`` out of ``[1, len(ordered)]`` (named as ``--moc-window``).
    """
    by_name = index_operators(ordered)
    if not ordered:
        raise ValueError("choose_window needs at least one operator")
    _check_rates(copy_bytes_per_s, fwd_bwd_s)
    limit = len(ordered) if max_window is None else _check_window(max_window, len(ordered))
    best = None
    for window in range(1, limit + 1):
        largest = max_bytes_per_iteration(build_schedule(ordered, window), by_name)
        seconds = largest / copy_bytes_per_s
        if seconds <= fwd_bwd_s:
            return WindowChoice(window=window, snapshot_s=seconds, fits=True)
        if best is None or seconds < best.snapshot_s:
            best = WindowChoice(window=window, snapshot_s=seconds, fits=False)
    return best


REPLAYED_WINDOWS_PER_FAILURE = 1.5
"""Iterations a failure makes exact recovery replay, in windows, on average: the last
complete window itself, plus half a window of the one being written (a failure lands
anywhere in it)."""


def choose_window_for_failures(ordered: Sequence[Operator], copy_bytes_per_s: float,
                               iter_s: float, hidden_s: float, mtbf_s: float,
                               max_window: Optional[int] = None) -> WindowChoice:
    """The ``W`` that loses the least time when failures come every ``mtbf_s`` seconds.

    Two costs pull ``W`` apart. A frame costs its copy beyond what hides behind the
    iteration, every iteration: ``max(0, T_snapshot(W) - hidden_s) / iter_s`` of the
    time (``T_snapshot`` as in :func:`choose_window`). A failure costs a replay of
    about ``1.5 W`` iterations (:data:`REPLAYED_WINDOWS_PER_FAILURE`): ``1.5 W iter_s /
    mtbf_s`` of the time. The result minimises their sum (ties: smaller ``W``).

    Args:
        ordered: operators in snapshot order.
        copy_bytes_per_s: what moving a frame's bytes achieves, bytes per second.
        iter_s: one iteration's time, seconds.
        hidden_s: the part of a frame's time that overlaps computation for free
            (``iter_s`` where a GPU computes while the host copies; 0 on CPU, where the
            copy takes the training's cores).
        mtbf_s: expected seconds between failures.
        max_window: the largest ``W`` to consider; default ``len(ordered)``.

    Returns:
        The best ``W``, its largest frame's seconds, and ``fits`` whether those hide
        within ``hidden_s``.

    Raises:
        ValueError: as :func:`choose_window`, or a non-positive ``iter_s`` / ``mtbf_s``
            or negative ``hidden_s``.
    """
    by_name = index_operators(ordered)
    if not ordered:
        raise ValueError("choose_window_for_failures needs at least one operator")
    _check_rates(copy_bytes_per_s, hidden_s)
    for name, value in (("iter_s", iter_s), ("mtbf_s", mtbf_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    limit = len(ordered) if max_window is None else _check_window(max_window, len(ordered))
    best, best_cost = None, None
    for window in range(1, limit + 1):
        seconds = max_bytes_per_iteration(build_schedule(ordered, window), by_name) / copy_bytes_per_s
        cost = (max(0.0, seconds - hidden_s) / iter_s
                + REPLAYED_WINDOWS_PER_FAILURE * window * iter_s / mtbf_s)
        if best_cost is None or cost < best_cost:
            best, best_cost = WindowChoice(window, seconds, seconds <= hidden_s), cost
    return best


# --- recovery -------------------------------------------------------------------------------

def last_complete_window(window: int, first_window_start: int,
                         failure_iteration: int) -> Optional[int]:
    """The start of the newest window whose ``W`` snapshots all completed before the failure.

    Windows start at ``first_window_start + k * window``. ``failure_iteration`` is the
    iteration that was running when the failure hit (its optimizer step did not finish).
    The snapshot of iteration ``i`` is only known complete once ``i``'s step finished, so
    window ``[s, s+W-1]`` counts only if ``s + W <= failure_iteration``. If ``W``
    changes, restart the count with a new ``first_window_start`` at that boundary.

    Returns:
        That window's first iteration, or ``None`` if no window completed.

    Raises:
        ValueError: ``window`` is not a positive int (named as ``--moc-window``), or an
            iteration is negative.
    """
    if not is_int(window) or window < 1:
        raise ValueError(f"{WINDOW_FLAG} must be a positive int, got {window!r}")
    check_count(first_window_start, "first_window_start")
    check_count(failure_iteration, "failure_iteration")
    complete = (failure_iteration - first_window_start) // window
    if complete < 1:
        return None
    return first_window_start + (complete - 1) * window


@dataclass(frozen=True)
class ReplayStep:
    """One replayed iteration of sparse-to-dense recovery.

    Attributes:
        iteration: the iteration replayed (its micro-batches are re-run).
        restored: groups loaded from their active snapshot at the start of this iteration
            (they become active now); ``()`` outside the window.
        stepping: active groups: they run with their own weights and take this
            iteration's optimizer step.
        frozen: groups run with saved compute weights; their gradients flow to earlier
            layers but their updates are discarded.
        frozen_from: the iteration whose frozen snapshot supplies those compute weights
            (this very iteration: the snapshot of its starting state); ``None`` if none.
    """

    iteration: int
    restored: Tuple[int, ...]
    stepping: Tuple[int, ...]
    frozen: Tuple[int, ...]
    frozen_from: Optional[int]

    @property
    def dense(self) -> bool:
        """Whether every operator is active: an ordinary training iteration."""
        return not self.frozen


def replay_plan(schedule: Schedule, window_start_iteration: int,
                failure_iteration: int) -> List[ReplayStep]:
    """Iterations to replay to rebuild the exact state at the start of ``failure_iteration``.

    With ``s = window_start_iteration``, replay iteration ``s+j`` for ``j < W``:

    * group ``j`` is restored from its active snapshot, the state at the start of
      ``s+j``, and so is exact from that point on;
    * groups ``0..j`` (all exact at the start of ``s+j``) run and take ``s+j``'s step;
    * groups ``j+1..W-1`` run with the compute weights of the frozen snapshot taken at the
      start of ``s+j``: exactly the weights the original run used there, so activations
      and gradients, and hence the steps of the active groups, are exact too.

    After ``s+W-1`` every group is active and holds the state at the start of ``s+W``;
    iterations ``s+W .. failure_iteration-1`` are then replayed as dense steps. The
    result holds ``failure_iteration - s`` steps.

    Args:
        schedule: the schedule the window's snapshots were taken under.
        window_start_iteration: the window's first iteration (:func:`last_complete_window`).
        failure_iteration: the iteration running when the failure hit; training resumes
            there once the plan has run.

    Raises:
        ValueError: a negative start, or the window did not complete before the failure
            (``window_start_iteration + W > failure_iteration``).
    """
    start = check_count(window_start_iteration, "window_start_iteration")
    w = schedule.window
    # A window cut short by the failure lacks active snapshots of its last groups: replay
    # would have no exact state to turn them active from.
    if not is_int(failure_iteration) or failure_iteration < start + w:
        raise ValueError(f"window starting at iteration {start} (W={w}) did not complete "
                         f"before failure_iteration {failure_iteration!r}")
    steps = [ReplayStep(iteration=start + j, restored=(j,), stepping=tuple(range(j + 1)),
                        frozen=tuple(range(j + 1, w)),
                        frozen_from=start + j if j + 1 < w else None)
             for j in range(w)]
    steps += [ReplayStep(iteration=i, restored=(), stepping=tuple(range(w)), frozen=(),
                         frozen_from=None)
              for i in range(start + w, failure_iteration)]
    return steps
