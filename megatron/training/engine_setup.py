"""The model, its optimizer and the DeepSpeed engine, and where this rank sits in the
job's tensor x data x expert layout.

Every rank calls :func:`setup_model_and_optimizer` once per run, after the process group
exists and the data is built (:func:`megatron.training.training.pretrain`), and
:func:`release_engine` when the run ends, finished or failed.
"""

import argparse
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.training.arguments import model_config_from_args
from megatron.training.ds_config import build_ds_config
from megatron.training.log import print_rank_0


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict]:
    """Decay and no-decay groups (biases and norms), split further into MoE groups for ZeRO."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.dim() == 1 else decay).append(param)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def setup_model_and_optimizer(args: argparse.Namespace):
    """Build the model, AdamW, the DeepSpeed engine and the LR schedule (all ranks)."""
    import deepspeed
    from megatron.lazy_compile import DEEPSPEED_COMPILING_MODULES, import_deferring_compile
    from megatron.training.lr_schedule import build_scheduler  # megatron.core's, first
    import_deferring_compile(*DEEPSPEED_COMPILING_MODULES)
    from megatron.model.gpt_moe import GPTMoEModel
    config = model_config_from_args(args)
    place = rank_place(args)
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if stages > 1:
        from megatron.model.gpt_moe_pipe import build_pipe_model
        try:
            model = build_pipe_model(config, stages, place.ep_rank)
        except ValueError as err:  # a stage without experts: names the flags
            raise ConfigError(str(err)) from None
    else:
        model = GPTMoEModel(config, ep_rank=place.ep_rank)
    # A checkpoint imported from Megatron-DeepSpeed's CPU run continues exactly only
    # with its optimizer's weight decay (torch.optim.Adam's L2, not AdamW's decoupled).
    adam = torch.optim.Adam if getattr(args, "l2_weight_decay", False) else torch.optim.AdamW
    optimizer = adam(param_groups(model, args.weight_decay), lr=args.lr,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, foreach=False)
    mpu = None  # a pipeline's groups come from its module's grid
    if config.tensor_model_parallel_size > 1 and stages == 1:
        from megatron.training.mpu import CoreMPU
        mpu = CoreMPU()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=build_ds_config(args), mpu=mpu)
    _check_expert_layout(model, args, place.ep_rank)
    from megatron.training.moe_schedule_setup import setup_moe_schedules
    setup_moe_schedules(model, args, print_rank_0)
    scheduler = build_scheduler(engine.optimizer, args)
    return engine, scheduler


def release_engine(engine) -> None:
    """This rank, when its run ends (finished or failed; no collective): break the
    reference cycles the engine cannot leave by itself, so that the next ``gc.collect``
    frees it with the model and the process groups its parameters name.

    ZeRO's gradient hooks sit on autograd's C++ accumulator nodes and hold the optimizer,
    a cycle Python's collector cannot see: without ``engine.destroy()`` (which removes
    them) a failed run's engine, and the gloo connections of every group its parameters
    hold, lived on in the process. A peer blocked in a collective with this rank then
    never saw the connection close and never left the failed round (4 training ranks,
    one SIGKILLed: rank 3 waited out the group's timeout in ZeRO's gradient all-reduce).
    """
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        try:
            destroy()
        except Exception as e:  # noqa: BLE001  (a half-built engine: nothing more to free)
            print_rank_0(f"> releasing the engine: {type(e).__name__}: {e}")
    unlink_parameter_groups(getattr(engine, "module", None))
    drop_pipeline_buffers(engine)


def drop_pipeline_buffers(engine) -> int:
    """A pipeline engine's activations in flight, let go of (no collective); returns how
    many buffers were dropped. DeepSpeed hooks each output's backward with a closure that
    holds the engine; the output, kept in ``engine.pipe_buffers`` until its gradient comes
    back, sits in autograd's graph, so the cycle is one the collector cannot see. A stage
    whose run failed between a forward and its backward (stage 0 when stage 1 died) kept
    its engine, and every group of the run, alive: its peer in stage 1 waited out the
    group's timeout in the next round's set-up."""
    buffers = getattr(engine, "pipe_buffers", None)
    if not isinstance(buffers, dict):
        return 0
    dropped = 0
    for values in buffers.values():
        for i, value in enumerate(values):
            for tensor in (value if isinstance(value, (tuple, list)) else (value,)):
                hooks = getattr(tensor, "_backward_hooks", None) if torch.is_tensor(tensor) else None
                if hooks:
                    hooks.clear()
            if value is not None:
                values[i] = None
                dropped += 1
    return dropped


PARAMETER_LINKS = ("_dp_group", "_hp_mapping")
"""What DeepSpeed's ZeRO pins on each model parameter: its data-parallel process group and
its fp32 fragment (``deepspeed.utils.mixed_precision_linkage``)."""


def unlink_parameter_groups(module) -> int:
    """Drop :data:`PARAMETER_LINKS` from every parameter of ``module``; returns how many
    were dropped. A parameter a closure still holds after ``destroy()`` then no longer
    keeps the run's data-parallel group, and its gloo connections, alive: seeded trials
    found a failed run's 4-rank group held through two parameters' ``_dp_group`` (and a
    closure), and a peer stayed blocked in its ZeRO gradient all-reduce."""
    dropped = 0
    for param in (module.parameters() if module is not None else ()):
        for name in PARAMETER_LINKS:
            if getattr(param, name, None) is not None:
                setattr(param, name, None)
                dropped += 1
    return dropped


def _check_expert_layout(model, args, ep_rank: int) -> None:
    """The global expert indices the model assumed must be the ones DeepSpeed assigned."""
    if args.num_experts <= 1:
        return
    from deepspeed.utils import groups
    name = f"ep_size_{args.moe_expert_parallel_size}"
    actual = groups._get_expert_parallel_rank(name)
    if actual != ep_rank:
        raise RuntimeError(f"expert-parallel rank {actual} != assumed {ep_rank}: "
                           "DeepSpeed's expert group layout changed")


def job_layout(args: argparse.Namespace):
    """This job's tensor x data x expert layout (the same on every rank)."""
    from megatron.training.parallel_layout import build_layout
    return build_layout(dist.get_world_size() // getattr(args, "pipeline_model_parallel_size", 1),
                        getattr(args, "tensor_model_parallel_size", 1),
                        args.moe_expert_parallel_size,
                        bool(getattr(args, "enable_expert_tensor_parallelism", False)))


def rank_place(args: argparse.Namespace):
    """This rank's place in its pipeline stage's layout (the whole world without a
    pipeline): DeepSpeed's pipeline topology puts the stage outermost, so a stage is
    ``world / P`` consecutive ranks with the same layout each."""
    layout = job_layout(args)
    return layout.place(dist.get_rank() % layout.world)


def print_banner(args: argparse.Namespace) -> None:
    from megatron.model.gpt_moe import count_parameters
    counts = count_parameters(model_config_from_args(args))
    print_rank_0(f"> building GPT-MoE model: {args.num_layers} layers, hidden {args.hidden_size}, "
                 f"{args.num_experts} experts every {args.expert_interval} layers, top-{args.topk}; "
                 f"parameters: {counts['total']:,} ({counts['expert']:,} in experts)")
    tp = getattr(args, "tensor_model_parallel_size", 1)
    print_rank_0(f"> world size {dist.get_world_size()}, expert-parallel {args.moe_expert_parallel_size}, "
                 + (f"tensor-parallel {tp} (data-parallel {args.data_parallel_size}), " if tp > 1 else "")
                 + f"ZeRO stage {args.zero_stage}, micro batch {args.micro_batch_size}, global batch "
                 f"{args.global_batch_size} ({args.gradient_accumulation_steps} accumulation steps), "
                 f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}")
