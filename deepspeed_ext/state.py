"""Describe a DeepSpeed engine's training state as fragments of global tensors.

Every tensor that a checkpoint must hold is named by its *global* name (experts by
their global index, so names do not depend on the expert-parallel layout), its global
shape, and the fragment ``[offset, offset + length)`` of the flattened tensor that this
rank holds, with a live 1-D view of those elements:

* ZeRO stage 1/2 (any precision): the fp32 master weights and the optimizer moments of
  the partition this rank owns, found through the per-parameter fragment maps DeepSpeed
  keeps (``param._hp_mapping``). Each element has exactly one owner in the world.
* No ZeRO, fp32: whole parameters and their moments, held identically by every rank of
  the parameter's data-parallel group (all ranks for non-expert parameters, the
  expert-data-parallel group for experts).

With tensor parallelism (an engine given an ``mpu`` whose tensor-parallel size T > 1) a
parameter marked as megatron-core marks split ones (``tensor_model_parallel``,
``partition_dim``) is rank ``t``'s part of a global tensor whose ``partition_dim`` is T
times longer; its fragments are counted in the part-major order of its
:class:`~deepspeed_ext.format.splits.TensorSplit` (:mod:`deepspeed_ext.format.splits`),
so a ZeRO partition of it is still one fragment. A split along an inner dimension of a
view of the tensor (a fused QKV projection kept as ``[3, heads, head_dim]`` rows) is
marked ``param.moc_partition_view = (view, dim)`` by the model. Unsplit parameters are
held identically by the T ranks of a tensor-parallel group.

The bf16/fp16 compute copies are derivable from the fp32 master and never described.
Moments that do not exist yet (before the first step, or the first fp16 step that does
not overflow) are not described either; :class:`MomentPresence` records which groups
have them, and :func:`prepare_optimizer_state` gives a loading engine the same.
Every rank calls :func:`describe_local_state` on its own engine; no collectives.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from deepspeed_ext.engine.naming import ExpertId, ExpertNaming, expert_naming  # noqa: F401 (re-exported)
from deepspeed_ext.engine.stages import PipelinePlace, pipeline_place
from deepspeed_ext.format.splits import TensorSplit

FP32 = "fp32"
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


@dataclass
class LocalFragment:
    """A fragment of a global tensor held by this rank, with a live view of its elements."""

    name: str
    """Global parameter name (expert index global)."""
    kind: str
    """``fp32`` (master weights), ``exp_avg`` or ``exp_avg_sq``."""
    shape: Tuple[int, ...]
    """Global shape of the parameter."""
    offset: int
    """First element of the fragment in the flattened global tensor."""
    length: int
    """Number of elements."""
    expert: Optional[ExpertId]
    """The expert this tensor belongs to, or None for non-expert state."""
    holders: Tuple[int, ...]
    """Global ranks holding identical bytes (one rank for ZeRO-partitioned state)."""
    tensor: torch.Tensor
    """1-D view of the fragment's elements (the training state itself: copy before use)."""
    split: Optional[TensorSplit] = None
    """The tensor-parallel split ``offset`` counts in (part-major order); None: row-major."""

    @property
    def key(self) -> str:
        """Storage key, unique across the world."""
        return f"{self.name}|{self.kind}|{self.offset}"


def _group_ranks(param: torch.nn.Parameter, pipe: Optional[PipelinePlace]) -> Tuple[int, ...]:
    """Global ranks holding a replica of ``param`` when nothing is partitioned and nothing
    is tensor-parallel: its expert-data-parallel group, or every rank of the world (of
    the stage, with a pipeline)."""
    import torch.distributed as dist
    from deepspeed.utils import groups
    if getattr(param, "allreduce", True) is False:  # an expert parameter
        group = groups._get_expert_data_parallel_group(param.group_name)
        return tuple(sorted(dist.get_process_group_ranks(group)))
    if pipe is not None:
        return pipe.stage_ranks
    return tuple(range(dist.get_world_size()))


@dataclass(frozen=True)
class TensorParallelPlace:
    """This rank's place among the tensor-parallel ranks (from the engine's mpu)."""

    rank: int
    """Rank within the tensor-parallel group (the part of a split tensor held here)."""
    size: int
    """Tensor-parallel size T (> 1)."""
    group: Tuple[int, ...]
    """Global ranks of this rank's tensor-parallel group."""
    data_group: Tuple[int, ...]
    """Global ranks of this rank's data-parallel group (all hold part ``rank``)."""


def tensor_parallel_place(engine) -> Optional[TensorParallelPlace]:
    """This rank's :class:`TensorParallelPlace`, None without tensor parallelism (no mpu,
    or a tensor-parallel size of 1). No collectives."""
    import torch.distributed as dist
    mpu = getattr(engine, "mpu", None)
    if mpu is None or not hasattr(mpu, "get_tensor_model_parallel_world_size"):
        return None
    size = mpu.get_tensor_model_parallel_world_size()
    if size == 1:
        return None
    # A pipeline engine's mpu is its grid, which names the tensor-parallel group "slice".
    group = getattr(mpu, "get_tensor_model_parallel_group", None) or mpu.get_slice_parallel_group
    return TensorParallelPlace(
        rank=mpu.get_tensor_model_parallel_rank(), size=size,
        group=tuple(sorted(dist.get_process_group_ranks(group()))),
        data_group=tuple(sorted(dist.get_process_group_ranks(mpu.get_data_parallel_group()))))


def param_split(name: str, param: torch.nn.Parameter, size: int) -> Optional[TensorSplit]:
    """How ``param`` (a rank's part) is cut from its global tensor among ``size``
    tensor-parallel ranks; None when it is not split (or ``size`` is 1).

    Raises:
        ValueError: naming the parameter, for a split this format cannot express (a
            ``partition_stride`` other than 1, or a view that does not fit).
    """
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError(f"{name}: tensor-parallel partition_stride {param.partition_stride} "
                         "is not supported by MoC checkpoints (strided splits)")
    dim = getattr(param, "partition_dim", 0)
    shape = global_shape(param, size)
    marked = getattr(param, "moc_partition_view", None)
    view, vdim = (tuple(marked[0]), marked[1]) if marked is not None else (shape, dim)
    try:
        split = TensorSplit(view, vdim, size)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if split.numel != math.prod(shape):
        raise ValueError(f"{name}: moc_partition_view {list(view)} does not hold the global "
                         f"shape {list(shape)}")
    return split


def global_shape(param: torch.nn.Parameter, size: int) -> Tuple[int, ...]:
    """The global shape of ``param``: its own, ``partition_dim`` times ``size`` when it is
    a tensor-parallel part."""
    shape = tuple(param.shape)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return shape
    dim = getattr(param, "partition_dim", 0)
    return shape[:dim] + (shape[dim] * size,) + shape[dim + 1:]


@dataclass(frozen=True)
class _Placement:
    """Where one parameter of this rank lies among the global tensors and the ranks."""

    shape: Tuple[int, ...]
    """Global shape."""
    split: Optional[TensorSplit]
    base: int
    """Stored offset of the parameter's first element (its part's start)."""
    replicas: Tuple[int, ...]
    """Ranks holding the same whole parameter (its data-parallel replicas)."""
    twins: Tuple[int, ...]
    """Ranks whose ZeRO partition of it is the same as this rank's (its tensor-parallel
    peers, for a parameter they do not split; this rank alone otherwise)."""


def _place(name: str, param, tp: Optional[TensorParallelPlace], pipe: Optional[PipelinePlace],
           rank: int, groups: Dict) -> _Placement:
    # one group lookup per expert group (or the world), not per parameter
    key = getattr(param, "group_name", None) if getattr(param, "allreduce", True) is False else None
    if key not in groups:
        groups[key] = _group_ranks(param, pipe)
    group = groups[key]
    if tp is None:
        return _Placement(tuple(param.shape), None, 0, group, (rank,))
    split = param_split(name, param, tp.size)
    shape = global_shape(param, tp.size)
    if split is not None:
        # Part tp.rank is held by this rank's data-parallel replicas only.
        replicas = tuple(r for r in group if r in tp.data_group)
        return _Placement(shape, split, split.stored_offset(tp.rank, 0), replicas, (rank,))
    expert = getattr(param, "allreduce", True) is False
    # An unsplit expert tensor (a row-parallel bias) is described by each peer's own
    # expert-data-parallel group: one of them writes it (the plan merges equal keys).
    return _Placement(shape, None, 0, group, (rank,) if expert else tp.group)


def base_optimizer(engine):
    """The torch optimizer holding the fp32 state (inside DeepSpeed's wrapper if any)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def is_partitioned(engine) -> bool:
    """Whether the engine keeps fp32 master state in per-rank partitions (ZeRO 1/2, bf16)."""
    return any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def has_optimizer_state(engine) -> bool:
    """Whether every (non-empty) parameter of the base optimizer has its moments."""
    opt = base_optimizer(engine)
    return all(opt.state.get(p) for g in opt.param_groups for p in g["params"] if p.numel())


@dataclass(frozen=True)
class MomentPresence:
    """Which parameter groups of the base optimizer have their moments yet.

    Torch creates Adam's moments at a group's first step, and DeepSpeed skips the step
    of an fp16 iteration whose gradients overflowed: until the first step that does not
    overflow there are none, and :func:`describe_local_state` describes none. A
    checkpoint records this next to the fragments (:func:`moment_presence`, in its
    objects), so that a load gives the engine no moments where the saved one had none
    (:func:`prepare_optimizer_state`), as the uninterrupted run would have, instead of
    creating them and finding them missing from the checkpoint ("snapshot lacks ...").
    """

    groups: Tuple[bool, ...]
    """Per parameter group: False when this rank holds parameters of the group and none
    of them has moments; True otherwise (a group without elements here lacks nothing)."""

    def to_record(self) -> List[bool]:
        """The JSON form kept in a checkpoint's objects."""
        return list(self.groups)

    @staticmethod
    def from_record(record) -> Optional["MomentPresence"]:
        """What :meth:`to_record` returned; None for a checkpoint saved without the record
        (by an older MoC, which only loaded when every moment existed).

        Raises:
            ValueError: the record is not a list of booleans (a damaged checkpoint).
        """
        if record is None:
            return None
        if not isinstance(record, (list, tuple)) or not all(isinstance(v, bool) for v in record):
            raise ValueError(f"optimizer_moments must be a list of booleans, not {record!r}")
        return MomentPresence(tuple(record))


def _lacks_moments(opt, group) -> bool:
    params = [p for p in group["params"] if p.numel()]
    return bool(params) and not any(
        any(k in opt.state.get(p, {}) for k in MOMENT_KINDS) for p in params)


def moment_presence(engine) -> MomentPresence:
    """This rank's :class:`MomentPresence` (no collectives)."""
    opt = base_optimizer(engine)
    return MomentPresence(tuple(not _lacks_moments(opt, g) for g in opt.param_groups))


def prepare_optimizer_state(engine, presence: Optional[MomentPresence]) -> None:
    """Before loading into ``engine``: give its optimizer the moments the checkpoint
    holds (created as :func:`ensure_optimizer_state` does) and no others (dropped, as
    they were before the saved engine's first step). ``presence`` None (a checkpoint
    without the record): every group's moments, as before.

    Raises:
        ValueError: ``presence`` has another number of parameter groups than the engine.
    """
    opt = base_optimizer(engine)
    wanted = presence.groups if presence is not None else (True,) * len(opt.param_groups)
    if len(wanted) != len(opt.param_groups):
        raise ValueError(f"checkpoint records the moments of {len(wanted)} optimizer parameter "
                         f"groups, this engine has {len(opt.param_groups)}")
    if any(want and _lacks_moments(opt, g) for want, g in zip(wanted, opt.param_groups)):
        ensure_optimizer_state(engine)  # every group's; the unwanted are dropped below
    dropped = False
    for want, group in zip(wanted, opt.param_groups):
        if not want:
            for p in group["params"]:
                dropped |= opt.state.pop(p, None) is not None
    if dropped and getattr(engine.optimizer, "_hp_optimizer_states_linked", None) is True:
        # DeepSpeed links each parameter to its moments once, at the first step; left
        # linked, its own readers (universal checkpoints) would see the dropped tensors.
        # Unlinked, the next step links the moments that step creates.
        engine.optimizer._hp_optimizer_states_linked = False


def ensure_optimizer_state(engine) -> None:
    """Create the optimizer moments if no step has run yet (torch creates them lazily).

    Loading into a fresh engine needs somewhere to put the saved moments. One step with
    zero gradients and learning rate 0 creates them without changing any weight; the
    saved step counters then overwrite the counters it advanced.
    """
    if has_optimizer_state(engine):
        return
    opt = base_optimizer(engine)
    params = [p for g in opt.param_groups for p in g["params"]]
    saved_lr = [g["lr"] for g in opt.param_groups]
    saved_grads = [p.grad for p in params]
    try:
        for g in opt.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved_lr):
            g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    lazy_init = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if lazy_init is not None:
        lazy_init()


def _moment_views(opt, mapping) -> Dict[str, torch.Tensor]:
    """The optimizer moments of a ZeRO fragment, as views into the flat partition's state.

    DeepSpeed links these into ``mapping.optim_fragment`` only once, at the first step,
    and a group whose state did not exist yet then stays unlinked for good (its moments
    would silently be missing from checkpoints), so they are found here directly: the
    fp32 fragment is a view of the flat partition the optimizer state is keyed by.
    """
    flat = mapping.hp_fragment._base if mapping.hp_fragment._base is not None else mapping.hp_fragment
    state = opt.state.get(flat, {})
    start = mapping.hp_fragment_address.start
    numel = mapping.hp_fragment_address.numel
    return {k: state[k].narrow(0, start, numel) for k in MOMENT_KINDS
            if k in state and state[k].shape == flat.shape}


@dataclass(frozen=True, eq=False)
class StateIdentity:
    """What :func:`describe_local_state`'s fragments point into (:func:`state_identity`)."""

    key: Tuple
    """Ids of every parameter and its ZeRO mapping, addresses and sizes of every optimizer
    parameter and its moments."""
    alive: Tuple
    """The parameters and mappings themselves: while this is kept, none of them can be
    freed and a new object made under the same id."""

    def same(self, other: Optional["StateIdentity"]) -> bool:
        return other is not None and self.key == other.key


def state_identity(engine) -> StateIdentity:
    """The identity of the tensors this rank's fragments point into. Two equal identities
    mean the same fragments describe the same bytes, so a caller may reuse them.

    Moments are compared by address, which is sound only while the caller also keeps the
    fragments: they are views that keep the old storage alive, so a reload that replaces
    the optimizer state (``load_state_dict`` makes new tensors) cannot put a new moment
    at the old address, and the identity changes.
    """
    opt = base_optimizer(engine)
    alive = tuple((p, getattr(p, "_hp_mapping", None)) for p in engine.module.parameters())
    key = [id(opt)] + [(id(p), id(m), p.data_ptr()) for p, m in alive]
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            key.append((p.data_ptr(), p.numel(),
                        tuple((k, state[k].data_ptr(), state[k].numel())
                              for k in MOMENT_KINDS if k in state)))
    return StateIdentity(tuple(key), alive + (opt,))


def _chunks(length: int, chunk_elems: int):
    return [(start, min(chunk_elems, length - start)) for start in range(0, length, chunk_elems)]


def describe_local_state(engine, naming: ExpertNaming, with_moments: bool = True,
                         for_save: bool = False, chunk_elems: int = 0) -> List[LocalFragment]:
    """Every fragment of fp32 master weights (and moments) this rank holds.

    Args:
        engine: the DeepSpeed engine.
        naming: from :func:`expert_naming`.
        with_moments: include the optimizer moments.
        for_save: describe what can be *read* for a save. With fp32 compute weights the
            weights every rank of a group holds are bitwise the master weights after a
            step, so their ``fp32`` kind is described as replicated (all holders), which
            lets the write plan balance them; loads always target the master partitions.
        chunk_elems: cut replicated tensors into chunks of this many elements (0: whole),
            so one large tensor does not fall on one rank.

    On a pipeline stage the names are the whole model's (``naming.stage``), a non-expert
    parameter's replicas are the stage's ranks (those of its tensor-parallel part, under
    tensor parallelism), and a save leaves out the
    copies of tied modules that an earlier stage holds too (it saves them; a load fills
    every copy).

    Raises:
        ValueError: low-precision training without ZeRO, whose master weights are not
            reachable through fragment maps.
    """
    import torch.distributed as dist
    fragments: List[LocalFragment] = []
    partitioned, rank = is_partitioned(engine), dist.get_rank()
    tp, pipe = tensor_parallel_place(engine), pipeline_place(engine)
    opt, groups = base_optimizer(engine), {}
    for local_name, param in engine.module.named_parameters():
        copy, tied = _tied_copy(pipe, local_name, param, for_save, partitioned)
        if copy and tied is None:
            continue  # a tied module's copy: the first stage holding it saves it
        name, expert = naming.global_name(local_name), naming.expert_of(local_name)
        place = _place(local_name, param, tp, pipe, rank, groups)
        if tied is not None:
            place = dataclasses.replace(place, replicas=tied)
        if not partitioned:
            fragments += _unpartitioned(name, place, expert, param, opt, with_moments, chunk_elems)
            continue
        replicated_weights = for_save and param.dtype == torch.float32
        if replicated_weights:
            # Described by every holder, owner of a partition or not: the plan may
            # pick any of them to write it.
            fragments += _replicated(name, place, expert, param.data.view(-1), chunk_elems)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None or copy:
            continue  # this rank owns no element of the parameter (or saves no copy)
        offset = place.base + mapping.lp_fragment_address.start
        length = mapping.lp_fragment_address.numel
        views = {} if replicated_weights else {FP32: mapping.hp_fragment}
        if with_moments:
            views.update(_moment_views(opt, mapping))
        holders: Tuple[int, ...] = place.twins
        for kind, view in views.items():
            fragments.append(LocalFragment(name, kind, place.shape, offset, length, expert, holders,
                                           view.view(-1), place.split))
    return fragments


def _tied_copy(pipe: Optional[PipelinePlace], local_name: str, param, for_save: bool,
               partitioned: bool) -> Tuple[bool, Optional[Tuple[int, ...]]]:
    """``(copy, tied)`` for a save: whether the parameter is a later stage's copy of a tied
    module's, and, for a tied weight whose fp32 weights a save reads (ZeRO, fp32: equal
    on every stage holding it), every rank that may write them."""
    if pipe is None or not for_save:
        return False, None
    tied = pipe.tied.get(local_name) if partitioned and param.dtype == torch.float32 else None
    return local_name in pipe.replicated, tied


def _unpartitioned(name, place: _Placement, expert, param, opt, with_moments,
                   chunk_elems) -> List[LocalFragment]:
    """Fragments of a parameter (and its moments) without ZeRO: whole on every replica."""
    if param.dtype != torch.float32:
        raise ValueError(f"MoC checkpointing of {param.dtype} weights needs ZeRO stage 1 or 2 "
                         "(the fp32 master weights live in its partitions); use --zero-stage 1/2")
    views = {FP32: param.data.view(-1)}
    state = opt.state.get(param, {})
    if with_moments:
        views.update({k: state[k].view(-1) for k in MOMENT_KINDS if k in state})
    out: List[LocalFragment] = []
    for kind, view in views.items():
        out += _replicated(name, place, expert, view, chunk_elems, kind)
    return out


def _replicated(name, place: _Placement, expert, flat, chunk_elems,
                kind=FP32) -> List[LocalFragment]:
    """Fragments of a tensor (part) every rank of ``place.replicas`` holds whole, cut into
    chunks."""
    spans = _chunks(flat.numel(), chunk_elems) if chunk_elems else [(0, flat.numel())]
    return [LocalFragment(name, kind, place.shape, place.base + start, n, expert, place.replicas,
                          flat.narrow(0, start, n), place.split)
            for start, n in spans]


def optimizer_scalars(engine) -> List[Dict]:
    """Per parameter group, the optimizer state that is not a per-element tensor (e.g. ``step``)."""
    opt = base_optimizer(engine)
    out = []
    for group in opt.param_groups:
        scalars: Dict = {}
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if key in MOMENT_KINDS or (torch.is_tensor(value) and value.numel() > 1):
                    continue
                scalars[key] = value.item() if torch.is_tensor(value) else value
            if scalars:
                break  # every parameter of a group shares its step counter
        out.append(scalars)
    return out


def set_optimizer_scalars(engine, scalars: List[Dict]) -> None:
    """Restore what :func:`optimizer_scalars` returned into every parameter's state."""
    opt = base_optimizer(engine)
    if len(scalars) != len(opt.param_groups):
        raise ValueError(f"checkpoint has {len(scalars)} optimizer parameter groups, "
                         f"this engine {len(opt.param_groups)}")
    for group, values in zip(opt.param_groups, scalars):
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            for key, value in values.items():
                old = state.get(key)
                state[key] = (torch.tensor(value, dtype=old.dtype, device=old.device)
                              if torch.is_tensor(old) else value)


def loss_scaler_state(engine) -> Optional[Dict]:
    """The fp16 loss scaler's scalar fields (scale, hysteresis, iterations since the last
    overflow); None without a scaler. Part of what makes a resumed run skip the same
    overflowing steps as an uninterrupted one."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}


def set_loss_scaler_state(engine, saved: Optional[Dict]) -> None:
    """Restore what :func:`loss_scaler_state` returned (fields this scaler lacks are skipped)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in (saved or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


def refresh_compute_weights(engine) -> None:
    """After fp32 master fragments changed: rebuild the (low-precision) compute weights.

    All ranks call it together (ZeRO all-gathers the partitions).
    """
    if is_partitioned(engine):
        engine.optimizer.update_lp_params()
