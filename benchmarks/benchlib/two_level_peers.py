"""The systems of ``two_level_bench.py`` on one engine: :class:`Bench` (what they share:
the engine, the iteration loop, the process groups) and one peer per system
(:func:`make_peer`): its saves, the waits it imposes, draining, recovery and cleanup.

Every rank builds the same peers and calls them in the same order (their saves and
loads run collectives)."""

import copy
import os
import time

from benchlib import host, ranks
from benchlib.model import synthetic_batch

SYSTEMS = ("deepspeed", "deepspeed-decoupled", "deepspeed-writer-sync", "dcp-async",
           "moc-full", "moc-pec")
ASYNC_PEERS = ("deepspeed-decoupled", "dcp-async")
BASELINE = "no-checkpoint"


class Bench:
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
            batch = synthetic_batch(args, self.batch, micro, self.rank)
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
        ranks.host_barrier()


class _Peer:
    """One system's turn: saves, the waits it imposes, draining, recovery, cleanup.

    Every save appends ``{"tag", "step", "call_s", "wait_s"}``: ``call_s`` is the save
    call, ``wait_s`` what the system made the loop wait besides (before the next
    optimizer step or the next save). Its stall is the sum.
    """

    def __init__(self, bench: Bench, name: str, save_dir: str):
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

    def startup(self) -> dict:
        """What setting the system up cost, outside the timed iterations (MoC: building
        the checkpointer and preparing its slots); empty for the others."""
        return {}

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
            host.evict_page_cache(self.save_dir)
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
        self.setup_s = None

    def setup(self):
        from deepspeed_ext.checkpointer import MoCCheckpointer
        from deepspeed_ext.config import MoCConfig
        opts = self.bench.opts
        shm_dir = os.path.join(opts.shm_root, os.path.basename(self.save_dir))
        config = MoCConfig(pec_k=self.k_persist, two_level=True, k_snapshot=self.k_snapshot,
                           persist_interval=opts.persist_interval, shm_dir=shm_dir)
        start = time.perf_counter()
        self.moc = MoCCheckpointer(self.bench.engine, config)
        self.setup_s = time.perf_counter() - start

    def startup(self) -> dict:
        """``setup_s``: the checkpointer's construction on this rank (its collectives, the
        keeper's start, the slots); ``prepare_s``: the part of it that prepared the slots
        (``TwoLevel.prepare_s``; None from a tree that does not measure it)."""
        two_level = getattr(self.moc, "two_level", None)
        prepare = getattr(two_level, "prepare_s", None)
        return {"setup_s": self.setup_s, "prepare_s": None if prepare is None else float(prepare)}

    def _attach_timings(self):
        """Give each save record its snapshot's stage times (``TwoLevel.timings``, matched
        by step) once sealed, as a plain dict under ``timing``. A tree whose snapshot path
        records none leaves the records without (the report shows ``-``)."""
        import dataclasses
        timings = list(getattr(getattr(self.moc, "two_level", None), "timings", None) or [])
        by_step = {int(t.step): t for t in timings if getattr(t, "sealed", False)}
        for record in self.records:
            found = by_step.get(record["step"])
            if found is not None and "timing" not in record:
                record["timing"] = dataclasses.asdict(found)

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
        self._attach_timings()  # every snapshot is sealed once the wait returns

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
            self._attach_timings()  # a failed turn: what was sealed before it failed
            self.moc.shutdown()


def make_peer(bench: Bench, system: str, save_dir: str) -> _Peer:
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


def parse_intervals(text: str) -> list:
    """``--intervals``: a comma list of iterations between checkpoints."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_systems(text: str) -> list:
    """``--systems``: a comma list of system names."""
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_system_iters(text: str) -> dict:
    """``--system-iters``: ``SYSTEM=N,...`` -> ``{SYSTEM: N}`` (ValueError if malformed)."""
    found = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        name, sep, count = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--system-iters: {part!r} is not SYSTEM=N")
        found[name.strip()] = int(count)
    return found


def timed_iters(opts, interval: int, system=None) -> int:
    """Timed iterations of ``system``'s turn at ``interval``: ``--iters``, or enough for
    ``--min-saves`` checkpoints; a system named in ``--system-iters`` gets its own count
    (at least one interval, so that it saves once)."""
    own = parse_system_iters(getattr(opts, "system_iters", "")).get(system)
    if own is not None:
        return max(own, interval)
    return max(opts.iters, interval * opts.min_saves)
