"""Lost-token accounting: the Proportion of Lost Tokens (PLT) of a recovery, and dynamic K.

A recovery with partial experts checkpointing resumes the non-expert state at step ``S``
but some experts at an older version ``v_e < S``: the updates those experts received from
the token-to-expert assignments of iterations ``v_e + 1 .. S`` are lost (the iterations
after ``S`` are recomputed, so they lose nothing). The MoC paper measures this as

    PLT = (1 / N_moe) * sum_i  L_i / (T_i * TopK_i)

with ``L_i`` the lost assignments of MoE layer ``i`` and ``T_i * TopK_i`` all of its
assignments; accuracy held while the accumulated PLT stayed <= 3.75 %, and dynamic K
doubles K after a recovery that leaves it above the limit.

:class:`TokenLedger` is what makes ``L_i`` exact for whatever version of each expert a
load actually took (newest checkpoint, an older one through the expert index, a memory
snapshot, or an older snapshot when a newer one was overwritten): it keeps the
cumulative assignments of every expert and their value at each expert's recent saved
versions, and travels inside every checkpoint and snapshot. Its denominators are the
assignments processed up to the recovered step (the paper's ``T_i`` is the whole run's;
ours is the running value, which is what can be known at a recovery).

Use, on every rank with the same inputs (pure: no torch, no I/O)::

    ledger.observe(gate_counts)               # every iteration, [moe_layer][expert], summed over ranks
    ledger.mark_saved(experts, step)          # before state_dict() goes into that checkpoint/snapshot
    ...
    ledger.load_state_dict(restored)          # at a recovery, from the loaded checkpoint
    loss = ledger.loss(step, versions_loaded) # RecoveryLoss: lost assignments and the PLT
    cumulative = cumulative_plt(earlier_losses + [loss])
    new_k = dynamic_k(k, num_experts, cumulative, threshold)
"""

import operator
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Mapping, Sequence, Tuple

ExpertId = Tuple[int, int]
"""``(moe_layer_index, global_expert_index)``, as in :mod:`deepspeed_ext.policy.pec`."""

HISTORY = 8
"""Saved versions remembered per expert. A load takes one of the newest few: up to three
memory snapshots (triple buffering) and the newest persisted checkpoint's, with room for
saves that later failed."""

PLT_THRESHOLD_FLAG = "--moc-plt-threshold"


@dataclass
class RecoveryLoss:
    """What one recovery lost, per MoE layer and expert."""

    step: int
    """The step training resumed from."""
    lost: List[List[int]]
    """``[moe_layer][expert]`` assignments whose updates the recovery discarded."""
    assigned: List[int]
    """``[moe_layer]`` all assignments processed up to ``step`` (T_i * TopK_i so far)."""
    exact: bool = True
    """False when some loaded version was older than the ledger's history (then ``lost``
    is a lower bound for those experts)."""

    @property
    def plt(self) -> float:
        """This recovery's PLT (the mean over MoE layers of lost / assigned)."""
        return cumulative_plt([self])

    def to_json(self) -> Dict:
        return {"step": self.step, "lost": self.lost, "assigned": self.assigned,
                "exact": self.exact, "plt": self.plt}

    @classmethod
    def from_json(cls, data: Mapping) -> "RecoveryLoss":
        return cls(step=int(data["step"]), lost=[[int(n) for n in row] for row in data["lost"]],
                   assigned=[int(n) for n in data["assigned"]], exact=bool(data.get("exact", True)))


def cumulative_plt(losses: Sequence[RecoveryLoss]) -> float:
    """Accumulated PLT of several recoveries: per layer, all lost assignments over the
    assignments processed by the latest of them; then the mean over layers.

    Returns 0.0 for no recoveries or a model whose layers have seen no tokens yet.

    Raises:
        ValueError: the recoveries disagree on the number of MoE layers.
    """
    if not losses:
        return 0.0
    layers = len(losses[0].assigned)
    if any(len(x.assigned) != layers or len(x.lost) != layers for x in losses):
        raise ValueError("recoveries of models with different MoE layer counts")
    if layers == 0:
        return 0.0
    latest = max(losses, key=lambda x: x.step).assigned
    ratios = []
    for i in range(layers):
        lost = sum(sum(x.lost[i]) for x in losses)
        ratios.append(lost / latest[i] if latest[i] else 0.0)
    return sum(ratios) / layers


def dynamic_k(k: int, num_experts: int, cumulative: float, threshold: float) -> int:
    """The paper's rule, applied once per recovery: double K (up to all experts) while the
    accumulated PLT is above the threshold; otherwise keep it.

    Raises:
        ValueError: ``k`` outside ``1..num_experts`` or a threshold outside (0, 1).
    """
    check_threshold(threshold)
    if not 1 <= k <= num_experts:
        raise ValueError(f"K must be in 1..{num_experts}, got {k}")
    return min(2 * k, num_experts) if cumulative > threshold else k


def check_threshold(threshold: float) -> float:
    """``threshold`` if it is a proportion strictly between 0 and 1, else ValueError naming
    the flag."""
    if not (isinstance(threshold, (int, float)) and 0.0 < threshold < 1.0):
        raise ValueError(f"{PLT_THRESHOLD_FLAG} must be in (0, 1), got {threshold!r}")
    return float(threshold)


@dataclass
class TokenLedger:
    """Cumulative token-to-expert assignments and their value at recent saved versions."""

    num_moe_layers: int
    """MoE layers of the model."""
    num_experts: int
    """Experts per MoE layer."""
    cumulative: List[List[int]] = field(default_factory=list)
    """``[moe_layer][expert]`` assignments routed to the expert since training began."""
    versions: List[List[List[Tuple[int, int]]]] = field(default_factory=list)
    """``[moe_layer][expert]`` -> ``[(step, cumulative at that step), ...]`` of its newest
    saved versions, oldest first, at most :data:`HISTORY`."""

    def __post_init__(self) -> None:
        if self.num_moe_layers < 0 or self.num_experts < 1:
            raise ValueError(f"ledger needs >= 0 MoE layers and >= 1 expert, got "
                             f"{self.num_moe_layers} and {self.num_experts}")
        if not self.cumulative:
            self.cumulative = [[0] * self.num_experts for _ in range(self.num_moe_layers)]
        if not self.versions:
            self.versions = [[[] for _ in range(self.num_experts)]
                             for _ in range(self.num_moe_layers)]

    def observe(self, counts: Sequence[Sequence[int]]) -> None:
        """Add one iteration's assignments (every rank, the same counts summed over ranks).

        Raises:
            ValueError: wrong shape or negative / non-integer counts; nothing is added.
        """
        rows = self._check_counts(counts, "token counts")
        for layer, row in enumerate(rows):
            cum = self.cumulative[layer]
            for e, n in enumerate(row):
                cum[e] += n

    def mark_saved(self, experts: Collection[ExpertId], step: int) -> None:
        """Remember the cumulative count of ``experts`` at ``step``, where a version of
        each was saved (a checkpoint or a snapshot). Saving a step again replaces it."""
        for layer, e in experts:
            if not (0 <= layer < self.num_moe_layers and 0 <= e < self.num_experts):
                raise ValueError(f"expert {(layer, e)} outside the ledger's "
                                 f"{self.num_moe_layers} x {self.num_experts}")
        for layer, e in experts:
            history = [v for v in self.versions[layer][e] if v[0] < step]
            history.append((step, self.cumulative[layer][e]))
            self.versions[layer][e] = history[-HISTORY:]

    def loss(self, step: int, versions_loaded: Mapping[ExpertId, int]) -> RecoveryLoss:
        """What a recovery to ``step`` lost, given the step of the version each expert was
        loaded from (experts not named were loaded at ``step``). The ledger must hold the
        state saved with ``step``.

        A version newer than ``step`` (two-level recovery takes a healthy node's newer
        expert snapshots over an older checkpoint) lost nothing: it counts as 0.
        """
        lost = [[0] * self.num_experts for _ in range(self.num_moe_layers)]
        exact = True
        for (layer, e), version in versions_loaded.items():
            if version >= step:
                continue
            history = dict(self.versions[layer][e])
            if version in history:
                base = history[version]
            else:  # older than the history: the oldest known bounds it from below
                exact = False
                base = history[min(history)] if history else self.cumulative[layer][e]
            lost[layer][e] = self.cumulative[layer][e] - base
        return RecoveryLoss(step=step, lost=lost, assigned=[sum(row) for row in self.cumulative],
                            exact=exact)

    def state_dict(self) -> Dict:
        """JSON-serialisable state (goes into every checkpoint's and snapshot's objects)."""
        return {"num_moe_layers": self.num_moe_layers, "num_experts": self.num_experts,
                "cumulative": [list(row) for row in self.cumulative],
                "versions": [[[list(v) for v in hist] for hist in row] for row in self.versions]}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: saved for another shape, or malformed; nothing changes then.
        """
        if (state.get("num_moe_layers"), state.get("num_experts")) != \
                (self.num_moe_layers, self.num_experts):
            raise ValueError(f"token ledger saved for {state.get('num_moe_layers')} MoE layers x "
                             f"{state.get('num_experts')} experts, this model has "
                             f"{self.num_moe_layers} x {self.num_experts}")
        cumulative = self._check_counts(state["cumulative"], "token ledger")
        versions = state["versions"]
        if len(versions) != self.num_moe_layers or any(len(r) != self.num_experts for r in versions):
            raise ValueError("token ledger: versions are not shaped [moe_layer][expert]")
        parsed = [[[(operator.index(s), operator.index(c)) for s, c in hist] for hist in row]
                  for row in versions]
        self.cumulative, self.versions = cumulative, parsed

    def _check_counts(self, counts, what: str) -> List[List[int]]:
        if len(counts) != self.num_moe_layers or any(len(r) != self.num_experts for r in counts):
            raise ValueError(f"{what} are not shaped [{self.num_moe_layers}][{self.num_experts}]")
        try:
            rows = [[operator.index(n) for n in row] for row in counts]
        except TypeError:
            raise ValueError(f"{what} are not ints") from None
        if any(n < 0 for row in rows for n in row):
            raise ValueError(f"{what} are negative")
        return rows
