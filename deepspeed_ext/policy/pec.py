"""Partial Experts Checkpointing (PEC): which experts each checkpoint saves.

A PEC checkpoint holds all non-expert state but only ``k`` of the ``num_experts`` experts
of every MoE layer. A policy decides which ones and keeps, per expert, the step of its
newest saved version and the token-to-expert assignments routed to it since then (the
updates a recovery from the newest checkpoint would lose for that expert).

Use, on every rank with the same inputs (the policies are deterministic, so every rank
computes the same selection without communicating)::

    policy = make_policy(args.moc_pec_policy, layout, args.moc_pec_k)
    policy.load_state_dict(saved_state)          # on resume, if the checkpoint has one
    for step in ...:
        policy.observe_tokens(gate_counts)        # [moe_layer][expert], summed over ranks
        if step % interval == 0:
            selection = policy.select()
            policy.mark_saved(selection, step)    # before state_dict() goes into the checkpoint
            save(selection, policy.state_dict())

``mark_saved`` is called *before* the policy state is written into the checkpoint it
describes, so that state records this checkpoint's experts as saved; if the write fails
the job resumes from an older checkpoint and restores that checkpoint's older state,
so the early bookkeeping can never be seen on its own.

This module is pure: no torch, no torch.distributed, no file I/O.
"""

import operator
from dataclasses import dataclass
from typing import Collection, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Type

ExpertId = Tuple[int, int]
"""``(moe_layer_index, global_expert_index)``; MoE layers are counted without dense layers."""

PEC_K_FLAG = "--moc-pec-k"
PEC_POLICY_FLAG = "--moc-pec-policy"
PEC_SCOPE_FLAG = "--moc-pec-scope"

WEIGHTS, OPTIMIZER = "w", "o"
"""The two parts of an expert's state: fp32 master weights, and the optimizer moments."""
SCOPES = ("wo", WEIGHTS, OPTIMIZER)
"""What PEC leaves out of a checkpoint for the experts it does not select (the paper's
variants): ``wo`` both parts, ``w`` only the weights (every expert's optimizer state is
saved), ``o`` only the optimizer state (every expert's weights are saved)."""
WEIGHT_KINDS = ("fp32",)
"""Fragment kinds that are weights; every other kind (``exp_avg``, ...) is optimizer state."""


def part_of_kind(kind: str) -> str:
    """``"w"`` for a weight kind (``fp32``), ``"o"`` for optimizer state (``exp_avg``, ...)."""
    return WEIGHTS if kind in WEIGHT_KINDS else OPTIMIZER


def check_scope(scope: str) -> str:
    """Return ``scope`` if it is one of :data:`SCOPES`, else raise ValueError naming the flag."""
    if scope not in SCOPES:
        raise ValueError(f"{PEC_SCOPE_FLAG} must be one of {', '.join(SCOPES)}, got {scope!r}")
    return scope


def partial_parts(scope: str) -> Tuple[str, ...]:
    """The parts PEC skips for unselected experts under ``scope``: ``("w", "o")`` for ``wo``."""
    check_scope(scope)
    return (WEIGHTS, OPTIMIZER) if scope == "wo" else (scope,)


@dataclass(frozen=True)
class ExpertLayout:
    """Where the experts of the model live.

    Attributes:
        num_moe_layers: MoE layers, indexed ``0..num_moe_layers-1`` (dense layers not counted).
        num_experts: experts per MoE layer (global count).
        ep_size: expert-parallel size; global expert ``e`` lives on EP rank
            ``e // (num_experts // ep_size)``.
    """

    num_moe_layers: int
    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        for name in ("num_moe_layers", "num_experts", "ep_size"):
            value = getattr(self, name)
            # A float or bool here would silently give fractional ranks or a 1-expert model.
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ExpertLayout.{name} must be a positive int, got {value!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"ExpertLayout.ep_size ({self.ep_size}) must divide "
                             f"num_experts ({self.num_experts})")

    @property
    def experts_per_rank(self) -> int:
        """Experts of one MoE layer held by each EP rank."""
        return self.num_experts // self.ep_size

    def ep_rank_of(self, expert: int) -> int:
        """The EP rank that holds global expert ``expert``.

        Raises:
            ValueError: ``expert`` is not in ``[0, num_experts)``.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is not in [0, {self.num_experts})")
        return expert // self.experts_per_rank

    def all_experts(self) -> FrozenSet[ExpertId]:
        """Every ``(moe_layer, expert)`` of the model."""
        return frozenset((layer, e) for layer in range(self.num_moe_layers)
                         for e in range(self.num_experts))

    def check_expert(self, expert_id: ExpertId) -> ExpertId:
        """Return ``expert_id`` as a tuple of ints, or raise ValueError if it is out of range."""
        try:
            layer, expert = (operator.index(x) for x in expert_id)
        except (TypeError, ValueError):
            raise ValueError(f"expert id {expert_id!r} is not a (moe_layer, expert) pair") from None
        if not (0 <= layer < self.num_moe_layers and 0 <= expert < self.num_experts):
            raise ValueError(f"expert id {expert_id!r} is outside {self.num_moe_layers} MoE "
                             f"layers x {self.num_experts} experts")
        return layer, expert

    def to_dict(self) -> Dict[str, int]:
        """The layout as a JSON-serialisable dict."""
        return {"num_moe_layers": self.num_moe_layers, "num_experts": self.num_experts,
                "ep_size": self.ep_size}


def per_rank_counts(selection: Iterable[ExpertId], layout: ExpertLayout) -> List[int]:
    """How many of the selected experts each EP rank holds (and so writes)."""
    counts = [0] * layout.ep_size
    for expert_id in selection:
        _, expert = layout.check_expert(expert_id)
        counts[layout.ep_rank_of(expert)] += 1
    return counts


def _check_k(k: int, layout: ExpertLayout) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= layout.num_experts:
        raise ValueError(f"{PEC_K_FLAG} must be an int in [1, {layout.num_experts}] "
                         f"(experts per MoE layer), got {k!r}")
    return k


class PECPolicy:
    """Base of the selection policies: the bookkeeping both share.

    Per expert it keeps the step of its newest saved version (``None``: never saved) and
    the token-to-expert assignments routed to it since then. Subclasses implement
    :meth:`_choose`; :meth:`select` adds every never-saved expert to that, so the first
    checkpoint is complete (a recovery with no saved version of an expert would have to
    fall back to its random initialisation).

    Args:
        layout: the model's MoE layers, experts and EP size.
        k: experts saved per MoE layer, ``1..num_experts`` (``--moc-pec-k``).

    Raises:
        ValueError: ``k`` is out of range (the message names ``--moc-pec-k``).
    """

    name = ""

    def __init__(self, layout: ExpertLayout, k: int) -> None:
        self.layout = layout
        self._k = _check_k(k, layout)
        self._checkpoints = 0
        shape = (layout.num_moe_layers, layout.num_experts)
        self._last_saved: List[List[Optional[int]]] = [[None] * shape[1] for _ in range(shape[0])]
        self._unsaved: List[List[int]] = [[0] * shape[1] for _ in range(shape[0])]

    # --- K ------------------------------------------------------------------------------

    @property
    def k(self) -> int:
        """Experts saved per MoE layer; settable (dynamic K doubles it while PLT is too high)."""
        return self._k

    @k.setter
    def k(self, value: int) -> None:
        self._k = _check_k(value, self.layout)

    @property
    def checkpoints(self) -> int:
        """Checkpoints recorded so far: the number of :meth:`mark_saved` calls."""
        return self._checkpoints

    # --- selection ----------------------------------------------------------------------

    def select(self) -> FrozenSet[ExpertId]:
        """The experts the next checkpoint saves; does not change the policy.

        Returns:
            The policy's ``k`` experts per MoE layer plus every expert never saved yet;
            all experts when ``k == num_experts``.
        """
        if self._k == self.layout.num_experts:
            return self.layout.all_experts()
        return frozenset(self._choose()) | self.never_saved()

    def _choose(self) -> Iterable[ExpertId]:
        """``k`` experts per MoE layer, the policy's own choice."""
        raise NotImplementedError

    def never_saved(self) -> FrozenSet[ExpertId]:
        """Experts with no saved version yet."""
        return frozenset((layer, e) for layer, row in enumerate(self._last_saved)
                         for e, step in enumerate(row) if step is None)

    # --- bookkeeping --------------------------------------------------------------------

    def observe_tokens(self, counts: Sequence[Sequence[int]]) -> None:
        """Add one iteration's token-to-expert assignments to the unsaved counters.

        Args:
            counts: shaped ``[num_moe_layers][num_experts]``, non-negative ints: the gate's
                per-expert counts of one iteration, summed over ranks (``tensor.tolist()``).

        Raises:
            ValueError: wrong shape or a negative / non-integer count; nothing is added
                then (a half-added iteration would skew every later selection).
        """
        rows = self._check_counts(counts)
        for layer, row in enumerate(rows):
            unsaved = self._unsaved[layer]
            for e, n in enumerate(row):
                unsaved[e] += n

    def _check_counts(self, counts: Sequence[Sequence[int]]) -> List[List[int]]:
        layers, experts = self.layout.num_moe_layers, self.layout.num_experts
        if len(counts) != layers:
            raise ValueError(f"token counts have {len(counts)} MoE layers, the layout {layers}")
        rows = []
        for layer, row in enumerate(counts):
            if len(row) != experts:
                raise ValueError(f"token counts of MoE layer {layer} have {len(row)} experts, "
                                 f"the layout {experts}")
            try:
                values = [operator.index(n) for n in row]
            except TypeError:
                raise ValueError(f"token counts of MoE layer {layer} are not ints: {list(row)!r}") \
                    from None
            if min(values) < 0:
                raise ValueError(f"token counts of MoE layer {layer} are negative: {values!r}")
            rows.append(values)
        return rows

    def mark_saved(self, experts: Collection[ExpertId], step: int) -> None:
        """Record that ``experts`` were saved at ``step``; counts one checkpoint.

        Zeroes their unsaved-token counters, sets their last saved step, and advances
        :attr:`checkpoints` by one (the sequential rotation moves on).

        Raises:
            ValueError: an expert id out of range, a negative step, or a step older than an
                expert's recorded one; nothing changes then (recording an older version as
                the newest would make recovery load stale experts).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        ids = [self.layout.check_expert(x) for x in experts]
        for layer, e in ids:
            previous = self._last_saved[layer][e]
            if previous is not None and step < previous:
                raise ValueError(f"expert {(layer, e)} was already saved at step {previous}, "
                                 f"cannot record an older save at step {step}")
        for layer, e in ids:
            self._last_saved[layer][e] = step
            self._unsaved[layer][e] = 0
        self._checkpoints += 1

    def unsaved_tokens(self) -> List[List[int]]:
        """``[moe_layer][expert]`` assignments routed since the expert's last save (a copy)."""
        return [list(row) for row in self._unsaved]

    def last_saved_steps(self) -> List[List[Optional[int]]]:
        """``[moe_layer][expert]`` step of the newest saved version, ``None`` if never (a copy)."""
        return [list(row) for row in self._last_saved]

    # --- state --------------------------------------------------------------------------

    def state_dict(self) -> Dict:
        """JSON-serialisable state; :meth:`load_state_dict` restores it.

        The bookkeeping is the same for every policy, so a state saved by one policy loads
        into the other (switching ``--moc-pec-policy`` on a restart keeps the record of
        which expert versions exist).
        """
        return {"policy": self.name, "layout": self.layout.to_dict(), "k": self._k,
                "checkpoints": self._checkpoints,
                "last_saved_step": self.last_saved_steps(),
                "unsaved_tokens": self.unsaved_tokens()}

    def load_state_dict(self, state: Dict) -> None:
        """Restore :meth:`state_dict` output, ``k`` included (dynamic K survives restarts).

        Raises:
            ValueError: the state was saved for another layout, is malformed, or names an
                unknown policy; nothing changes then.
        """
        missing = {"policy", "layout", "k", "checkpoints", "last_saved_step",
                   "unsaved_tokens"} - set(state)
        if missing:
            raise ValueError(f"PEC policy state lacks {sorted(missing)}")
        if state["policy"] not in POLICIES:
            raise ValueError(f"PEC policy state names unknown policy {state['policy']!r}")
        self._check_layout(state["layout"])
        k = _check_k(state["k"], self.layout)
        checkpoints = state["checkpoints"]
        if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 0:
            raise ValueError(f"PEC policy state has a bad checkpoint count {checkpoints!r}")
        unsaved = self._check_counts(state["unsaved_tokens"])
        last_saved = self._check_steps(state["last_saved_step"])
        self._k, self._checkpoints = k, checkpoints
        self._unsaved, self._last_saved = unsaved, last_saved

    def _check_layout(self, saved: Dict) -> None:
        mine = self.layout.to_dict()
        for field, value in mine.items():
            # Loading a record of other experts would send recovery to versions that do not exist.
            if saved.get(field) != value:
                raise ValueError(f"PEC policy state was saved for {field}={saved.get(field)!r}, "
                                 f"this model has {field}={value}")

    def _check_steps(self, steps: Sequence[Sequence[Optional[int]]]) -> List[List[Optional[int]]]:
        layers, experts = self.layout.num_moe_layers, self.layout.num_experts
        if len(steps) != layers or any(len(row) != experts for row in steps):
            raise ValueError(f"PEC policy state: last_saved_step is not shaped "
                             f"[{layers}][{experts}]")
        for row in steps:
            for s in row:
                if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
                    raise ValueError(f"PEC policy state: bad last saved step {s!r}")
        return [list(row) for row in steps]


def expert_order(layout: ExpertLayout) -> List[int]:
    """The sequential rotation order of one layer's experts, interleaved across EP ranks.

    ``order[m] = (m % ep_size) * local + m // ep_size``: consecutive positions fall on
    consecutive EP ranks (``ep_rank_of(order[m]) == m % ep_size``), so any run of
    consecutive positions spreads over the ranks as evenly as possible.
    """
    ep, local = layout.ep_size, layout.experts_per_rank
    return [(m % ep) * local + m // ep for m in range(layout.num_experts)]


class SequentialPolicy(PECPolicy):
    """The paper's default: rotate through each layer's experts, staggered across layers.

    At checkpoint number ``c`` (:attr:`checkpoints`, advanced by :meth:`mark_saved`) MoE
    layer ``i`` saves ``order[(c*k + i*k + j) % num_experts]`` for ``j < k`` (see
    :func:`expert_order`). Layer ``i`` starts ``i*k`` positions later than layer 0, so the
    ``num_moe_layers * k`` saved experts of one checkpoint occupy consecutive positions,
    i.e. consecutive EP ranks: each EP rank saves the same number of experts, within one.
    Every expert of a layer is saved once per ``num_experts / k`` checkpoints.

    The first checkpoint saves everything (no expert has a saved version yet), so the
    rotation as seen in :meth:`select` starts with checkpoint ``c = 1``; :meth:`scheduled`
    gives the rotation alone for any ``c``.
    """

    name = "sequential"

    def __init__(self, layout: ExpertLayout, k: int) -> None:
        super().__init__(layout, k)
        self._order = expert_order(layout)

    def scheduled(self, checkpoint: int) -> FrozenSet[ExpertId]:
        """The rotation's experts for checkpoint number ``checkpoint``, without never-saved ones."""
        n, k = self.layout.num_experts, self._k
        return frozenset((layer, self._order[(checkpoint * k + layer * k + j) % n])
                         for layer in range(self.layout.num_moe_layers) for j in range(k))

    def _choose(self) -> Iterable[ExpertId]:
        return self.scheduled(self._checkpoints)


class LoadAwarePolicy(PECPolicy):
    """Save, per MoE layer, the ``k`` experts with the most unsaved token assignments.

    Ties go to the expert saved longest ago, then to the lower index. Experts with no
    unsaved tokens are still eligible: Adam's momentum moves an expert's weights even in
    iterations that route no token to it, so its saved version still ages.
    """

    name = "load-aware"

    def _choose(self) -> Iterable[ExpertId]:
        for layer in range(self.layout.num_moe_layers):
            unsaved, saved = self._unsaved[layer], self._last_saved[layer]
            ranked = sorted(range(self.layout.num_experts),
                            key=lambda e: (-unsaved[e], -1 if saved[e] is None else saved[e], e))
            for e in ranked[:self._k]:
                yield layer, e


POLICIES: Dict[str, Type[PECPolicy]] = {
    SequentialPolicy.name: SequentialPolicy,
    LoadAwarePolicy.name: LoadAwarePolicy,
}


def make_policy(name: str, layout: ExpertLayout, k: int) -> PECPolicy:
    """Build the policy ``--moc-pec-policy`` names (``sequential`` or ``load-aware``).

    Raises:
        ValueError: unknown name (naming ``--moc-pec-policy``) or bad ``k`` (``--moc-pec-k``).
    """
    if name not in POLICIES:
        raise ValueError(f"{PEC_POLICY_FLAG} must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](layout, k)
