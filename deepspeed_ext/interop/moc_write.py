"""An imported checkpoint written as a MoC checkpoint, as a job of the chosen layout
would have saved it. One process writes every rank's file.

The plan (pure, :func:`plan_import`) gives every tensor to one rank of the layout
(:func:`~deepspeed_ext.policy.plan.build_write_plan`: an expert's tensors to a rank of its
expert-parallel group, the rest spread to balance the bytes). The write follows a
save's order: the rank files (``format.storage.write_fragment_file``: temp, fsync,
rename), ``objects.json``, the manifest (the commit point), then ``latest``. A crash
before the manifest leaves a directory no loader takes.

MoC loads a checkpoint under any world, expert-parallel, tensor-parallel or pipeline
size, so the layout chosen here only decides which file holds what.
"""

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from deepspeed_ext.format.assemble import FragmentSpec, RankReport, assemble_manifest
from deepspeed_ext.format.dtypes import dtype_name
from deepspeed_ext.format.expert_index import build_expert_index
from deepspeed_ext.format.manifest import FileEntry, write_manifest
from deepspeed_ext.format.naming import rank_file_name, tensor_key
from deepspeed_ext.format.objects import OBJECTS_FILE, encode, write_objects_file
from deepspeed_ext.format.storage import ensure_dir, write_fragment_file
from deepspeed_ext.format.vocab import OBJECTS_KEY, PaddedVocab
from deepspeed_ext.interop.upstream import UpstreamCheckpoint
from deepspeed_ext.interop.upstream_model import scheduler_in_iterations
from deepspeed_ext.policy.plan import Piece, WritePlan, build_write_plan
from deepspeed_ext.policy.plt import TokenLedger
from deepspeed_ext.store.latest import update_latest


@dataclass(frozen=True)
class ImportLayout:
    """The layout whose save the import imitates."""

    world_size: int
    """Ranks (one file each)."""
    ep_size: int
    """Expert-parallel size (which ranks may hold an expert's tensors)."""
    zero_stage: int = 2
    """Recorded in the manifest's layout (loads reshard between stages 1 and 2)."""


def plan_import(tensors: Dict[Tuple[str, str], Tuple[int, Optional[Tuple[int, int]]]],
                layout: ImportLayout, num_experts: int) -> WritePlan:
    """Which rank file holds each tensor.

    Args:
        tensors: ``(name, kind)`` -> ``(bytes, expert or None)``.
        layout: the imitated layout; ``num_experts`` per MoE layer.

    Raises:
        ValueError: ``ep_size`` divides neither the world nor the experts.
    """
    world, ep = layout.world_size, layout.ep_size
    if world < 1 or ep < 1 or world % ep or num_experts % ep:
        raise ValueError(f"expert-parallel size {ep} must divide the world size {world} "
                         f"and the {num_experts} experts")
    local = num_experts // ep
    pieces = []
    for (name, kind), (nbytes, expert) in tensors.items():
        holders = (tuple(range(world)) if expert is None else
                   tuple(r for r in range(world) if r % ep == expert[1] // local))
        pieces.append(Piece(tensor_key(name, kind), nbytes, holders, expert))
    return build_write_plan(pieces, world)


def import_objects(ckpt: UpstreamCheckpoint, layout: ImportLayout) -> Dict[str, Any]:
    """The checkpoint's non-tensor state: what the trainer resumes from
    (``client_state``), the engine's counters, Adam's steps and which moments exist,
    the padded vocabulary, and a token ledger that starts at the import."""
    model = ckpt.model
    groups = len(ckpt.group_steps) or 4
    ledger = TokenLedger(len(model.moe_layers), model.num_experts)
    ledger.mark_saved([(l, e) for l in range(len(model.moe_layers))
                       for e in range(model.num_experts)], ckpt.iteration)
    names = ["word_embeddings.weight"] + (["output_layer.weight"] if model.untie else [])
    vocab = PaddedVocab(names, model.padded_vocab_size, model.true_vocab_size)
    client = {"iteration": ckpt.iteration,
              "consumed_train_samples": ckpt.global_samples,
              "opt_param_scheduler": scheduler_in_iterations(ckpt.scheduler,
                                                             model.global_batch_size),
              "rng_states": None,
              "args": dict(model.moc_args(), l2_weight_decay=ckpt.l2_weight_decay,
                           adam_beta1=ckpt.adam.betas[0], adam_beta2=ckpt.adam.betas[1],
                           adam_eps=ckpt.adam.eps, weight_decay=ckpt.adam.weight_decay,
                           clip_grad=ckpt.adam.clip_grad)}
    return {"client_state": client,
            "engine": {"global_steps": ckpt.iteration, "global_samples": ckpt.global_samples,
                       "skipped_steps": 0},
            "optimizer_scalars": [{"step": s} for s in ckpt.group_steps] or [{}] * groups,
            "optimizer_moments": [bool(ckpt.moments)] * groups,
            "lr_scheduler": None, "loss_scaler": None, "pec_policy": None,
            "token_ledger": ledger.state_dict(), OBJECTS_KEY: vocab.to_record(),
            "rng_states": ckpt.rng_states or None}


def all_tensors(ckpt: UpstreamCheckpoint) -> Dict[Tuple[str, str], torch.Tensor]:
    """``(MoC name, kind)`` -> tensor: the weights as ``fp32``, the moments by kind."""
    out = {(name, "fp32"): t for name, t in ckpt.weights.items()}
    out.update(ckpt.moments)
    return out


def write_moc_checkpoint(out_dir: str, ckpt: UpstreamCheckpoint, layout: ImportLayout) -> str:
    """Write ``ckpt`` as MoC checkpoint ``<out_dir>/<ckpt.tag>`` and point ``latest`` at
    it; returns the tag directory.

    Raises:
        ValueError: a layout the model does not fit, or a manifest that does not
            assemble (a bug: nothing is committed then).
    """
    tensors = all_tensors(ckpt)
    experts = ckpt.experts()
    meta = {key: (t.numel() * t.element_size(), experts.get(key[0]))
            for key, t in tensors.items()}
    plan = plan_import(meta, layout, ckpt.model.num_experts)
    tag_dir = os.path.join(out_dir, ckpt.tag)
    ensure_dir(tag_dir)
    tree, object_tensors = encode(import_objects(ckpt, layout))
    reports = [_write_rank(tag_dir, rank, plan, tensors, experts,
                           object_tensors if rank == 0 else {})
               for rank in range(layout.world_size)]
    obj_record = write_objects_file(tag_dir, tree, rank_file_name(0))
    model = ckpt.model
    index = build_expert_index(None, sorted(set(experts.values())), ckpt.iteration, ckpt.tag,
                               len(model.moe_layers), model.num_experts)
    manifest = assemble_manifest(
        ckpt.tag, ckpt.iteration, layout.world_size,
        {"world_size": layout.world_size, "ep_size": layout.ep_size,
         "zero_stage": layout.zero_stage, "num_moe_layers": len(model.moe_layers),
         "num_experts": model.num_experts},
        reports, index, extra_files={OBJECTS_FILE: FileEntry.from_record(obj_record, 0)},
        extra={"imported_from": "megatron-deepspeed", "source_tag": ckpt.tag})
    write_manifest(tag_dir, manifest)
    update_latest(out_dir, ckpt.tag, ckpt.iteration)
    return tag_dir


def _write_rank(tag_dir: str, rank: int, plan: WritePlan,
                tensors: Dict[Tuple[str, str], torch.Tensor],
                experts: Dict[str, Tuple[int, int]],
                extra: Dict[str, torch.Tensor]) -> RankReport:
    """Rank ``rank``'s file: its planned tensors whole (one fragment each) and ``extra``."""
    by_key = {tensor_key(n, k): (n, k) for n, k in tensors}
    specs: List[FragmentSpec] = []
    payload: Dict[str, torch.Tensor] = dict(extra)
    for key in plan.keys_for(rank):
        name, kind = by_key[key]
        tensor = tensors[(name, kind)].contiguous()
        spec = FragmentSpec(name=name, kind=kind, offset=0, length=tensor.numel(),
                            shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                            expert=experts.get(name))
        payload[spec.key] = tensor.reshape(-1)
        specs.append(spec)
    file = rank_file_name(rank)
    record = write_fragment_file(os.path.join(tag_dir, file), payload)
    return RankReport.from_record(rank, file, record, specs)
