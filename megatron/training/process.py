"""The training process's distributed set-up and its undoing: the process group and the
groups built on it, the CPU threads, deterministic kernels, DeepSpeed's shared-memory
buffer.

Every rank calls, in this order: :func:`set_threads`, :func:`set_determinism` (before any
CUDA work), :func:`initialize_distributed`; at the end :func:`remove_deepspeed_shm_buffers`
after its last collective and :func:`close_process_groups`, after which
:func:`initialize_distributed` may run again in the same process (a second run, or the
next round of an in-job restart). After a failed run on NCCL, :func:`abort_communicators`
(any thread) comes before :func:`close_process_groups`.
"""

import argparse
import os
import threading

import torch
import torch.distributed as dist

from megatron.training.log import print_rank_0, show_model_lines


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
    from deepspeed_ext.runtime import rounds
    if os.environ.get(rounds.STORE_ENV):  # --moc-restart in-job, under MoC's supervisor
        _init_on_round_store(accel.communication_backend_name(), timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
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
        from megatron.data.compat import quiet_core_import
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


def _init_on_round_store(backend: str, timeout) -> None:
    """Under MoC's supervisor (``--moc-restart in-job``): the process group of this
    process's round on the supervisor's store, under the round's own prefix. The store
    lives in the supervisor, so it outlives any training process; a round's prefix keeps
    its rendezvous apart from the earlier rounds' (whose members may be dead)."""
    from deepspeed_ext.runtime import rounds
    host, port = rounds.store_address(os.environ[rounds.STORE_ENV])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    number = int(os.environ.get(rounds.ROUND_ENV, "0"))
    if number:  # a recovery round: all of it must get there before its group forms
        mine = rounds.RoundAssignment.from_json(store.get(rounds.round_key(number)))
        rounds.await_round(store, mine, timeout.total_seconds())
    prefix = rounds.group_prefix(number)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def set_threads(args: argparse.Namespace) -> None:
    # Several CPU ranks on one machine each defaulting to all cores oversubscribe it
    # many times over and run slower than one rank.
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        from deepspeed_ext.node_layout import ranks_per_node
        local = ranks_per_node(0, int(os.environ.get("WORLD_SIZE", "1") or 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))


def set_determinism(args: argparse.Namespace) -> None:
    """``--deterministic`` (or ``--moc-mode exact`` on CUDA): deterministic kernels."""
    from megatron.training import determinism
    on_cuda = torch.cuda.is_available()
    if determinism.wanted(args.deterministic, getattr(args, "moc_mode", "pec"), on_cuda):
        done = determinism.apply(on_cuda)
        print_rank_0("> deterministic kernels" + ("" if args.deterministic else
                                                   " (implied by --moc-mode exact on CUDA)")
                     + ": " + "; ".join(done))


ABORT_LOCK = threading.Lock()
"""Held while the communicators are aborted or the groups closed: the round watcher's
thread and the main thread may both get there after a failure."""
_aborted = False
"""Whether :func:`abort_communicators` ended this process's world since the last
:func:`close_process_groups`."""


def nccl_in_use() -> bool:
    """Whether this process's default group runs its CUDA collectives on NCCL."""
    return (dist.is_available() and dist.is_initialized() and dist.is_nccl_available()
            and "nccl" in str(dist.get_backend()))


def abort_communicators() -> bool:
    """Any thread of a training process, once its run has failed (a peer died): on NCCL,
    abort every communicator of every group (``ncclCommAbort``) and drop torch's record of
    them; returns whether it did. No-op (False) on gloo, or when nothing is left to abort.

    A destroy would wait for the failed collectives, and a kernel waiting for a dead
    peer inside a node never errs: the main thread would stay blocked until the group's
    timeout. After the abort that kernel ends, the main thread's next collective raises,
    and :func:`close_process_groups` drops what DeepSpeed and megatron-core keep.
    (gloo cannot be aborted from another thread in torch 2.13: a gloo peer's death
    closes its connections instead, and a hang is the monitor's.)
    """
    global _aborted
    with ABORT_LOCK:
        if not nccl_in_use():
            return False
        # torch's own experimental call: every group's communicators in one NCCL group
        # call (aborted one by one they can deadlock each other), its tables cleared
        dist.distributed_c10d._abort_process_group()
        _aborted = True
        return True


def close_process_groups() -> None:
    """Every rank, after its last collective of the run: destroy every group the run made,
    so that :func:`initialize_distributed` can make them again in this process.

    In this order: megatron-core's model-parallel groups (with tensor parallelism), then
    the default group through DeepSpeed (``deepspeed.comm.destroy_process_group``, which
    also drops the expert, expert-data, all-to-all and world groups and the mpu that
    ``deepspeed.utils.groups`` caches), then MoC's metadata group. A second
    ``deepspeed.initialize`` that found the cached groups of a destroyed world reused
    them and failed in its first collective. After :func:`abort_communicators` torch's
    groups are gone already: only the references are dropped. No-op when no process
    group exists.
    """
    global _aborted
    with ABORT_LOCK:
        aborted, _aborted = _aborted, False
        if not aborted and not (dist.is_available() and dist.is_initialized()):
            return
        _forget_cached_groups()
        from deepspeed.comm import comm as ds_comm  # the module: the package's cdb is a copy
        if aborted:
            _release_deepspeed_groups()
        elif ds_comm.cdb is not None:
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
        from deepspeed_ext.runtime.groups import forget_metadata_group
        forget_metadata_group()


def _forget_cached_groups() -> None:
    """megatron-core's model-parallel groups and the pipeline's p2p groups."""
    import sys
    core = sys.modules.get("megatron.core.parallel_state")
    if core is not None and core.model_parallel_is_initialized():
        core.destroy_model_parallel()  # destroys only the groups torch still lists
    p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if p2p is not None:
        # The pipeline's send/recv groups and grid live in module globals: kept, they held
        # a failed run's connections open, and a stage-0 survivor waited in its recv from
        # stage 1 (which had left the round) for the whole group timeout.
        p2p._groups, p2p._grid, p2p._async = None, None, []


def _release_deepspeed_groups() -> None:
    """After an abort: what ``deepspeed.comm.destroy_process_group`` drops once torch's
    destroy succeeded (the expert, expert-data, all-to-all and world groups, the mpu),
    without that destroy, which would refuse a world torch no longer lists."""
    from deepspeed.utils import groups
    release = getattr(groups, "_release_process_group_references", None)
    if release is None:
        raise RuntimeError("this DeepSpeed cannot drop its process groups after an NCCL "
                           "abort (no deepspeed.utils.groups._release_process_group_"
                           "references): use DeepSpeed 0.19.8 or later for --moc-restart "
                           "in-job on NCCL")
    release(group=None)
