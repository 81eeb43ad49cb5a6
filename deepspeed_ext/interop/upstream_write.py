"""A whole checkpoint record written in Megatron-DeepSpeed's layout (DeepSpeed's format,
ZeRO stage 1, expert parallelism), as upstream's ``pretrain_gpt.py`` on the record's
data-parallel and expert-parallel sizes would have saved it. One process writes every
file.

Files (see :mod:`deepspeed_ext.interop.upstream`): ``mp_rank_00_model_states.pt`` (the
dense weights nested as upstream's ``module``, ``param_shapes``, the scheduler, the
stored arguments, RNG states, counters), one file per expert, and with Adam's state one
ZeRO file per data-parallel rank laid out by
:mod:`~deepspeed_ext.interop.upstream_layout`. Each is written atomically (temp, fsync,
rename); ``latest`` is written last, so a crash leaves no ``latest`` naming a partial
directory. The ZeRO files pickle DeepSpeed's own three record types (what upstream's
DeepSpeed unpickles); nothing else but containers, tensors, NumPy RNG state and an
``argparse.Namespace``.
"""

import argparse
import collections
import io
import os
from typing import Any, Dict, List, Mapping

import torch

from deepspeed_ext.format.storage import atomic_write_bytes, atomic_write_text
from deepspeed_ext.interop.megatron_names import is_qkv, qkv_to_upstream, upstream_name
from deepspeed_ext.interop.upstream import MODEL_FILE, UpstreamCheckpoint, expert_file, zero_file
from deepspeed_ext.interop.upstream_layout import GroupSlices, rank_partitions, upstream_params
from deepspeed_ext.interop.zero_files import global_expert_name

GROUP_NAMES = ("wd_no_scale_lr", "no_wd_no_scale_lr")
EXPERT_TENSORS = ("dense_h_to_4h.weight", "dense_h_to_4h.bias", "dense_4h_to_h.weight",
                  "dense_4h_to_h.bias")
"""An expert's tensors in its module's order (as upstream's expert files list them)."""


def upstream_tensors(ckpt: UpstreamCheckpoint) -> Dict[str, Dict[str, torch.Tensor]]:
    """Upstream name (global expert ids) -> kind (``fp32``, ``exp_avg``, ``exp_avg_sq``)
    -> tensor, the fused QKV rows in upstream's order."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    heads, permute = ckpt.model.num_attention_heads, not ckpt.model.grouped
    for name, tensor in ckpt.weights.items():
        kinds = {"fp32": tensor}
        for kind in ("exp_avg", "exp_avg_sq"):
            if (name, kind) in ckpt.moments:
                kinds[kind] = ckpt.moments[(name, kind)]
        out[upstream_name(name)] = {
            k: (qkv_to_upstream(t, heads) if permute and is_qkv(name) else t).contiguous()
            for k, t in kinds.items()}
    return out


def write_upstream_checkpoint(out_dir: str, ckpt: UpstreamCheckpoint,
                              ds_version: str) -> str:
    """Write ``ckpt`` under ``<out_dir>/global_step<N>`` and point ``latest`` at it;
    returns the tag directory.

    Raises:
        ValueError: a tensor the model's layout has no place for, or one it lacks.
    """
    tensors = upstream_tensors(ckpt)
    expected = _expected_names(ckpt)
    if set(tensors) != expected:
        extra, lacking = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise ValueError(f"the checkpoint's tensors do not fit the model: not placed "
                         f"{extra[:4]}, missing {lacking[:4]}")
    tag_dir = os.path.join(out_dir, ckpt.tag)
    os.makedirs(tag_dir, exist_ok=True)
    _save(os.path.join(tag_dir, MODEL_FILE), model_state(ckpt, tensors, ds_version))
    model = ckpt.model
    for ordinal, layer in enumerate(model.moe_layers):
        for expert in range(model.num_experts):
            prefix = (f"language_model.encoder.layers.{layer}.mlp.deepspeed_moe.experts."
                      f"deepspeed_experts.{expert}.")
            _save(os.path.join(tag_dir, expert_file(ordinal, expert)),
                  {prefix + n: tensors[prefix + n]["fp32"] for n in expert_tensors(model)})
    if ckpt.moments:
        for rank, groups in rank_partitions(model).items():
            _save(os.path.join(tag_dir, zero_file(rank)),
                  zero_state(ckpt, tensors, rank, groups, ds_version))
    atomic_write_text(os.path.join(out_dir, "latest_checkpointed_iteration.txt"),
                      str(ckpt.iteration))
    atomic_write_text(os.path.join(out_dir, "latest"), ckpt.tag)
    return tag_dir


def expert_tensors(model) -> tuple:
    """An expert's tensors in its module's order (the biases only where the model has them)."""
    return tuple(n for n in EXPERT_TENSORS if model.add_bias_linear or n.endswith("weight"))


def _expected_names(ckpt: UpstreamCheckpoint) -> set:
    model = ckpt.model
    names = {p.name for p in upstream_params(model) if p.expert < 0}
    for layer in model.moe_layers:
        for expert in range(model.num_experts):
            for n in expert_tensors(model):
                names.add(f"language_model.encoder.layers.{layer}.mlp.deepspeed_moe.experts."
                          f"deepspeed_experts.{expert}.{n}")
    return names


def _save(path: str, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def model_state(ckpt: UpstreamCheckpoint, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                ds_version: str) -> Dict[str, Any]:
    """What upstream's DeepSpeed engine saves in ``mp_rank_00_model_states.pt``."""
    model, params = ckpt.model, upstream_params(ckpt.model)
    encoder = collections.OrderedDict(
        (p.name[len("language_model.encoder."):], tensors[p.name]["fp32"])
        for p in params if p.expert < 0 and p.name.startswith("language_model.encoder."))
    embedding = {"word_embeddings": {"weight": tensors[
        "language_model.embedding.word_embeddings.weight"]["fp32"]}}
    language_model = {"embedding": embedding, "encoder": encoder}
    if not model.rotary:
        embedding["position_embeddings"] = {"weight": tensors[
            "language_model.embedding.position_embeddings.weight"]["fp32"]}
    if model.untie:
        language_model["output_layer"] = {"weight": tensors[
            "language_model.output_layer.weight"]["fp32"]}
    shapes = [collections.OrderedDict((p.name, torch.Size(p.shape)) for p in params
                                      if p.group == g) for g in range(4)]
    return {"module": {"language_model": language_model},
            "buffer_names": [], "optimizer": None, "param_shapes": shapes,
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
            "lr_scheduler": dict(ckpt.scheduler), "data_sampler": None, "random_ltd": None,
            "skipped_steps": 0, "global_steps": ckpt.iteration,
            "global_samples": ckpt.global_samples, "dp_world_size": model.dp_world_size,
            "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": ds_config(ckpt), "ds_version": ds_version,
            "num_experts": [model.num_experts] * len(model.moe_layers), "ds_autoep_layers": None,
            "universal_checkpoint_info": {
                "universal_checkpoint_version": 0.4,
                "original_vocab_size": model.true_vocab_size,
                "padded_vocab_size": model.padded_vocab_size,
                "vocabulary_parameter_patterns": [
                    "language_model.embedding.word_embeddings.weight"]
                + (["language_model.output_layer.weight"] if model.untie else []),
                "parameter_with_2_sub_params_cat_dim_0": []},
            "args": stored_args(ckpt), "checkpoint_version": 3.0, "iteration": ckpt.iteration,
            "tokens": ckpt.global_samples * model.seq_length,
            "rng_state": [_upstream_rng(r) for r in ckpt.rng_states]}


def ds_config(ckpt: UpstreamCheckpoint) -> Dict[str, Any]:
    """The DeepSpeed configuration recorded with the files (ZeRO stage 1, fp32)."""
    model = ckpt.model
    return {"train_batch_size": model.global_batch_size,
            "train_micro_batch_size_per_gpu": model.micro_batch_size,
            "gradient_clipping": ckpt.adam.clip_grad, "zero_optimization": {"stage": 1},
            "fp16": {"enabled": False}, "bf16": {"enabled": False}}


def stored_args(ckpt: UpstreamCheckpoint) -> argparse.Namespace:
    """The arguments upstream stores and checks on a load (``check_checkpoint_args``'s
    fields among them); upstream's many other flags are left to the loading run."""
    m = ckpt.model
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.kv_heads,
        kv_channels=m.hidden_size // m.num_attention_heads, seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings, add_position_embedding=not m.rotary,
        padded_vocab_size=m.padded_vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        tokenizer_type=m.tokenizer_type, num_experts=[m.num_experts],
        expert_interval=m.expert_interval, topk=m.topk, moe_expert_parallel_size=m.ep_size,
        mlp_type="standard", swiglu=m.swiglu, normalization=m.normalization,
        add_bias_linear=m.add_bias_linear, untie_embeddings_and_output_weights=m.untie,
        use_rotary_position_embeddings=m.rotary, rope_theta=m.rope_theta,
        layernorm_epsilon=m.layernorm_epsilon,
        apply_residual_connection_post_layernorm=False, enable_expert_tensor_parallelism=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        data_parallel_size=m.dp_world_size, world_size=m.dp_world_size,
        global_batch_size=m.global_batch_size, micro_batch_size=m.micro_batch_size,
        iteration=ckpt.iteration, consumed_train_samples=ckpt.global_samples,
        consumed_valid_samples=0, params_dtype=torch.float32, fp16=False, bf16=False,
        optimizer="adam", adam_beta1=ckpt.adam.betas[0], adam_beta2=ckpt.adam.betas[1],
        adam_eps=ckpt.adam.eps, weight_decay=ckpt.adam.weight_decay,
        clip_grad=ckpt.adam.clip_grad)


def zero_state(ckpt: UpstreamCheckpoint, tensors: Mapping[str, Mapping[str, torch.Tensor]],
               rank: int, groups: Mapping[int, GroupSlices], ds_version: str) -> Dict[str, Any]:
    """Data-parallel rank ``rank``'s ZeRO-1 file."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    model = ckpt.model
    flats: Dict[str, List[torch.Tensor]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
    mappings, states, param_groups = [], {}, []
    for g in range(4):
        part = groups[g]
        flat, mapping = _fill(part, tensors, rank % model.ep_size if g >= 2 else None,
                              model.local_experts)
        for kind in flats:
            flats[kind].append(flat[kind])
        mappings.append(mapping)
        states[g] = {"step": torch.tensor(float(ckpt.group_steps[g])),
                     "exp_avg": flat["exp_avg"], "exp_avg_sq": flat["exp_avg_sq"]}
        param_groups.append(_param_group(ckpt, g))
    expert_partitions = model.dp_world_size // model.ep_size
    osd = {"loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
           "clip_grad": ckpt.adam.clip_grad,
           "base_optimizer_state": {"state": states, "param_groups": param_groups},
           "single_partition_of_fp32_groups": flats["fp32"],
           "zero_stage": ZeroStageEnum.optimizer_states,
           "group_paddings": [groups[g].padding for g in range(4)],
           "param_alignment_paddings": [[0] * len(m) for m in mappings],
           "partition_count": [model.dp_world_size] * 2 + [expert_partitions] * 2,
           "ds_version": ds_version, "param_slice_mappings": mappings}
    return {"optimizer_state_dict": osd, "ds_config": ds_config(ckpt), "ds_version": ds_version}


def _fill(part: GroupSlices, tensors, ep_rank, local_experts: int):
    """One partition's flat tensors and its ``param_slice_mappings``."""
    from deepspeed.utils.tensor_fragment import fragment_address
    flat = {kind: torch.zeros(part.numel) for kind in ("fp32", "exp_avg", "exp_avg_sq")}
    mapping = collections.OrderedDict()
    for name, start, numel, offset in part.slices:
        source = global_expert_name(name, ep_rank, local_experts) if ep_rank is not None else name
        for kind, out in flat.items():
            out[start:start + numel] = tensors[source][kind].reshape(-1)[offset:offset + numel]
        mapping[name] = fragment_address(numel=numel, start=start)
    return flat, mapping


def _param_group(ckpt: UpstreamCheckpoint, group: int) -> Dict[str, Any]:
    """Torch Adam's record of optimizer group ``group`` (its ``lr`` is the schedule's
    peak: upstream's scheduler sets the current one on load)."""
    decay = group % 2 == 0
    out: Dict[str, Any] = {
        "name": GROUP_NAMES[group] if group < 2 else f"ep_size_{ckpt.model.ep_size}",
        "wd_mult": 1.0 if decay else 0.0, "lr_mult": 1.0}
    if group >= 2:
        out["moe"] = True
    out.update(lr=ckpt.scheduler.get("max_lr", 0.0), betas=ckpt.adam.betas, eps=ckpt.adam.eps,
               weight_decay=ckpt.adam.weight_decay if decay else 0.0, amsgrad=False,
               maximize=False, foreach=None, capturable=False, differentiable=False,
               fused=None, decoupled_weight_decay=not ckpt.l2_weight_decay, params=[group])
    return out


def _upstream_rng(state: Mapping[str, Any]) -> Dict[str, Any]:
    """MoC's per-rank RNG record in upstream's form."""
    version, words, gauss = state["python"]
    torch_state = state["torch"]
    return {"random_rng_state": (int(version), tuple(int(w) for w in words), gauss),
            "np_rng_state": state["numpy"], "torch_rng_state": torch_state,
            "cuda_rng_state": state.get("cuda") if state.get("cuda") is not None else torch_state,
            "rng_tracker_states": {}}
