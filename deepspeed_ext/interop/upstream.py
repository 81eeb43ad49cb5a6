"""A Megatron-DeepSpeed MoE checkpoint read whole into one typed record, in MoC's names.

Called by one process (``moc-ckpt import``). What a checkpoint directory holds
(DeepSpeed's format, ``<dir>/latest`` naming ``<dir>/<tag>/``)::

    mp_rank_00_model_states.pt                     dense weights (nested ``module``), the
                                                   gates, ``args``, scheduler, RNG, counters
    layer_{M}_expert_{E}_mp_rank_00_model_states.pt  expert E of the M-th MoE layer (global E)
    zero_pp_rank_{r}_mp_rank_00_optim_states.pt    data-parallel rank r's ZeRO partitions

Every file is read by :func:`~deepspeed_ext.interop.safe_load.load_upstream_file`
(weights only). The weights MoC takes are the ZeRO files' fp32 master weights when they
are there (a half-precision run's module holds rounded copies), else the module's and
expert files' tensors; the fused QKV rows are put in MoC's order
(:func:`~deepspeed_ext.interop.megatron_names.qkv_to_moc`), moments alike.
"""

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.naming import check_tag
from deepspeed_ext.interop.megatron_names import (expert_of, flatten_module, is_qkv, moc_name,
                                                  qkv_to_moc)
from deepspeed_ext.interop.safe_load import check_inside, load_upstream_file
from deepspeed_ext.interop.upstream_layout import expected_shapes
from deepspeed_ext.interop.upstream_model import AdamSettings, UpstreamModel
from deepspeed_ext.interop.zero_files import ZeroState, assemble_zero

logger = logging.getLogger(__name__)

MODEL_FILE = "mp_rank_00_model_states.pt"
LATEST_MAX_BYTES = 4096


def expert_file(moe_layer: int, expert: int) -> str:
    """Upstream's file of global expert ``expert`` of the ``moe_layer``-th MoE layer."""
    return f"layer_{moe_layer}_expert_{expert}_mp_rank_00_model_states.pt"


def zero_file(rank: int) -> str:
    """Upstream's ZeRO file of data-parallel rank ``rank``."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@dataclass
class UpstreamCheckpoint:
    """Everything ``moc-ckpt import`` carries over, in MoC's parameter names."""

    tag: str
    """Upstream's tag (``global_step6``)."""
    model: UpstreamModel
    """The model's shape and the run's layout."""
    iteration: int
    """Iterations trained."""
    global_samples: int
    """Samples consumed (DeepSpeed's count)."""
    weights: Dict[str, torch.Tensor]
    """MoC name -> fp32 weights (QKV rows in MoC's order)."""
    moments: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)
    """``(MoC name, exp_avg | exp_avg_sq)`` -> Adam's moment; empty: weights only."""
    group_steps: List[float] = field(default_factory=list)
    """Adam's step per optimizer group (empty: weights only)."""
    scheduler: Dict[str, Any] = field(default_factory=dict)
    """Upstream's LR scheduler state (steps counted in samples)."""
    rng_states: List[Dict[str, Any]] = field(default_factory=list)
    """Saved RNG states in :func:`deepspeed_ext.engine.rng.get_rng_state`'s form."""
    source_weights: str = ""
    """Where the weights came from: ``zero`` (fp32 master weights) or ``module``."""
    l2_weight_decay: bool = False
    """Upstream's Adam added weight decay to the gradient (``torch.optim.Adam``); MoC's
    trainer continues it exactly with ``--l2-weight-decay``."""
    adam: AdamSettings = field(default_factory=AdamSettings)
    """Adam's settings and the clipping norm (what an export records again)."""

    def experts(self) -> Dict[str, Tuple[int, int]]:
        """MoC name -> ``(moe layer ordinal, global expert)`` of every expert tensor."""
        ordinal = {layer: i for i, layer in enumerate(self.model.moe_layers)}
        out = {}
        for name in self.weights:
            found = expert_of(name)
            if found is not None:
                out[name] = (ordinal[found[0]], found[1])
        return out


def resolve_tag(root: str, tag: Optional[str]) -> str:
    """The tag to import: ``tag``, else the one ``<root>/latest`` names.

    Raises:
        CheckpointError: no ``latest`` (and no ``tag``), or a tag that is not a plain
            directory name of ``root``.
    """
    if tag is None:
        latest = os.path.join(root, "latest")
        check_inside(root, latest)
        if os.path.getsize(latest) > LATEST_MAX_BYTES:
            raise CheckpointError(f"{latest}: {os.path.getsize(latest)} bytes, not a tag")
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
    try:
        check_tag(tag)
    except ValueError as err:
        raise CheckpointError(f"{root}: tag {tag!r}: {err}") from None
    if not os.path.isdir(os.path.join(root, tag)):
        raise CheckpointError(f"{root}: no checkpoint directory {tag!r} (from "
                              f"{'--tag' if tag else 'latest'})")
    return tag


def read_upstream(root: str, tag: Optional[str] = None,
                  weights_only: bool = False) -> UpstreamCheckpoint:
    """Read the checkpoint ``tag`` (default: ``latest``'s) of ``root``.

    Args:
        weights_only: leave the ZeRO files unread (the import then carries no optimizer
            state).

    Raises:
        CheckpointError: a missing or unreadable file, a file that needs more than the
            allow-list, or tensors that do not fit the model's arguments (named).
        ValueError: an architecture MoC cannot train yet (the upstream flag named).
    """
    tag = resolve_tag(root, tag)
    tag_dir = os.path.join(root, tag)
    _refuse_other_layouts(tag_dir)
    state = load_upstream_file(root, os.path.join(tag_dir, MODEL_FILE))
    model = UpstreamModel.from_args(state.get("args"), state.get("universal_checkpoint_info"))
    module = _module_weights(state, tag_dir)
    model.check_moe_layers(_gate_layers(module))
    experts = _expert_weights(root, tag_dir, model)
    _check_shapes(tag_dir, model, {**module, **experts})
    names = list(module) + list(experts)
    zero = None if weights_only else _zero_state(root, tag_dir, model)
    ckpt = UpstreamCheckpoint(
        tag=tag, model=model, iteration=int(state.get("iteration", state.get("global_steps", 0))),
        global_samples=int(state.get("global_samples", 0)), weights={},
        adam=AdamSettings.from_values(vars(state["args"])),
        scheduler=dict(state.get("lr_scheduler") or {}),
        rng_states=[_rng_state(r) for r in state.get("rng_state") or []])
    source = {**module, **experts}
    for name in names:
        ours = moc_name(name)
        tensor = zero.tensors[(name, "fp32")] if zero is not None else source[name].float()
        ckpt.weights[ours] = _to_moc(ours, tensor, model)
        if zero is not None:
            for kind in ("exp_avg", "exp_avg_sq"):
                if (name, kind) in zero.tensors:
                    ckpt.moments[(ours, kind)] = _to_moc(ours, zero.tensors[(name, kind)], model)
    if zero is not None:
        ckpt.group_steps = list(zero.steps)
        ckpt.l2_weight_decay = zero.l2_weight_decay
    ckpt.source_weights = "zero" if zero is not None else "module"
    return ckpt


def _to_moc(name: str, tensor: torch.Tensor, model: UpstreamModel) -> torch.Tensor:
    tensor = tensor.detach().to(torch.float32).contiguous()
    if is_qkv(name) and not model.grouped:  # grouped-query rows: the same order in both
        return qkv_to_moc(tensor, model.num_attention_heads)
    return tensor


def _refuse_other_layouts(tag_dir: str) -> None:
    """Refuse tensor- and pipeline-parallel upstream checkpoints (not imported yet)."""
    names = os.listdir(tag_dir)
    if any(re.match(r"mp_rank_0*[1-9]\d*_model_states\.pt$", n) for n in names):
        raise ValueError(f"{tag_dir} was saved with tensor parallelism (mp_rank_01...): "
                         f"import a --tensor-model-parallel-size 1 checkpoint (MoC reshards "
                         f"to any tensor-parallel size after the import)")
    if any(re.match(r"layer_\d+-model_\d+-model_states\.pt$", n) for n in names):
        raise ValueError(f"{tag_dir} was saved by DeepSpeed's pipeline engine (layer_NN-model_"
                         f"...): import a --no-pipeline-parallel checkpoint")
    if MODEL_FILE not in names:
        raise CheckpointError(f"{tag_dir}: no {MODEL_FILE}; not a Megatron-DeepSpeed "
                              f"checkpoint directory")


def _module_weights(state: Mapping, tag_dir: str) -> Dict[str, torch.Tensor]:
    """The dense file's weights by upstream name, stray expert copies dropped."""
    module = state.get("module")
    if not isinstance(module, Mapping):
        raise CheckpointError(f"{tag_dir}/{MODEL_FILE}: no 'module' state")
    try:
        flat = flatten_module(module)
    except ValueError as err:
        raise CheckpointError(f"{tag_dir}/{MODEL_FILE}: {err}") from None
    kept = {}
    for name, tensor in flat.items():
        if moc_name(name) is not None:  # raises for a parameter MoC has no place for
            kept[name if name.startswith("language_model.") else "language_model." + name] = tensor
    dropped = len(flat) - len(kept)
    if dropped:
        logger.info(f"[moc] {MODEL_FILE}: {dropped} stray expert tensors (DeepSpeed's "
                    f"'encoderlayers...' copies) ignored; the expert files are read instead")
    return kept


def _check_shapes(tag_dir: str, model: UpstreamModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the stored arguments describe, with their shape, and no other.

    Raises:
        CheckpointError: naming the first tensor that differs (arguments that do not
            describe these files: a hand-edited ``args``, another model's files).
    """
    expected = expected_shapes(model)
    for name in sorted(set(expected) | set(tensors)):
        want, got = expected.get(name), tuple(tensors[name].shape) if name in tensors else None
        if want != got:
            raise CheckpointError(
                f"{tag_dir}: {name} is {got or 'missing'}, but the stored arguments describe "
                f"{want or 'no such tensor'} (--swiglu {model.swiglu}, --normalization "
                f"{model.normalization}, biases {model.add_bias_linear}, key-value heads "
                f"{model.kv_heads}): the files and their arguments disagree")


def _gate_layers(module: Mapping[str, torch.Tensor]) -> List[int]:
    found = {int(m.group(1)) for n in module
             for m in [re.search(r"layers\.(\d+)\.mlp\.deepspeed_moe\.gate\.", n)] if m}
    return sorted(found)


def _expert_weights(root: str, tag_dir: str, model: UpstreamModel) -> Dict[str, torch.Tensor]:
    """Every expert file's tensors, by upstream name; every expert must have its file."""
    out: Dict[str, torch.Tensor] = {}
    for ordinal, layer in enumerate(model.moe_layers):
        for expert in range(model.num_experts):
            path = os.path.join(tag_dir, expert_file(ordinal, expert))
            tensors = load_upstream_file(root, path)
            prefix = (f"language_model.encoder.layers.{layer}.mlp.deepspeed_moe.experts."
                      f"deepspeed_experts.{expert}.")
            if not isinstance(tensors, Mapping) or not tensors or any(
                    not k.startswith(prefix) or not isinstance(v, torch.Tensor)
                    for k, v in tensors.items()):
                raise CheckpointError(f"{path}: expected tensors named {prefix}*")
            out.update(tensors)
    return out


def _zero_state(root: str, tag_dir: str, model: UpstreamModel) -> Optional[ZeroState]:
    """The ZeRO files' state, or None (with a log line) when the checkpoint has none."""
    paths = [os.path.join(tag_dir, zero_file(r)) for r in range(model.dp_world_size)]
    present = [os.path.isfile(p) for p in paths]
    if not any(present):
        logger.info(f"[moc] {tag_dir}: no ZeRO optimizer files (zero_pp_rank_*): importing "
                    f"the weights only; Adam's moments start from zero")
        return None
    if not all(present):
        missing = [os.path.basename(p) for p, ok in zip(paths, present) if not ok]
        raise CheckpointError(f"{tag_dir}: missing {', '.join(missing)} of the "
                              f"{model.dp_world_size} data-parallel ranks' ZeRO files "
                              f"(pass --weights-only to import the weights alone)")
    states = []
    for path in paths:
        loaded = load_upstream_file(root, path)
        osd = loaded.get("optimizer_state_dict") if isinstance(loaded, Mapping) else None
        if not isinstance(osd, Mapping) or "param_slice_mappings" not in osd:
            raise CheckpointError(f"{path}: not a ZeRO stage 1/2 optimizer file "
                                  f"(no optimizer_state_dict.param_slice_mappings)")
        states.append(osd)
    shapes = expected_shapes(model)  # the files' tensors have them (_check_shapes)
    try:
        return assemble_zero(states, model.ep_size, model.local_experts, shapes)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{tag_dir}: ZeRO files: {err}") from None


def _rng_state(saved: Mapping) -> Dict[str, Any]:
    """Upstream's per-rank RNG record in MoC's form (CUDA's state only when it is one)."""
    version, words, gauss = saved["random_rng_state"]
    cuda = saved.get("cuda_rng_state")
    return {"python": (int(version), np.asarray(words, dtype=np.uint32), gauss),
            "numpy": saved["np_rng_state"], "torch": saved["torch_rng_state"],
            "cuda": None if cuda is None or torch.equal(cuda, saved["torch_rng_state"])
            else cuda}
