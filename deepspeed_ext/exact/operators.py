"""Exact recovery's operator index: which operator (an expert, a gate, a dense block)
each of this rank's tensors belongs to, their sizes, and the experts' popularity."""

from typing import Any, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.exact.config import MOMENTS
from deepspeed_ext.exact.frames import LP_PREFIX
from deepspeed_ext.policy import operators
from deepspeed_ext.policy import window as win

BYTES_PER_ACTIVE_ELEMENT = 12
"""fp32 master weight plus Adam's two fp32 moments."""
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
"""The engine attributes a frame restores (what :meth:`ExactSnapshots.record` saves)."""


def engine_counters(objects: Any) -> Dict[str, int]:
    """The engine counters of a frame's objects, checked: only :data:`ENGINE_COUNTERS`,
    as non-negative ints. Every key of a frame's ``engine`` record used to be set on the
    engine, so a crafted frame could replace its optimizer (or any attribute) or make
    ``global_steps`` a string.

    Raises:
        CheckpointError: anything else (the window is unusable, as a damaged one is).
    """
    from deepspeed_ext.format.errors import CheckpointError
    counters = objects.get("engine") if isinstance(objects, dict) else None
    if not isinstance(counters, dict):
        raise CheckpointError(f"frame objects: engine counters are {type(counters).__name__}, "
                              f"not an object")
    for key, value in counters.items():
        if key not in ENGINE_COUNTERS:
            raise CheckpointError(f"frame objects: engine field {key!r} is not a counter a "
                                  f"frame restores")
        if type(value) is not int or value < 0:
            raise CheckpointError(f"frame objects: engine counter {key} is {value!r}, not a "
                                  f"non-negative int")
    return counters


def operator_of(name: str, expert: Optional[Tuple[int, int]]) -> str:
    """The operator a global parameter name belongs to.

    Experts are ``expert/<moe layer>/<expert>``; a gate is its module path ending in
    ``.gate``; a parameter under ``<container>.<index>.`` (a transformer layer) belongs to
    that layer's dense block; anything else to its top-level module.
    """
    if expert is not None:
        return f"expert/{expert[0]}/{expert[1]}"
    if ".gate." in name:
        return name[:name.index(".gate.") + len(".gate")]
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def build_operators(engine, naming) -> List[operators.Operator]:
    """Every operator of the model with its global sizes, identical on every rank.

    Expert sizes come from this rank's experts of the same MoE layer (a layer's experts
    are alike), so every rank lists all global experts without communicating.
    """
    sizes: Dict[str, List[int]] = {}
    kinds: Dict[str, Tuple[str, Optional[Tuple[int, int]]]] = {}
    expert_sizes: Dict[int, List[int]] = {}
    for local_name, param in engine.module.named_parameters():
        expert = naming.expert_of(local_name)
        numel, lp = param.numel(), param.numel() * param.element_size()
        if expert is not None:
            if expert[1] == naming.first_expert_of(expert[0]):  # one local expert per layer
                acc = expert_sizes.setdefault(expert[0], [0, 0])
                acc[0] += numel * BYTES_PER_ACTIVE_ELEMENT
                acc[1] += lp
            continue
        op = operator_of(naming.global_name(local_name), None)
        acc = sizes.setdefault(op, [0, 0])
        acc[0] += numel * BYTES_PER_ACTIVE_ELEMENT
        acc[1] += lp
        kinds[op] = ("gate" if op.endswith(".gate") else "dense", None)
    ops = [operators.Operator(op, kinds[op][0], None, a, f) for op, (a, f) in sizes.items()]
    for layer, (a, f) in sorted(expert_sizes.items()):
        for e in range(naming.experts_in(layer)):
            ops.append(operators.Operator(f"expert/{layer}/{e}", "expert", (layer, e), a, f))
    return ops


def whole_model_operators(local: List[operators.Operator]) -> List[operators.Operator]:
    """Every rank's operators, each once, in rank order: on a pipeline, a stage builds
    only its own, and the window schedule must be the same on every rank (a rank whose
    schedule lacked the other stages' operators cut its windows elsewhere, and a
    recovery found no common window). Every rank calls it (one ``all_gather_object``)."""
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    gathered: List = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local, group=metadata_group())
    seen: Dict[str, operators.Operator] = {}
    for ops in gathered:
        for op in ops:
            seen.setdefault(op.name, op)  # a tied module's operator is on two stages
    return list(seen.values())


class OperatorIndex:
    """This rank's tensors by operator, and the experts' popularity (which orders them).

    Built once per rank by :class:`ExactSnapshots`; read by the frame writer (what a
    frame holds), the window sizing (what a frame costs) and the replay (what it
    restores), all on the training's thread.

    Args:
        engine: the DeepSpeed engine.
        naming: the engine's expert naming (:func:`deepspeed_ext.state.expert_naming`).
    """

    def __init__(self, engine, naming):
        self.engine, self.naming = engine, naming
        self.operators = build_operators(engine, naming)
        if naming.stage is not None:  # a pipeline stage: its own layers' operators only
            self.operators = whole_model_operators(self.operators)
        self.by_name = operators.index_operators(self.operators)
        self.popularity: Dict[Tuple[int, int], int] = {}
        """Tokens routed to each ``(moe layer, expert)`` so far, summed over ranks."""
        self._fragments = None
        self._have_moments = False
        self._op_of_param: Dict[str, str] = {}
        for local_name, _ in engine.module.named_parameters():
            self._op_of_param[local_name] = operator_of(naming.global_name(local_name),
                                                        naming.expert_of(local_name))

    def observe_tokens(self, counts) -> None:
        """One iteration's gate counts, ``[moe_layer][expert]``, summed over ranks."""
        for layer, row in enumerate(counts):
            for e, n in enumerate(row):
                self.popularity[(layer, e)] = self.popularity.get((layer, e), 0) + int(n)

    def ordered(self) -> List[operators.Operator]:
        """The operators in snapshot order (least popular experts first)."""
        return operators.order_operators(self.operators, self.popularity)

    def fragments_by_op(self):
        """This rank's optimizer fragments (fp32 weights, moments) by operator; built on
        first use and again after :meth:`forget_fragments`."""
        from deepspeed_ext.state import describe_local_state
        if self._fragments is None:
            frags = describe_local_state(self.engine, self.naming)
            self._have_moments = any(f.kind != "fp32" for f in frags)
            self._fragments = {}
            for frag in frags:
                self._fragments.setdefault(operator_of(frag.name, frag.expert), []).append(frag)
        return self._fragments

    def forget_fragments(self) -> None:
        """Describe the fragments again at next use (the optimizer's moments may have just
        been created, by a replay's restore)."""
        self._fragments = None

    def params_by_op(self) -> Dict[str, List[Tuple[str, torch.nn.Parameter]]]:
        """This rank's compute weights by operator, as ``(global name, parameter)``."""
        out: Dict[str, List] = {}
        for local_name, param in self.engine.module.named_parameters():
            out.setdefault(self._op_of_param[local_name], []).append(
                (self.naming.global_name(local_name), param))
        return out

    def optimizer_ready(self) -> bool:
        """Whether the optimizer's moments exist. Torch creates them at the first step; a
        frame taken before would lack them, and a replay from it could not recreate the
        lazily-initialised state bit for bit (the step counters would differ)."""
        from deepspeed_ext.state import base_optimizer
        opt = base_optimizer(self.engine)
        ready = any(opt.state.get(p) for g in opt.param_groups for p in g["params"])
        if ready and self._fragments is not None and not self._have_moments:
            self._fragments = None  # built before the moments existed
        return ready

    def on_gpu(self) -> bool:
        """Whether the model's parameters live on a GPU."""
        return any(p.device.type == "cuda" for p in self.engine.module.parameters())

    def local_operators(self) -> List[operators.Operator]:
        """The operators in snapshot order, sized by what THIS rank copies of each."""
        frags, params = self.fragments_by_op(), self.params_by_op()
        # Before the first step the moments do not exist yet: count them as the fp32
        # weights' size each (Adam's two).
        scale = 1 if self._have_moments else 1 + len(MOMENTS)
        out = []
        for op in self.ordered():
            active = scale * sum(f.tensor.numel() * f.tensor.element_size()
                                 for f in frags.get(op.name, []))
            frozen = sum(p.numel() * p.element_size() for _, p in params.get(op.name, []))
            out.append(operators.Operator(op.name, op.kind, op.expert, active, frozen))
        return out

    def frame_sources(self, schedule: win.Schedule, t: int) -> Dict[str, torch.Tensor]:
        """Live tensors of frame position ``t``: group t active, later groups frozen."""
        snap = win.snapshot_at(schedule, t)
        frags, params = self.fragments_by_op(), self.params_by_op()
        out: Dict[str, torch.Tensor] = {}
        for op in snap.active:
            for frag in frags.get(op, []):
                out[frag.key] = frag.tensor
        for op in snap.frozen:
            for name, param in params.get(op, []):
                out[LP_PREFIX + name] = param.data.view(-1)
        return out
