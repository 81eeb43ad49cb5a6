#!/usr/bin/env python
"""Checkpoint save benchmark: DeepSpeed's ``save_checkpoint`` vs MoC (all experts) vs MoC PEC K=1.

One run starts ``--nproc`` local ranks (gloo on CPU, NCCL on GPUs), builds ONE GPT-MoE
DeepSpeed engine from the trainer's own arguments, trains a few steps on synthetic tokens
so that Adam state exists, and then saves the same state with each system:

* ``deepspeed``   DeepSpeed's own ``engine.save_checkpoint``;
* ``deepspeed-fsync`` the same, with every file it writes fsynced inside the save (the
  durability MoC's saves have: MoC fsyncs every file before its manifest commits);
* ``moc-full``    ``MoCCheckpointer`` with K = every expert of a MoE layer (its default
  asynchronous save: returns once the state is copied into host memory; a writer thread
  writes, fsyncs and commits);
* ``moc-full-sync`` the same with ``async_save=False``: returns once committed;
* ``moc-pec-k1``  ``MoCCheckpointer`` with partial expert checkpointing, K = 1.

Each system gets one warm-up save and then ``--repeats`` timed saves, interleaved across
systems, each into a fresh tag of the system's own directory. Before every save the page
cache is flushed (``os.sync``, untimed) and all ranks meet at a barrier; a save's time is
the maximum over ranks of the save call (``save_s``: what the training loop waits), and
``durable_s`` the maximum over ranks until the checkpoint is fsynced and committed (MoC:
the save call plus ``wait()``; deepspeed-fsync: the save call; deepspeed: never, it
does not fsync). The script prints a table (and ``--json FILE``
writes it); it asserts nothing about the numbers.

    python benchmarks/checkpoint_bench.py [--nproc 4 --ep 4 --zero-stage 2 --repeats 3]
                                          [--json FILE] [--out-dir DIR] [--keep] [model flags]
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("deepspeed", "deepspeed-fsync", "moc-full", "moc-full-sync", "moc-pec-k1")
RESULTS_FILE = "results.json"
VOCAB = 257  # the byte-level tokenizer's vocabulary; tokens are synthetic anyway

# Flags forwarded from the launcher to every rank (the rest only concern the launcher).
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "seq_length", "num_experts", "expert_interval", "topk", "micro_batch_size",
               "train_steps", "zero_stage", "ep", "repeats", "seed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Compare the checkpoint save of DeepSpeed, MoC (all experts) and MoC PEC "
                    "K=1 on one GPT-MoE engine; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=4, help="Local ranks to start.")
    g.add_argument("--ep", type=int, default=4, help="Expert-parallel size.")
    g.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2], help="DeepSpeed ZeRO stage.")
    g = p.add_argument_group("model (GPT-350M-16E-shaped, scaled to CPU; fp32)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=0, help="0: 4 x hidden size.")
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--num-experts", type=int, default=16, help="Experts per MoE layer.")
    g.add_argument("--expert-interval", type=int, default=2, help="Every N-th layer is MoE.")
    g.add_argument("--topk", type=int, default=1, choices=[1, 2])
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--train-steps", type=int, default=2,
                   help="Optimizer steps before the first save (so Adam state exists).")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("measurement and output")
    g.add_argument("--repeats", type=int, default=3, help="Timed saves per system after the warm-up.")
    g.add_argument("--json", metavar="FILE", help="Also write the table rows here as JSON.")
    g.add_argument("--out-dir", metavar="DIR",
                   help="Where checkpoints and rank logs go (must be empty or absent); "
                        "default: a new temporary directory.")
    g.add_argument("--keep", action="store_true",
                   help="Keep the out dir (every checkpoint and the rank logs) at the end.")
    g.add_argument("--timeout", type=float, default=600,
                   help="Seconds the ranks may run before they are killed.")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


# ============================================================================ rank side

def _trainer_argv(opts) -> list:
    """The trainer's flags for this benchmark's model (parsed by megatron's own parser)."""
    argv = ["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size,
            "--ffn-hidden-size", opts.ffn_hidden_size,
            "--num-attention-heads", opts.num_attention_heads, "--seq-length", opts.seq_length,
            "--max-position-embeddings", opts.seq_length, "--make-vocab-size-divisible-by", 128,
            "--num-experts", opts.num_experts, "--moe-expert-parallel-size", opts.ep,
            "--expert-interval", opts.expert_interval, "--topk", opts.topk,
            "--micro-batch-size", opts.micro_batch_size, "--train-iters", max(opts.train_steps, 1),
            "--lr", 1e-3, "--lr-warmup-iters", 0, "--zero-stage", opts.zero_stage,
            "--hidden-dropout", 0, "--attention-dropout", 0, "--seed", opts.seed,
            "--data-path", "unused", "--log-interval", 1, "--eval-iters", 0]
    return [str(a) for a in argv]


def _synthetic_batch(args, step: int, micro: int, rank: int):
    import torch
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (args.micro_batch_size, args.seq_length + 1), generator=gen)
    positions = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return tokens[:, :-1], positions, tokens[:, 1:]


def _train(engine, args, steps: int, rank: int) -> list:
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()
    losses = []
    for step in range(steps):
        for micro in range(args.gradient_accumulation_steps):
            tokens, positions, labels = (t.to(device) for t in _synthetic_batch(args, step, micro, rank))
            lm_loss, aux_loss, _ = engine(tokens, positions, labels)
            engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
            engine.step()
        losses.append(float(lm_loss.item()))
    return losses


def _param_counts(engine, world: int, ep: int) -> dict:
    """Parameters of the whole model: expert (DeepSpeed marks them allreduce=False) and not."""
    import torch
    import torch.distributed as dist
    expert = sum(p.numel() for p in engine.module.parameters() if not getattr(p, "allreduce", True))
    dense = sum(p.numel() for p in engine.module.parameters() if getattr(p, "allreduce", True))
    from deepspeed_ext.runtime.groups import metadata_group
    total_expert = torch.tensor([expert], dtype=torch.int64)
    dist.all_reduce(total_expert, group=metadata_group())  # a CPU tensor: never on NCCL
    expert_all = int(total_expert.item()) // (world // ep)  # each expert lives on world/ep ranks
    return {"params_total": expert_all + dense, "params_expert": expert_all,
            "params_non_expert": dense,
            "expert_fraction": expert_all / max(1, expert_all + dense)}


class _DeepSpeedWriteRecorder:
    """Wraps ``engine.checkpoint_engine.save`` to record (path, size) of what this rank wrote.

    In DeepSpeed 0.19.8 every tensor-bearing file of ``save_checkpoint`` (per-expert
    ``layer_*_expert_*_model_states.pt``, ``mp_rank_*_model_states.pt``, the ZeRO
    ``*_optim_states.pt``) is written by ``self.checkpoint_engine.save(state_dict, path)``
    (TorchCheckpointEngine: ``torch.save``). ``latest`` and the recovery scripts
    ``zero_to_fp32.py``/``zero_to_torch.py`` are written directly by rank 0 and are not
    counted here.
    """

    def __init__(self, engine):
        self.records = []
        self.fsync = False
        ckpt_engine = engine.checkpoint_engine
        original = ckpt_engine.save

        def save(state_dict, path, *args, **kwargs):
            result = original(state_dict, path, *args, **kwargs)
            if self.fsync:
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
            self.records.append((os.path.abspath(path), os.path.getsize(path)))
            return result

        ckpt_engine.save = save


def _files_under(root: str) -> dict:
    """{absolute path: size} of every regular file under ``root``."""
    found = {}
    if os.path.isdir(root):
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):
                    found[os.path.abspath(path)] = os.path.getsize(path)
    return found


def _attribute_bytes(system: str, save_dir: str, tag: str, world: int, gathered: list):
    """Rank 0: (bytes per rank, {uncounted file: size}) of one finished save."""
    tag_dir = os.path.join(save_dir, tag)
    on_disk = _files_under(tag_dir)
    for name in os.listdir(save_dir):  # `latest`; DeepSpeed's recovery scripts land here too
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            on_disk[os.path.abspath(path)] = os.path.getsize(path)
    per_rank = [0] * world
    counted = set()
    if system.startswith("deepspeed"):
        for rank, (_, _, records, _) in enumerate(gathered):
            for path, size in records:
                per_rank[rank] += size
                counted.add(path)
    else:
        from deepspeed_ext.format.naming import rank_file_name
        for rank in range(world):
            path = os.path.abspath(os.path.join(tag_dir, rank_file_name(rank)))
            if path in on_disk:
                per_rank[rank] += on_disk[path]
                counted.add(path)
        for name in ("objects.json", "manifest.json"):
            path = os.path.abspath(os.path.join(tag_dir, name))
            if path in on_disk:
                per_rank[0] += on_disk[path]
                counted.add(path)
    uncounted = {os.path.relpath(p, save_dir): s for p, s in sorted(on_disk.items()) if p not in counted}
    return per_rank, uncounted


def _manifest_elements(tag_dir: str):
    """Elements of tensor state a MoC checkpoint's manifest lists, split into expert and
    non-expert (a sanity check that a save wrote what it should); None if unreadable."""
    try:
        with open(os.path.join(tag_dir, "manifest.json")) as f:
            tensors = json.load(f)["tensors"]
        counts = {"expert": 0, "non_expert": 0}
        for entry in tensors.values():
            side = "non_expert" if entry.get("expert") is None else "expert"
            counts[side] += sum(int(frag["length"]) for frag in entry["fragments"])
        return counts
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_worker(opts, worker) -> None:
    """A rank's entry: ``worker(opts, rank, world)``; a failure's traceback goes to
    ``error.rank<R>.txt`` for the launcher to report."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        worker(opts, rank, world)
    except BaseException:
        with open(os.path.join(opts.out_dir, f"error.rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def worker_main(opts) -> None:
    run_worker(opts, _worker)


def host_barrier() -> None:
    """Every rank: wait for this rank's queued device work, then a barrier on the metadata
    group (:mod:`deepspeed_ext.runtime.groups`, made by :func:`build_engine`'s
    ``initialize_distributed``). An NCCL barrier waited for the device too; the gloo one
    does not, and a timing started after it would otherwise pay for earlier kernels."""
    import torch
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier(group=metadata_group())


def gather_objects(value, world: int) -> list:
    """Every rank: ``value`` of every rank, in rank order (on the metadata group)."""
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    gathered = [None] * world
    dist.all_gather_object(gathered, value, group=metadata_group())
    return gathered


def build_engine(opts, rank: int, world: int) -> tuple:
    """Every rank: the benchmark's engine, trained ``--train-steps`` steps so Adam state
    exists. Returns (engine, args, the results' config record)."""
    sys.path.insert(0, REPO)
    from megatron.training.arguments import padded_vocab_size, parse_args, validate_args
    from deepspeed_ext.engine.rng import set_seed
    from megatron.training.training import initialize_distributed, setup_model_and_optimizer
    args = parse_args(_trainer_argv(opts))
    validate_args(args, world)
    initialize_distributed(args)
    set_seed(args.seed)
    args.padded_vocab_size = padded_vocab_size(VOCAB, args.make_vocab_size_divisible_by)
    engine, _ = setup_model_and_optimizer(args)
    losses = _train(engine, args, opts.train_steps, rank)
    num_moe_layers = len([l for l in range(1, args.num_layers + 1) if l % args.expert_interval == 0])
    config = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size,
              "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length,
              "num_experts": args.num_experts, "expert_interval": args.expert_interval,
              "num_moe_layers": num_moe_layers, "topk": args.topk,
              "padded_vocab_size": args.padded_vocab_size, "dtype": "fp32",
              "world_size": world, "ep_size": opts.ep, "dp_size": world,
              "zero_stage": opts.zero_stage, "micro_batch_size": args.micro_batch_size,
              "train_steps": opts.train_steps, "train_losses": losses,
              **_param_counts(engine, world, opts.ep)}
    return engine, args, config


def write_results(out_dir: str, results: dict) -> None:
    """Rank 0: the results so far, atomically (the launcher reads them even after a crash)."""
    tmp = os.path.join(out_dir, RESULTS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, os.path.join(out_dir, RESULTS_FILE))


def _worker(opts, rank: int, world: int) -> None:
    import torch.distributed as dist
    from deepspeed_ext.checkpointer import MoCCheckpointer
    from deepspeed_ext.config import MoCConfig

    engine, args, config = build_engine(opts, rank, world)
    recorder = _DeepSpeedWriteRecorder(engine)
    # Not patched by enable_moc_checkpointing, so this is DeepSpeed's own method; if some
    # other code patched it, the original is kept as deepspeed_save_checkpoint.
    ds_save = getattr(engine, "deepspeed_save_checkpoint", engine.save_checkpoint)
    moc = {"moc-full": MoCCheckpointer(engine, MoCConfig(pec_k=opts.num_experts)),
           "moc-full-sync": MoCCheckpointer(engine, MoCConfig(pec_k=opts.num_experts,
                                                               async_save=False)),
           "moc-pec-k1": MoCCheckpointer(engine, MoCConfig(pec_k=1))}
    ckpt_root = os.path.join(opts.out_dir, "ckpt")
    save_dirs = {s: os.path.join(ckpt_root, s) for s in SYSTEMS}

    results = {
        "config": {**config, "moc_pec_policy": "sequential"},
        "systems": {s: {"warmup": None, "saves": [], "error": None} for s in SYSTEMS},
    }

    def publish():
        if rank == 0:
            write_results(opts.out_dir, results)

    def save_once(system: str, tag: str):
        client_state = {"benchmark_tag": tag}
        if system.startswith("deepspeed"):
            recorder.fsync = system == "deepspeed-fsync"
            ds_save(save_dirs[system], tag=tag, client_state=client_state)
        else:
            moc[system].save(save_dirs[system], tag=tag, client_state=client_state)

    def measure(system: str, tag: str) -> dict:
        recorder.records.clear()
        if rank == 0:
            os.sync()  # no save pays for the writeback of an earlier one
        host_barrier()
        error = None
        start = time.perf_counter()
        try:
            save_once(system, tag)
        except Exception as e:  # reported in the table, not raised
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            # Also to a file now: a rank failing alone may leave the others waiting in
            # the save's collectives until the launcher's timeout.
            with open(os.path.join(opts.out_dir, f"save_errors.rank{rank}.txt"), "a") as f:
                f.write(f"{system} {tag}: {error}\n")
        elapsed = time.perf_counter() - start
        durable = elapsed if system != "deepspeed" else None
        if system in moc and error is None:
            try:
                moc[system].wait()  # fsynced and committed (a collective: every rank)
                durable = time.perf_counter() - start
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        gathered = gather_objects((elapsed, error, list(recorder.records), durable), world)
        errors = [(r, e) for r, (_, e, _, _) in enumerate(gathered) if e]
        entry = {"tag": tag, "save_s_per_rank": [g[0] for g in gathered],
                 "save_s": max(g[0] for g in gathered),
                 "durable_s": None if durable is None else max(g[3] for g in gathered),
                 "error": _group_errors(errors) or None}
        if rank == 0 and not errors:
            per_rank, uncounted = _attribute_bytes(system, save_dirs[system], tag, world, gathered)
            entry.update(bytes_per_rank=per_rank, uncounted_files=uncounted)
            if not system.startswith("deepspeed"):
                entry["manifest_elements"] = _manifest_elements(os.path.join(save_dirs[system], tag))
        return entry

    def drop_superseded(system: str, keep_tag: str):
        """Delete this system's older tags, untimed, to bound disk use. Not for PEC: its
        checkpoints reference expert versions held by earlier tags (MoC's next save reads
        only the last tag's manifest either way)."""
        if rank != 0 or opts.keep or system == "moc-pec-k1":
            return
        root = save_dirs[system]
        for name in os.listdir(root) if os.path.isdir(root) else []:
            path = os.path.join(root, name)
            if os.path.isdir(path) and name != keep_tag:
                shutil.rmtree(path, ignore_errors=True)

    def run_save(system: str, tag: str) -> dict:
        results["current"] = {"system": system, "tag": tag}
        publish()
        entry = measure(system, tag)
        results["current"] = None
        return entry

    for system in SYSTEMS:
        entry = run_save(system, "warmup")
        results["systems"][system]["warmup"] = entry
        if entry["error"]:
            results["systems"][system]["error"] = f"warm-up save: {entry['error']}"
        publish()
    for repeat in range(opts.repeats):
        for system in SYSTEMS:
            state = results["systems"][system]
            if state["error"]:
                continue
            tag = f"repeat{repeat}"
            entry = run_save(system, tag)
            state["saves"].append(entry)
            if entry["error"]:
                state["error"] = f"save {tag}: {entry['error']}"
            publish()
            drop_superseded(system, tag)
    results["complete"] = True
    publish()
    host_barrier()
    from megatron.training.training import remove_deepspeed_shm_buffers
    remove_deepspeed_shm_buffers()
    dist.destroy_process_group()


# ========================================================================= launcher side

def _group_errors(errors) -> str:
    """``[(rank, message), ...]`` -> one line, ranks with the same message together."""
    by_message = {}
    for rank, message in errors:
        by_message.setdefault(message, []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
                     for message, ranks in by_message.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _filesystem_of(path: str) -> str:
    """Mount point and type of the filesystem holding ``path`` (Linux), else ''."""
    try:
        real = os.path.realpath(path)
        best = ("", "")
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount, fstype = fields[1], fields[2]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                    best = (mount, fstype)
        return f"{best[1]} at {best[0]}" if best[0] else ""
    except OSError:
        return ""


def _versions() -> str:
    from importlib import metadata
    parts = [f"Python {platform.python_version()}"]
    for package in ("torch", "deepspeed"):
        try:
            parts.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{package} not installed")
    return ", ".join(parts)


def run_rank_processes(argv: list, nproc: int, out_dir: str, timeout: float) -> tuple:
    """Start ``nproc`` local ranks of ``argv`` (logs in ``out_dir/logs``); wait at most
    ``timeout`` seconds, then kill what is left. Returns (exit codes, timed out?)."""
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    port = str(_free_port())
    procs, handles = [], []
    for rank in range(nproc):
        # CROSS_RANK/CROSS_SIZE: what DeepSpeed's launcher sets on one node; its checkpoint
        # writers read them.
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONWARNINGS="ignore")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        log = open(os.path.join(logs, f"rank{rank}.log"), "w")
        handles.append(log)
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:  # only the processes started here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in handles:
            log.close()
    return [p.returncode for p in procs], timed_out


def _launch(opts, out_dir: str) -> tuple:
    """Start the ranks; wait (with the timeout); returns (exit codes, timed out?, save errors)."""
    worker_argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out-dir", out_dir]
    for name in MODEL_FLAGS:
        worker_argv += ["--" + name.replace("_", "-"), str(getattr(opts, name))]
    if opts.keep:
        worker_argv.append("--keep")
    codes, timed_out = run_rank_processes(worker_argv, opts.nproc, out_dir, opts.timeout)
    # What ranks reported before a kill (the survivors' collectives fail after it).
    save_errors = []
    for rank in range(opts.nproc):
        path = os.path.join(out_dir, f"save_errors.rank{rank}.txt")
        if os.path.isfile(path):
            save_errors += [(rank, line) for line in _tail(path, 1).splitlines() if line.strip()]
    return codes, timed_out, save_errors


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _median(values):
    return statistics.median(values) if values else None


def _rows(results: dict, launch_error: str, repeats: int) -> list:
    """One JSON row per system (failed systems included, with their error)."""
    config = results.get("config", {})
    current = results.get("current") or {}
    rows = []
    for system in SYSTEMS:
        state = results.get("systems", {}).get(system)
        if launch_error and current.get("system") == system and not (state or {}).get("error"):
            state = dict(state or {}, error=f"{launch_error}, during its '{current['tag']}' save")
        row = {"system": system, "bytes_total": None, "bytes_max_rank": None,
               "bytes_mean_rank": None, "max_over_mean": None, "save_s_median": None,
               "save_s_min": None, "durable_s_median": None, "repeats": 0, "config": config}
        saves = [s for s in (state or {}).get("saves", []) if not s["error"]]
        error = (state or {}).get("error")
        if state is None or (not saves and not error):
            error = f"not measured: {launch_error}" if launch_error else "no result"
        elif error is None and len(saves) < repeats:
            error = (f"only {len(saves)} of {repeats} timed saves finished"
                     + (f": {launch_error}" if launch_error else ""))
        if error:
            row["error"] = error
        if saves:
            totals = [sum(s["bytes_per_rank"]) for s in saves]
            maxima = [max(s["bytes_per_rank"]) for s in saves]
            means = [sum(s["bytes_per_rank"]) / len(s["bytes_per_rank"]) for s in saves]
            ratios = [mx / mn if mn else None for mx, mn in zip(maxima, means)]
            times = [s["save_s"] for s in saves]
            durable = [s["durable_s"] for s in saves if s.get("durable_s") is not None]
            row.update(bytes_total=round(statistics.mean(totals)),
                       bytes_max_rank=round(statistics.mean(maxima)),
                       bytes_mean_rank=statistics.mean(means),
                       max_over_mean=statistics.mean(r for r in ratios if r is not None)
                       if any(r is not None for r in ratios) else None,
                       max_over_mean_worst=max((r for r in ratios if r is not None), default=None),
                       save_s_median=_median(times), save_s_min=min(times), repeats=len(saves),
                       durable_s_median=_median(durable),
                       save_s=times, bytes_per_rank=[s["bytes_per_rank"] for s in saves],
                       uncounted_files=saves[-1]["uncounted_files"])
            if saves[-1].get("manifest_elements") is not None:
                row["manifest_elements"] = saves[-1]["manifest_elements"]
        warmup = (state or {}).get("warmup")
        if warmup and not warmup["error"]:
            row["warmup"] = {"save_s": warmup["save_s"],
                             "bytes_total": sum(warmup["bytes_per_rank"]),
                             "bytes_per_rank": warmup["bytes_per_rank"]}
        rows.append(row)
    by_name = {r["system"]: r for r in rows}
    for row in rows:
        for ref, suffix in (("moc-full", "moc_full"), ("deepspeed", "deepspeed")):
            base = by_name[ref]
            ok = row["bytes_total"] is not None and base["bytes_total"]
            row[f"bytes_vs_{suffix}"] = row["bytes_total"] / base["bytes_total"] if ok else None
            ok = row["save_s_median"] is not None and base["save_s_median"]
            row[f"time_vs_{suffix}"] = row["save_s_median"] / base["save_s_median"] if ok else None
    return rows


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def _print_table(rows: list) -> None:
    mib = float(2 ** 20)
    header = ["system", "bytes_total (MiB)", "bytes_max_rank (MiB)", "bytes_mean_rank (MiB)",
              "max/mean", "save_s_median", "save_s_min", "durable_s_median", "bytes vs moc-full",
              "time vs moc-full",
              "bytes vs deepspeed", "time vs deepspeed"]
    table = [header]
    for r in rows:
        if r["bytes_total"] is None:
            table.append([r["system"], "FAILED"] + ["-"] * (len(header) - 2))
            continue
        table.append([r["system"], _fmt(r["bytes_total"], ".2f", mib), _fmt(r["bytes_max_rank"], ".2f", mib),
                      _fmt(r["bytes_mean_rank"], ".2f", mib), _fmt(r["max_over_mean"], ".3f"),
                      _fmt(r["save_s_median"], ".3f"), _fmt(r["save_s_min"], ".3f"),
                      _fmt(r["durable_s_median"], ".3f"), _fmt(r["bytes_vs_moc_full"], ".3f"), _fmt(r["time_vs_moc_full"], ".3f"),
                      _fmt(r["bytes_vs_deepspeed"], ".3f"), _fmt(r["time_vs_deepspeed"], ".3f")])
    print_aligned(table)
    for r in rows:
        if r.get("error"):
            print(f"{r['system']}: FAILED: {r['error']}")


def print_aligned(table: list) -> None:
    """Print rows of strings as columns; the first row is the header."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print(" | ".join(cell.ljust(w) if j == 0 else cell.rjust(w)
                         for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def _print_coverage(rows, config: dict) -> None:
    """How much of the state the MoC manifests list, against what they should (Adam: the fp32
    master weights and two moments of every parameter; PEC: of K experts per MoE layer)."""
    if not config.get("params_total"):
        return
    parts = []
    for r in rows:
        elements = r.get("manifest_elements")
        if not elements:
            continue
        k = config["num_experts"] if r["system"] == "moc-full" else 1
        want_dense = 3 * config["params_non_expert"]
        want_expert = 3 * config["params_expert"] * k / config["num_experts"]
        parts.append(f"{r['system']} non-expert {elements['non_expert'] / want_dense:.3f}, "
                     f"expert {elements['expert'] / want_expert:.3f}")
    if parts:
        print("state: elements listed in the last MoC manifest / 3 x the parameters it should "
              "cover (fp32 master + 2 Adam moments; 1.000 = complete): " + "; ".join(parts))


def _print_notes_and_checks(rows: list, config: dict) -> None:
    by_name = {r["system"]: r for r in rows}
    ds, full, pec = by_name["deepspeed"], by_name["moc-full"], by_name["moc-pec-k1"]
    print()
    print("bytes: deepspeed counts every file written through engine.checkpoint_engine.save, "
          "attributed to the rank that wrote it;")
    print("       moc-* count each rank's rankNNNNN.safetensors, plus objects.json and manifest.json "
          "for rank 0;")
    print("       not counted for any system: `latest` and, for deepspeed, rank 0's copies of "
          "zero_to_fp32.py/zero_to_torch.py. Means over the timed saves.")
    for r in rows:
        if r.get("uncounted_files"):
            listed = ", ".join(f"{p} ({s / 1024:.1f} KiB)" for p, s in r["uncounted_files"].items())
            print(f"       uncounted in {r['system']}'s last save: {listed}")
    print("time:  save_s: max over ranks of the save call (what training waits for); durable_s: until "
          "every file is fsynced and the checkpoint committed")
    print("       (moc-full, moc-pec-k1: the save call, then wait(); moc-full-sync and deepspeed-fsync: "
          "inside the save call; deepspeed: never, torch.save does not fsync).")
    _print_coverage((full, pec), config)
    if pec.get("warmup"):
        print(f"warm-up (excluded): moc-pec-k1's first save held every expert: "
              f"{pec['warmup']['bytes_total'] / 2**20:.2f} MiB in {pec['warmup']['save_s']:.3f} s.")
    print()
    print("checks (measured here, not asserted):")
    if pec["bytes_total"] is not None and full["bytes_total"]:
        frac = config.get("expert_fraction")
        expected = ""
        if frac is not None and config.get("num_experts"):
            expected = (f"; parameter share of non-expert state + 1/{config['num_experts']} of the "
                        f"experts: {(1 - frac) + frac / config['num_experts']:.3f}")
        print(f"  1. PEC K=1 bytes / MoC full bytes = {pec['bytes_total'] / full['bytes_total']:.3f}"
              f" ({pec['bytes_total'] / 2**20:.2f} / {full['bytes_total'] / 2**20:.2f} MiB{expected})")
    else:
        print("  1. PEC K=1 bytes / MoC full bytes: not measured (a system failed)")
    parts = [f"{r['system']} {r['max_over_mean']:.3f} (worst save {r['max_over_mean_worst']:.3f})"
             for r in (full, pec) if r["max_over_mean"] is not None]
    print("  2. MoC per-rank bytes max/mean: " + ("; ".join(parts) if parts else "not measured")
          + (f"; deepspeed {ds['max_over_mean']:.3f}" if ds["max_over_mean"] is not None else ""))
    if full["save_s_median"] is not None and ds["save_s_median"]:
        print(f"  3. MoC full save time / DeepSpeed save time (medians) = "
              f"{full['save_s_median'] / ds['save_s_median']:.3f} "
              f"({full['save_s_median']:.3f} s vs {ds['save_s_median']:.3f} s; "
              f"min {full['save_s_min']:.3f} s vs {ds['save_s_min']:.3f} s)")
    else:
        print("  3. MoC full save time vs DeepSpeed: not measured (a system failed)")
    dsf, sync = by_name.get("deepspeed-fsync"), by_name.get("moc-full-sync")
    if dsf and full["durable_s_median"] is not None and dsf["durable_s_median"]:
        print(f"     until durable, vs deepspeed-fsync: "
              f"{full['durable_s_median'] / dsf['durable_s_median']:.3f} "
              f"({full['durable_s_median']:.3f} s vs {dsf['durable_s_median']:.3f} s)")
    if sync and sync["save_s_median"] is not None and ds["save_s_median"]:
        print(f"     moc-full-sync (the save call waits for the commit) / deepspeed: "
              f"{sync['save_s_median'] / ds['save_s_median']:.3f} "
              f"({sync['save_s_median']:.3f} s vs {ds['save_s_median']:.3f} s)")


def prepare_out_dir(out_dir, prefix: str) -> tuple:
    """The run's output directory: a new temporary one, or ``out_dir`` if it is empty or
    absent. Returns (absolute path, created here?).

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory (naming the flag).
    """
    if out_dir is None:
        return tempfile.mkdtemp(prefix=prefix), True
    out_dir = os.path.abspath(out_dir)
    created = not os.path.exists(out_dir)
    if not created and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"--out-dir {out_dir} must be an empty directory or absent")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir, created


def read_results(out_dir: str, codes: list, timed_out: bool, timeout: float) -> tuple:
    """Rank 0's results file and, if the ranks did not all end well, why: (results, error)."""
    results = {}
    path = os.path.join(out_dir, RESULTS_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
    if timed_out:
        return results, f"the ranks were killed after --timeout {timeout:g} s"
    if not any(codes) and results.get("complete"):
        return results, None
    errors = []
    for rank in range(len(codes)):
        path = os.path.join(out_dir, f"error.rank{rank}.txt")
        if os.path.isfile(path):
            last = [l for l in _tail(path, 3).splitlines() if l.strip()]
            errors.append((rank, last[-1] if last else "?"))
    return results, f"rank exit codes {codes}" + (": " + _group_errors(errors) if errors else "")


def print_model(config: dict, layout_extra: str = "") -> None:
    """The model, parameter and layout lines of a results config (nothing if empty)."""
    if not config:
        return
    print(f"model:   {config['num_layers']} layers, hidden {config['hidden_size']}, ffn "
          f"{config['ffn_hidden_size']}, {config['num_attention_heads']} heads, seq "
          f"{config['seq_length']}, vocab {config['padded_vocab_size']}, {config['num_experts']} "
          f"experts per MoE layer, MoE every {config['expert_interval']} layers "
          f"({config['num_moe_layers']} MoE layers), top-{config['topk']}, {config['dtype']}")
    print(f"params:  {config['params_total'] / 1e6:.2f} M: expert {config['params_expert'] / 1e6:.2f} M "
          f"({100 * config['expert_fraction']:.1f} %), non-expert {config['params_non_expert'] / 1e6:.2f} M")
    print(f"layout:  {config['world_size']} ranks, EP {config['ep_size']}, DP {config['dp_size']}, "
          f"ZeRO-{config['zero_stage']}{layout_extra}")


def print_failed_rank_logs(out_dir: str, codes: list, launch_error) -> None:
    """After a failed launch: the last lines of rank 0's log and the first failed rank's."""
    if not launch_error:
        return
    print(f"\nranks failed ({launch_error}); last lines of the rank logs:")
    failed = [r for r, code in enumerate(codes) if code]
    for rank in sorted({0, *failed[:1]}):
        tail = _tail(os.path.join(out_dir, "logs", f"rank{rank}.log"), 15)
        if tail:
            print(f"--- rank {rank} (exit {codes[rank]}) ---\n{tail.rstrip()}")


def finish_out_dir(out_dir: str, created: bool, keep: bool) -> None:
    """Keep the output directory, delete it (created here), or empty it (the user's)."""
    if keep:
        print(f"kept {out_dir} (checkpoints under ckpt/, results.json, rank logs under logs/)")
    elif created:
        shutil.rmtree(out_dir, ignore_errors=True)
    else:  # an empty directory the user named: remove only what this run put there
        for name in os.listdir(out_dir):
            path = os.path.join(out_dir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def launcher_main(opts) -> int:
    if opts.nproc < 1 or opts.ep < 1 or opts.repeats < 1 or opts.train_steps < 1:
        print("error: --nproc, --ep, --repeats and --train-steps must be >= 1", file=sys.stderr)
        return 2
    if opts.nproc % opts.ep or opts.num_experts % opts.ep:
        print(f"error: --nproc ({opts.nproc}) and --num-experts ({opts.num_experts}) must be "
              f"divisible by --ep ({opts.ep})", file=sys.stderr)
        return 2
    try:
        out_dir, created = prepare_out_dir(opts.out_dir, "moc-ckpt-bench-")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    command = shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    print("MoC checkpoint save benchmark")
    print(f"command: {command}")
    print(f"machine: {os.cpu_count()} CPU cores, {platform.platform()}, {_versions()}")
    fs = _filesystem_of(out_dir)
    print(f"out dir: {out_dir}" + (f" ({fs})" if fs else ""))
    sys.stdout.flush()

    started = time.perf_counter()
    codes, timed_out, save_errors = _launch(opts, out_dir)
    wall = time.perf_counter() - started
    results, launch_error = read_results(out_dir, codes, timed_out, opts.timeout)
    if timed_out and save_errors:
        launch_error += " (save errors before that: " + _group_errors(save_errors) + ")"
    config = dict(results.get("config", {}))
    print_model(config, f"; MoC PEC policy {config.get('moc_pec_policy')}")
    print(f"protocol: {opts.train_steps} training steps on synthetic tokens; per system 1 warm-up "
          f"save, then {opts.repeats} timed saves (interleaved across systems), each into a fresh "
          f"tag; os.sync() and a barrier before every save. Ranks ran {wall:.1f} s.")
    print()
    rows = _rows(results, launch_error, opts.repeats)
    config.update(nproc=opts.nproc, cpu_cores=os.cpu_count(), command=command)
    for row in rows:
        row["config"] = config
    _print_table(rows)
    _print_notes_and_checks(rows, config)

    print_failed_rank_logs(out_dir, codes, launch_error)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"\nwrote {opts.json}")
    finish_out_dir(out_dir, created, opts.keep)
    return 1 if launch_error or any(r.get("error") for r in rows) else 0


def main() -> int:
    opts = build_parser().parse_args()
    if opts.worker:
        worker_main(opts)
        return 0
    return launcher_main(opts)


if __name__ == "__main__":
    # Not sys.exit: a worker's clean end must not turn into a teardown abort (-6).
    sys.path.insert(0, REPO)
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(main())
