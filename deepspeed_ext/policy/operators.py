"""Exact recovery's operators: the units of state a sparse snapshot copies, and their order.

After MoEtion (DESIGN section 3). Each rank's state is cut into operators (experts, dense
blocks, gates; :class:`Operator`), put in a snapshot order (:func:`order_operators`: the
non-expert operators first, then experts least popular first), and re-ordered at a window
boundary when routing popularity moved far enough (:func:`popularity_shift`,
:func:`should_reorder`). :mod:`deepspeed_ext.policy.window` cuts the ordered operators into
a window's groups.

This module is pure: no torch, no torch.distributed, no file I/O.
"""

import operator as _op
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

ExpertId = Tuple[int, int]
"""``(moe_layer_index, global_expert_index)``, as in :mod:`deepspeed_ext.policy.pec`."""

KINDS = ("expert", "dense", "gate")


def is_int(value) -> bool:
    """Whether ``value`` is an int and not a bool."""
    # bool is an int subclass; True as a byte count or window would pass silently.
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value, what: str, minimum: int = 0) -> int:
    """``value``, checked to be an int >= ``minimum``.

    Raises:
        ValueError: naming ``what``, when it is not.
    """
    if not is_int(value) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


# --- operators ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Operator:
    """One unit of model state that is snapshotted as a whole.

    Attributes:
        name: unique name of the operator (on this rank).
        kind: ``"expert"``, ``"dense"`` or ``"gate"``.
        expert: ``(moe_layer, global_expert)`` for an expert, ``None`` otherwise.
        active_bytes: bytes of its fp32 master weights plus optimizer moments (an
            *active* snapshot copies these).
        frozen_bytes: bytes of its low-precision compute weights (a *frozen* snapshot
            copies these).
    """

    name: str
    kind: str
    expert: Optional[ExpertId]
    active_bytes: int
    frozen_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Operator.name must be a non-empty str, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Operator {self.name!r}: kind must be one of {KINDS}, "
                             f"got {self.kind!r}")
        for field in ("active_bytes", "frozen_bytes"):
            check_count(getattr(self, field), f"Operator {self.name!r}: {field}")
        # An expert without an id could not be ranked by popularity; a dense block with one
        # would be ranked like an expert and leave the fixed non-expert prefix.
        if (self.kind == "expert") != (self.expert is not None):
            raise ValueError(f"Operator {self.name!r}: expert must be set iff kind is "
                             f"'expert' (kind {self.kind!r}, expert {self.expert!r})")
        if self.expert is not None:
            object.__setattr__(self, "expert", _check_expert_id(self.expert, self.name))


def _check_expert_id(expert_id, owner: str) -> ExpertId:
    try:
        layer, expert = (_op.index(x) for x in expert_id)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: expert id {expert_id!r} is not a (moe_layer, expert) "
                         f"pair of ints") from None
    if layer < 0 or expert < 0:
        raise ValueError(f"{owner}: expert id {expert_id!r} is negative")
    return layer, expert


def index_operators(operators: Iterable[Operator]) -> Dict[str, Operator]:
    """``name -> operator``; the ``operators_by_name`` argument of the byte helpers.

    Raises:
        ValueError: two operators share a name (their snapshots would overwrite each other).
    """
    by_name: Dict[str, Operator] = {}
    for op in operators:
        if op.name in by_name:
            raise ValueError(f"duplicate operator name {op.name!r}")
        by_name[op.name] = op
    return by_name


def _check_popularity(popularity: Mapping[ExpertId, int],
                      experts: Iterable[ExpertId]) -> Dict[ExpertId, int]:
    known = set(experts)
    counts = {}
    for key, count in popularity.items():
        expert_id = _check_expert_id(key, "popularity")
        # A count for an expert this rank does not hold means the caller mixed up layouts.
        if expert_id not in known:
            raise ValueError(f"popularity names expert {expert_id} that no operator holds")
        counts[expert_id] = check_count(count, f"popularity of expert {expert_id}")
    return counts


def order_operators(operators: Iterable[Operator],
                    popularity: Mapping[ExpertId, int]) -> List[Operator]:
    """The snapshot order: non-expert operators first, then experts least popular first.

    Non-expert operators (dense blocks, gates) come first, sorted by name. They are
    updated every iteration whatever the routing, so popularity says nothing about them;
    and an operator in group ``g`` is snapshotted frozen at the ``g`` earlier positions of
    every window, so putting the (usually large) non-expert operators in the first
    group keeps their compute weights out of every frozen snapshot.

    Experts follow, least popular first (MoEtion's order), ties by ``(moe_layer,
    expert)``, then by name (an expert may be split into several operators).

    Args:
        operators: this rank's operators, in any order.
        popularity: ``(moe_layer, expert) -> tokens`` routed to it over a recent period;
            experts missing from it count as 0.

    Returns:
        The operators in snapshot order; the same for the same inputs in any order.

    Raises:
        ValueError: duplicate operator names, or ``popularity`` has a negative or
            non-integer count or an expert that no operator holds.
    """
    ops = list(index_operators(operators).values())
    counts = _check_popularity(popularity, (op.expert for op in ops if op.expert is not None))
    fixed = sorted((op for op in ops if op.expert is None), key=lambda op: op.name)
    experts = sorted((op for op in ops if op.expert is not None),
                     key=lambda op: (counts.get(op.expert, 0), op.expert, op.name))
    return fixed + experts


# --- re-ordering ----------------------------------------------------------------------------

def _sort_counting(values: List[int]) -> Tuple[List[int], int]:
    """``values`` sorted, and its pairs ``i < j`` with ``values[i] > values[j]`` (merge sort)."""
    if len(values) < 2:
        return list(values), 0
    mid = len(values) // 2
    left, left_count = _sort_counting(values[:mid])
    right, right_count = _sort_counting(values[mid:])
    merged, count, i = [], left_count + right_count, 0
    for value in right:
        while i < len(left) and left[i] < value:
            merged.append(left[i])
            i += 1
        count += len(left) - i  # every left value still unmerged is larger than ``value``
        merged.append(value)
    return merged + left[i:], count


def popularity_shift(old_order: Sequence[str], new_order: Sequence[str]) -> float:
    """How far a new snapshot order is from the old one: normalised Kendall-tau distance.

    The fraction of operator pairs whose relative order differs: 0.0 for the same order,
    1.0 for the reverse.

    Raises:
        ValueError: the two orders are not permutations of the same unique names.
    """
    if len(set(old_order)) != len(old_order) or sorted(old_order) != sorted(new_order):
        raise ValueError("popularity_shift needs two orders of the same unique operator names")
    n = len(old_order)
    if n < 2:
        return 0.0
    rank = {name: i for i, name in enumerate(old_order)}
    _, inversions = _sort_counting([rank[name] for name in new_order])
    return inversions / (n * (n - 1) // 2)


def should_reorder(shift: float, threshold: float) -> bool:
    """Whether to adopt the new order: ``shift > threshold``.

    The new order (and its :class:`~deepspeed_ext.policy.window.Schedule`) may only take
    effect at a window boundary: every snapshot of one window must follow one schedule, and recovery must replay a
    window with the schedule its snapshots were taken under.

    Raises:
        ValueError: ``shift`` or ``threshold`` is not in ``[0, 1]``.
    """
    for what, value in (("shift", shift), ("reorder threshold", threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"{what} must be a number in [0, 1], got {value!r}")
    return shift > threshold
