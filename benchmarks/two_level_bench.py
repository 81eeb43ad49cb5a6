#!/usr/bin/env python
"""Two-level checkpointing benchmark: the training loop with a checkpoint every I iterations.

One run starts ``--nproc`` local ranks (gloo on CPU, NCCL on GPUs) and builds ONE GPT-MoE
DeepSpeed engine, the model and layout of ``checkpoint_bench.py``. The systems then take
turns on that engine: for each interval in ``--intervals`` and each system, ``--iters``
training iterations (at least ``--min-saves`` checkpoints' worth, 10 by default) with a
checkpoint every ``interval`` iterations, into the system's own
directory. Before the first and after the last turn, ``--iters`` iterations without any
checkpoint give the reference iteration time. The systems:

* ``deepspeed``             DeepSpeed's own ``engine.save_checkpoint`` (synchronous);
* ``deepspeed-decoupled``   DeepSpeed's decoupled checkpoint engine (``"checkpoint":
  {"writer": {"decoupled": true}}``): the save queues the state to a writer process per
  rank, the next ``engine.step()`` waits for the commit;
* ``deepspeed-writer-sync`` the same writer with ``"decoupled": false``: the setting of that
  checkpoint engine that can save this ZeRO-2 engine (the decoupled one stops with
  "Cowardly refusing to serialize non-leaf tensor which requires_grad");
* ``dcp-async``             ``torch.distributed.checkpoint.async_save`` of the module and
  optimizer state, staged in a background thread into reused (shared, on GPUs pinned)
  host memory; its upload thread has its own gloo process group;
* ``moc-full``, ``moc-pec`` MoC two-level checkpointing: ``MoCCheckpointer.save``
  snapshots into the node keeper's shared memory, the copy overlaps the next
  forward/backward, every ``--persist-interval``-th snapshot goes to storage.

Measured per (system, interval): the training-loop stall of each checkpoint (the save
call plus every wait the system imposes before the next optimizer step or save), the
mean iteration time against the no-checkpoint reference, bytes persisted, host memory
held for snapshots (where the system has a way to tell), and the time to load the newest
checkpoint back into the engine (MoC: from memory and from storage). The script prints
a table (``--json FILE`` writes it, ``--plot FILE.png`` plots the stalls); it asserts
nothing about the numbers.

    python benchmarks/two_level_bench.py [--iters 20 --intervals 1,10] [--systems a,b]
                                         [--json FILE] [--plot FILE.png] [--out-dir DIR] [--keep]
"""

import argparse
import copy
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_bench as cb  # noqa: E402  (the model, its flags and the rank helpers)

REPO = cb.REPO
SYSTEMS = ("deepspeed", "deepspeed-decoupled", "deepspeed-writer-sync", "dcp-async",
           "moc-full", "moc-pec")
ASYNC_PEERS = ("deepspeed-decoupled", "dcp-async")
BASELINE = "no-checkpoint"

# Flags forwarded from the launcher to every rank (the rest only concern the launcher).
WORKER_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "seq_length", "num_experts", "expert_interval", "topk", "micro_batch_size",
                "train_steps", "zero_stage", "ep", "seed", "iters", "intervals", "systems",
                "persist_interval", "pec_k_snapshot", "pec_k_persist", "min_saves")


def build_parser() -> argparse.ArgumentParser:
    model = cb.build_parser().parse_args([])  # checkpoint_bench's model: same defaults
    p = argparse.ArgumentParser(
        description="Training-loop stall, iteration overhead, bytes and recovery time of "
                    "checkpointing every I iterations: DeepSpeed, its decoupled writer, "
                    "torch DCP async_save and MoC two-level; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=model.nproc, help="Local ranks to start.")
    g.add_argument("--ep", type=int, default=model.ep, help="Expert-parallel size.")
    g.add_argument("--zero-stage", type=int, default=model.zero_stage, choices=[0, 1, 2],
                   help="DeepSpeed ZeRO stage.")
    g = p.add_argument_group("model (checkpoint_bench.py's: GPT-350M-16E-shaped, scaled to CPU; fp32)")
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "seq_length", "num_experts", "expert_interval", "micro_batch_size", "seed"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(model, name))
    g.add_argument("--topk", type=int, default=model.topk, choices=[1, 2])
    g.add_argument("--train-steps", type=int, default=model.train_steps,
                   help="Optimizer steps before the first measurement (so Adam state exists).")
    g = p.add_argument_group("measurement and output")
    g.add_argument("--iters", type=int, default=20,
                   help="Timed training iterations per (system, interval) (at least "
                        "--min-saves checkpoints' worth), and of the no-checkpoint rows.")
    g.add_argument("--min-saves", type=int, default=10,
                   help="Checkpoints each turn times at least: a turn runs max(--iters, "
                        "interval x this) timed iterations (and as many reference ones), "
                        "so that medians are not taken over one or two saves.")
    g.add_argument("--intervals", default="1,10",
                   help="Checkpoint every I iterations, for each I of this comma list.")
    g.add_argument("--systems", default=",".join(SYSTEMS), help="Comma list of systems to run.")
    g.add_argument("--persist-interval", type=int, default=10,
                   help="MoC: every N-th snapshot is persisted to storage.")
    g.add_argument("--pec-k-snapshot", type=int, default=4,
                   help="moc-pec: experts per MoE layer snapshotted into memory.")
    g.add_argument("--pec-k-persist", type=int, default=1,
                   help="moc-pec: experts per MoE layer persisted to storage.")
    g.add_argument("--profile-saves", metavar="FILE",
                   help="MoC systems: profile rank 0's save calls (cProfile) and write the "
                        "functions with the most cumulative time to FILE (per system and "
                        "interval; profiling slows the calls, so stalls of such a run are "
                        "not comparable).")
    g.add_argument("--profile-recovery", metavar="FILE",
                   help="MoC systems: profile every rank's recovery from memory (cProfile) "
                        "and write the functions with the most cumulative time to FILE "
                        "(rank 0) and FILE.rank<R> (the others): every rank waits in the "
                        "same collectives, so one rank's profile does not show whose work "
                        "they wait for.")
    g.add_argument("--json", metavar="FILE", help="Also write the table rows here as JSON.")
    g.add_argument("--plot", metavar="FILE",
                   help="PNG of the stall of every checkpoint (needs matplotlib); "
                        "default: the --json path with .png, else none.")
    g.add_argument("--out-dir", metavar="DIR",
                   help="Where checkpoints and rank logs go (must be empty or absent); "
                        "default: a new temporary directory.")
    g.add_argument("--keep", action="store_true",
                   help="Keep the out dir (every checkpoint and the rank logs) at the end.")
    g.add_argument("--timeout", type=float, default=1200,
                   help="Seconds the ranks may run before they are killed.")
    g.add_argument("--checksum-speed", action="store_true",
                   help="Only measure the memory checksums (deepspeed_ext.format.memsum) against "
                        "SHA-256 on one core over 256 MiB, print a table and exit.")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm-root", help=argparse.SUPPRESS)
    return p


def checksum_speed(nbytes: int = 256 << 20, repeats: int = 3) -> int:
    """Print GiB/s of each checksum a snapshot could use (best of ``repeats``)."""
    import hashlib
    sys.path.insert(0, REPO)
    from deepspeed_ext.format import memsum
    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    rows = [(name, lambda a=name: memsum.digest(data, a)) for name in ("xxh3_64", "crc32")
            if name != "xxh3_64" or memsum.xxhash is not None]
    rows.append(("sha256 (storage)", lambda: hashlib.sha256(data).hexdigest()))
    print(f"checksum over {nbytes >> 20} MiB on one core (best of {repeats})")
    print(f"{'checksum':<18} | {'GiB/s':>7} | {'ms per 100 MiB':>14}")
    for name, run in rows:
        best = min(_timed(run) for _ in range(repeats))
        print(f"{name:<18} | {nbytes / 2**30 / best:7.2f} | {best / (nbytes / (100 << 20)) * 1e3:14.1f}")
    print(f"memory snapshots use: {memsum.default_algorithm()}")
    return 0


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _intervals(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _systems(text: str) -> list:
    return [s.strip() for s in text.split(",") if s.strip()]


# ============================================================================ rank side

def _error(e: BaseException) -> str:
    """``Type: message``, then where it was raised inside DeepSpeed, MoC or DCP (the
    innermost calls of those packages), which says more than the message alone."""
    inside = [f.name for f in traceback.extract_tb(e.__traceback__)
              if any(part in f.filename.replace(os.sep, "/") for part in
                     ("/deepspeed/", "/deepspeed_ext/", "/torch/distributed/checkpoint/"))]
    where = f" [raised in {' > '.join(inside[-4:])}]" if inside else ""
    # Some messages (torch.load's) carry terminal colour codes.
    return re.sub(r"\x1b\[[0-9;]*m", "", f"{type(e).__name__}: {e}") + where


def _evict_page_cache(root: str) -> None:
    """Write back and drop the page cache of every file under ``root`` (no root needed:
    ``posix_fadvise(DONTNEED)`` on files this user can read), so a load reads storage."""
    os.sync()
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


class _Bench:
    """What the systems share: the engine, the iteration loop, the process groups."""

    def __init__(self, engine, args, opts, rank: int, world: int, out_dir: str):
        from deepspeed.accelerator import get_accelerator
        from torch.distributed.constants import default_pg_timeout

        from deepspeed_ext.runtime.groups import new_host_group
        self.engine, self.args, self.opts = engine, args, opts
        self.rank, self.world, self.out_dir = rank, world, out_dir
        self.device = get_accelerator().current_device_name()
        self.batch = 0  # synthetic batches drawn so far (any phase)
        self.save_profiler = None  # rank 0, --profile-saves: a cProfile.Profile of the saves
        self.recovery_profiler = None  # --profile-recovery: of this rank's memory recovery
        # DCP's upload thread runs collectives while the training loop runs its own:
        # a group of its own keeps the two apart (torch's default timeout, as before).
        self.dcp_group = new_host_group(default_pg_timeout)
        self.expert_names = {n for n, p in engine.module.named_parameters()
                             if not getattr(p, "allreduce", True)}

    def iteration(self, peer=None, save_tag=None) -> float:
        """One training iteration (and a save after its step); returns its seconds."""
        engine, args = self.engine, self.args
        start = time.perf_counter()
        for micro in range(args.gradient_accumulation_steps):
            batch = cb._synthetic_batch(args, self.batch, micro, self.rank)
            tokens, positions, labels = (t.to(self.device) for t in batch)
            lm_loss, aux_loss, _ = engine(tokens, positions, labels)
            engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
            if peer is not None and micro == args.gradient_accumulation_steps - 1:
                peer.before_step()
            engine.step()
        self.batch += 1
        if save_tag is not None:
            peer.save(save_tag)
        return time.perf_counter() - start

    def barrier(self):
        cb.host_barrier()


class _Peer:
    """One system's turn: saves, the waits it imposes, draining, recovery, cleanup.

    Every save appends ``{"tag", "step", "call_s", "wait_s"}``: ``call_s`` is the save
    call, ``wait_s`` what the system made the loop wait besides (before the next
    optimizer step or the next save). Its stall is the sum.
    """

    def __init__(self, bench: _Bench, name: str, save_dir: str):
        self.bench, self.name, self.save_dir = bench, name, save_dir
        self.records = []

    def setup(self):
        pass

    def before_step(self):
        pass

    def save(self, tag: str):
        raise NotImplementedError

    def drain(self):
        """Wait until everything saved is on storage (not a stall: the run goes on)."""

    def recover(self) -> dict:
        raise NotImplementedError

    def host_memory_bytes(self):
        return None

    def close(self):
        pass

    def _add_wait(self, seconds: float, index: int = -1):
        if self.records:
            self.records[index]["wait_s"] += seconds

    def _record(self, tag: str, call_s: float):
        self.records.append({"tag": tag, "step": int(self.bench.engine.global_steps),
                             "call_s": call_s, "wait_s": 0.0})

    def _timed_load(self, load, from_storage: bool) -> float:
        """Seconds of ``load()`` on this rank, all ranks starting together."""
        if from_storage and self.bench.rank == 0:
            _evict_page_cache(self.save_dir)
        self.bench.barrier()
        start = time.perf_counter()
        load()
        return time.perf_counter() - start


class _DeepSpeedPeer(_Peer):
    """``engine.save_checkpoint``/``load_checkpoint``; with ``writer`` set, a checkpoint
    engine built from ``{"checkpoint": {"writer": writer}}`` is installed on the engine for
    this turn, the way DeepSpeed's ``_configure_checkpointing`` builds it from the config."""

    def __init__(self, bench, name, save_dir, writer=None):
        super().__init__(bench, name, save_dir)
        self.writer = writer
        self.original_engine = None
        engine = bench.engine
        # enable_moc_checkpointing keeps DeepSpeed's own methods under these names.
        self.ds_save = getattr(engine, "deepspeed_save_checkpoint", engine.save_checkpoint)
        self.ds_load = getattr(engine, "deepspeed_load_checkpoint", engine.load_checkpoint)

    def setup(self):
        if self.writer is None:
            return
        from deepspeed.runtime.checkpoint_engine import create_checkpoint_engine
        from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config
        from deepspeed.utils import groups
        engine = self.bench.engine
        config = copy.copy(engine._config)
        config.checkpoint_config = get_checkpoint_config({"checkpoint": {"writer": self.writer}})
        ckpt_engine = create_checkpoint_engine(
            config_params=config, groups=groups, zero_stage=engine.zero_optimization_stage(),
            has_moe_layers=engine.has_moe_layers,
            optimize_dp_state=not engine.zero_optimization_partition_weights())
        commit = ckpt_engine.commit

        def timed_commit(info):  # the decoupled engine's commit runs inside engine.step()
            start = time.perf_counter()
            try:
                return commit(info)
            finally:
                self._add_wait(time.perf_counter() - start)

        ckpt_engine.commit = timed_commit
        self.original_engine, engine.checkpoint_engine = engine.checkpoint_engine, ckpt_engine
        self.shared_before = self._shared_state_tensors()

    def _shared_state_tensors(self) -> int:
        """Tensors of the engine's state living in shared memory: putting a tensor on a
        torch.multiprocessing queue moves its storage there in place (share_memory_())."""
        import torch
        engine = self.bench.engine
        tensors = list(engine.module.parameters())
        tensors += list(getattr(engine.optimizer, "single_partition_of_fp32_groups", []))
        for state in engine.optimizer.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return sum(1 for t in tensors if t.is_shared())

    def save(self, tag):
        start = time.perf_counter()
        try:
            self.ds_save(self.save_dir, tag=tag, client_state={"benchmark_tag": tag})
        finally:
            self._record(tag, time.perf_counter() - start)

    def drain(self):
        engine = self.bench.engine
        if engine.checkpoint_engine.is_decoupled() and engine.checkpoint_engine.get_commit_info():
            engine._commit_decoupled_checkpoint()  # what the next engine.step() would do

    def recover(self):
        loaded = {}

        def load():
            loaded["path"], _ = self.ds_load(self.save_dir)

        seconds = self._timed_load(load, from_storage=True)
        if loaded["path"] is None:
            raise RuntimeError(f"engine.load_checkpoint found nothing in {self.save_dir}")
        return {"recovery_s": seconds, "recovery_storage_s": seconds,
                "recovered_step": int(self.bench.engine.global_steps), "load_source": "storage"}

    def close(self):
        engine = self.bench.engine
        if self.original_engine is None:
            return
        try:
            engine.checkpoint_engine.cleanup()  # commits what is pending, stops the writer
        finally:
            engine.checkpoint_engine = self.original_engine
            self.original_engine = None
        moved = self._shared_state_tensors() - self.shared_before
        if moved > 0:
            self.note = (f"{moved} tensors of the engine's state (this rank) were left in shared "
                         "memory by the writer queue; later turns ran with them there")


def _detached(obj):
    """``obj`` with every tensor detached (same storage), so that views of parameters that
    require grad can be staged and loaded into."""
    import torch
    if torch.is_tensor(obj):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_detached(v) for v in obj]
    return obj


class _DcpPeer(_Peer):
    """``torch.distributed.checkpoint.async_save`` of the module and the ZeRO optimizer's
    state. Keys: non-expert weights by name (replicated: DCP writes each once); this rank's
    experts and optimizer partition under ``rank<r>``. Loading is DCP's in-place load into
    the same live tensors, then the engine's counters."""

    def setup(self):
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        accelerator = torch.accelerator.is_available()
        # Pinned memory and non-blocking copies need an accelerator; on CPU the stager
        # copies into reused shared-memory storages, in a background thread.
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
            use_async_staging=True, use_non_blocking_copy=accelerator))
        self.staging = None
        self.upload = None

    def _state(self):
        bench, engine = self.bench, self.bench.engine
        optimizer = engine.optimizer
        model, experts = {}, {}
        for name, tensor in engine.module.state_dict().items():
            (experts if name in bench.expert_names else model)[name] = tensor
        return _detached({
            "model": model,
            f"rank{bench.rank}": {
                "experts": experts,
                "fp32_partitions": {str(i): t for i, t in
                                    enumerate(optimizer.single_partition_of_fp32_groups)},
                "base_optimizer": optimizer.optimizer.state_dict()},
            "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps}})

    def save(self, tag):
        import torch.distributed.checkpoint as dcp
        waited = 0.0
        if self.upload is not None:  # one upload at a time: wait for the previous one
            start = time.perf_counter()
            upload, self.upload = self.upload, None
            upload.result()
            waited = time.perf_counter() - start
        start = time.perf_counter()
        try:
            response = dcp.async_save(self._state(), checkpoint_id=os.path.join(self.save_dir, tag),
                                      process_group=self.bench.dcp_group, async_stager=self.stager)
        finally:
            self._record(tag, time.perf_counter() - start)
            self.records[-1]["wait_s"] += waited
        if hasattr(response, "staging_completion"):
            self.staging, self.upload = response.staging_completion, response.upload_completion
        else:  # staged synchronously
            self.upload = response

    def before_step(self):
        if self.staging is not None:  # the optimizer step must not change what is being copied
            start = time.perf_counter()
            staging, self.staging = self.staging, None
            staging.result()
            self._add_wait(time.perf_counter() - start)

    def drain(self):
        self.before_step()
        if self.upload is not None:
            upload, self.upload = self.upload, None
            upload.result()

    def recover(self):
        import torch
        import torch.distributed.checkpoint as dcp
        engine = self.bench.engine
        newest = os.path.join(self.save_dir, self.records[-1]["tag"])

        def load():
            target = self._state()
            with torch.no_grad():
                dcp.load(target, checkpoint_id=newest, process_group=self.bench.dcp_group)
            for key, value in target["engine"].items():
                setattr(engine, key, value)
            saved_groups = target[f"rank{self.bench.rank}"]["base_optimizer"]["param_groups"]
            for group, saved in zip(engine.optimizer.optimizer.param_groups, saved_groups):
                group.update({k: v for k, v in saved.items() if k != "params"})

        seconds = self._timed_load(load, from_storage=True)
        return {"recovery_s": seconds, "recovery_storage_s": seconds,
                "recovered_step": int(engine.global_steps), "load_source": "storage"}

    def host_memory_bytes(self):
        # The stager keeps one staging storage per source storage and reuses it; torch has
        # no public accessor, so this reads its private cache (None if that changes).
        stager = getattr(self.stager, "_state_dict_stager", None)
        cache = getattr(stager, "_cached_storage_mapping", None)
        if cache is None:
            return None
        return sum(int(s.nbytes()) for s in list(cache.values()))

    def close(self):
        if getattr(self, "stager", None) is not None:
            self.stager.close()


class _MoCPeer(_Peer):
    """MoC two-level checkpointing (``deepspeed_ext``): snapshot into the keeper's shared
    memory on every save, persist every ``persist_interval``-th snapshot."""

    def __init__(self, bench, name, save_dir, k_snapshot, k_persist):
        super().__init__(bench, name, save_dir)
        self.k_snapshot, self.k_persist = k_snapshot, k_persist
        self.moc = None
        self.seen = 0

    def setup(self):
        from deepspeed_ext.checkpointer import MoCCheckpointer
        from deepspeed_ext.config import MoCConfig
        opts = self.bench.opts
        shm_dir = os.path.join(opts.shm_root, os.path.basename(self.save_dir))
        config = MoCConfig(pec_k=self.k_persist, two_level=True, k_snapshot=self.k_snapshot,
                           persist_interval=opts.persist_interval, shm_dir=shm_dir)
        self.moc = MoCCheckpointer(self.bench.engine, config)

    def _collect_stalls(self):
        """moc.stall_s gets an entry at each optimizer step that waited for a snapshot's
        copy; the entries since the last save belong to that save."""
        stalls = list(self.moc.stall_s)
        self._add_wait(sum(stalls[self.seen:]))
        self.seen = len(stalls)

    def save(self, tag):
        self._collect_stalls()
        profiler = self.bench.save_profiler if self.bench.rank == 0 else None
        start = time.perf_counter()
        try:
            if profiler is not None:
                profiler.enable()
            self.moc.save(self.save_dir, tag=tag, client_state={"benchmark_tag": tag})
        finally:
            if profiler is not None:
                profiler.disable()
            self._record(tag, time.perf_counter() - start)

    def drain(self):
        self._collect_stalls()
        self.moc.wait()

    def recover(self):
        out = {}
        loaded = {}

        def load_memory():
            profiler = self.bench.recovery_profiler
            if profiler is not None:
                profiler.enable()
            try:
                loaded["memory"], _ = self.moc.load(self.save_dir)
            finally:
                if profiler is not None:
                    profiler.disable()

        out["recovery_memory_s"] = self._timed_load(load_memory, from_storage=False)
        out["recovery_s"] = out["recovery_memory_s"]
        out["load_source"] = getattr(self.moc, "last_load_source", None)
        out["recovered_step"] = int(self.bench.engine.global_steps)

        def load_storage():
            loaded["storage"], _ = self.moc.load(self.save_dir, from_memory=False)

        out["recovery_storage_s"] = self._timed_load(load_storage, from_storage=True)
        out["storage_source"] = getattr(self.moc, "last_load_source", None)
        out["recovered_step_storage"] = (int(self.bench.engine.global_steps)
                                         if loaded["storage"] is not None else None)
        return out

    def host_memory_bytes(self):
        return int(self.moc.host_memory_bytes())

    def close(self):
        if self.moc is not None:
            self.moc.shutdown()


def _make_peer(bench: _Bench, system: str, save_dir: str) -> _Peer:
    import torch
    opts = bench.opts
    # The fast (DeepNVMe/aio) writer pins memory through the accelerator: on CPU it stops
    # with "Cannot access accelerator device when none is available"; the python writer
    # is the setting that exists there.
    writer_type = "fast" if torch.accelerator.is_available() else "python"
    if system == "deepspeed":
        return _DeepSpeedPeer(bench, system, save_dir)
    if system == "deepspeed-decoupled":
        return _DeepSpeedPeer(bench, system, save_dir, {"type": writer_type, "decoupled": True})
    if system == "deepspeed-writer-sync":
        return _DeepSpeedPeer(bench, system, save_dir, {"type": writer_type, "decoupled": False})
    if system == "dcp-async":
        return _DcpPeer(bench, system, save_dir)
    if system == "moc-full":
        return _MoCPeer(bench, system, save_dir, opts.num_experts, opts.num_experts)
    if system == "moc-pec":
        return _MoCPeer(bench, system, save_dir, opts.pec_k_snapshot, opts.pec_k_persist)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def _timed_iters(opts, interval: int) -> int:
    """Timed iterations of a turn at ``interval``: ``--iters``, or enough for
    ``--min-saves`` checkpoints."""
    return max(opts.iters, interval * opts.min_saves)


def _run_phase(bench: _Bench, system: str, interval: int, save_dir: str) -> dict:
    """One system's turn (this rank's view). Iterations: as many without checkpoints as
    the turn times (its own reference: the machine's speed drifts between turns), a
    warm-up one with a save and a settling one (neither timed), the timed ones
    (:func:`_timed_iters`) saving after every ``interval``-th, and an untimed tail one,
    whose step still carries the wait the last save imposes. Errors end the turn and are
    reported, never raised."""
    out = {"iter_s": [], "records": [], "errors": [], "warmup": None}
    peer = None
    if bench.rank == 0:
        os.sync()  # no turn pays for the writeback of an earlier one
    bench.barrier()
    stage = "reference iterations"
    try:
        timed = _timed_iters(bench.opts, interval)
        out["ref_iter_s"] = [bench.iteration() for _ in range(timed)]
        stage = "setup"
        peer = _make_peer(bench, system, save_dir)
        peer.setup()
        stage = "warm-up save"
        bench.iteration(peer, save_tag=f"warmup_step{int(bench.engine.global_steps) + 1}")
        stage = "warm-up save reaching storage"
        peer.drain()  # so that no timed iteration pays for the warm-up's background work
        stage = "warm-up"
        bench.iteration(peer)
        for i in range(timed):
            save = (i + 1) % interval == 0
            tag = f"global_step{int(bench.engine.global_steps) + 1}" if save else None
            stage = f"save {tag}" if save else f"iteration {i}"
            out["iter_s"].append(bench.iteration(peer, save_tag=tag))
        stage = "tail iteration"
        bench.iteration(peer)
        stage = "waiting for the last save to reach storage"
        start = time.perf_counter()
        peer.drain()
        out["drain_s"] = time.perf_counter() - start
        out["records"] = peer.records[1:]
        out["warmup"] = peer.records[0] if peer.records else None
        stage = "host memory"
        out["host_mem_bytes"] = peer.host_memory_bytes()
        stage = "recovery"
        out["recovery"] = peer.recover()
    except Exception as e:  # reported in the table
        traceback.print_exc()
        out["errors"].append(f"{stage}: {_error(e)}")
        out["failed_early"] = stage in ("setup", "warm-up save", "warm-up save reaching storage")
        if peer is not None:
            out["records"] = peer.records[1:]
            out["warmup"] = peer.records[0] if peer.records else None
    finally:
        if peer is not None:
            try:
                peer.close()
            except Exception as e:
                traceback.print_exc()
                out["errors"].append(f"close: {_error(e)}")
            if getattr(peer, "note", None):
                out["note"] = peer.note
    return out


def _baseline(bench: _Bench) -> list:
    bench.barrier()
    bench.iteration()  # settle
    return [bench.iteration() for _ in range(bench.opts.iters)]


def _persisted_bytes(save_dir: str, tags: list) -> dict:
    """Rank 0: bytes under each timed tag's directory; every other file is listed as
    uncounted (the warm-up's, ``latest``, DeepSpeed's ``zero_to_*.py`` copies)."""
    found = cb._files_under(save_dir)
    per_tag, counted = {}, set()
    for tag in tags:
        prefix = os.path.abspath(os.path.join(save_dir, tag)) + os.sep
        files = {p: s for p, s in found.items() if p.startswith(prefix)}
        if files:
            per_tag[tag] = sum(files.values())
            counted.update(files)
    uncounted = {}
    for path, size in found.items():
        if path not in counted:
            top = os.path.relpath(path, save_dir).split(os.sep)[0]
            uncounted[top] = uncounted.get(top, 0) + size
    return {"bytes_per_tag": per_tag, "uncounted": uncounted}


def worker_main(opts) -> None:
    cb.run_worker(opts, _worker)


def _worker(opts, rank: int, world: int) -> None:
    import torch.distributed as dist
    engine, args, config = cb.build_engine(opts, rank, world)
    bench = _Bench(engine, args, opts, rank, world, opts.out_dir)
    bench.batch = opts.train_steps

    results = {
        "config": {**config, "gradient_accumulation_steps": args.gradient_accumulation_steps,
                   "iters": opts.iters, "min_saves": opts.min_saves,
                   "persist_interval": opts.persist_interval,
                   "pec_k_snapshot": opts.pec_k_snapshot, "pec_k_persist": opts.pec_k_persist},
        "baseline": {}, "phases": [], "current": None,
    }

    def write_results():
        if rank == 0:
            cb.write_results(opts.out_dir, results)

    def gather(value):
        return cb.gather_objects(value, world)

    def baseline(label: str):
        results["current"] = {"system": BASELINE, "label": label}
        write_results()
        results["baseline"][label] = gather(_baseline(bench))
        results["current"] = None
        write_results()

    baseline("before")
    failed_early = {}  # system -> why its setup or first save failed (same engine, same config)
    for interval in _intervals(opts.intervals):
        for system in _systems(opts.systems):
            save_dir = os.path.join(opts.out_dir, "ckpt", f"{system}-every{interval}")
            results["current"] = {"system": system, "interval": interval}
            write_results()
            started = time.perf_counter()
            if system in failed_early:
                out = {"iter_s": [], "records": [], "warmup": None,
                       "errors": [f"not run again: {failed_early[system]}"]}
            else:
                if opts.profile_saves and rank == 0 and system.startswith("moc"):
                    import cProfile
                    bench.save_profiler = cProfile.Profile()
                if opts.profile_recovery and system.startswith("moc"):
                    import cProfile
                    bench.recovery_profiler = cProfile.Profile()
                out = _run_phase(bench, system, interval, save_dir)
                if bench.save_profiler is not None:
                    _write_profile(bench.save_profiler, opts.profile_saves,
                                   f"{system} every {interval}: rank 0's save calls")
                    bench.save_profiler = None
                if bench.recovery_profiler is not None:
                    _write_profile(bench.recovery_profiler,
                                   opts.profile_recovery + (f".rank{rank}" if rank else ""),
                                   f"{system} every {interval}: rank {rank}'s memory recovery")
                    bench.recovery_profiler = None
            out["turn_s"] = time.perf_counter() - started
            per_rank = gather(out)
            early = [o["errors"][0] for o in per_rank if o.get("failed_early")]
            if early and system not in failed_early:
                failed_early[system] = (f"it failed before its timed iterations at every "
                                        f"{interval} (see that row)")
            phase = {"system": system, "interval": interval, "per_rank": per_rank}
            if rank == 0:
                tags = [r["tag"] for r in per_rank[0]["records"]]
                phase["storage"] = _persisted_bytes(save_dir, tags)
                if not opts.keep:
                    shutil.rmtree(save_dir, ignore_errors=True)
            results["phases"].append(phase)
            results["current"] = None
            write_results()
    baseline("after")
    results["complete"] = True
    write_results()
    cb.host_barrier()
    from megatron.training.training import remove_deepspeed_shm_buffers
    remove_deepspeed_shm_buffers()
    dist.destroy_process_group()


def _write_profile(profiler, path: str, title: str, top: int = 40) -> None:
    """Append the ``top`` functions by cumulative time of what ``profiler`` saw."""
    import io
    import pstats
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    with open(path, "a") as f:
        f.write(f"=== {title} ===\n{text.getvalue()}\n")


# ========================================================================= launcher side

def _launch(opts, out_dir: str, shm_root: str) -> tuple:
    """Start the ranks of this script; wait (with the timeout); (exit codes, timed out?)."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out-dir", out_dir,
            "--shm-root", shm_root]
    for name in WORKER_FLAGS:
        argv += ["--" + name.replace("_", "-"), str(getattr(opts, name))]
    if opts.keep:
        argv.append("--keep")
    if opts.profile_saves:
        argv += ["--profile-saves", os.path.abspath(opts.profile_saves)]
    if opts.profile_recovery:
        argv += ["--profile-recovery", os.path.abspath(opts.profile_recovery)]
    return cb.run_rank_processes(argv, opts.nproc, out_dir, opts.timeout)


def _stop_leftover_keepers(shm_root: str) -> list:
    """MoC keepers of this run that are still there (a rank died before shutdown): stop
    them through MoC's own call, then remove the run's shared-memory directory."""
    left = []
    if os.path.isdir(shm_root):
        for name in sorted(os.listdir(shm_root)):
            path = os.path.join(shm_root, name)
            left.append(name)
            try:
                from deepspeed_ext.keeper import shutdown_keeper
                shutdown_keeper(path, timeout_s=60)
            except Exception:
                pass
        shutil.rmtree(shm_root, ignore_errors=True)
    return left


def _max_per_index(lists: list) -> list:
    """Per position, the maximum over ranks (lists of equal length; shorter ones cut)."""
    n = min((len(x) for x in lists), default=0)
    return [max(x[i] for x in lists) for i in range(n)]


def _rows(results: dict, launch_error: str, opts) -> list:
    """The no-checkpoint reference row, then one row per (system, interval), failed
    ones included with their error."""
    baseline = [_max_per_index(v) for v in results.get("baseline", {}).values()]
    base_times = [t for part in baseline for t in part]
    base_mean = statistics.mean(base_times) if base_times else None
    rows = [{"system": BASELINE, "interval": None, "iter_s_mean": base_mean,
             "iter_s_mean_before": statistics.mean(baseline[0]) if baseline and baseline[0] else None,
             "iter_s_mean_after": (statistics.mean(baseline[1])
                                   if len(baseline) > 1 and baseline[1] else None),
             "iter_s": base_times}]
    if launch_error and (results.get("current") or {}).get("system") == BASELINE:
        rows[0]["error"] = launch_error
    done = {(p["system"], p["interval"]): p for p in results.get("phases", [])}
    current = results.get("current") or {}
    for interval in _intervals(opts.intervals):
        for system in _systems(opts.systems):
            row = {"system": system, "interval": interval, "checkpoints": 0,
                   "stall_s_median": None, "stall_s_max": None, "stall_s_mean": None,
                   "save_call_s_median": None, "wait_s_median": None, "iter_s_mean": None,
                   "iter_overhead": None, "recovery_s": None, "recovery_memory_s": None,
                   "recovery_storage_s": None, "recovered_step": None, "newest_step": None,
                   "recovered_step_storage": None, "load_source": None,
                   "bytes_persisted": None, "persists": None, "host_mem_bytes": None,
                   "drain_s": None, "error": None}
            phase = done.get((system, interval))
            if phase is None:
                if launch_error and current.get("system") == system and current.get("interval") == interval:
                    row["error"] = f"{launch_error}, during this turn"
                else:
                    row["error"] = f"not measured: {launch_error}" if launch_error else "no result"
                rows.append(row)
                continue
            per_rank = phase["per_rank"]
            errors = [(r, e) for r, out in enumerate(per_rank) for e in out["errors"]]
            if errors:
                row["error"] = cb._group_errors(errors)
            records = [out["records"] for out in per_rank]
            n = min(len(r) for r in records)
            stalls, calls, waits = [], [], []
            for i in range(n):
                # Waits of None (never reported) count as 0 in the stall.
                per = [(rec[i]["call_s"], rec[i]["wait_s"] or 0.0) for rec in records]
                stalls.append(max(c + w for c, w in per))
                calls.append(max(c for c, _ in per))
                waits.append(max(w for _, w in per))
            iter_s = _max_per_index([out["iter_s"] for out in per_rank])
            if stalls:
                row.update(checkpoints=n, stall_s_median=statistics.median(stalls),
                           stall_s_max=max(stalls), stall_s_mean=statistics.mean(stalls),
                           save_call_s_median=statistics.median(calls),
                           wait_s_median=statistics.median(waits), stall_s=stalls,
                           newest_step=records[0][n - 1]["step"],
                           # Each rank's own median: against the median of the max over
                           # ranks, it shows what waiting for the slowest rank adds.
                           save_call_s_median_per_rank=[
                               statistics.median(rec[i]["call_s"] for i in range(n))
                               for rec in records])
            ref_s = _max_per_index([out.get("ref_iter_s") or [] for out in per_rank])
            if ref_s:
                row["ref_iter_s_mean"] = statistics.mean(ref_s)
            if len(iter_s) == _timed_iters(opts, interval):
                row["iter_s_mean"] = statistics.mean(iter_s)
                row["iter_s"] = iter_s
                if row.get("ref_iter_s_mean"):
                    row["iter_overhead"] = row["iter_s_mean"] / row["ref_iter_s_mean"] - 1
            warm = [out["warmup"] for out in per_rank if out.get("warmup")]
            if warm:
                row["warmup_stall_s"] = max(w["call_s"] + (w["wait_s"] or 0.0) for w in warm)
                if row["newest_step"] is None:
                    row["newest_step"] = warm[0]["step"]
            if not stalls and not errors:
                row["note"] = (f"no checkpoint within the {_timed_iters(opts, interval)} timed "
                               f"iterations; recovery "
                               "loaded the warm-up's")
            drains = [out["drain_s"] for out in per_rank if out.get("drain_s") is not None]
            row["drain_s"] = max(drains) if drains else None
            row["turn_s"] = max(out.get("turn_s") or 0.0 for out in per_rank)
            recs = [out.get("recovery") for out in per_rank]
            if all(recs):
                for key in ("recovery_s", "recovery_memory_s", "recovery_storage_s"):
                    values = [r.get(key) for r in recs]
                    row[key] = max(values) if all(v is not None for v in values) else None
                row["recovered_step"] = recs[0].get("recovered_step")
                row["recovered_step_storage"] = recs[0].get("recovered_step_storage")
                row["load_source"] = recs[0].get("load_source")
                if recs[0].get("storage_source") is not None:
                    row["storage_load_source"] = recs[0]["storage_source"]
            hosts = [out.get("host_mem_bytes") for out in per_rank]
            if hosts and all(h is not None for h in hosts):
                row["host_mem_bytes"] = sum(hosts)
            storage = phase.get("storage") or {}
            if storage.get("bytes_per_tag") is not None and stalls:
                row["bytes_persisted"] = sum(storage["bytes_per_tag"].values())
                row["persists"] = int(len(storage["bytes_per_tag"]))
                row["bytes_per_tag"] = storage["bytes_per_tag"]
                row["uncounted_files"] = storage.get("uncounted")
            notes = [out["note"] for out in per_rank if out.get("note")]
            if notes:
                row["note"] = (row["note"] + "; " if row.get("note") else "") + notes[0]
            rows.append(row)
    return rows


_fmt = cb._fmt


def _print_table(rows: list) -> None:
    mib = float(2 ** 20)
    header = ["system", "every", "ckpts", "stall med (s)", "stall max (s)", "iter mean (s)",
              "ref iter (s)", "iter overhead", "persisted (MiB)", "persists", "host mem (MiB)",
              "recovery (s)", "from memory (s)", "from storage (s)", "loaded step / newest"]
    table = [header]
    for r in rows:
        if r["system"] == BASELINE:
            table.append([BASELINE, "-", "0", "-", "-", _fmt(r["iter_s_mean"], ".3f"), "-", "-"]
                         + ["-"] * (len(header) - 8))
            continue
        if r["stall_s_median"] is None and r["iter_s_mean"] is None:
            table.append([r["system"], str(r["interval"]), "FAILED"] + ["-"] * (len(header) - 3))
            continue
        steps = "-"
        if r["recovered_step"] is not None:
            steps = f"{r['recovered_step']} / {r['newest_step']}"
            if r.get("recovered_step_storage") is not None:
                steps += (f"; storage: {r['recovered_step_storage']}"
                          f" ({r.get('storage_load_source') or '?'})")
        overhead = "-" if r["iter_overhead"] is None else f"{100 * r['iter_overhead']:+.1f} %"
        table.append([r["system"], str(r["interval"]), str(r["checkpoints"]),
                      _fmt(r["stall_s_median"], ".4f"), _fmt(r["stall_s_max"], ".4f"),
                      _fmt(r["iter_s_mean"], ".3f"), _fmt(r.get("ref_iter_s_mean"), ".3f"), overhead,
                      _fmt(r["bytes_persisted"], ".1f", mib), "-" if r["persists"] is None else str(r["persists"]),
                      _fmt(r["host_mem_bytes"], ".1f", mib), _fmt(r["recovery_s"], ".3f"),
                      _fmt(r["recovery_memory_s"], ".3f"), _fmt(r["recovery_storage_s"], ".3f"),
                      steps])
    cb.print_aligned(table)
    for r in rows:
        label = r["system"] + (f" every {r['interval']}" if r.get("interval") else "")
        if r.get("error"):
            failed = r["system"] != BASELINE and r["stall_s_median"] is None and r["iter_s_mean"] is None
            lines = r["error"].splitlines()
            print(f"{label}: {'FAILED' if failed else 'error'}: {lines[0]}"
                  + (" [...] (whole message in --json)" if len(lines) > 1 else ""))
        if r.get("note"):
            print(f"{label}: note: {r['note']}")


def _ratio_text(a, b, spec=".3f") -> str:
    return "-" if a is None or not b else format(a / b, spec)


def _print_notes_and_checks(rows: list, opts) -> None:
    by_key = {(r["system"], r["interval"]): r for r in rows}
    intervals = _intervals(opts.intervals)
    print()
    print("stall: per checkpoint, max over ranks of the save call plus the waits the system "
          "imposes before the next optimizer step or save")
    print("       (deepspeed*: the save call; deepspeed-decoupled: + the commit inside the next "
          "engine.step(); dcp-async: + waiting for the staging")
    print("       before the next step and for the previous upload before the next save; moc-*: "
          "+ moc.stall_s). The warm-up save of each turn is excluded.")
    print("iter:  mean over the timed iterations of the max over ranks (forward, backward, step, "
          "save); overhead against the turn's own reference:")
    print("       the same number of iterations without checkpoints right before the turn "
          "(the no-checkpoint row: before the first turn and after the last).")
    print("bytes: files under the timed checkpoints' directories once everything is on storage "
          "(`latest`, warm-up and DeepSpeed's zero_to_*.py copies not counted).")
    print("recovery: max over ranks of loading the newest checkpoint into the engine; storage "
          "loads after os.sync() and posix_fadvise(DONTNEED) on the files.")
    base = by_key.get((BASELINE, None))
    if base and base.get("iter_s_mean_before") is not None and base.get("iter_s_mean_after") is not None:
        print(f"reference iteration: {base['iter_s_mean_before']:.3f} s before the turns, "
              f"{base['iter_s_mean_after']:.3f} s after them")
    print()
    print("checks (measured here, not asserted):")

    def failed(row):
        if row is None:
            return "not run"
        if row["stall_s_median"] is None:
            return "FAILED" if row.get("error") else "no timed checkpoint"
        return None

    mocs = [s for s in ("moc-full", "moc-pec") if s in _systems(opts.systems)]
    line = []
    for interval in intervals:
        ds = by_key.get(("deepspeed", interval))
        for moc in mocs:
            m = by_key.get((moc, interval))
            why = failed(m) or failed(ds)
            line.append(f"{moc} every {interval}: "
                        + (why or f"{100 * m['stall_s_median'] / ds['stall_s_median']:.2f} % "
                                   f"({m['stall_s_median']:.4f} s vs {ds['stall_s_median']:.4f} s)"))
    print("  1. MoC stall / deepspeed sync stall (medians; expected <= 2 %): "
          + ("; ".join(line) if line else "no MoC system run"))
    own = []
    for interval in intervals:
        for moc in mocs:
            m = by_key.get((moc, interval))
            if m and m.get("save_call_s_median_per_rank"):
                ranks = ", ".join(f"{1000 * c:.1f}" for c in m["save_call_s_median_per_rank"])
                own.append(f"{moc} every {interval}: {ranks} ms (max over ranks: "
                           f"{1000 * m['save_call_s_median']:.1f} ms)")
    if own:
        print("     each rank's own median save call, per rank: " + "; ".join(own))
    line = []
    for interval in intervals:
        for moc in mocs:
            m = by_key.get((moc, interval))
            for peer in ASYNC_PEERS:
                if peer not in _systems(opts.systems):
                    continue
                p = by_key.get((peer, interval))
                why = failed(m) or (f"{peer} {failed(p)}" if failed(p) else None)
                line.append(f"{moc}/{peer} every {interval}: "
                            + (why or _ratio_text(m["stall_s_median"], p["stall_s_median"])))
    print("  2. MoC stall / async peer's stall (medians; expected <= 0.5): "
          + ("; ".join(line) if line else "not measured"))
    line = []
    for moc in mocs:
        m = by_key.get((moc, 1))
        if 1 not in intervals:
            line.append(f"{moc}: interval 1 not run")
        elif failed(m) or m["iter_overhead"] is None:
            line.append(f"{moc}: {failed(m) or 'not measured'}")
        else:
            line.append(f"{moc}: {100 * m['iter_overhead']:+.1f} %")
    print("  3. iteration overhead of MoC checkpointing every iteration (expected <= 10 %): "
          + ("; ".join(line) if line else "no MoC system run"))
    line = []
    for interval in intervals:
        ds = by_key.get(("deepspeed", interval))
        for moc in mocs:
            m = by_key.get((moc, interval))
            if ds is None or ds["recovery_s"] is None:
                line.append(f"every {interval}: deepspeed recovery not measured")
                break
            if m is None or m["recovery_memory_s"] is None:
                line.append(f"{moc} every {interval}: memory recovery not measured")
                continue
            line.append(f"{moc} every {interval}: {ds['recovery_s'] / m['recovery_memory_s']:.1f}x "
                        f"({ds['recovery_s']:.3f} s vs {m['recovery_memory_s']:.3f} s)")
    print("  4. deepspeed load time / MoC recovery time from memory (expected >= 5x): "
          + ("; ".join(line) if line else "not measured"))


def _plot(rows: list, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nplot: matplotlib is not importable here; {path} not written "
              "(pip install matplotlib, then rerun)")
        return
    measured = [r for r in rows if r.get("stall_s")]
    if not measured:
        print(f"\nplot: no system measured a stall; {path} not written")
        return
    intervals = sorted({r["interval"] for r in measured})
    fig, axes = plt.subplots(1, len(intervals), figsize=(6 * len(intervals), 4.5), squeeze=False)
    from matplotlib.ticker import MaxNLocator
    for ax, interval in zip(axes[0], intervals):
        for r in measured:
            if r["interval"] != interval:
                continue
            xs = list(range(1, len(r["stall_s"]) + 1))
            ax.plot(xs, r["stall_s"], marker="o", markersize=3, label=r["system"])
        failed = [r["system"] for r in rows if r.get("interval") == interval
                  and r.get("error") and not r.get("stall_s")]
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"checkpoint (one every {interval} iteration{'s' if interval > 1 else ''})")
        ax.set_ylabel("stall per checkpoint (s, max over ranks)")
        ax.set_title(f"training-loop stall, checkpoint every {interval}"
                     + (f"\nFAILED (not plotted): {', '.join(failed)}" if failed else ""),
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}")


def launcher_main(opts) -> int:
    try:
        intervals, systems = _intervals(opts.intervals), _systems(opts.systems)
    except ValueError:
        print("error: --intervals must be a comma list of integers", file=sys.stderr)
        return 2
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(f"error: --systems: unknown {', '.join(unknown) or '(none given)'}; known: "
              f"{', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if (opts.nproc < 1 or opts.ep < 1 or opts.iters < 1 or opts.train_steps < 1
            or not intervals or min(intervals) < 1 or opts.persist_interval < 1
            or opts.min_saves < 1):
        print("error: --nproc, --ep, --iters, --min-saves, --train-steps, --intervals and "
              "--persist-interval must be >= 1", file=sys.stderr)
        return 2
    if opts.nproc % opts.ep or opts.num_experts % opts.ep:
        print(f"error: --nproc ({opts.nproc}) and --num-experts ({opts.num_experts}) must be "
              f"divisible by --ep ({opts.ep})", file=sys.stderr)
        return 2
    try:
        out_dir, created = cb.prepare_out_dir(opts.out_dir, "moc-two-level-bench-")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shm_root = tempfile.mkdtemp(prefix="moc-two-level-bench-", dir=shm_base)

    command = shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    print("MoC two-level checkpointing benchmark")
    print(f"command: {command}")
    print(f"machine: {os.cpu_count()} CPU cores, {platform.platform()}, {cb._versions()}")
    fs = cb._filesystem_of(out_dir)
    print(f"out dir: {out_dir}" + (f" ({fs})" if fs else "") + f"; MoC snapshots under {shm_root}")
    sys.stdout.flush()

    started = time.perf_counter()
    codes, timed_out = _launch(opts, out_dir, shm_root)
    wall = time.perf_counter() - started
    leftover = _stop_leftover_keepers(shm_root)
    results, launch_error = cb.read_results(out_dir, codes, timed_out, opts.timeout)
    config = dict(results.get("config", {}))
    cb.print_model(config)
    print(f"systems: moc-full: K_snapshot = K_persist = {opts.num_experts} (all), moc-pec: "
          f"K_snapshot = {opts.pec_k_snapshot}, K_persist = {opts.pec_k_persist}, both persisting "
          f"every {opts.persist_interval}th snapshot; deepspeed-decoupled / -writer-sync: "
          f"checkpoint.writer type {'fast' if _has_accelerator() else 'python'}")
    print(f"protocol: {opts.train_steps} training steps, then {opts.iters} reference iterations "
          f"without checkpoints; per interval ({opts.intervals}) and system in turn: 1 warm-up "
          f"iteration with a save + 1 more, max({opts.iters}, {opts.min_saves} x interval) timed "
          f"iterations (after as many reference ones), 1 tail iteration; "
          f"{opts.iters} reference iterations again at the end. Ranks ran {wall:.1f} s.")
    print()
    rows = _rows(results, launch_error, opts)
    config.update(nproc=opts.nproc, cpu_cores=os.cpu_count(), command=command)
    for row in rows:
        row["config"] = config
    _print_table(rows)
    _print_notes_and_checks(rows, opts)
    if leftover:
        print(f"\nMoC keepers still held snapshots after the ranks ended ({', '.join(leftover)}); "
              "stopped and removed")

    cb.print_failed_rank_logs(out_dir, codes, launch_error)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"\nwrote {opts.json}")
    plot = opts.plot or (os.path.splitext(opts.json)[0] + ".png" if opts.json else None)
    if plot:
        _plot(rows, plot, f"{command}\n{config.get('world_size', opts.nproc)} ranks, "
                          f"{os.cpu_count()} CPU cores")
    else:
        print("\nplot: not written (give --plot FILE.png or --json FILE)")
    cb.finish_out_dir(out_dir, created, opts.keep)
    return 1 if launch_error or any(r.get("error") for r in rows) else 0


def _has_accelerator() -> bool:
    try:
        import torch
        return torch.accelerator.is_available()
    except Exception:
        return False


def main() -> int:
    opts = build_parser().parse_args()
    if opts.checksum_speed:
        return checksum_speed()
    if opts.worker:
        worker_main(opts)
        return 0
    return launcher_main(opts)


if __name__ == "__main__":
    # Not sys.exit: a worker's clean end must not turn into a teardown abort (-6).
    sys.path.insert(0, REPO)
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(main())
