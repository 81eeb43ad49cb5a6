"""A MoC checkpoint read whole into the record an import produces
(:class:`~deepspeed_ext.interop.upstream.UpstreamCheckpoint`), for the export to
Megatron-DeepSpeed's layout. One process; every tensor whole (expert versions resolved
through the expert index, tensor-parallel splits re-assembled, checksums verified).
"""

from typing import Any, List, Mapping, Optional

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.interop.upstream import UpstreamCheckpoint
from deepspeed_ext.interop.upstream_model import (AdamSettings, UpstreamModel,
                                                  scheduler_in_samples)
from deepspeed_ext.store.reader import CheckpointReader, find_loadable

MOMENTS = ("exp_avg", "exp_avg_sq")


def read_moc(save_dir: str, tag: Optional[str], ep_size: Optional[int],
             dp_size: Optional[int]) -> UpstreamCheckpoint:
    """The checkpoint ``tag`` of ``save_dir`` (default: the newest that verifies) as an
    upstream run of ``dp_size`` data-parallel ranks and expert-parallel size ``ep_size``
    (defaults: the saving layout's) would hold it.

    Raises:
        CheckpointError: no checkpoint, a damaged one, or one whose arguments do not
            describe a model upstream has (named).
    """
    if tag is None:
        tag, _ = find_loadable(save_dir, checksums=True)
        if tag is None:
            raise CheckpointError(f"no complete MoC checkpoint in {save_dir}")
    with CheckpointReader(save_dir, tag) as reader:
        objects = reader.objects() or {}
        client = objects.get("client_state") or {}
        args = client.get("args")
        if not isinstance(args, Mapping):
            raise CheckpointError(f"{save_dir}/{tag}: its objects record no trainer arguments "
                                  f"(saved by enable_moc_checkpointing outside this trainer?); "
                                  f"the model's shape is unknown")
        layout = reader.manifest.layout
        samples = int(client.get("consumed_train_samples", 0))
        try:
            model = UpstreamModel.from_moc_args(
                args, ep_size or int(layout.get("ep_size", 1)),
                dp_size or int(layout.get("world_size", reader.manifest.world_size)))
            scheduler = scheduler_in_samples(client.get("opt_param_scheduler") or {},
                                             model.global_batch_size, samples * model.seq_length)
        except ValueError as err:
            raise CheckpointError(f"{save_dir}/{tag}: {err}") from None
        ckpt = UpstreamCheckpoint(
            tag=f"global_step{int(client.get('iteration', reader.step))}", model=model,
            iteration=int(client.get("iteration", reader.step)), global_samples=samples,
            weights={}, scheduler=scheduler,
            rng_states=list(objects.get("rng_states") or client.get("rng_states") or []),
            source_weights="moc", l2_weight_decay=bool(args.get("l2_weight_decay", False)),
            adam=AdamSettings.from_values(args))
        for name in reader.tensor_names("fp32"):
            ckpt.weights[name] = reader.read_full(name, "fp32").float()
            if all(kind in reader.kinds(name) for kind in MOMENTS):
                for kind in MOMENTS:
                    ckpt.moments[(name, kind)] = reader.read_full(name, kind).float()
        ckpt.group_steps = _steps(objects) if ckpt.moments else []
    if ckpt.moments and len(ckpt.moments) != 2 * len(ckpt.weights):
        raise CheckpointError(f"{save_dir}/{tag}: Adam's moments are saved for some tensors "
                              f"only; export it with --weights-only")
    return ckpt


def _steps(objects: Mapping[str, Any]) -> List[float]:
    """Adam's step per upstream optimizer group (MoC's trainer has the same four)."""
    scalars = objects.get("optimizer_scalars") or []
    steps = [float(s["step"]) for s in scalars if isinstance(s, Mapping) and "step" in s]
    if not steps:
        return [0.0] * 4
    return (steps + [steps[-1]] * 4)[:4]
