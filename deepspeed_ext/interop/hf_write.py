"""A MoC checkpoint written as a Hugging Face model directory (Mixtral): safetensors
shards holding Mixtral's tensors, their index when there is more than one shard, and
``config.json`` last (a directory without it is no model: a crash leaves nothing that
loads half-written). One process; each tensor read whole (expert versions resolved,
tensor-parallel pieces re-assembled, checksums verified) and streamed out one at a time,
so memory holds a few tensors, not the model.
"""

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import atomic_write_json, write_safetensors_streaming
from deepspeed_ext.interop.hf_mixtral import MixtralShape, hf_tensors
from deepspeed_ext.store.reader import CheckpointReader, find_loadable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFPlan:
    """Which Hugging Face tensor comes from which MoC tensor, and the shards."""

    sources: Dict[str, Tuple[str, int]] = field(default_factory=dict)
    """Hugging Face name -> (MoC name, index among that tensor's parts)."""
    shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    """Hugging Face name -> shape."""
    shards: List[List[str]] = field(default_factory=list)
    """Hugging Face names per file, in order."""

    def file_names(self) -> List[str]:
        """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` per shard."""
        if len(self.shards) == 1:
            return [SINGLE_FILE]
        n = len(self.shards)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_hf(moc_shapes: Dict[str, Tuple[int, ...]], shape: MixtralShape, itemsize: int,
            max_shard_bytes: int) -> HFPlan:
    """Pure: the Hugging Face tensors of MoC's (by name -> shape), shards filled in name
    order up to ``max_shard_bytes`` each (a larger tensor gets a shard of its own).

    Raises:
        ValueError: a MoC tensor Mixtral has no place for, or Mixtral tensors missing.
    """
    plan = HFPlan()
    for name in sorted(moc_shapes):
        parts = hf_tensors(name, torch.empty(moc_shapes[name], device="meta"), shape)
        for index, (hf_name, tensor) in enumerate(parts):
            plan.sources[hf_name] = (name, index)
            plan.shapes[hf_name] = tuple(tensor.shape)
    expected = 3 + shape.num_layers * (7 + 3 * shape.num_experts)
    if len(plan.sources) != expected:
        raise ValueError(f"{len(plan.sources)} Hugging Face tensors from the checkpoint, "
                         f"Mixtral of this shape has {expected}")
    current, size = [], 0
    for hf_name in sorted(plan.shapes):
        nbytes = int(torch.Size(plan.shapes[hf_name]).numel()) * itemsize
        if current and size + nbytes > max_shard_bytes:
            plan.shards.append(current)
            current, size = [], 0
        current.append(hf_name)
        size += nbytes
    plan.shards.append(current)
    return plan


def write_hf_mixtral(save_dir: str, tag: Optional[str], out_dir: str, dtype: str = "float32",
                     max_shard_bytes: int = 5 << 30) -> Tuple[str, MixtralShape, HFPlan]:
    """Write checkpoint ``tag`` of ``save_dir`` (default: the newest that verifies) as a
    ``transformers`` Mixtral under ``out_dir``; returns the tag, the shape and the plan.

    Raises:
        CheckpointError: no checkpoint, a damaged one, or a model that is not
            Mixtral-shaped (naming the flags it lacks).
    """
    if tag is None:
        tag, _ = find_loadable(save_dir, checksums=True)
        if tag is None:
            raise CheckpointError(f"no complete MoC checkpoint in {save_dir}")
    with CheckpointReader(save_dir, tag) as reader:
        args = ((reader.objects() or {}).get("client_state") or {}).get("args")
        if not isinstance(args, dict):
            raise CheckpointError(f"{save_dir}/{tag}: no trainer arguments recorded; the "
                                  f"model's shape is unknown")
        try:
            shape = MixtralShape.from_args(args)
            plan = plan_hf({n: reader.info(n, "fp32").shape for n in reader.tensor_names("fp32")},
                           shape, torch.empty(0, dtype=DTYPES[dtype]).element_size(),
                           max_shard_bytes)
        except ValueError as err:
            raise CheckpointError(f"{save_dir}/{tag}: {err}") from None
        os.makedirs(out_dir, exist_ok=True)
        _write_shards(reader, plan, shape, out_dir, DTYPES[dtype])
    atomic_write_json(os.path.join(out_dir, "config.json"), shape.config_json(dtype))
    return tag, shape, plan


def _write_shards(reader: CheckpointReader, plan: HFPlan, shape: MixtralShape, out_dir: str,
                  dtype: torch.dtype) -> None:
    """Every shard, streamed; a MoC tensor is read once and kept until its last part
    (QKV's three, an expert's two) is written."""
    remaining: Dict[str, int] = {}
    for moc_name, _ in plan.sources.values():
        remaining[moc_name] = remaining.get(moc_name, 0) + 1
    cache: Dict[str, List[torch.Tensor]] = {}

    def produce(hf_name: str) -> torch.Tensor:
        moc_name, index = plan.sources[hf_name]
        if moc_name not in cache:
            whole = reader.read_full(moc_name, "fp32").float()
            cache[moc_name] = [t for _, t in hf_tensors(moc_name, whole, shape)]
        part = cache[moc_name][index].to(dtype).contiguous()
        remaining[moc_name] -= 1
        if not remaining[moc_name]:
            del cache[moc_name]
        return part

    files = plan.file_names()
    for file, names in zip(files, plan.shards):
        layout = [(n, plan.shapes[n], dtype) for n in names]
        write_safetensors_streaming(os.path.join(out_dir, file), layout, produce,
                                    metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(int(torch.Size(s).numel()) for s in plan.shapes.values()) * \
            torch.empty(0, dtype=dtype).element_size()
        weight_map = {n: f for f, names in zip(files, plan.shards) for n in names}
        atomic_write_json(os.path.join(out_dir, INDEX_FILE),
                          {"metadata": {"total_size": total}, "weight_map": weight_map})

