"""Baseline checkpoints through DeepSpeed's own ``save_checkpoint``/``load_checkpoint``.

Besides the engine's state a checkpoint carries, in ``client_state``, the iteration,
consumed samples, the LR scheduler, the RNG states of every rank and the arguments.
Rank 0 also writes ``megatron_meta.json`` beside DeepSpeed's files after every rank
has saved, so that ``--load`` can compare model settings before DeepSpeed tries to
load mismatching tensors (which fails deep inside with a shape error).

All ranks call :func:`save_checkpoint` and :func:`load_checkpoint` together.
"""

import argparse
import os
import time
import traceback
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state, set_rng_state
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.naming import ITERATION_FILE
from deepspeed_ext.format.storage import (SMALL_RECORD_MAX_BYTES, atomic_write_json,
                                          atomic_write_text, read_json)
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.outcomes import broadcast_outcome
from megatron.errors import ConfigError
from megatron.training.arguments import MODEL_SHAPE_ARGS
from megatron.training.log import print_rank_0
from megatron.training.vocab_check import vocab_refusal

META_FILE = "megatron_meta.json"
META_MAX_BYTES = 16 << 20
"""Largest ``megatron_meta.json`` read (the saved arguments: kilobytes)."""
LATEST_FILE = "latest"
LATEST_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest DeepSpeed ``latest`` read (one tag): one linked to /dev/zero was read forever."""
DEEPSPEED_MODEL_FILE = "mp_rank_00_model_states.pt"
"""The file every DeepSpeed-format checkpoint (ours, Megatron-DeepSpeed's) has in its tag."""
DEEPSPEED_FORMAT = "deepspeed"
"""``meta["format"]`` of :func:`newest_tag` when ``--moc-checkpoint`` resumes from a
DeepSpeed-format checkpoint (bringing a run over)."""


@dataclass
class ResumeState:
    """Where training resumes: 0/0 for a fresh start."""

    iteration: int = 0
    """Optimizer steps already taken."""
    consumed_train_samples: int = 0
    """Training samples already consumed (the data loader resumes after them)."""
    rng_state: Optional[Dict] = None
    """This rank's saved RNG state. Applied by the caller right before the first
    iteration: building data loaders draws from the global generator, so applying it
    any earlier would shift every later random draw."""
    recovery: Optional[object] = None
    """What loading a MoC checkpoint cost (:class:`megatron.training.recovery.RecoveryReport`)."""


def tag_for(iteration: int) -> str:
    """Megatron-DeepSpeed's checkpoint folder name."""
    return f"global_step{iteration}"


def args_to_dict(args: argparse.Namespace) -> Dict:
    """The JSON-serialisable part of the arguments."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (int, float, str, bool, list, type(None)))}


def checkpoint_args(args: argparse.Namespace, state: "ResumeState") -> argparse.Namespace:
    """The arguments a baseline checkpoint stores under ``args``: a Namespace, as
    Megatron-DeepSpeed stores them (its tools read attributes, e.g.
    ``checkpoint_args.tensor_model_parallel_size``; a dict raised AttributeError there),
    holding the JSON-serialisable arguments plus the fields those tools read that this
    trainer fixes (tensor/pipeline parallel size 1) or tracks elsewhere (consumed samples,
    iteration)."""
    saved = argparse.Namespace(**args_to_dict(args))
    for name, value in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                        ("consumed_valid_samples", 0)):
        if getattr(saved, name, None) is None:
            setattr(saved, name, value)
    saved.consumed_train_samples = state.consumed_train_samples
    saved.iteration = state.iteration
    return saved


def save_checkpoint(engine, args: argparse.Namespace, scheduler, state: ResumeState,
                    log: bool = True) -> str:
    """Save through ``engine.save_checkpoint``; all ranks call it. Returns the tag.

    Every rank contributes its RNG state (one ``all_gather_object``), DeepSpeed
    writes its files (not ``latest``), then, after a barrier, rank 0 writes
    ``megatron_meta.json`` and only then ``latest`` (atomically): DeepSpeed writes
    ``latest`` before its own last barrier, so a rank dying there left ``latest`` naming
    a checkpoint without its meta file, which stopped every restart with exit 2. With
    MoC the save runs no collective here: MoC keeps every rank's RNG state itself (a
    snapshot per iteration must not pay a gather for it). ``log`` False: no log line.
    The gather and the barrier are host collectives, on the metadata group
    (:mod:`deepspeed_ext.runtime.groups`, made by ``initialize_distributed``).
    """
    start = time.perf_counter()
    tag = tag_for(state.iteration)
    rng_states = None
    if getattr(engine, "moc", None) is None:
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, get_rng_state(), group=metadata_group())
    client_state = {"iteration": state.iteration,
                    "consumed_train_samples": state.consumed_train_samples,
                    "opt_param_scheduler": scheduler.state_dict(),
                    "rng_states": rng_states}
    moc = getattr(engine, "moc", None) is not None
    # MoC keeps the arguments as JSON (objects.json): a dict there, a Namespace in a
    # DeepSpeed checkpoint (what Megatron-DeepSpeed's tools read).
    client_state["args"] = args_to_dict(args) if moc else checkpoint_args(args, state)
    engine.save_checkpoint(args.save, tag=tag, client_state=client_state, save_latest=moc)
    if moc:
        # MoC's manifest already makes the save atomic and holds the arguments (in the
        # client state); an extra file would only be something for retention to trip on.
        how = ("in host memory; writing in the background" if engine.moc.config.async_save
               else "committed")
        if engine.moc.two_level is not None:
            how = "snapshot in the node keeper's memory"
        if log:
            print_rank_0(f"[{time.strftime('%H:%M:%S')}] saved checkpoint at iteration "
                         f"{state.iteration:7d} to {args.save}/{tag} in "
                         f"{time.perf_counter() - start:.3f} s ({how})")
        return tag
    dist.barrier(group=metadata_group())  # every rank's files written, before rank 0's meta

    def finish() -> None:
        atomic_write_json(os.path.join(args.save, tag, META_FILE), {
            "iteration": state.iteration, "consumed_train_samples": state.consumed_train_samples,
            "world_size": dist.get_world_size(), "args": args_to_dict(args)})
        atomic_write_text(os.path.join(args.save, LATEST_FILE), tag)  # the checkpoint is whole
        # Megatron-DeepSpeed's tools read it; only after `latest`, so it never runs ahead.
        atomic_write_text(os.path.join(args.save, ITERATION_FILE), str(state.iteration))
    broadcast_outcome(finish, f"saving {os.path.join(args.save, tag)}")  # rank 0's failure: all
    print_rank_0(f"[{time.strftime('%H:%M:%S')}] saved checkpoint at iteration {state.iteration:7d} "
                 f"to {args.save}/{tag} in {time.perf_counter() - start:.2f} s")
    return tag


def find_latest_tag(load_dir: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file names, or None when there is no checkpoint.

    Raises:
        ConfigError: naming the file, when it is not one directory name inside
            ``load_dir`` (:func:`_check_baseline_tag`), or is too large or not UTF-8.
    """
    latest = fs.join(load_dir, LATEST_FILE)
    try:
        tag = fs.read_text(latest, limit=LATEST_MAX_BYTES).strip()
    except (FileNotFoundError, IsADirectoryError):
        return None
    except (CheckpointError, UnicodeDecodeError) as e:
        raise ConfigError(f"--load: {latest}: {e}; it must name a checkpoint directory "
                          f"inside {load_dir}") from None
    if not tag:
        return None
    _check_baseline_tag(load_dir, latest, tag)
    return tag


def _check_baseline_tag(load_dir: str, latest: str, tag: str) -> None:
    """Refuse a ``latest`` that does not name a directory inside ``load_dir``.

    DeepSpeed joins the tag into a path and unpickles the files it finds there: an
    absolute path (``/elsewhere``), a ``..``, or a tag directory linked outside sent the
    load, and its pickles, out of ``--load``. A tag is one path component (no
    separator, not ``.``/``..``, no NUL) whose resolved path lies inside ``load_dir``.

    Raises:
        ConfigError: naming the file and what it holds.
    """
    bad = (tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag
           or (os.sep != "/" and os.sep in tag) or (os.altsep and os.altsep in tag))
    if not bad and not fs.is_url(load_dir):
        root = os.path.realpath(load_dir)
        bad = os.path.dirname(os.path.realpath(os.path.join(load_dir, tag))) != root
    if bad:
        raise ConfigError(f"--load: {latest} names {tag[:200]!r}, which is not a checkpoint "
                          f"directory inside {load_dir} (one directory name, not a path); "
                          f"refusing to load it: write the tag of a checkpoint in {load_dir} "
                          f"into {latest}")


def _moc_newest_tag(load_dir: str) -> Optional[str]:
    """Rank 0, MoC checkpoints: the tag ``latest`` names if it is complete, else the
    newest complete checkpoint (what MoC's own load would pick); None when there is none.

    Without the fallback, a ``latest`` lost or damaged (a crash between a first commit's
    manifest and ``latest``, a copy without it) started the run from scratch, and its
    first save then set every existing checkpoint aside as an abandoned timeline.
    """
    from deepspeed_ext.format import errors
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import catalog, latest
    try:
        tag = latest.read_latest(load_dir)
    except errors.CheckpointError as e:
        print_rank_0(f"WARNING: {e}; resuming from the newest complete checkpoint instead")
        tag = None
    if tag is not None and fs.isfile(os.path.join(load_dir, tag, mf.MANIFEST_FILE)):
        return tag
    complete = catalog.scan_checkpoints(load_dir).complete
    if complete:
        print_rank_0(f"WARNING: {fs.join(load_dir, LATEST_FILE)} "
                     f"{'names ' + repr(tag) + ', not a complete checkpoint' if tag else 'is missing'}; "
                     f"resuming from the newest complete checkpoint, {complete[-1][1]}")
        return complete[-1][1]
    return None


def newest_tag(engine, load_dir: Optional[str]) -> Tuple[Optional[str], Dict]:
    """Every rank: the tag ``latest`` names under ``load_dir`` and its saved arguments,
    as rank 0 read them (one broadcast).

    Called by :func:`load_checkpoint` on every rank, first thing, before any other
    collective of the load (public so that tests can check the choice of tag directly).

    Rank 0 alone reads them: ranks that read ``latest`` themselves could see different
    tags (a keeper of the previous attempt committing while the job restarts) and take
    different paths through the load's collectives, and a read error on one rank (an
    object store's transient failure) would leave the others waiting in the load's
    first collective. Rank 0's failure is raised on every rank.

    Returns:
        ``(tag, meta)``: None and ``{}`` when there is no checkpoint.

    Raises:
        ConfigError: on every rank, when the checkpoint's metadata is missing.
        RuntimeError: on every rank, when rank 0 could not read them.
    """
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            tag = None
            moc = getattr(engine, "moc", None) is not None
            if load_dir and fs.isdir(load_dir):
                tag = _moc_newest_tag(load_dir) if moc else find_latest_tag(load_dir)
            meta = saved_meta(engine, load_dir, tag) if tag is not None else {}
            if moc and tag is None and load_dir and fs.isdir(load_dir):
                tag, meta = _deepspeed_tag(load_dir)
            outcome = [("ok", tag, meta)]
        except ConfigError as e:
            outcome = [("config", str(e), None)]
        except Exception as e:
            traceback.print_exc()
            outcome = [("error", f"{type(e).__name__}: {e}", None)]
    dist.broadcast_object_list(outcome, src=0, group=metadata_group())
    kind, value, meta = outcome[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(f"--load {load_dir}: rank 0 could not read which checkpoint to "
                           f"resume from ({fs.join(load_dir, LATEST_FILE)}): {value}")
    return value, meta


def _deepspeed_tag(load_dir: str) -> Tuple[Optional[str], Dict]:
    """Rank 0, ``--moc-checkpoint`` finding no MoC checkpoint: the tag of a DeepSpeed-format
    checkpoint ``latest`` names (this trainer's, from a run without ``--moc-checkpoint``)
    and its meta, marked ``format: deepspeed``; ``(None, {})`` when there is none.

    Without it, a run brought over with ``--moc-checkpoint --load`` started from scratch.
    A checkpoint without ``megatron_meta.json`` (Megatron-DeepSpeed's own) never gets
    here with ``--moc-checkpoint``: :mod:`megatron.training.upstream_import` imports it
    into ``--save`` first and the load reads that.
    """
    tag = find_latest_tag(load_dir)
    if tag is None or not fs.isfile(os.path.join(load_dir, tag, DEEPSPEED_MODEL_FILE)):
        return None, {}
    meta = {}
    if fs.isfile(os.path.join(load_dir, tag, META_FILE)):
        meta = _baseline_meta(os.path.join(load_dir, tag))
    return tag, dict(meta, format=DEEPSPEED_FORMAT)


def check_compatible(meta: Dict, args: argparse.Namespace, path: str) -> None:
    """Stop with the first model setting that differs between a checkpoint and this run.

    Raises:
        ConfigError: naming the flag and both values.
    """
    saved = meta.get("args", {})
    for name in MODEL_SHAPE_ARGS:
        if name == "padded_vocab_size":
            continue  # vocab_refusal: the padding may differ, the vocabulary may not
        if name in saved and saved[name] != getattr(args, name, None):
            flag = name.replace("_", "-")
            raise ConfigError(f"checkpoint {path} was saved with --{flag} {saved[name]} but this "
                              f"run has --{flag} {getattr(args, name, None)}; use the same setting "
                              "or another --load directory")
    _warn_weight_decay(saved, args, path)
    moc = getattr(args, "moc_checkpoint", False) and meta.get("format") != DEEPSPEED_FORMAT
    refusal = vocab_refusal(saved, args, reshards=moc)
    if refusal:
        raise ConfigError(f"checkpoint {path} {refusal}")
    if moc:
        return  # MoC checkpoints load on any layout
    if saved.get("moe_expert_parallel_size", args.moe_expert_parallel_size) != args.moe_expert_parallel_size \
            or meta.get("world_size", dist.get_world_size()) != dist.get_world_size():
        raise ConfigError(
            f"checkpoint {path} was saved on {meta.get('world_size')} ranks with "
            f"--moe-expert-parallel-size {saved.get('moe_expert_parallel_size')}; DeepSpeed's "
            f"checkpoints only load on the same layout (this run: {dist.get_world_size()} ranks, "
            f"--moe-expert-parallel-size {args.moe_expert_parallel_size})")


def _warn_weight_decay(saved: Dict, args: argparse.Namespace, path: str) -> None:
    """One line when the checkpoint's Adam applied weight decay otherwise than this run's
    will (an import of Megatron-DeepSpeed's CPU run: L2), which changes every update."""
    if "l2_weight_decay" not in saved:
        return
    then, now = bool(saved["l2_weight_decay"]), bool(getattr(args, "l2_weight_decay", False))
    if then != now:
        kind = {True: "L2 weight decay (torch.optim.Adam)", False: "decoupled weight decay (AdamW)"}
        print_rank_0(f"WARNING: checkpoint {path} was trained with {kind[then]}, this run "
                     f"uses {kind[now]}; {'add' if then else 'leave out'} --l2-weight-decay "
                     f"to continue it as it was trained")


def saved_meta(engine, load_dir: str, tag: str) -> Dict:
    """The saved arguments (and world size) of checkpoint ``tag``, read without its tensors.

    Called by rank 0 alone, inside :func:`newest_tag` (which broadcasts the result), and
    by tests. No collective.
    """
    path = os.path.join(load_dir, tag)
    if getattr(engine, "moc", None) is not None:
        from deepspeed_ext.format.objects import OBJECTS_FILE
        from deepspeed_ext.format.storage import FileRecord, verify_file
        from deepspeed_ext.store.reader import CheckpointReader
        try:
            with CheckpointReader(load_dir, tag, verify_checksums=False) as reader:
                # The arguments live in objects.json (its tensors, possibly in rank 0's
                # whole file, are not hashed for this): damage there must not stop the
                # run with a made-up "was saved with --flag" instead of falling back.
                entry = reader.manifest.files.get(OBJECTS_FILE)
                if entry is not None:
                    verify_file(os.path.join(path, OBJECTS_FILE), FileRecord(entry.nbytes, entry.sha256))
                objects = reader.objects() or {}
                world = reader.manifest.world_size
        except Exception as e:  # a broken newest checkpoint: MoC's load falls back past it
            print_rank_0(f"WARNING: cannot read the arguments of {path}: {e}")
            return {}
        return {"args": objects.get("client_state", {}).get("args", {}), "world_size": world}
    return _baseline_meta(path)


def _baseline_meta(path: str) -> Dict:
    """Rank 0: ``megatron_meta.json`` of the DeepSpeed-format checkpoint at ``path``."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ConfigError(f"--load: {meta_path} is missing: {path} is not a complete checkpoint "
                          "of this trainer (was it saved with --moc-checkpoint?)")
    try:
        meta = read_json(meta_path, META_MAX_BYTES)
    except (CheckpointError, OSError) as e:  # too large, not JSON, nested too deeply
        raise ConfigError(f"--load: {e} (a damaged checkpoint: load another)") from None
    # check_compatible reads these fields: another shape raised a stray AttributeError.
    if not isinstance(meta, dict) or not isinstance(meta.get("args", {}), dict):
        raise ConfigError(f"--load: {meta_path}: not this trainer's metadata (expected an "
                          f"object with an \"args\" object)")
    return meta


def check_exact_client_state(client) -> None:
    """Raise unless a frame's ``client_state`` holds what :func:`_exact_resume` uses (a
    crafted or damaged frame raised KeyError on one rank after its replay began).

    Passed by :func:`_exact_resume` (every rank) to ``exact.recover`` as its
    ``check_client_state``, which calls it on each frame's client state before the replay;
    tests call it directly. No collective.

    Raises:
        ValueError: naming the missing or malformed field.
    """
    if not isinstance(client, dict):
        raise ValueError(f"the frame's client_state is {type(client).__name__}, not an object")
    for key in ("iteration", "consumed_train_samples"):
        if type(client.get(key)) is not int or client[key] < 0:
            raise ValueError(f"the frame's client_state {key} is {client.get(key)!r}, not a "
                             f"non-negative int")
    if not isinstance(client.get("opt_param_scheduler"), dict):
        raise ValueError("the frame's client_state has no opt_param_scheduler state")


def _exact_resume(engine, args, scheduler, exact, tag: Optional[str]) -> Optional[ResumeState]:
    """``--moc-mode exact``: resume at the newest complete window of frames if it ends
    after checkpoint ``tag`` (every rank); None: load the checkpoint instead."""
    newer_than = None
    if tag is not None and tag.startswith("global_step") and tag[len("global_step"):].isdigit():
        newer_than = int(tag[len("global_step"):])
    start = time.perf_counter()
    objects = exact.recover(args.load, newer_than, check_client_state=check_exact_client_state)
    if objects is None and exact.failed_window is not None and tag is None:
        # Starting from scratch would also drop the frames at the loop's start: the
        # next attempt (storage back, memory freed) may well replay them.
        from deepspeed_ext.checkpointer import MoCCheckpointError
        raise MoCCheckpointError(
            f"--load {args.load}: exact recovery cannot replay the newest {exact.failed_window}, "
            f"and the directory holds no checkpoint to fall back to; the frames are left as "
            f"they are (move {os.path.join(args.load, 'exact')} away to start from scratch)")
    if objects is None:
        if exact.failed_window is not None:
            print_rank_0(f"> exact recovery failed ({exact.failed_window}); loading checkpoint "
                         f"{tag} instead")
        return None
    client = objects["client_state"]
    scheduler.load_state_dict(client["opt_param_scheduler"])
    state = ResumeState(iteration=int(client["iteration"]),
                        consumed_train_samples=int(client["consumed_train_samples"]),
                        rng_state=None if args.no_load_rng else objects["rng"])
    moc = engine.moc
    moc.mark_exact_replay(exact.last_source)
    from megatron.training.recovery import account_recovery
    state.recovery = account_recovery(engine, args, state.iteration, time.perf_counter() - start)
    return state


def record_attempt(engine, args: argparse.Namespace) -> None:
    """Every rank, before :func:`load_checkpoint` (rank 0 writes): record this attempt's
    start in ``--save`` (:data:`deepspeed_ext.store.latest.ATTEMPT_FILE`), so that a committer
    of an earlier attempt finishing late neither moves ``latest`` under this attempt's
    load nor runs a retention that could delete the checkpoint it resumes from.

    A failure is a warning: the record only guards against that race, and a ``--save``
    that cannot be written fails the first save with its own error.
    """
    moc = getattr(engine, "moc", None)
    if moc is None or not args.save or dist.get_rank() != 0:
        return
    from deepspeed_ext.store.latest import ATTEMPT_FILE, record_attempt as write_record
    try:
        write_record(args.save, moc.attempt_started)
    except Exception as e:
        print_rank_0(f"WARNING: cannot write {os.path.join(args.save, ATTEMPT_FILE)} "
                     f"({type(e).__name__}: {e}); a late commit of an earlier attempt may "
                     f"still move latest")


def load_checkpoint(engine, args: argparse.Namespace, scheduler, exact=None) -> ResumeState:
    """Resume from the newest checkpoint under ``--load``; all ranks call it.

    An empty or missing directory starts from scratch with a log line. With ``exact``
    (:class:`deepspeed_ext.exact.ExactSnapshots`) a newer complete window of frames
    wins over the checkpoint: training resumes at its start and replays it. With
    ``--moc-checkpoint`` and no MoC checkpoint under ``--load``, a DeepSpeed-format one
    (a run's without ``--moc-checkpoint``) is loaded through DeepSpeed's own load
    (:func:`_deepspeed_tag`); the next save writes a MoC checkpoint holding every expert.

    Raises:
        ConfigError: the checkpoint's model settings differ from this run's, or its
            metadata is missing.
    """
    load_dir = args.load
    tag, meta = newest_tag(engine, load_dir)
    if exact is not None:
        resumed = _exact_resume(engine, args, scheduler, exact, tag)
        if resumed is not None:
            return resumed
    two_level = getattr(args, "moc_two_level", False)
    if tag is None and not two_level:  # two-level: the keepers' memory may hold snapshots
        print_rank_0(f"> no checkpoint found at --load {load_dir}: starting from scratch")
        return ResumeState()
    path = os.path.join(load_dir, tag or "")
    if tag is not None:
        check_compatible(meta, args, path)  # the same meta everywhere: all ranks or none raise
    start = time.perf_counter()
    seeded = get_rng_state() if args.no_load_rng else None
    load_path, client_state, imported = _engine_load(engine, args, tag, meta, path)
    if load_path is None and tag is None:
        print_rank_0(f"> no checkpoint found at --load {load_dir} nor in memory: starting "
                     f"from scratch")
        return ResumeState()
    if load_path is None:
        raise ConfigError(f"--load: could not load {path}")
    fields = resume_fields(client_state)
    scheduler.load_state_dict(fields["opt_param_scheduler"])
    state = ResumeState(iteration=fields["iteration"],
                        consumed_train_samples=fields["consumed_train_samples"],
                        rng_state=_resumed_rng_state(engine, args, fields["rng_states"], seeded))
    load_s = time.perf_counter() - start
    print_rank_0(f"> loaded checkpoint {load_path} at iteration {state.iteration} "
                 f"({state.consumed_train_samples} consumed samples) in {load_s:.2f} s")
    if getattr(engine, "moc", None) is not None and not imported:
        from megatron.training.recovery import account_recovery
        state.recovery = account_recovery(engine, args, state.iteration, load_s)
    return state


def _engine_load(engine, args: argparse.Namespace, tag: Optional[str], meta: Dict,
                 path: str) -> Tuple[Optional[str], Optional[Dict], bool]:
    """The engine's load for :func:`load_checkpoint`: ``(load_path, client_state,
    imported)``, ``imported`` true when a DeepSpeed-format checkpoint was loaded.

    Called on every rank (the engine's loads are collective). A MoC load comes first
    unless the newest checkpoint is DeepSpeed's; with ``--moc-two-level`` it comes first
    anyway (newer snapshots in the keepers' memory win over the import). ``load_path``
    is None when neither found anything.
    """
    load_dir = args.load
    imported = meta.get("format") == DEEPSPEED_FORMAT
    load_path = client_state = None
    if not imported or getattr(args, "moc_two_level", False):
        load_path, client_state = engine.load_checkpoint(
            # MoC picks the newest *valid* checkpoint itself (falling back past a corrupt one).
            load_dir, tag=None if getattr(args, "moc_checkpoint", False) else tag,
            load_optimizer_states=not args.no_load_optim, load_lr_scheduler_states=False)
        imported = imported and load_path is None
    if imported:
        print_rank_0(f"> loading a DeepSpeed checkpoint {path} (no MoC checkpoint in --load "
                     f"{load_dir}); the next save writes a MoC checkpoint")
        load_path, client_state = engine.deepspeed_load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=not args.no_load_optim,
            load_lr_scheduler_states=False)
    return load_path, client_state, imported


def resume_fields(client_state: Dict) -> Dict:
    """What a load resumes from in a checkpoint's ``client_state``: ``iteration``,
    ``consumed_train_samples``, ``opt_param_scheduler`` and ``rng_states`` (one per rank,
    :func:`deepspeed_ext.engine.rng.get_rng_state`'s form, or None).

    Called by :func:`load_checkpoint` on every rank after the engine's load (no
    collective); tests call it directly. Reads ours (MoC's or a baseline run's, whose
    ``args`` is a dict in older checkpoints and a Namespace now: neither is read here)
    and Megatron-DeepSpeed's (the scheduler under ``lr_scheduler`` in older versions,
    consumed samples in ``args``, per-rank RNG states under ``rng_state``).
    """
    saved_args = client_state.get("args")
    consumed = client_state.get("consumed_train_samples")
    if consumed is None:  # Megatron-DeepSpeed: args.consumed_train_samples
        consumed = (saved_args.get("consumed_train_samples", 0) if isinstance(saved_args, dict)
                    else getattr(saved_args, "consumed_train_samples", 0))
    scheduler = client_state.get("opt_param_scheduler", client_state.get("lr_scheduler"))
    if not isinstance(scheduler, dict):
        raise ConfigError("--load: the checkpoint holds no LR scheduler state "
                          "(opt_param_scheduler or lr_scheduler)")
    rng_states = client_state.get("rng_states")
    if rng_states is None and isinstance(client_state.get("rng_state"), list):
        rng_states = [{"python": r.get("random_rng_state"), "numpy": r.get("np_rng_state"),
                       "torch": r.get("torch_rng_state"), "cuda": r.get("cuda_rng_state")}
                      for r in client_state["rng_state"]]
    return {"iteration": int(client_state["iteration"]),
            "consumed_train_samples": int(consumed or 0),
            "opt_param_scheduler": scheduler, "rng_states": rng_states}


def _resumed_rng_state(engine, args, rng_states, seeded) -> Optional[Dict]:
    """Every rank, after the engine's load: the RNG state training resumes with (None:
    keep the current one)."""
    if seeded is not None:
        # MoC's load restores the saved states (also those of a damaged checkpoint it
        # fell back past, on some ranks): --no-load-rng undoes whatever it did.
        set_rng_state(seeded)
    if args.no_load_rng:
        return None
    if rng_states is None and getattr(engine, "moc", None) is not None and engine.moc.rng_restored:
        return get_rng_state()  # MoC has just restored this rank's saved state
    rng_states = rng_states or []
    if len(rng_states) == dist.get_world_size():
        return rng_states[dist.get_rank()]
    print_rank_0(f"WARNING: checkpoint holds {len(rng_states)} RNG states for "
                 f"{dist.get_world_size()} ranks; RNG states not restored")
    return None
