"""The pretraining loop: set up DeepSpeed, the model, data and schedule; train; evaluate; save.

Every rank runs :func:`pretrain` with the same arguments. Call order on each rank:
``validate_args`` (no collectives) -> process group -> tokenizer and datasets ->
model and ``deepspeed.initialize`` -> ``load_checkpoint`` -> the loop, where each
iteration runs ``gradient_accumulation_steps`` forward/backward passes, one
optimizer step, and one small all-reduce of the losses.
"""

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.engine.rng import set_rng_state, set_seed
from megatron.errors import ConfigError
from megatron.training import checkpointing
from megatron.training.arguments import (moc_config_from_args, model_config_from_args,
                                         padded_vocab_size, validate_args)
from megatron.training.ds_config import build_ds_config
from megatron.training.megatron_compat import ignored_flag_notes
from megatron.training.log import (MetricsWriter, eval_log_line, is_nan_iteration,
                                   print_rank_0, show_model_lines, throughput, timestamp,
                                   training_log_line)
from megatron.training.tb_tags import (Position, interval_scalars, training_scalars,
                                       validation_scalars)
from megatron.training.wandb_log import open_wandb


@dataclass
class StepStats:
    """What one training iteration produced on this rank."""

    lm_loss: float
    """LM loss averaged over the data-parallel ranks and micro batches."""
    moe_aux_loss: float
    """Load-balancing loss, averaged like ``lm_loss`` (before ``--moe-loss-coeff``)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    skipped: bool
    """The optimizer skipped the step (fp16 overflow)."""
    expert_counts: torch.Tensor
    """Token-to-expert assignments of this rank's micro batches, int64 ``[moe_layers, experts]``,
    on the engine's device."""
    loss_scale: Optional[float] = None
    """The optimizer's loss scale after the step; None where it has none (see
    :func:`optimizer_loss_scale`)."""


@dataclass
class TrainResult:
    """What :func:`pretrain` returns (for tests and wrappers)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    losses: List[float] = field(default_factory=list)
    """LM loss of every iteration this process ran."""
    valid_losses: List[float] = field(default_factory=list)


def remove_deepspeed_shm_buffers() -> None:
    """Every rank, after training ended normally: DeepSpeed's CPU communication op maps a
    shared-memory all-reduce buffer per rank (``/dev/shm/deepspeed_allreduce_buffer_<uid>_
    <addr>_<port>_<rank>``, 66 MiB each) and never unlinks it, so every CPU run left
    them in /dev/shm. Once every rank is past its last collective, each unlinks its own
    (the mappings stay valid until the processes exit). Called by pretrain_gpt_moe.py
    and the benchmarks' workers. Since :mod:`megatron.training.jit_ops` keeps that op
    from loading, no buffer exists after :func:`initialize_distributed`; this stays for
    processes that started DeepSpeed otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return
    from deepspeed_ext.runtime.groups import metadata_group
    dist.barrier(group=metadata_group())  # orders host work only
    unlink_deepspeed_shm_buffer()


def unlink_deepspeed_shm_buffer() -> None:
    """This rank's part of :func:`remove_deepspeed_shm_buffers`, without the barrier: for a
    rank about to exit because of a hang, when a collective would never return."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_"
            f"{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_"
            f"{dist.get_rank()}")
    try:
        os.remove(name)
    except OSError:
        pass


def initialize_distributed(args: argparse.Namespace) -> None:
    """Create the process group through DeepSpeed's accelerator (NCCL on CUDA, gloo on CPU).

    A plain ``python pretrain_gpt_moe.py`` run gets single-rank defaults.

    Raises:
        ConfigError: ``--fp16``/``--bf16`` this rank's device cannot run, before the
            rendezvous (:func:`megatron.training.precision.check_precision`).
    """
    import deepspeed
    from datetime import timedelta
    from deepspeed.accelerator import get_accelerator
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ["LOCAL_RANK"]))
    # Before the rendezvous, on this rank's device (CUDA answers for the current one):
    # DeepSpeed's engine refused an unsupported --fp16/--bf16 only after the data and
    # model were built, with a ValueError traceback on every rank.
    from megatron.training.precision import check_precision
    check_precision(args, accel)
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    # Before init_distributed, which JIT-built DeepSpeed's unused CPU shared-memory op in
    # every rank: a rank killed in that build left a lock file every later start waited
    # on forever. No unused op is built; a dead build's lock is removed or reported.
    from megatron.training import jit_ops
    jit_ops.prepare_start()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _init_from_agent_store(accel.communication_backend_name(), timeout)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), timeout=timeout)
    # Every rank, here: the gloo group of MoC's collectives on CPU tensors and objects
    # (deepspeed_ext.runtime.groups), before any of them runs.
    from deepspeed_ext.runtime.groups import init_metadata_group
    init_metadata_group(timeout)
    show_model_lines(dist.get_rank())
    if getattr(args, "tensor_model_parallel_size", 1) > 1:
        # megatron-core's tensor- and data-parallel groups (consecutive ranks share the
        # layers: megatron/training/parallel_layout.py), before the model is built. With
        # a pipeline, its stages too: megatron-core's order (stage outermost) is that of
        # DeepSpeed's pipeline topology, so both name the same data-parallel groups.
        from megatron.data._compat import quiet_core_import
        with quiet_core_import():
            from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
            distributed_timeout_minutes=args.distributed_timeout_minutes)


def _init_from_agent_store(backend: str, timeout) -> None:
    """Under torchrun's elastic agent, create the process group on the agent's store with
    a prefix per restart. The agent keeps one store for the whole job, and without the
    prefix a restarted rank read its peers' addresses of the failed attempt and could not
    connect ("Gloo connectFullMesh failed ... Connection refused"); DeepSpeed's
    ``init_distributed`` then finds the group already made and keeps it."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"moc/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _set_threads(args: argparse.Namespace) -> None:
    # Several CPU ranks on one machine each defaulting to all cores oversubscribe it
    # many times over and run slower than one rank.
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        from deepspeed_ext.node_layout import ranks_per_node
        local = ranks_per_node(0, int(os.environ.get("WORLD_SIZE", "1") or 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))


def _set_determinism(args: argparse.Namespace) -> None:
    """``--deterministic`` (or ``--moc-mode exact`` on CUDA): deterministic kernels."""
    from megatron.training import determinism
    on_cuda = torch.cuda.is_available()
    if determinism.wanted(args.deterministic, getattr(args, "moc_mode", "pec"), on_cuda):
        done = determinism.apply(on_cuda)
        print_rank_0("> deterministic kernels" + ("" if args.deterministic else
                                                   " (implied by --moc-mode exact on CUDA)")
                     + ": " + "; ".join(done))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict]:
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
    place = _place(args)
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if stages > 1:
        from megatron.model.gpt_moe_pipe import build_pipe_model
        try:
            model = build_pipe_model(config, stages, place.ep_rank)
        except ValueError as err:  # a stage without experts: names the flags
            raise ConfigError(str(err)) from None
    else:
        model = GPTMoEModel(config, ep_rank=place.ep_rank)
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                  foreach=False)
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


def _batch_to_device(batch: Dict, device) -> Dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}


def optimizer_loss_scale(optimizer) -> Optional[float]:
    """The DeepSpeed optimizer's current loss scale, or None where it has none.

    Megatron-DeepSpeed logs ``optimizer.cur_scale`` when the attribute exists: ZeRO 1/2's
    optimizer has it (1.0 without fp16); DeepSpeed's fp16 optimizer of ZeRO stage 0 names
    it ``loss_scale`` (None without grad scaling); a plain torch optimizer (fp32, stage 0)
    has neither, and then the log line leaves the field out, as upstream's does.
    """
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if torch.is_tensor(value) and value.numel() == 1:
            return float(value.item())
    return None


def train_step(engine, data_iterator: Iterator, args: argparse.Namespace) -> StepStats:
    """One optimizer step over ``gradient_accumulation_steps`` micro batches (all ranks).

    Losses and gate counts stay on the device until the one all-reduce at the end: a
    ``.item()`` per micro batch would make a GPU wait for every micro batch.
    """
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        from megatron.training.pipeline import pipe_train_step
        lm, aux, counts = pipe_train_step(engine, data_iterator, args.num_experts)
        return _step_stats(engine, lm, aux, counts)
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    counts = None
    for _ in range(args.gradient_accumulation_steps):
        batch = _batch_to_device(next(data_iterator), engine.device)
        lm_loss, aux_loss, expert_counts = engine(batch["tokens"], batch["position_ids"],
                                                  batch["labels"], batch["loss_mask"])
        engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
        engine.step()
        sums += torch.stack((lm_loss.detach().double(), aux_loss.detach().double()))
        counts = expert_counts if counts is None else counts + expert_counts
    sums /= args.gradient_accumulation_steps * dist.get_world_size()
    dist.all_reduce(sums)  # on the device: NCCL cannot reduce CPU tensors
    # On NCCL the host waits here, for the all-reduce and the compute queued before it;
    # the monitor's clock counts only the all-reduce's stream time as collective time
    # (CUDA events), so a slow device still shows as this rank's own time.
    lm, aux = sums.tolist()
    return _step_stats(engine, lm, aux, counts)


def _step_stats(engine, lm: float, aux: float, counts: torch.Tensor) -> StepStats:
    """The step's record, with what the engine knows after its optimizer step."""
    grad_norm = engine.get_global_grad_norm()
    return StepStats(lm_loss=lm, moe_aux_loss=aux,
                     grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
                     skipped=bool(getattr(engine.optimizer, "overflow", False)),
                     expert_counts=counts, loss_scale=optimizer_loss_scale(engine.optimizer))


@torch.no_grad()
def evaluate(engine, data_iterator: Iterator, args: argparse.Namespace,
             on_step: Optional[Callable[[], None]] = None) -> float:
    """Mean LM loss over ``--eval-iters`` global batches of validation data (all ranks).

    Args:
        on_step: called after each micro batch (the monitor's progress touch).
    """
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        from megatron.training.pipeline import pipe_evaluate
        return pipe_evaluate(engine, data_iterator, args, on_step)
    engine.eval()
    total = torch.zeros(1, dtype=torch.float64, device=engine.device)
    steps = args.eval_iters * args.gradient_accumulation_steps
    for _ in range(steps):
        batch = _batch_to_device(next(data_iterator), engine.device)
        lm_loss, _, _ = engine(batch["tokens"], batch["position_ids"], batch["labels"],
                               batch["loss_mask"])
        total += lm_loss.detach().double()
        if on_step is not None:
            on_step()
    engine.train()
    total /= steps * dist.get_world_size()
    dist.all_reduce(total)
    return total.item()


def _layout(args: argparse.Namespace):
    """This job's tensor x data x expert layout (the same on every rank)."""
    from megatron.training.parallel_layout import build_layout
    return build_layout(dist.get_world_size() // getattr(args, "pipeline_model_parallel_size", 1),
                        getattr(args, "tensor_model_parallel_size", 1),
                        args.moe_expert_parallel_size,
                        bool(getattr(args, "enable_expert_tensor_parallelism", False)))


def _place(args: argparse.Namespace):
    """This rank's place in its pipeline stage's layout (the whole world without a
    pipeline): DeepSpeed's pipeline topology puts the stage outermost, so a stage is
    ``world / P`` consecutive ranks with the same layout each."""
    layout = _layout(args)
    return layout.place(dist.get_rank() % layout.world)


def _build_loaders(args: argparse.Namespace, datasets, state: checkpointing.ResumeState):
    """Train and valid iterators positioned after what ``state`` says was consumed."""
    from megatron.data import build_pretraining_data_loader
    train_ds, valid_ds, _ = datasets
    # The data-parallel rank reads its shard; the ranks of a tensor-parallel group read
    # the same one.
    place = _place(args)
    rank, world = place.dp_rank, args.data_parallel_size
    train = build_pretraining_data_loader(train_ds, state.consumed_train_samples,
                                          args.micro_batch_size, rank, world, args.num_workers)
    valid_consumed = (state.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    valid = (build_pretraining_data_loader(valid_ds, valid_consumed, args.micro_batch_size, rank,
                                           world, args.num_workers)
             if args.eval_iters > 0 and valid_ds is not None else None)
    train, valid = iter(train), (iter(valid) if valid is not None else None)
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:  # the engine pulls its batches
        from deepspeed.accelerator import get_accelerator
        from megatron.training.pipeline import pipe_batches
        device = get_accelerator().current_device_name()
        train = pipe_batches(train, device)
        valid = pipe_batches(valid, device) if valid is not None else None
    return train, valid


def pretrain(args: argparse.Namespace, extra_setup=None) -> TrainResult:
    """Train a GPT-MoE model as the arguments say; every rank calls it.

    Args:
        args: parsed (not yet validated) arguments.
        extra_setup: optional ``callable(engine, args)`` run after the engine exists
            and before any checkpoint is loaded (extensions patch the engine here).

    Raises:
        ConfigError: bad input, raised on every rank before training starts.
    """
    from megatron.training.stopping import DurationLimit
    limit = DurationLimit(getattr(args, "exit_duration_in_mins", None))  # counts start-up too
    validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    # Start-up and loading are watched like iterations (--moc-monitor): a phase that
    # never ends (a JIT build waiting on a dead builder's lock, a peer that never joins
    # the rendezvous, a stalled load) is reported by name instead of waiting forever.
    startup = _startup_watch(args)
    try:
        _set_threads(args)
        _set_determinism(args)  # before any CUDA work (cuBLAS reads its workspace setting once)
        startup.phase("process group")
        initialize_distributed(args)
        validate_args(args, dist.get_world_size())
        for note in ignored_flag_notes(args):  # Megatron-DeepSpeed switches with no effect here
            print_rank_0(f"> {note}")
        set_seed(args.seed)
        startup.phase("data")
        from megatron.data import build_tokenizer, build_train_valid_test_datasets
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                                   getattr(args, "tensor_model_parallel_size", 1))
        # Saved with the arguments: which rows hold tokens when a load meets another padding.
        args.true_vocab_size = tokenizer.vocab_size
        # Data before the model: a missing or unusable --data-path stops the job before
        # the (slow) engine set-up.
        datasets = build_train_valid_test_datasets(args, tokenizer)
        _print_banner(args)
        startup.phase("model and engine")
        engine, scheduler = setup_model_and_optimizer(args)
        # Training's draws (dropout masks, top-2 gate noise) start from the seed whatever
        # building the model drew: torch's nn.Linear initialisers draw, megatron-core's
        # tensor-parallel layers do not, and a T = 2 run gated differently from T = 1.
        set_seed(args.seed)
        injector = _fault_injector(args, engine)
        if args.moc_checkpoint:
            from deepspeed_ext import enable_moc_checkpointing
            armed = injector.persist_env() if injector is not None else {}
            os.environ.update(armed)  # the node keeper, started now, inherits it ...
            try:
                enable_moc_checkpointing(engine, moc_config_from_args(args))
            finally:
                for key in armed:  # ... but not this process, which persists in-process
                    os.environ.pop(key, None)  # when the keeper is gone
            if injector is not None and engine.moc.two_level is not None:
                engine.moc.two_level.fault_hook = injector.in_snapshot
            print_rank_0(f"> MoC checkpointing on: K = {args.moc_pec_k or args.num_experts} of "
                         f"{args.num_experts} experts per MoE layer per checkpoint, "
                         f"policy {args.moc_pec_policy}"
                         + (f", scope {args.moc_pec_scope}" if args.moc_pec_scope != "wo" else ""))
        exact = None
        if getattr(args, "moc_mode", "pec") == "exact":
            from deepspeed_ext.exact import ExactConfig, ExactSnapshots
            from deepspeed_ext.two_level import default_shm_dir
            exact = ExactSnapshots(engine, args.save,
                                   ExactConfig(window=args.moc_window,
                                               memory_dir=args.moc_shm_dir or default_shm_dir(args.save),
                                               ranks_per_node=args.moc_ranks_per_node,
                                               expected_mtbf_s=(args.moc_expected_mtbf
                                                                or args.moc_fault_mtbf or 0.0),
                                               host_memory_gb=args.moc_host_memory_gb),
                                   log=print_rank_0)
            engine.moc_exact = exact  # for the lose-memory fault
            if getattr(args, "moc_upstream_logging", False):
                from megatron.training.pipeline import attach_upstream_log
                engine.moc_upstream = attach_upstream_log(engine, args)
        stage_loss = _stage_loss(args, engine, exact, scheduler, datasets)
        if extra_setup is not None:
            extra_setup(engine, args)
        startup.phase("checkpoint load")
        state = checkpointing.ResumeState()
        checkpointing.record_attempt(engine, args)
        if args.load:
            state = checkpointing.load_checkpoint(engine, args, scheduler, exact=exact)
            if exact is not None and exact.replaying and getattr(engine, "moc_upstream", None):
                print_rank_0("[moc] upstream logs: none survived the restart (they live in the "
                             "training processes, which it replaced): every stage replays the "
                             "window (global exact replay)")
        startup.phase("data loaders")
        train_iter, valid_iter = _build_loaders(args, datasets, state)
        if state.rng_state is not None:
            set_rng_state(state.rng_state)
        from megatron.training.lr_schedule import uses_tokens
        if uses_tokens(args):  # a checkpoint without the token count: the samples tell it
            scheduler.step(0, token_num=state.consumed_train_samples * args.seq_length)
    finally:
        startup.stop()  # the loop's heartbeat takes over (or start-up failed)
    writer = MetricsWriter(args.metrics_file, args.tensorboard_dir,
                           queue_size=getattr(args, "tensorboard_queue_size", None),
                           wandb=open_wandb(args, dist.get_rank()))
    watch = _Watch(args)
    try:
        return _train_loop(args, engine, scheduler, state, train_iter, valid_iter, writer,
                           injector, watch, exact, limit, stage_loss)
    finally:
        watch.stop()
        writer.close()


def _startup_watch(args: argparse.Namespace):
    """Every rank, first thing in :func:`pretrain`: the ``--moc-monitor`` watch of its
    start-up phases (:class:`megatron.training.monitor.StartupWatch`); without the flag
    the phases are recorded and nobody checks them."""
    from megatron.training import jit_ops, monitor
    watching = getattr(args, "moc_monitor", False)
    cfg = monitor.MonitorConfig.from_args(args) if watching else monitor.MonitorConfig()
    emit = None
    if watching and args.moc_event_file:
        from megatron.training.events import EventLog
        emit = EventLog(args.moc_event_file).append
    watch = monitor.StartupWatch(int(os.environ.get("RANK", "0")), cfg, emit=emit,
                                 hint=jit_ops.lock_hint)
    return watch.start() if watching else watch


def _print_banner(args: argparse.Namespace) -> None:
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


def _progress_recorder(args: argparse.Namespace):
    """Rank 0's per-iteration progress record beside ``--moc-event-file`` (the next start
    reports the iterations a failure lost from it); None where there is none."""
    if not getattr(args, "moc_event_file", None) or dist.get_rank() != 0:
        return None
    import socket
    from megatron.training.events import Progress
    from megatron.training.recovery import progress_path
    recorder = Progress(progress_path(args.moc_event_file))
    run_id = f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
    return lambda iteration, loop: recorder.record(iteration, run_id, loop.record())


def _fault_injector(args: argparse.Namespace, engine):
    """Every rank: the ``--moc-fault``/``--moc-fault-mtbf`` injector, or None. Its record
    of fired faults lives beside the checkpoints, so restarts do not fire them again."""
    if not (getattr(args, "moc_fault", None) or getattr(args, "moc_fault_mtbf", None)):
        return None
    from megatron.training.events import EventLog
    from megatron.training.faults import FaultInjector, faults_from_args
    lose_memory = None
    if getattr(args, "moc_two_level", False):
        lose_memory = lambda: engine.moc.two_level.drop_node_memory()  # noqa: E731
    elif getattr(args, "moc_mode", "pec") == "exact":
        lose_memory = lambda: engine.moc_exact.drop_node_memory()  # noqa: E731
    emit = EventLog(args.moc_event_file).append if args.moc_event_file else None
    rank, world = dist.get_rank(), dist.get_world_size()
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(getattr(args, "moc_ranks_per_node", 0), world)
    node = rank // per_node
    def slow_compute(seconds: float) -> None:
        engine.module.register_forward_pre_hook(lambda *_: time.sleep(seconds))

    return FaultInjector(faults_from_args(args, world), rank, world,
                         os.path.join(args.save, "moc-faults.json"),
                         mtbf_s=args.moc_fault_mtbf, seed=args.moc_fault_seed,
                         lose_memory=lose_memory, emit=emit,
                         node_ranks=range(node * per_node, min(world, (node + 1) * per_node)),
                         slow_compute=slow_compute)


class _Watch:
    """``--moc-monitor``: this rank's heartbeat and hang/straggler watchdog (every rank
    creates one before the loop; a no-op without the flag)."""

    def __init__(self, args: argparse.Namespace):
        self.heartbeat = self.watchdog = self.clock = None
        self._last_top = None
        if not getattr(args, "moc_monitor", False):
            return
        from megatron.training import monitor
        from megatron.training.events import EventLog
        cfg = monitor.MonitorConfig.from_args(args)
        store = monitor.default_store()
        emit = EventLog(args.moc_event_file).append if args.moc_event_file else None
        self.heartbeat = monitor.Heartbeat(store, dist.get_rank(), cfg.straggler_window)
        self.watchdog = monitor.Watchdog(store, dist.get_rank(), dist.get_world_size(), cfg,
                                         emit=emit, on_hang=self._on_hang)
        self.watchdog.start()
        self.clock = monitor.CollectiveClock().install()

    def _on_hang(self, event) -> None:
        # os._exit skips the normal end: free DeepSpeed's /dev/shm buffer first (no
        # barrier: the other ranks may be the ones that hang).
        unlink_deepspeed_shm_buffer()
        self.watchdog.stop_job(event)

    def beat(self, iteration: int) -> None:
        """Top of each iteration: its number, the last iteration's wall time and the part
        of it this rank spent outside collectives (what tells a straggler apart)."""
        if self.heartbeat is None:
            return
        # take() first: it waits for the device to pass the last iteration's collectives
        # (CUDA), so that wait belongs to the iteration that queued them, not the next.
        comm_s, calls = self.clock.take()
        top = time.perf_counter()
        iter_s = top - self._last_top if self._last_top else None
        self.heartbeat.beat(iteration, iter_s=iter_s,
                            own_s=max(0.0, iter_s - comm_s) if iter_s is not None else None,
                            comm_s=comm_s if iter_s is not None else None,
                            collectives=calls if iter_s is not None else None)
        self._last_top = top

    def ready(self, iteration: int) -> None:
        """Before the loop: a beat of the iteration it resumes from (see Heartbeat.ready)."""
        if self.heartbeat is not None:
            self.heartbeat.ready(iteration)

    def touch(self) -> None:
        """Progress inside an iteration: after each evaluation step, before a save."""
        if self.heartbeat is not None:
            self.heartbeat.touch()

    def stop(self) -> None:
        """After the loop, before the final save (a long save must not look like a hang)."""
        if self.heartbeat is not None:
            self.heartbeat.finish()
            self.watchdog.stop()
            self.clock.uninstall()
            self.heartbeat = None


_FAULT_FLAGS = ("--moc-fault", "--moc-fault-mtbf", "--moc-fault-seed")


@functools.lru_cache(maxsize=1)  # every frame records it; argv does not change
def _replay_command() -> Tuple[str, ...]:
    """This run's command line without its fault injection: what ``moc-ckpt densify``
    re-runs to replay a window of frames offline (a fault would fire there again)."""
    argv, out, skip = sys.argv[1:], [os.path.abspath(sys.argv[0])], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in _FAULT_FLAGS:
            skip = "=" not in arg
            continue
        if skip and not arg.startswith("--"):
            continue  # a value of the fault flag (--moc-fault takes several)
        skip = False
        out.append(arg)
    return tuple(out)


def _exact_client_state(state, scheduler) -> Dict:
    """What an exact-recovery frame needs from the trainer to resume at its iteration,
    and the command that can replay it (``moc-ckpt densify``)."""
    return {"iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "opt_param_scheduler": scheduler.state_dict(),
            "command": list(_replay_command()), "cwd": os.getcwd()}


def _size_upstream_log(engine, args, exact) -> None:
    """Every rank, after each frame: once the exact-mode window is known (or changes),
    the upstream log keeps two of them and its budget is checked."""
    log = getattr(engine, "moc_upstream", None)
    schedule = exact.schedule
    if log is None or schedule is None or getattr(engine, "moc_upstream_window", None) == schedule.window:
        return
    from megatron.training.pipeline import check_upstream_log
    check_upstream_log(log, args, schedule.window)
    engine.moc_upstream_window = schedule.window


def _stage_loss(args, engine, exact, scheduler, datasets):
    """Every rank: the ``lose-stage`` faults' in-process recovery
    (:mod:`megatron.training.stage_loss`), or None."""
    from megatron.training.faults import faults_from_args
    specs = [s for s in faults_from_args(args, dist.get_world_size()) if s.kind == "lose-stage"]
    if not specs or exact is None:
        return None
    from megatron.training.stage_loss import StageLoss
    stage_size = dist.get_world_size() // args.pipeline_model_parallel_size

    def batches_from(consumed: int):
        resume = checkpointing.ResumeState(iteration=consumed // args.global_batch_size,
                                           consumed_train_samples=consumed)
        return _build_loaders(args, datasets, resume)[0]

    return StageLoss(engine, exact, specs, lambda rank: rank // stage_size, batches_from,
                     scheduler, args, print_rank_0)


def _train_loop(args, engine, scheduler, state, train_iter, valid_iter, writer,
                injector=None, watch=None, exact=None, limit=None,
                stage_loss=None) -> TrainResult:
    from megatron.training.stopping import DurationLimit, train_tokens_reached
    limit = limit or DurationLimit(None)
    result = TrainResult(iteration=state.iteration, consumed_train_samples=state.consumed_train_samples)
    world_size = dist.get_world_size()
    window: List[StepStats] = []
    window_start = time.perf_counter()
    paused = 0.0  # evaluation and save time inside the window: not iteration time (Megatron)
    skipped_total = nan_total = 0  # since this process started (Megatron: per interval)
    last_saved = state.iteration if args.load else -1
    save_interval = args.save_interval
    if getattr(args, "moc_two_level", False) and args.moc_snapshot_interval:
        save_interval = args.moc_snapshot_interval
    print_rank_0(f"[{timestamp()}] training from iteration {state.iteration} to {args.train_iters}"
                 + (f" or {args.train_tokens} tokens" if getattr(args, "train_tokens", None)
                    else "")
                 + ("" if args.save else " (no --save: no checkpoints will be written)"))
    if state.recovery is not None:
        writer.write("moc", state.iteration, state.recovery.metrics())
    progress = _progress_recorder(args)
    watch = watch or _Watch(args)
    watch.ready(state.iteration)
    if injector is not None:
        injector.training_starts()
    from megatron.training.recovery import LoopTime, record_start, report_ettr
    record_start(args, state.iteration)
    loop_time = LoopTime()  # after the start event: the ETTR's measured iteration time
    if exact is not None:
        try:
            exact.start(state.iteration, _exact_client_state(state, scheduler))
            _size_upstream_log(engine, args, exact)  # a fixed --moc-window: before training
        except (MemoryError, ConfigError) as e:  # the same on every rank: the figures are all-reduced
            exact.close()  # bad input, not a failure: no keeper and memory left behind
            raise ConfigError(str(e)) from None
    while (state.iteration < args.train_iters
           and not train_tokens_reached(args, state.consumed_train_samples)):
        if injector is not None:
            injector.before_iteration(state.iteration + 1)
        if stage_loss is not None:
            stage_loss.before_iteration(state.iteration + 1)
        watch.beat(state.iteration + 1)
        top = time.perf_counter()
        loop_time.top(top)
        stats = train_step(engine, train_iter, args)
        # The tokens consumed once this iteration counts (a token schedule's position).
        scheduler.step(1, token_num=(state.consumed_train_samples + args.global_batch_size)
                       * args.seq_length)
        moc = getattr(engine, "moc", None)
        if moc is not None and stats.expert_counts.numel():
            counts = stats.expert_counts.clone()
            dist.all_reduce(counts)  # the policy state must be identical on every rank
            # (the host waits at tolist(); the clock times the all-reduce on the stream).
            # The T ranks of a tensor-parallel group route the same tokens: each token
            # was counted T times, which would inflate the lost-token figures' totals.
            counts //= getattr(args, "tensor_model_parallel_size", 1)
            moc.observe_tokens(counts.tolist())
            if exact is not None:
                exact.observe_tokens(counts.tolist())
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        if exact is not None:  # replaying: the next frame's weights, before any evaluation
            exact.after_step(state.iteration)
        if progress is not None:
            progress(state.iteration, loop_time)
        skipped_total += int(stats.skipped)
        nan_total += int(is_nan_iteration(stats.skipped, stats.lm_loss, stats.moe_aux_loss))
        window.append(stats)
        result.losses.append(stats.lm_loss)
        last = (state.iteration == args.train_iters
                or train_tokens_reached(args, state.consumed_train_samples))
        record = {
            "consumed_samples": state.consumed_train_samples, "lm_loss": stats.lm_loss,
            "moe_aux_loss": stats.moe_aux_loss, "grad_norm": stats.grad_norm,
            "lr": scheduler.optimizer.param_groups[0]["lr"], "skipped": int(stats.skipped)}
        if getattr(args, "log_batch_size_to_tensorboard", False):
            record["batch_size"] = args.global_batch_size
        if getattr(args, "log_timers_to_tensorboard", False):
            record["iteration_time_ms"] = 1000.0 * (time.perf_counter() - top)
        at = Position(state.iteration, state.consumed_train_samples,
                      state.consumed_train_samples * args.seq_length)
        losses = {"lm loss": stats.lm_loss, "moe aux loss": stats.moe_aux_loss}
        writer.write("train", state.iteration, record, scalars=training_scalars(
            at, losses, record["lr"], stats.grad_norm, args.global_batch_size, args.seq_length,
            loss_scale=stats.loss_scale, fp16=args.fp16,
            log_batch_size=getattr(args, "log_batch_size_to_tensorboard", False)))
        if state.iteration % args.log_interval == 0 or last:
            elapsed = time.perf_counter() - window_start - paused
            rates = throughput(len(window), elapsed, args.global_batch_size, args.seq_length,
                               world_size)
            print_rank_0(training_log_line(state.iteration, args.train_iters, {
                "consumed_samples": state.consumed_train_samples, "consumed_tokens": at.tokens,
                "elapsed_ms": 1000.0 * elapsed / len(window),
                "tokens_per_s": rates["tokens_per_s"],
                "lr": scheduler.optimizer.param_groups[0]["lr"],
                "global_batch_size": args.global_batch_size,
                "lm_loss": sum(s.lm_loss for s in window) / len(window),
                "moe_aux_loss": sum(s.moe_aux_loss for s in window) / len(window),
                "loss_scale": stats.loss_scale, "grad_norm": window[-1].grad_norm,
                "seq_length": args.seq_length, "skipped": skipped_total, "nan": nan_total,
                "samples_per_s": rates["samples_per_s"], "tgs": rates["tgs"]}))
            writer.add_scalars(interval_scalars(
                at, losses, elapsed / len(window), rates, world_size,
                log_timers=getattr(args, "log_timers_to_tensorboard", False)))
            window, window_start, paused = [], time.perf_counter(), 0.0
        if valid_iter is not None and state.iteration % args.eval_interval == 0:
            began = time.perf_counter()
            watch.touch()
            loss = evaluate(engine, valid_iter, args, on_step=watch.touch)
            result.valid_losses.append(loss)
            print_rank_0(eval_log_line(f"validation loss at iteration {state.iteration}", loss))
            valid_record = {"lm_loss": loss}
            log_ppl = getattr(args, "log_validation_ppl_to_tensorboard", False)
            ppl = math.exp(min(20.0, loss))  # as the log line's PPL
            if log_ppl:
                valid_record["ppl"] = ppl
            writer.write("valid", state.iteration, valid_record, scalars=validation_scalars(
                Position(state.iteration, state.consumed_train_samples,
                         state.consumed_train_samples * args.seq_length), loss, ppl, log_ppl))
            paused += time.perf_counter() - began
        if exact is not None:
            try:
                exact.snapshot(state.iteration, _exact_client_state(state, scheduler))
                _size_upstream_log(engine, args, exact)
            except (MemoryError, ConfigError) as e:  # over a budget, on every rank
                exact.close()
                raise ConfigError(str(e)) from None
        # While an exact replay runs, the frozen operators' fp32 state is not whole yet.
        replaying = exact is not None and exact.replaying
        if args.save and save_interval and state.iteration % save_interval == 0 and not replaying:
            # Snapshots every iteration would print a line each: log them with the
            # training lines, and the last one.
            quiet = (save_interval != args.save_interval
                     and state.iteration % args.log_interval != 0
                     and not last
                     and not (args.exit_interval and state.iteration % args.exit_interval == 0))
            began = time.perf_counter()
            watch.touch()
            checkpointing.save_checkpoint(engine, args, scheduler, state, log=not quiet)
            last_saved = state.iteration
            paused += time.perf_counter() - began
        if limit.expired():  # one all-reduce per iteration, with the flag only
            print_rank_0(f"> exiting at iteration {state.iteration} after "
                         f"{limit.elapsed_minutes():.2f} minutes (--exit-duration-in-mins "
                         f"{args.exit_duration_in_mins:g})")
            break
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            print_rank_0(f"> exiting at iteration {state.iteration} (--exit-interval {args.exit_interval})")
            break
    loop_time.stop(time.perf_counter())
    watch.stop()
    if getattr(engine, "moc_upstream", None) is not None:
        from megatron.training.pipeline import report_upstream_log
        print_rank_0(report_upstream_log(engine.moc_upstream, args))
    if exact is not None:
        exact.close()
        if exact.replaying:
            print_rank_0(f"WARNING: stopped at iteration {state.iteration} inside an exact "
                         f"replay: no final checkpoint (the frames still hold the window)")
            last_saved = state.iteration
    if args.save and last_saved != state.iteration:
        checkpointing.save_checkpoint(engine, args, scheduler, state)
    if getattr(engine, "moc", None) is not None:
        # The last save is committed (or its failure raised) and, with two-level
        # checkpointing, the node's keeper stopped and its shared memory freed.
        engine.moc.shutdown()
    ettr = report_ettr(args, state.iteration, loop_time)
    if ettr is not None:
        writer.write("moc", state.iteration, {"ettr": ettr["ettr"]})
    done = ("done" if state.iteration >= args.train_iters
            or train_tokens_reached(args, state.consumed_train_samples) else "stopped")
    print_rank_0(f"[{timestamp()}] training {done} at iteration {state.iteration} "
                 f"({state.consumed_train_samples} samples)")
    result.iteration, result.consumed_train_samples = state.iteration, state.consumed_train_samples
    return result
