#!/usr/bin/env python
"""Snapshot redundancy benchmark: what protecting two-level snapshots in peers' memory
costs, and how fast a lost node comes back from its peers compared with storage.

One run starts ``--nproc`` local ranks as ``--nproc / --ranks-per-node`` simulated nodes
(each with its own keeper and shared memory) and builds ONE GPT-MoE DeepSpeed engine, the
model and layout of ``checkpoint_bench.py``. Each mode in ``--modes`` then takes a turn:

1. ``--iters`` training iterations with a two-level snapshot after every one (every
   expert; every ``--persist-interval``-th snapshot also persisted to storage), with
   ``--moc-redundancy`` set to the mode (``none``, ``replicate`` with ``--replicas``,
   ``erasure`` with ``--ec-data`` data nodes plus one XOR parity per group);
2. everything is drained (persisted, protected), then node ``--lost-node`` loses its
   keeper and shared memory (MoC's own lose-memory fault);
3. a fresh checkpointer (as after a restart) loads: from memory with the peers' help
   where the mode allows, else from storage; then, for comparison, from storage alone.

Measured per mode: bytes each rank sends per snapshot, the seconds until a snapshot is
protected (its redundancy complete) and the resulting bandwidth, host memory held for
peers per rank, the mean iteration time (the redundancy runs in a background thread
beside training), the stall per snapshot, and the recovery times. The script prints a
table (``--json FILE`` writes it, ``--plot FILE.png`` draws the times); it asserts
nothing about the numbers.

    python benchmarks/redundancy_bench.py [--nproc 4 --ranks-per-node 1 --iters 12]
                                          [--modes none,replicate,erasure] [--json FILE]
                                          [--plot FILE.png]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_bench as cb  # noqa: E402  (the model's flags and their defaults)
from benchlib import launch, ranks  # noqa: E402  (the rank helpers)
from benchlib.model import build_engine, synthetic_batch  # noqa: E402
from benchlib.host import evict_page_cache  # noqa: E402

REPO = ranks.REPO
MODES = ("none", "replicate", "erasure")
TURNS = ",".join(["none,replicate,erasure,replicate:5,erasure:5"] * 2)
"""The default turns: two interleaved rounds (each mode's row pools its turns)."""
WORKER_FLAGS = cb.MODEL_FLAGS + ("nproc", "iters", "modes", "ranks_per_node", "replicas",
                                 "ec_data", "persist_interval", "lost_node")


def build_parser() -> argparse.ArgumentParser:
    p = cb.build_parser()
    p.description = ("Cost of snapshot redundancy across simulated nodes (replicate, erasure) "
                     "and recovery of a lost node from peers vs. storage; prints a table.")
    g = p.add_argument_group("redundancy")
    g.add_argument("--modes", default=TURNS, help="Comma-separated turns, each MODE or "
                   f"MODE:N (protect every N-th snapshot), MODE from {', '.join(MODES)}.")
    g.add_argument("--ranks-per-node", type=int, default=1,
                   help="Ranks per simulated node (--moc-ranks-per-node).")
    g.add_argument("--replicas", type=int, default=1, help="--moc-replicas for replicate.")
    g.add_argument("--ec-data", type=int, default=0,
                   help="--moc-ec-data for erasure; 0: nodes - 1 (one group of all nodes).")
    g.add_argument("--iters", type=int, default=12, help="Timed iterations per mode.")
    g.add_argument("--persist-interval", type=int, default=5,
                   help="Persist every N-th snapshot to storage.")
    g.add_argument("--lost-node", type=int, default=1, help="The node that loses its memory.")
    g.add_argument("--plot", metavar="FILE.png", help="Write a bar chart of the times here.")
    g.add_argument("--shm-root", help=argparse.SUPPRESS)
    return p


# ============================================================================ rank side

def _iteration(engine, args, batch: int, rank: int) -> float:
    start = time.perf_counter()
    for micro in range(args.gradient_accumulation_steps):
        tokens, positions, labels = synthetic_batch(args, batch, micro, rank)
        lm_loss, aux_loss, _ = engine(tokens, positions, labels)
        engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
        engine.step()
    return time.perf_counter() - start


def _split(turn: str) -> tuple:
    """``mode[:interval]`` -> (mode, interval)."""
    mode, _, every = turn.partition(":")
    return mode, int(every or 1)


def _valid(turn: str) -> bool:
    try:
        mode, every = _split(turn)
    except ValueError:
        return False
    return mode in MODES and every > 0


def _config(opts, turn: str, name: str):
    from deepspeed_ext.config import MoCConfig
    nodes = opts.nproc // opts.ranks_per_node
    mode, every = _split(turn)
    return MoCConfig(pec_k=0, two_level=True, persist_interval=opts.persist_interval,
                     shm_dir=os.path.join(opts.shm_root, name),
                     ranks_per_node=opts.ranks_per_node, redundancy=mode,
                     replicas=opts.replicas, ec_data=opts.ec_data or max(1, nodes - 1),
                     redundancy_interval=every)


def _wait_for_persist(two, timeout_s: float = 300.0) -> None:
    """Until the pending persist (if any) is committed or failed."""
    from deepspeed_ext.store import commit
    if two.persist is None:
        return
    tag_dir = os.path.join(two.persist.save_dir, two.persist.tag)
    deadline = time.monotonic() + timeout_s
    while commit.commit_outcome(tag_dir, two.world) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tag_dir} not committed within {timeout_s:.0f} s")
        time.sleep(0.05)


def _timed(fn, cold: str = "") -> tuple:
    """``fn()`` on every rank, started together; ``cold``: a directory whose files are
    dropped from the page cache first (as if storage were another machine's)."""
    import torch.distributed as dist
    if cold and dist.get_rank() == 0:
        evict_page_cache(cold)
    ranks.host_barrier()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _turn(engine, args, opts, rank: int, index: int, mode: str, batch: int) -> dict:
    """One mode: train with snapshots, drain, lose a node, recover (every rank)."""
    from deepspeed_ext.checkpointer import MoCCheckpointer
    from deepspeed_ext.peers import image_end
    name = f"{index}-{mode.replace(':', '-')}"
    save_dir = os.path.join(opts.out_dir, "ckpt", name)
    moc = MoCCheckpointer(engine, _config(opts, mode, name))
    two = moc.two_level
    out = {"mode": mode, "iter_s": [], "errors": []}
    _iteration(engine, args, batch, rank)  # warm-up: the slots are created here
    moc.save(save_dir, client_state={"batch": batch})
    batch += 1
    two.join_copy()
    if two.redundancy is not None:
        two.redundancy.wait_slots()
    first_protected = len(two.redundancy.protected) if two.redundancy is not None else 0
    stalls_before = len(moc.stall_s)
    ranks.host_barrier()
    for _ in range(opts.iters):
        out["iter_s"].append(_iteration(engine, args, batch, rank))
        moc.save(save_dir, client_state={"batch": batch})
        batch += 1
    out["stall_s"] = list(moc.stall_s[stalls_before:])
    # The node dies once the copies and the redundancy of the snapshots so far are done
    # and the last persist that was due is committed; the newer snapshots are in memory
    # only (as in a running job, where storage lags behind by up to the persist interval).
    two.join_copy()
    if two.redundancy is not None:
        two.redundancy.wait_slots()
    _wait_for_persist(two)
    if two.redundancy is not None:
        done = two.redundancy.protected[first_protected:]
        out["protect_s"] = [s for _, _, s in done]
        out["sent_bytes"] = [b for _, b, _ in done]
        out["peer_bytes"] = two.redundancy.store.host_bytes()
        out["redundancy_failed"] = two.redundancy.failed
        out["redundancy_wait_s"] = two.redundancy_wait_s
    out["slot_bytes"] = two.slots.host_bytes()
    out["snapshot_bytes"] = max(image_end(m) for _, m in two.slots.complete())
    out["newest_step"] = int(engine.global_steps)
    ranks.host_barrier()
    if two.node == opts.lost_node and two.first_of_node:
        two.drop_node_memory()
    ranks.host_barrier()
    # A restart: a fresh checkpointer finds what memory (its own, its peers') is left.
    again = MoCCheckpointer(engine, _config(opts, mode, name))
    _, out["recovery_s"] = _timed(lambda: again.load(save_dir), cold=save_dir)
    out["recovery_source"] = again.last_load_source
    out["recovered_step"] = int(engine.global_steps)
    _, out["storage_s"] = _timed(lambda: again.load(save_dir, from_memory=False), cold=save_dir)
    out["storage_step"] = int(engine.global_steps)
    again.shutdown()
    # The first checkpointer's threads (its keepers are gone with the shutdown above).
    two.stages.shutdown()
    if two.redundancy is not None:
        two.redundancy.pool.shutdown(wait=True)
    out["batch"] = batch
    return out


def worker_main(opts) -> None:
    ranks.run_worker(opts, _worker)


def _worker(opts, rank: int, world: int) -> None:
    engine, args, config = build_engine(opts, rank, world)
    results = {"config": {**config, "iters": opts.iters, "ranks_per_node": opts.ranks_per_node,
                          "persist_interval": opts.persist_interval},
               "turns": []}
    batch = opts.train_steps
    for index, mode in enumerate(opts.modes.split(",")):
        out = _turn(engine, args, opts, rank, index, mode, batch)
        batch = out["batch"]
        results["turns"].append(ranks.gather_objects(out, world))
        if rank == 0:
            ranks.write_results(opts.out_dir, results)
    ranks.finish_rank()


# ========================================================================= launcher side

def _median(values):
    return statistics.median(values) if values else None


def _rows(results: dict) -> list:
    """One row per mode, pooling its turns (the rounds are interleaved, so that the
    shared machine's drift affects every mode alike)."""
    by_mode: dict = {}
    for per_rank in results.get("turns", []):
        by_mode.setdefault(per_rank[0]["mode"], []).append(per_rank)
    rows = []
    for mode, turns in by_mode.items():
        # The loop's pace is set by its slowest rank: per iteration, the max over ranks.
        iters = [max(r["iter_s"][i] for r in per_rank)
                 for per_rank in turns for i in range(len(per_rank[0]["iter_s"]))]
        ranks = [r for per_rank in turns for r in per_rank]
        stalls = [s for r in ranks for s in r["stall_s"]]
        protect = [s for r in ranks for s in r.get("protect_s", [])]
        sent = [b for r in ranks for b in r.get("sent_bytes", [])]
        row = {"mode": mode, "turns": len(turns),
               "iter_s_mean": statistics.mean(iters) if iters else None,
               "stall_s_median": _median(stalls),
               "snapshot_bytes_per_rank": max(r["snapshot_bytes"] for r in ranks),
               "sent_bytes_per_snapshot_per_rank": _median(sent) if sent else 0,
               "protect_s_median": _median(protect), "protect_s_max": max(protect, default=None),
               "peer_host_bytes_per_rank": max(r.get("peer_bytes", 0) for r in ranks),
               "slot_host_bytes_per_rank": max(r["slot_bytes"] for r in ranks),
               "protected_per_turn": min(len(r.get("protect_s", [])) for r in ranks),
               "snapshots_per_turn": len(turns[0][0]["iter_s"]),
               "recovery_sources": sorted({t[0]["recovery_source"] for t in turns}),
               "recovery_s": [max(r["recovery_s"] for r in t) for t in turns],
               "iterations_lost": [t[0]["newest_step"] - t[0]["recovered_step"] for t in turns],
               "storage_s": [max(r["storage_s"] for r in t) for t in turns],
               "redundancy_wait_s": sum(r.get("redundancy_wait_s", 0.0) for r in ranks),
               "failed": [r["redundancy_failed"] for r in ranks if r.get("redundancy_failed")]}
        row["recovery_s_median"] = _median(row["recovery_s"])
        row["storage_s_median"] = _median(row["storage_s"])
        row["bandwidth_mib_s"] = (row["sent_bytes_per_snapshot_per_rank"] / 2**20
                                  / row["protect_s_median"] if row["protect_s_median"] else None)
        rows.append(row)
    base = next((r["iter_s_mean"] for r in rows if r["mode"] == "none"), None)
    for row in rows:
        row["iter_overhead"] = (row["iter_s_mean"] / base - 1) if base and row["iter_s_mean"] \
            else None
    return rows


def fmt(value, spec=".3f", scale=1.0):
    return "-" if value is None else format(value * scale, spec)


def print_table(rows: list, config: dict) -> None:
    print(f"\nmodel: {config.get('num_layers')} layers, hidden {config.get('hidden_size')}, "
          f"{config.get('num_experts')} experts, {config.get('world_size')} ranks as "
          f"{config.get('world_size', 0) // max(1, config.get('ranks_per_node', 1))} nodes, "
          f"a snapshot after each of {config.get('iters')} iterations per turn\n")
    head = (f"{'mode':<10} {'snap MiB':>8} {'sent MiB':>8} {'protect s':>9} {'MiB/s':>7} "
            f"{'peer MiB':>8} {'iter s':>7} {'overhead':>8} {'stall s':>8} {'recovered from':<15} "
            f"{'lost':>5} {'recovery s':>10} {'storage s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mode']:<10} {fmt(r['snapshot_bytes_per_rank'], '.2f', 2**-20):>8} "
              f"{fmt(r['sent_bytes_per_snapshot_per_rank'], '.2f', 2**-20):>8} "
              f"{fmt(r['protect_s_median']):>9} {fmt(r['bandwidth_mib_s'], '.0f'):>7} "
              f"{fmt(r['peer_host_bytes_per_rank'], '.2f', 2**-20):>8} "
              f"{fmt(r['iter_s_mean']):>7} {fmt(r['iter_overhead'], '+.1%'):>8} "
              f"{fmt(r['stall_s_median'], '.4f'):>8} {'/'.join(r['recovery_sources']):<15} "
              f"{max(r['iterations_lost']):>5} {fmt(r['recovery_s_median']):>10} "
              f"{fmt(r['storage_s_median']):>9}")
        if r["failed"]:
            print(f"  redundancy failed: {r['failed'][0]}")
    print("\nsnap/sent/peer MiB: per rank (snapshot image; sent per snapshot; held for peers); "
          "protect s: median seconds from a snapshot's hand-off to its redundancy being "
          "complete; iter s: mean iteration time (snapshot after each), overhead against "
          "none; lost: iterations between the newest snapshot and where the restart resumed "
          "(max over turns); recovery s: median restart load after the node loss; storage s: "
          "median load from storage only. "
          "Storage files are dropped from the page cache before each load.")


def plot(rows: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # Measurements are done and printed by now: a missing optional package must not
        # fail the run (exit 1) after them.
        print(f"\nplot: matplotlib is not importable here; {path} not written "
              "(pip install -e .[bench], then rerun)")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["mode"] for r in rows]
    x = range(len(rows))
    width = 0.27
    ax.bar([i - width for i in x], [r["protect_s_median"] or 0 for r in rows], width,
           label="protect a snapshot (background)")
    ax.bar(list(x), [r["recovery_s_median"] for r in rows], width,
           label="recover after node loss")
    ax.bar([i + width for i in x], [r["storage_s_median"] for r in rows], width,
           label="recover from storage only")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{n}\n({'/'.join(r['recovery_sources'])})" for n, r in zip(names, rows)],
                       fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Snapshot redundancy: cost and recovery of a lost node")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launcher_main(opts) -> int:
    nodes = opts.nproc // opts.ranks_per_node
    if opts.nproc % opts.ranks_per_node or nodes < 2:
        print(f"error: --nproc {opts.nproc} must split into at least 2 nodes of "
              f"--ranks-per-node {opts.ranks_per_node}", file=sys.stderr)
        return 2
    bad = [m for m in opts.modes.split(",") if not _valid(m)]
    if bad:
        print(f"error: --modes: unknown {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    out_dir = opts.out_dir or tempfile.mkdtemp(prefix="moc-redundancy-bench-")
    os.makedirs(out_dir, exist_ok=True)
    shm_root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                            f"moc-bench-{os.getpid()}")
    argv = launch.worker_argv(__file__, out_dir, opts, WORKER_FLAGS, shm_root=shm_root)
    start = time.perf_counter()
    try:
        codes, timed_out = ranks.run_rank_processes(argv, opts.nproc, out_dir, opts.timeout)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    try:
        with open(os.path.join(out_dir, ranks.RESULTS_FILE)) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = {}
    rows = _rows(results)
    print_table(rows, results.get("config", {}))
    print(f"\n{time.perf_counter() - start:.0f} s; rank exit codes {codes}"
          + (" (timed out)" if timed_out else ""))
    if any(codes):
        print(f"rank logs: {os.path.join(out_dir, 'logs')}", file=sys.stderr)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": results.get("config"), "rows": rows}, f, indent=1)
    if opts.plot and rows:
        plot(rows, opts.plot)
        print(f"plot: {opts.plot}")
    if not opts.keep and not any(codes):
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if rows and not any(codes) else 1


def main() -> int:
    return launch.launcher_or_worker(build_parser().parse_args(), worker_main, launcher_main)


if __name__ == "__main__":
    launch.exit_after(main)
