"""The ``--moc-*`` flags of MoC checkpointing (partial experts, two-level snapshots, exact
recovery, redundancy in the peers' memory) and their checks.

The checks run on every rank in :func:`megatron.training.arguments.validate_args`, in the
order that function lists, before any collective: a setting the checkpoint library would
refuse later on one rank (a layout its redundancy cannot cover, a keeper socket path too
long to bind) stops every rank here instead, with :class:`~megatron.errors.ConfigError`
naming the flag. The fault-injection and monitor flags (``--moc-fault*``,
``--moc-monitor*``) are defined by :mod:`megatron.training.faults` and
:mod:`megatron.training.monitor`; :func:`check_fault_flags` checks them against these.
"""

import argparse
import math
from typing import Optional

from deepspeed_ext.keeper.paths import SocketPathTooLong, check_keeper_socket_path
from megatron.errors import ConfigError
from megatron.training.args.checks import MAX_TIMEOUT_S, check_at_least, check_float


def add_moc_args(p: argparse.ArgumentParser) -> None:
    """The ``MoC checkpointing`` group."""
    g = p.add_argument_group("MoC checkpointing")
    for add in (_add_pec_flags, _add_exact_flags, _add_memory_flags, _add_redundancy_flags,
                _add_run_flags):
        add(g)


def _add_pec_flags(g) -> None:
    g.add_argument("--moc-checkpoint", action="store_true",
                   help="Save and load through MoC (deepspeed_ext) instead of DeepSpeed's own path.")
    g.add_argument("--moc-pec-k", type=int, default=0,
                   help="Experts saved per MoE layer per checkpoint; 0: all.")
    g.add_argument("--moc-pec-policy", default="sequential", choices=["sequential", "load-aware"],
                   help="Which experts a partial checkpoint saves: sequential rotates through "
                        "each MoE layer's experts (staggered across layers and expert-parallel "
                        "ranks); load-aware takes, per layer, those with the most tokens routed "
                        "to them since their last save.")
    g.add_argument("--moc-pec-scope", default="wo", choices=["wo", "w", "o"],
                   help="What a partial checkpoint leaves out of the experts it does not "
                        "select (the MoC paper's variants): wo both weights and optimizer "
                        "state, w the weights only (every expert's optimizer state is saved), "
                        "o the optimizer state only (every expert's weights are saved).")
    g.add_argument("--moc-keep", type=int, default=0,
                   help="Complete checkpoints to keep (still-referenced expert versions are "
                        "never deleted); 0: all.")
    g.add_argument("--moc-two-level", action="store_true",
                   help="Two-level checkpointing: each save is an asynchronous snapshot into a "
                        "per-node keeper's shared memory; every --moc-persist-interval-th "
                        "snapshot is persisted to --save in the background; --load recovers "
                        "from memory first.")


def _add_exact_flags(g) -> None:
    g.add_argument("--moc-mode", default="pec", choices=["pec", "exact"],
                   help="pec: checkpoints as the other --moc-* flags say; exact: also a "
                        "sparse frame every iteration (one group of operators with fp32 "
                        "weights and optimizer state, the later groups' compute weights), "
                        "and recovery replays the newest complete window to the exact state "
                        "(no lost tokens). Needs --moc-checkpoint and --save.")
    g.add_argument("--moc-window", type=int, default=0,
                   help="Exact mode: iterations per window of frames; 0: the smallest window "
                        "whose frame copy hides behind an iteration, measured at the start.")
    g.add_argument("--moc-upstream-logging", action="store_true",
                   help="Exact mode with --pipeline-model-parallel-size > 1: each stage keeps "
                        "in host memory what it sends to its neighbours (activations forward, "
                        "input gradients back) for two windows, MoEtion's upstream logs.")
    g.add_argument("--moc-upstream-log-gb", type=float, default=1.0,
                   help="Host memory a stage's upstream log may take (GB, per rank), checked "
                        "before training; 0: unchecked.")
    g.add_argument("--moc-expected-mtbf", type=float, default=0.0,
                   help="Exact mode: expected seconds between failures; the automatic window "
                        "then weighs a frame's cost against the replay each failure costs "
                        "(default: --moc-fault-mtbf when given, else unknown).")


def _add_memory_flags(g) -> None:
    g.add_argument("--moc-k-snapshot", type=int, default=0,
                   help="Experts per MoE layer in each in-memory snapshot; 0: all.")
    g.add_argument("--moc-k-persist", type=int, default=None,
                   help="Experts per MoE layer persisted to storage (default: --moc-pec-k, "
                        "which it replaces; at most --moc-k-snapshot).")
    g.add_argument("--moc-snapshot-interval", type=int, default=0,
                   help="Iterations between snapshots with --moc-two-level; 0: --save-interval.")
    g.add_argument("--moc-persist-interval", type=int, default=1,
                   help="Persist every N-th snapshot to storage.")
    g.add_argument("--moc-ranks-per-node", type=int, default=0,
                   help="Ranks per node for the keepers; 0: the launcher's (LOCAL_WORLD_SIZE, LOCAL_SIZE "
                        "or SLURM_NTASKS_PER_NODE). "
                        "Smaller values simulate several nodes on one machine.")


def _add_redundancy_flags(g) -> None:
    g.add_argument("--moc-redundancy", default="none", choices=("none", "replicate", "erasure"),
                   help="With --moc-two-level: keep the snapshots also in other nodes' memory, "
                        "so a lost node recovers from its peers instead of storage: copies "
                        "(replicate) or XOR parity across groups of nodes (erasure).")
    g.add_argument("--moc-replicas", type=int, default=1,
                   help="--moc-redundancy replicate: peer nodes holding a copy of each "
                        "node's snapshots (that many lost nodes are covered).")
    g.add_argument("--moc-ec-data", type=int, default=2,
                   help="--moc-redundancy erasure: data nodes per group; each group of "
                        "--moc-ec-data + 1 nodes survives one lost node, holding "
                        "1/--moc-ec-data of a snapshot extra per rank.")
    g.add_argument("--moc-ec-parity", type=int, default=1,
                   help="--moc-redundancy erasure: parity pieces per group; only 1 (XOR).")
    g.add_argument("--moc-redundancy-interval", type=int, default=1,
                   help="Protect every N-th snapshot in the peers' memory (the traffic and "
                        "its CPU cost divided by N; a lost node resumes at most N-1 "
                        "snapshots further back).")


def _add_run_flags(g) -> None:
    g.add_argument("--moc-shm-dir", default=None,
                   help="Shared-memory directory of the job: one node<N>/ per node with its "
                        "keeper's socket and, by mode, the ranks' snapshot slots and the peers' "
                        "copies (--moc-two-level) or the frames of the recent windows (--moc-mode "
                        "exact); default: derived from --save under /dev/shm (stable across "
                        "restarts of one job).")
    g.add_argument("--moc-host-memory-gb", type=float, default=0.0,
                   help="Host memory one rank's snapshot slots (--moc-two-level) or a window of "
                        "frames (--moc-mode exact) may use; 0: unchecked.")
    g.add_argument("--moc-checksum-threads", type=int, default=0,
                   help="--moc-two-level: threads hashing each snapshot's image after its copy, "
                        "off the optimizer step's path; 0: up to 4, half the host's cores.")
    g.add_argument("--moc-dynamic-k", action="store_true",
                   help="After each recovery, double the experts per checkpoint (up to all) "
                        "while the accumulated proportion of lost tokens exceeds "
                        "--moc-plt-threshold (the MoC paper's dynamic K).")
    g.add_argument("--moc-plt-threshold", type=float, default=0.0375,
                   help="Accumulated PLT above which --moc-dynamic-k doubles K; in (0, 1).")
    g.add_argument("--moc-event-file", default=None,
                   help="JSON-lines file of failures, detections and recoveries (PLT, K, "
                        "iterations lost); default: <save>/moc-events.jsonl for a local --save.")
    g.add_argument("--moc-commit-timeout", type=float, default=600.0,
                   help="Seconds a checkpoint may take to be written and committed before "
                        "the save counts as failed (every rank's file durable, the "
                        "manifest written).")
    g.add_argument("--moc-restart-count", type=int, default=None,
                   help="Which attempt of the job this is (0: the first), for the event file "
                        "and ETTR; default: TORCHELASTIC_RESTART_COUNT or MOC_RESTART_COUNT "
                        "from the environment (scripts/launch_cluster.sh passes this flag).")
    g.add_argument("--moc-sync-save", action="store_true",
                   help="Wait until each checkpoint is written and committed; by default a "
                        "save returns once the state is in host memory and is written in "
                        "the background.")


# (flag's dest, smallest value, what the smallest value means)
MOC_COUNTS = (("moc_pec_k", 0, " (0: all experts)"),
              ("moc_k_persist", 0, " (0: all experts)"),
              ("moc_k_snapshot", 0, " (0: all experts)"),
              ("moc_keep", 0, " (0: keep all)"),
              ("moc_window", 0, " (0: automatic)"),
              ("moc_snapshot_interval", 0, " (0: --save-interval)"),
              ("moc_persist_interval", 1, ""),
              ("moc_ranks_per_node", 0, " (0: the launcher's count)"),
              ("moc_redundancy_interval", 1, ""),
              ("moc_restart_count", 0, ""),
              ("moc_checksum_threads", 0, " (0: automatic)"))
"""The ``--moc-*`` counts and their least values."""


def check_moc_numbers(args: argparse.Namespace) -> None:
    """Durations, sizes and counts of the ``--moc-*`` flags that make no sense (negative,
    NaN, infinite): refused here, instead of a traceback, a hang or an infinite wait later."""
    check_float("--moc-commit-timeout", args.moc_commit_timeout, "seconds",
                maximum=MAX_TIMEOUT_S)
    check_float("--moc-expected-mtbf", args.moc_expected_mtbf, "seconds", zero_ok=True,
                note=" (0: unknown)")
    check_float("--moc-host-memory-gb", args.moc_host_memory_gb, "GB", zero_ok=True,
                note=" (0: unchecked)")
    check_float("--moc-upstream-log-gb", getattr(args, "moc_upstream_log_gb", 0.0), "GB",
                zero_ok=True, note=" (0: unchecked)")
    # Defined by the fault-injection and monitor groups (getattr: a parser without them).
    for name in ("moc_fault_mtbf", "moc_hang_timeout", "moc_monitor_poll"):
        check_float(f"--{name.replace('_', '-')}", getattr(args, name, None), "seconds",
                    maximum=MAX_TIMEOUT_S)
    for name, least, meaning in MOC_COUNTS:
        check_at_least(args, name, least, meaning)


def check_moc(args: argparse.Namespace, world_size: int) -> None:
    """The ``--moc-*`` flags against each other, the model and the storage: the modes'
    needs, redundancy against the node layout, storage URLs, dynamic K."""
    if args.moc_pec_k > args.num_experts:
        raise ConfigError(f"--moc-pec-k ({args.moc_pec_k}) exceeds --num-experts ({args.num_experts})")
    if args.moc_two_level and not args.moc_checkpoint:
        raise ConfigError("--moc-two-level needs --moc-checkpoint")
    _check_exact_mode(args)
    check_redundancy(args, world_size)
    if args.moc_pec_scope != "wo" and args.moc_two_level:
        raise ConfigError(f"--moc-pec-scope {args.moc_pec_scope} is not supported with "
                          "--moc-two-level (use wo)")
    check_storage_urls(args)
    if args.moc_dynamic_k and not args.moc_checkpoint:
        raise ConfigError("--moc-dynamic-k needs --moc-checkpoint")
    if not 0.0 < args.moc_plt_threshold < 1.0:
        raise ConfigError(f"--moc-plt-threshold must be in (0, 1), got {args.moc_plt_threshold}")


def _check_exact_mode(args: argparse.Namespace) -> None:
    """``--moc-mode exact`` writes frames to a local ``--save``; upstream logging replays
    a pipeline stage's window from them."""
    if args.moc_mode == "exact":
        if not (args.moc_checkpoint and args.save):
            raise ConfigError("--moc-mode exact needs --moc-checkpoint and --save (its frames "
                              "go to <save>/exact)")
        if args.moc_two_level:
            raise ConfigError("--moc-mode exact does not combine with --moc-two-level yet")
        from deepspeed_ext.format import fs
        if fs.is_url(args.save):
            raise ConfigError(f"--moc-mode exact: --save {args.save} must be a local path")
    if getattr(args, "moc_upstream_logging", False) and (
            args.moc_mode != "exact" or getattr(args, "pipeline_model_parallel_size", 1) < 2):
        raise ConfigError("--moc-upstream-logging needs --moc-mode exact (a stage replays its "
                          "window from the logs) and --pipeline-model-parallel-size > 1")


def check_redundancy(args: argparse.Namespace, world_size: int) -> None:
    """``--moc-redundancy`` and its counts against the node layout (every rank)."""
    from deepspeed_ext.policy import redundancy as rd
    try:
        spec = rd.RedundancySpec(args.moc_redundancy, args.moc_replicas, args.moc_ec_data,
                                 args.moc_ec_parity)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.moc_redundancy_interval < 1:
        raise ConfigError(f"--moc-redundancy-interval must be >= 1, got "
                          f"{args.moc_redundancy_interval}")
    if not spec.enabled:
        return
    if not args.moc_two_level:
        raise ConfigError(f"--moc-redundancy {spec.mode} protects two-level snapshots: add "
                          "--moc-two-level")
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(args.moc_ranks_per_node, world_size)
    try:
        rd.check_layout(spec, rd.Topology(world_size, per_node))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_storage_urls(args: argparse.Namespace) -> None:
    """``--save``/``--load`` may be fsspec URLs (``s3://...``) with --moc-checkpoint only,
    and the URL's filesystem package must be importable: fail here, not at the first save
    hours into the run."""
    from deepspeed_ext.format import fs
    for flag in ("save", "load"):
        value = getattr(args, flag)
        if not value or not fs.is_url(value):
            continue
        if not args.moc_checkpoint:
            raise ConfigError(f"--{flag} {value}: storage URLs need --moc-checkpoint (DeepSpeed's "
                              f"own checkpoints are written to local paths only)")
        try:
            fs.check_location(value)
        except ValueError as err:
            raise ConfigError(f"--{flag}: {err}") from None


def fill_event_file(args: argparse.Namespace) -> None:
    """``--moc-event-file`` defaults to ``<save>/moc-events.jsonl`` with --moc-checkpoint
    (a local --save only)."""
    if args.moc_event_file is None:
        from megatron.training.events import default_event_file
        args.moc_event_file = default_event_file(args.save) if args.moc_checkpoint else None


def check_fault_flags(args: argparse.Namespace, world_size: int) -> None:
    """Fault injection and hang/straggler detection: bad values stop the job here."""
    from megatron.training.faults import faults_from_args
    from megatron.training.monitor import MonitorConfig
    specs = faults_from_args(args, world_size)
    for spec in specs:  # FaultSpec refuses slow <= 0 and NaN; an endless sleep is no fault
        if not math.isfinite(spec.slow_s) or spec.slow_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--moc-fault {spec.text}: slow must be a finite number of "
                              f"seconds > 0, at most {MAX_TIMEOUT_S:g}, got {spec.slow_s:g}")
    kinds = {spec.kind for spec in specs}
    from megatron.training.stage_loss import check_stage_loss
    check_stage_loss(args, specs)
    # Checked here, on every rank: the injector finds out only on the fault's own rank,
    # after the process group exists (the others then hang), or never fires them.
    two_level = getattr(args, "moc_two_level", False)
    exact = getattr(args, "moc_mode", "pec") == "exact"
    for kind in ("lose-memory", "lose-node"):
        if kind in kinds and not (two_level or exact):
            raise ConfigError(f"--moc-fault {kind} needs in-memory snapshots (--moc-two-level, "
                              "or --moc-mode exact's frames): there is nothing to lose")
    if "lose-node" in kinds and getattr(args, "moc_restart", "relaunch") != "in-job":
        raise ConfigError("--moc-fault lose-node needs --moc-restart in-job: it kills its "
                          "process group, which only MoC's supervisor launch confines to a node")
    for kind in ("snapshot-crash", "persist-crash"):
        if kind in kinds and not two_level:
            raise ConfigError(f"--moc-fault {kind} needs --moc-two-level: without it there is "
                              f"no snapshot (or keeper persist) for the fault to fire in")
    if (args.moc_fault or args.moc_fault_mtbf is not None) and \
            (not args.save or "://" in args.save):
        raise ConfigError("--moc-fault/--moc-fault-mtbf need a local --save: the record of "
                          "fired faults lives there, so a restarted job does not fire them again")
    if args.moc_monitor:
        MonitorConfig.from_args(args)


def effective_shm_dir(args: argparse.Namespace) -> Optional[str]:
    """The shared-memory directory the job uses: ``--moc-shm-dir``, else derived from
    ``--save`` (two-level snapshots or exact mode's frames); None when it uses none."""
    if args.moc_two_level:
        source = args.save or args.load
    elif args.moc_mode == "exact":
        source = args.save
    else:
        return None
    if args.moc_shm_dir:
        return args.moc_shm_dir
    if not source:
        return None
    from deepspeed_ext.two_level import default_shm_dir
    return default_shm_dir(source)


def nodes_max_index(args: argparse.Namespace, world_size: int) -> int:
    """The largest node index of the job, computed as the keepers place ranks."""
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(args.moc_ranks_per_node, world_size)
    return (max(world_size, 1) - 1) // max(per_node, 1)


def check_shm_dir(args: argparse.Namespace, world_size: int) -> None:
    """Two-level snapshots have a directory to live in, and the job's shared-memory
    directory leaves room for the socket of its last node's keeper (a path too long fails
    only inside that keeper's bind, and the ranks would wait for it in vain)."""
    if args.moc_two_level and not (args.save or args.load or args.moc_shm_dir):
        raise ConfigError("--moc-two-level needs --save (or --moc-shm-dir) to name its memory")
    shm_dir = effective_shm_dir(args)
    if shm_dir:
        try:
            check_keeper_socket_path(shm_dir, nodes_max_index(args, world_size),
                                     "--moc-shm-dir" if args.moc_shm_dir else
                                     "--moc-shm-dir (default, derived from --save)")
        except SocketPathTooLong as err:
            raise ConfigError(str(err)) from None


def check_moc_with_model(args: argparse.Namespace) -> None:
    """The snapshot's and the persist's experts per layer against the model's, and the
    ZeRO stage the fp32 master weights of half precision need."""
    if args.moc_k_snapshot > args.num_experts:
        raise ConfigError(f"--moc-k-snapshot ({args.moc_k_snapshot}) exceeds --num-experts "
                          f"({args.num_experts})")
    k_persist = args.moc_k_persist if args.moc_k_persist is not None else args.moc_pec_k
    if k_persist > args.num_experts:
        raise ConfigError(f"--moc-k-persist ({k_persist}) exceeds --num-experts "
                          f"({args.num_experts})")
    if args.moc_k_snapshot and k_persist > args.moc_k_snapshot:
        raise ConfigError(f"--moc-k-persist ({k_persist}) must not exceed --moc-k-snapshot "
                          f"({args.moc_k_snapshot})")
    if args.moc_checkpoint and args.zero_stage == 0 and (args.bf16 or args.fp16):
        raise ConfigError("--moc-checkpoint with --bf16/--fp16 needs --zero-stage 1 or 2 "
                          "(the fp32 master weights live in ZeRO's partitions)"
                          + (f"; --deepspeed_config {args.deepspeed_config} has ZeRO stage 0 "
                             "with " + ("fp16" if args.fp16 else "bf16") + ": set "
                             "zero_optimization.stage to 1 or 2 there"
                             if args.deepspeed_config else ""))
