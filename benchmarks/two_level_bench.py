#!/usr/bin/env python
"""Two-level checkpointing benchmark: the training loop with a checkpoint every I iterations.

One run starts ``--nproc`` local ranks (gloo on CPU, NCCL on GPUs) and builds ONE GPT-MoE
DeepSpeed engine, the model and layout of ``checkpoint_bench.py``. The systems then take
turns on that engine: for each interval in ``--intervals`` and each system, ``--iters``
training iterations (at least ``--min-saves`` checkpoints' worth, 10 by default) with a
checkpoint every ``interval`` iterations, into the system's own directory, after the
system's setup and ``--warmup`` iterations with a save (not timed). Each turn sits between
two references (A/B/A): as many iterations without checkpoints right before it and right
after the system is closed; its overhead is against the mean of the two. Before the
first and after the last turn, ``--iters`` iterations without any checkpoint give the
no-checkpoint row. The systems:

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
checkpoint back into the engine (MoC: from memory and from storage). For MoC also, per
rank: the checkpointer's construction and the slot preparation in it (``setup_s``,
``prepare_s``), and each snapshot's stages (``TwoLevel.timings``: save call, copies, slot
wait, the step's host and device waits, copy, checksum, publish), with the saves that
persisted apart from those kept in memory only. The script prints a table and a table of
MoC's stage medians (``--json FILE`` writes the rows, with every save's stall and stage
times, ``--plot FILE.png`` plots the stalls); it asserts nothing about the numbers.

    python benchmarks/two_level_bench.py [--iters 30 --intervals 1,10] [--systems a,b]
                                         [--warmup 3] [--system-iters deepspeed=5]
                                         [--json FILE] [--plot FILE.png] [--out-dir DIR] [--keep]
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_bench as cb  # noqa: E402  (the model's flags and their defaults)
from benchlib import host, launch, ranks, tables  # noqa: E402  (the rank helpers)
from benchlib.model import build_engine  # noqa: E402
from benchlib.two_level_peers import (BASELINE, SYSTEMS, Bench, make_peer,  # noqa: E402
                                      parse_intervals, parse_system_iters, parse_systems,
                                      timed_iters)
from benchlib.two_level_report import (plot_stalls, print_notes_and_checks,  # noqa: E402
                                       print_stage_table, print_table, table_rows)

REPO = ranks.REPO

# Flags forwarded from the launcher to every rank (the rest only concern the launcher).
WORKER_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "seq_length", "num_experts", "expert_interval", "topk", "micro_batch_size",
                "train_steps", "zero_stage", "ep", "seed", "iters", "intervals", "systems",
                "persist_interval", "pec_k_snapshot", "pec_k_persist", "min_saves", "warmup",
                "system_iters")


def build_parser() -> argparse.ArgumentParser:
    model = cb.build_parser().parse_args([])  # checkpoint_bench's model: same defaults
    p = argparse.ArgumentParser(
        description="Training-loop stall, iteration overhead, bytes and recovery time of "
                    "checkpointing every I iterations: DeepSpeed, its decoupled writer, "
                    "torch DCP async_save and MoC two-level; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_flags(p, model)
    g = p.add_argument_group("measurement and output")
    _add_turn_flags(g)
    _add_output_flags(g)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm-root", help=argparse.SUPPRESS)
    return p


def _add_model_flags(p: argparse.ArgumentParser, model: argparse.Namespace) -> None:
    """The layout and model groups, with ``model``'s (checkpoint_bench.py's) defaults."""
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


def _add_turn_flags(g) -> None:
    """What each turn runs: its iterations, warm-up, intervals, systems and their settings."""
    g.add_argument("--iters", type=int, default=30,
                   help="Timed training iterations per (system, interval) (at least "
                        "--min-saves checkpoints' worth), and of the no-checkpoint rows.")
    g.add_argument("--warmup", type=int, default=3,
                   help="Iterations with a save at the start of each turn, not timed (first "
                        "uses); their saves' stalls are reported on their own.")
    g.add_argument("--system-iters", default="", metavar="SYSTEM=N,...",
                   help="Timed iterations (and reference ones) for these systems instead "
                        "(at least one interval's worth), e.g. deepspeed=5 where its "
                        "synchronous saves take seconds each.")
    g.add_argument("--no-recovery", action="store_true",
                   help="Skip the recovery loads at the end of each turn (they take seconds "
                        "per GB of state; the saves are measured all the same).")
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


def _add_output_flags(g) -> None:
    """Profiles, the JSON and plot, the out dir, the time limit and the checksum table."""
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
                   help="Only measure the memory checksums (deepspeed_ext.format.memsum: the "
                        "one-pass ones and the chunked one on 1, 2 and the default number of "
                        "threads) against SHA-256 over 1 GiB, print a table and exit.")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _error(e: BaseException) -> str:
    """``Type: message``, then where it was raised inside DeepSpeed, MoC or DCP (the
    innermost calls of those packages), which says more than the message alone."""
    inside = [f.name for f in traceback.extract_tb(e.__traceback__)
              if any(part in f.filename.replace(os.sep, "/") for part in
                     ("/deepspeed/", "/deepspeed_ext/", "/torch/distributed/checkpoint/"))]
    where = f" [raised in {' > '.join(inside[-4:])}]" if inside else ""
    # Some messages (torch.load's) carry terminal colour codes.
    return re.sub(r"\x1b\[[0-9;]*m", "", f"{type(e).__name__}: {e}") + where


def checksum_speed(nbytes: int = 1 << 30, repeats: int = 3) -> int:
    """Print GiB/s of each checksum a snapshot could use (best of ``repeats``): the
    one-pass ones of earlier versions, the chunked default on 1, 2 and
    ``memsum.default_threads()`` threads, and storage's SHA-256 (one core)."""
    import hashlib
    sys.path.insert(0, REPO)
    from deepspeed_ext.format import memsum
    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    rows = [(f"{name} (one pass)", lambda a=name: memsum.digest(data, a))
            for name in ("xxh3_64", "crc32") if name != "xxh3_64" or memsum.xxhash is not None]
    chunked = memsum.default_algorithm()
    for threads in sorted({1, 2, memsum.default_threads()}):
        rows.append((f"{chunked} x{threads}",
                     lambda t=threads: memsum.digest(data, chunked, threads=t)))
    rows.append(("sha256 (storage)", lambda: hashlib.sha256(data).hexdigest()))
    print(f"checksum over {nbytes >> 20} MiB (best of {repeats}; xN: N threads)")
    print(f"{'checksum':<22} | {'GiB/s':>7} | {'ms per 100 MiB':>14}")
    for name, run in rows:
        best = min(_timed(run) for _ in range(repeats))
        print(f"{name:<22} | {nbytes / 2**30 / best:7.2f} | {best / (nbytes / (100 << 20)) * 1e3:14.1f}")
    print(f"memory snapshots use: {chunked}, {memsum.default_threads()} thread(s) by default "
          f"(--moc-checksum-threads)")
    return 0


# ============================================================================ rank side


EARLY_STAGES = ("setup", "warm-up save", "warm-up save reaching storage")
"""Stages of a turn whose failure ends the system's turns at every later interval too."""


def _run_phase(bench: Bench, system: str, interval: int, save_dir: str) -> dict:
    """One system's turn (this rank's view), between two references (A/B/A): as many
    iterations without checkpoints as the turn times before it and again after the
    system is closed (the machine's speed drifts between turns and within one). The turn:
    the system's setup (``startup``: MoC's checkpointer and slot preparation, outside
    every timed iteration), ``--warmup`` iterations each with a save (first uses; their
    stalls are reported on their own), a drain and a settling iteration (none timed), the
    timed ones (:func:`timed_iters`) saving after every ``interval``-th, and an untimed
    tail one, whose step still carries the wait the last save imposes. Every save record
    of a timed iteration gets its index there (``iteration``). Errors end the turn and are
    reported, never raised."""
    turn = _Turn(bench, system, interval, save_dir)
    if bench.rank == 0:
        os.sync()  # no turn pays for the writeback of an earlier one
    bench.barrier()
    try:
        turn.measure()
    except Exception as e:  # reported in the table
        traceback.print_exc()
        turn.out["errors"].append(f"{turn.stage}: {_error(e)}")
        turn.out["failed_early"] = turn.stage in EARLY_STAGES
    finally:
        turn.close()
    turn.reference_after()
    return turn.out


class _Turn:
    """The parts of :func:`_run_phase`: what the turn measured so far (``out``), the
    stage it is in (named in the error that ends it) and the system's peer (None until
    its setup)."""

    def __init__(self, bench: Bench, system: str, interval: int, save_dir: str):
        self.bench, self.system, self.interval, self.save_dir = bench, system, interval, save_dir
        self.timed = timed_iters(bench.opts, interval, system)
        self.warmups = max(1, bench.opts.warmup)
        self.out = {"iter_s": [], "records": [], "errors": [], "warmup_records": [],
                    "startup": {}}
        self.peer = None
        self.stage = "reference iterations"

    def measure(self) -> None:
        """The reference before, the setup, the warm-up, the timed iterations, the drain
        and the recovery; raises what the system raised (``stage`` says where)."""
        self.out["ref_iter_s"] = [self.bench.iteration() for _ in range(self.timed)]
        self.stage = "setup"
        self.peer = make_peer(self.bench, self.system, self.save_dir)
        self.peer.setup()
        self.out["startup"] = self.peer.startup()
        self._warm_up()
        self._timed_iterations()
        self._drain_and_recover()

    def _warm_up(self) -> None:
        bench, peer = self.bench, self.peer
        for _ in range(self.warmups):
            self.stage = "warm-up save"
            bench.iteration(peer, save_tag=f"warmup_step{int(bench.engine.global_steps) + 1}")
        self.stage = "warm-up save reaching storage"
        peer.drain()  # so that no timed iteration pays for the warm-up's background work
        self.stage = "warm-up"
        bench.iteration(peer)

    def _timed_iterations(self) -> None:
        bench, peer = self.bench, self.peer
        for i in range(self.timed):
            save = (i + 1) % self.interval == 0
            tag = f"global_step{int(bench.engine.global_steps) + 1}" if save else None
            self.stage = f"save {tag}" if save else f"iteration {i}"
            self.out["iter_s"].append(bench.iteration(peer, save_tag=tag))
            if save:
                peer.records[-1]["iteration"] = i
        self.stage = "tail iteration"
        bench.iteration(peer)

    def _drain_and_recover(self) -> None:
        self.stage = "waiting for the last save to reach storage"
        start = time.perf_counter()
        self.peer.drain()
        self.out["drain_s"] = time.perf_counter() - start
        self.stage = "host memory"
        self.out["host_mem_bytes"] = self.peer.host_memory_bytes()
        if not self.bench.opts.no_recovery:
            self.stage = "recovery"
            self.out["recovery"] = self.peer.recover()

    def close(self) -> None:
        """Close the peer (if its setup got that far) and take its save records."""
        peer = self.peer
        if peer is None:
            return
        try:
            peer.close()
        except Exception as e:
            traceback.print_exc()
            self.out["errors"].append(f"close: {_error(e)}")
        if getattr(peer, "note", None):
            self.out["note"] = peer.note
        # After close: MoC attaches its stage times to the records there too.
        self.out["warmup_records"] = peer.records[:self.warmups]
        self.out["records"] = peer.records[self.warmups:]

    def reference_after(self) -> None:
        """The reference after: every rank gets here (errors of the turn are caught), so
        every rank runs these iterations' collectives, as it runs the next turn's
        reference."""
        try:
            self.bench.iteration()  # settle: the first iteration after a recovery load is slower
            self.out["ref_after_iter_s"] = [self.bench.iteration() for _ in range(self.timed)]
        except Exception as e:
            traceback.print_exc()
            self.out["errors"].append(f"reference iterations after the turn: {_error(e)}")


def _baseline(bench: Bench) -> list:
    bench.barrier()
    bench.iteration()  # settle
    return [bench.iteration() for _ in range(bench.opts.iters)]


def _persisted_bytes(save_dir: str, tags: list) -> dict:
    """Rank 0: bytes under each timed tag's directory; every other file is listed as
    uncounted (the warm-up's, ``latest``, DeepSpeed's ``zero_to_*.py`` copies)."""
    found = host.files_under(save_dir)
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
    ranks.run_worker(opts, _worker)


def _worker(opts, rank: int, world: int) -> None:
    """Every rank: the engine, the no-checkpoint reference, each (interval, system) turn
    in order, the reference again, the teardown (every rank calls the same collectives in
    the same order; rank 0 publishes the results after each step)."""
    engine, args, config = build_engine(opts, rank, world)
    bench = Bench(engine, args, opts, rank, world, opts.out_dir)
    bench.batch = opts.train_steps
    config = {**config, "gradient_accumulation_steps": args.gradient_accumulation_steps,
              "iters": opts.iters, "min_saves": opts.min_saves, "warmup": opts.warmup,
              "system_iters": opts.system_iters, "persist_interval": opts.persist_interval,
              "pec_k_snapshot": opts.pec_k_snapshot, "pec_k_persist": opts.pec_k_persist}
    run = _RankRun(bench, config)
    run.baseline("before")
    for interval in parse_intervals(opts.intervals):
        for system in parse_systems(opts.systems):
            run.turn(system, interval)
    run.baseline("after")
    run.results["complete"] = True
    run.publish()
    ranks.finish_rank()


class _RankRun:
    """One rank's side of the run (:func:`_worker`): the results rank 0 keeps publishing
    (the launcher reads them even after a crash: ``current`` names what was running) and
    the systems whose setup or first save failed (same engine, same config: not run at
    later intervals)."""

    def __init__(self, bench: Bench, config: dict):
        self.bench, self.opts, self.rank, self.world = bench, bench.opts, bench.rank, bench.world
        self.results = {"config": config, "baseline": {}, "phases": [], "current": None}
        self.failed_early = {}  # system -> why its setup or first save failed

    def publish(self) -> None:
        if self.rank == 0:
            ranks.write_results(self.opts.out_dir, self.results)

    def baseline(self, label: str) -> None:
        """The no-checkpoint iterations (``before`` the first turn, ``after`` the last)."""
        self.results["current"] = {"system": BASELINE, "label": label}
        self.publish()
        self.results["baseline"][label] = ranks.gather_objects(_baseline(self.bench), self.world)
        self.results["current"] = None
        self.publish()

    def turn(self, system: str, interval: int) -> None:
        """One system's turn at ``interval``, every rank's results gathered; rank 0 adds
        the bytes it persisted and removes its checkpoints (unless ``--keep``)."""
        save_dir = os.path.join(self.opts.out_dir, "ckpt", f"{system}-every{interval}")
        self.results["current"] = {"system": system, "interval": interval}
        self.publish()
        started = time.perf_counter()
        if system in self.failed_early:
            out = {"iter_s": [], "records": [], "warmup_records": [], "startup": {},
                   "errors": [f"not run again: {self.failed_early[system]}"]}
        else:
            out = self._profiled_phase(system, interval, save_dir)
        out["turn_s"] = time.perf_counter() - started
        per_rank = ranks.gather_objects(out, self.world)
        early = [o["errors"][0] for o in per_rank if o.get("failed_early")]
        if early and system not in self.failed_early:
            self.failed_early[system] = (f"it failed before its timed iterations at every "
                                         f"{interval} (see that row)")
        phase = {"system": system, "interval": interval, "per_rank": per_rank}
        if self.rank == 0:
            tags = [r["tag"] for r in per_rank[0]["records"]]
            phase["storage"] = _persisted_bytes(save_dir, tags)
            if not self.opts.keep:
                shutil.rmtree(save_dir, ignore_errors=True)
        self.results["phases"].append(phase)
        self.results["current"] = None
        self.publish()

    def _profiled_phase(self, system: str, interval: int, save_dir: str) -> dict:
        """:func:`_run_phase`, with the ``--profile-saves`` / ``--profile-recovery``
        profilers of a MoC system around it."""
        opts, bench, rank = self.opts, self.bench, self.rank
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
        return out


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
    argv = launch.worker_argv(__file__, out_dir, opts, WORKER_FLAGS, shm_root=shm_root)
    if opts.keep:
        argv.append("--keep")
    if opts.no_recovery:
        argv.append("--no-recovery")
    if opts.profile_saves:
        argv += ["--profile-saves", os.path.abspath(opts.profile_saves)]
    if opts.profile_recovery:
        argv += ["--profile-recovery", os.path.abspath(opts.profile_recovery)]
    return ranks.run_rank_processes(argv, opts.nproc, out_dir, opts.timeout)


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


def _option_error(opts):
    """Why the options cannot run (the ``error:`` line), or None."""
    try:
        intervals, systems = parse_intervals(opts.intervals), parse_systems(opts.systems)
    except ValueError:
        return "--intervals must be a comma list of integers"
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        return (f"--systems: unknown {', '.join(unknown) or '(none given)'}; known: "
                f"{', '.join(SYSTEMS)}")
    try:
        own_iters = parse_system_iters(opts.system_iters)
    except ValueError as err:
        return str(err)
    if (opts.nproc < 1 or opts.ep < 1 or opts.iters < 1 or opts.train_steps < 1
            or not intervals or min(intervals) < 1 or opts.persist_interval < 1
            or opts.min_saves < 1 or opts.warmup < 1 or min(own_iters.values(), default=1) < 1):
        return ("--nproc, --ep, --iters, --min-saves, --warmup, --train-steps, --intervals, "
                "--persist-interval and every --system-iters count must be >= 1")
    if set(own_iters) - set(SYSTEMS):
        return (f"--system-iters: unknown {', '.join(sorted(set(own_iters) - set(SYSTEMS)))}; "
                f"known: {', '.join(SYSTEMS)}")
    if opts.nproc % opts.ep or opts.num_experts % opts.ep:
        return (f"--nproc ({opts.nproc}) and --num-experts ({opts.num_experts}) must be "
                f"divisible by --ep ({opts.ep})")
    return None


def _print_protocol(opts, wall: float) -> None:
    """The systems' settings and what each turn ran (``wall``: the ranks' seconds)."""
    print(f"systems: moc-full: K_snapshot = K_persist = {opts.num_experts} (all), moc-pec: "
          f"K_snapshot = {opts.pec_k_snapshot}, K_persist = {opts.pec_k_persist}, both persisting "
          f"every {opts.persist_interval}th snapshot; deepspeed-decoupled / -writer-sync: "
          f"checkpoint.writer type {'fast' if _has_accelerator() else 'python'}")
    own = f" ({opts.system_iters} instead for those)" if opts.system_iters else ""
    print(f"protocol: {opts.train_steps} training steps, then {opts.iters} reference iterations "
          f"without checkpoints; per interval ({opts.intervals}) and system in turn: as many "
          f"reference iterations as it times, the system's setup (not timed), {opts.warmup} "
          f"warm-up iterations with a save + 1 more, max({opts.iters}, {opts.min_saves} x "
          f"interval){own} timed iterations, 1 tail iteration, "
          f"{'no recovery, ' if opts.no_recovery else 'the recovery loads, '}the system closed, "
          f"as many reference iterations again (A/B/A); {opts.iters} reference iterations again "
          f"at the end. Ranks ran {wall:.1f} s.")


def _print_report(rows: list, opts, leftover: list) -> None:
    """The tables, the notes and checks, and the keepers left behind (if any)."""
    print_table(rows)
    print_stage_table(rows)
    print_notes_and_checks(rows, opts)
    if leftover:
        print(f"\nMoC keepers still held snapshots after the ranks ended ({', '.join(leftover)}); "
              "stopped and removed")


def _write_outputs(rows: list, opts, command: str, config: dict) -> None:
    """``--json`` and the plot (``--plot``, else the JSON's path with ``.png``)."""
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"\nwrote {opts.json}")
    plot = opts.plot or (os.path.splitext(opts.json)[0] + ".png" if opts.json else None)
    if plot:
        plot_stalls(rows, plot, f"{command}\n{config.get('world_size', opts.nproc)} ranks, "
                          f"{os.cpu_count()} CPU cores")
    else:
        print("\nplot: not written (give --plot FILE.png or --json FILE)")


def launcher_main(opts) -> int:
    problem = _option_error(opts)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    prepared = launch.out_dir_or_error(opts.out_dir, "moc-two-level-bench-")
    if prepared is None:
        return 2
    out_dir, created = prepared
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shm_root = tempfile.mkdtemp(prefix="moc-two-level-bench-", dir=shm_base)

    command = launch.command_line()
    launch.print_header("MoC two-level checkpointing benchmark", command)
    fs = host.filesystem_of(out_dir)
    print(f"out dir: {out_dir}" + (f" ({fs})" if fs else "") + f"; MoC snapshots under {shm_root}")
    sys.stdout.flush()

    started = time.perf_counter()
    codes, timed_out = _launch(opts, out_dir, shm_root)
    wall = time.perf_counter() - started
    leftover = _stop_leftover_keepers(shm_root)
    results, launch_error = ranks.read_results(out_dir, codes, timed_out, opts.timeout)
    config = dict(results.get("config", {}))
    tables.print_model(config)
    _print_protocol(opts, wall)
    print()
    rows = table_rows(results, launch_error, opts)
    config.update(nproc=opts.nproc, cpu_cores=os.cpu_count(), command=command)
    for row in rows:
        row["config"] = config
    _print_report(rows, opts, leftover)
    ranks.print_failed_rank_logs(out_dir, codes, launch_error)
    _write_outputs(rows, opts, command, config)
    ranks.finish_out_dir(out_dir, created, opts.keep)
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
    return launch.launcher_or_worker(opts, worker_main, launcher_main)


if __name__ == "__main__":
    launch.exit_after(main)
