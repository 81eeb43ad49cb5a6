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

    python benchmarks/checkpoint_bench.py [--nproc 4 --ep 4 --tp 1 --zero-stage 2 --repeats 3]
                                          [--json FILE] [--out-dir DIR] [--keep] [model flags]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import launch  # noqa: E402
from benchlib.host import files_under, filesystem_of  # noqa: E402
from benchlib.model import build_engine  # noqa: E402
from benchlib.ranks import (file_tail, finish_out_dir, finish_rank,  # noqa: E402
                            gather_objects, group_errors, host_barrier,
                            print_failed_rank_logs, read_results, run_rank_processes,
                            run_worker, write_results)
from benchlib.tables import fmt, print_aligned, print_model  # noqa: E402

SYSTEMS = ("deepspeed", "deepspeed-fsync", "moc-full", "moc-full-sync", "moc-pec-k1")

# Flags forwarded from the launcher to every rank (the rest only concern the launcher).
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "seq_length", "num_experts", "expert_interval", "topk", "micro_batch_size",
               "train_steps", "zero_stage", "ep", "tp", "repeats", "seed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Compare the checkpoint save of DeepSpeed, MoC (all experts) and MoC PEC "
                    "K=1 on one GPT-MoE engine; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=4, help="Local ranks to start.")
    g.add_argument("--ep", type=int, default=4, help="Expert-parallel size.")
    g.add_argument("--tp", type=int, default=1,
                   help="Tensor-parallel size (> 1: experts sharded over it too, "
                        "--enable-expert-tensor-parallelism).")
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


def _attribute_bytes(system: str, save_dir: str, tag: str, world: int, gathered: list):
    """Rank 0: (bytes per rank, {uncounted file: size}) of one finished save."""
    tag_dir = os.path.join(save_dir, tag)
    on_disk = files_under(tag_dir)
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


def worker_main(opts) -> None:
    run_worker(opts, _worker)


def _worker(opts, rank: int, world: int) -> None:
    """Every rank: the engine, one warm-up save per system, then ``--repeats`` rounds of
    one timed save per system (a system that failed is not run again), the teardown."""
    engine, args, config = build_engine(opts, rank, world)
    saves = _RankSaves(engine, opts, rank, world, config)
    for system in SYSTEMS:
        saves.warm_up(system)
    for repeat in range(opts.repeats):
        for system in SYSTEMS:
            saves.repeat(system, f"repeat{repeat}")
    saves.results["complete"] = True
    saves.publish()
    finish_rank()


class _RankSaves:
    """One rank's side of the saves (:func:`_worker`): the systems' save calls on one
    engine, each save timed between barriers, and the results rank 0 keeps publishing
    (the launcher reads them even after a crash: ``current`` names the save running)."""

    def __init__(self, engine, opts, rank: int, world: int, config: dict):
        from deepspeed_ext.checkpointer import MoCCheckpointer
        from deepspeed_ext.config import MoCConfig
        self.opts, self.rank, self.world = opts, rank, world
        self.recorder = _DeepSpeedWriteRecorder(engine)
        # Not patched by enable_moc_checkpointing, so this is DeepSpeed's own method; if some
        # other code patched it, the original is kept as deepspeed_save_checkpoint.
        self.ds_save = getattr(engine, "deepspeed_save_checkpoint", engine.save_checkpoint)
        self.moc = {"moc-full": MoCCheckpointer(engine, MoCConfig(pec_k=opts.num_experts)),
                    "moc-full-sync": MoCCheckpointer(engine, MoCConfig(pec_k=opts.num_experts,
                                                                        async_save=False)),
                    "moc-pec-k1": MoCCheckpointer(engine, MoCConfig(pec_k=1))}
        ckpt_root = os.path.join(opts.out_dir, "ckpt")
        self.save_dirs = {s: os.path.join(ckpt_root, s) for s in SYSTEMS}
        self.results = {
            "config": {**config, "moc_pec_policy": "sequential"},
            "systems": {s: {"warmup": None, "saves": [], "error": None} for s in SYSTEMS},
        }

    def publish(self) -> None:
        if self.rank == 0:
            write_results(self.opts.out_dir, self.results)

    def warm_up(self, system: str) -> None:
        """The system's first save (not timed in the table); its failure ends the system."""
        entry = self.run_save(system, "warmup")
        self.results["systems"][system]["warmup"] = entry
        if entry["error"]:
            self.results["systems"][system]["error"] = f"warm-up save: {entry['error']}"
        self.publish()

    def repeat(self, system: str, tag: str) -> None:
        """One timed save of a system that has not failed yet, then its older tags dropped."""
        state = self.results["systems"][system]
        if state["error"]:
            return
        entry = self.run_save(system, tag)
        state["saves"].append(entry)
        if entry["error"]:
            state["error"] = f"save {tag}: {entry['error']}"
        self.publish()
        self.drop_superseded(system, tag)

    def run_save(self, system: str, tag: str) -> dict:
        self.results["current"] = {"system": system, "tag": tag}
        self.publish()
        entry = self.measure(system, tag)
        self.results["current"] = None
        return entry

    def save_once(self, system: str, tag: str) -> None:
        client_state = {"benchmark_tag": tag}
        if system.startswith("deepspeed"):
            self.recorder.fsync = system == "deepspeed-fsync"
            self.ds_save(self.save_dirs[system], tag=tag, client_state=client_state)
        else:
            self.moc[system].save(self.save_dirs[system], tag=tag, client_state=client_state)

    def measure(self, system: str, tag: str) -> dict:
        """One save on every rank, after os.sync() (rank 0) and a barrier: its times and
        errors over the ranks and (rank 0, no error) the bytes each rank wrote."""
        self.recorder.records.clear()
        if self.rank == 0:
            os.sync()  # no save pays for the writeback of an earlier one
        host_barrier()
        elapsed, error, durable = self._timed_save(system, tag)
        gathered = gather_objects((elapsed, error, list(self.recorder.records), durable),
                                  self.world)
        errors = [(r, e) for r, (_, e, _, _) in enumerate(gathered) if e]
        entry = {"tag": tag, "save_s_per_rank": [g[0] for g in gathered],
                 "save_s": max(g[0] for g in gathered),
                 "durable_s": None if durable is None else max(g[3] for g in gathered),
                 "error": group_errors(errors) or None}
        if self.rank == 0 and not errors:
            save_dir = self.save_dirs[system]
            per_rank, uncounted = _attribute_bytes(system, save_dir, tag, self.world, gathered)
            entry.update(bytes_per_rank=per_rank, uncounted_files=uncounted)
            if not system.startswith("deepspeed"):
                entry["manifest_elements"] = _manifest_elements(os.path.join(save_dir, tag))
        return entry

    def _timed_save(self, system: str, tag: str) -> tuple:
        """This rank's (save call seconds, error or None, seconds until durable or None)."""
        error = None
        start = time.perf_counter()
        try:
            self.save_once(system, tag)
        except Exception as e:  # reported in the table, not raised
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            # Also to a file now: a rank failing alone may leave the others waiting in
            # the save's collectives until the launcher's timeout.
            path = os.path.join(self.opts.out_dir, f"save_errors.rank{self.rank}.txt")
            with open(path, "a") as f:
                f.write(f"{system} {tag}: {error}\n")
        elapsed = time.perf_counter() - start
        durable = elapsed if system != "deepspeed" else None
        if system in self.moc and error is None:
            try:
                self.moc[system].wait()  # fsynced and committed (a collective: every rank)
                durable = time.perf_counter() - start
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        return elapsed, error, durable

    def drop_superseded(self, system: str, keep_tag: str) -> None:
        """Delete this system's older tags, untimed, to bound disk use. Not for PEC: its
        checkpoints reference expert versions held by earlier tags (MoC's next save reads
        only the last tag's manifest either way)."""
        if self.rank != 0 or self.opts.keep or system == "moc-pec-k1":
            return
        root = self.save_dirs[system]
        for name in os.listdir(root) if os.path.isdir(root) else []:
            path = os.path.join(root, name)
            if os.path.isdir(path) and name != keep_tag:
                shutil.rmtree(path, ignore_errors=True)


# ========================================================================= launcher side


def _launch(opts, out_dir: str) -> tuple:
    """Start the ranks; wait (with the timeout); returns (exit codes, timed out?, save errors)."""
    worker_argv = launch.worker_argv(__file__, out_dir, opts, MODEL_FLAGS)
    if opts.keep:
        worker_argv.append("--keep")
    codes, timed_out = run_rank_processes(worker_argv, opts.nproc, out_dir, opts.timeout)
    # What ranks reported before a kill (the survivors' collectives fail after it).
    save_errors = []
    for rank in range(opts.nproc):
        path = os.path.join(out_dir, f"save_errors.rank{rank}.txt")
        if os.path.isfile(path):
            save_errors += [(rank, line) for line in file_tail(path, 1).splitlines() if line.strip()]
    return codes, timed_out, save_errors


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
        table.append([r["system"], fmt(r["bytes_total"], ".2f", mib), fmt(r["bytes_max_rank"], ".2f", mib),
                      fmt(r["bytes_mean_rank"], ".2f", mib), fmt(r["max_over_mean"], ".3f"),
                      fmt(r["save_s_median"], ".3f"), fmt(r["save_s_min"], ".3f"),
                      fmt(r["durable_s_median"], ".3f"), fmt(r["bytes_vs_moc_full"], ".3f"), fmt(r["time_vs_moc_full"], ".3f"),
                      fmt(r["bytes_vs_deepspeed"], ".3f"), fmt(r["time_vs_deepspeed"], ".3f")])
    print_aligned(table)
    for r in rows:
        if r.get("error"):
            print(f"{r['system']}: FAILED: {r['error']}")


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


def _option_error(opts):
    """Why the options cannot run (the ``error:`` line), or None."""
    if min(opts.nproc, opts.ep, opts.tp, opts.repeats, opts.train_steps) < 1:
        return "--nproc, --ep, --tp, --repeats and --train-steps must be >= 1"
    if opts.nproc % opts.tp:
        return f"--nproc ({opts.nproc}) must be divisible by --tp ({opts.tp})"
    if (opts.nproc // opts.tp) % opts.ep or opts.num_experts % opts.ep:
        return (f"the data-parallel size (--nproc / --tp = {opts.nproc // opts.tp}) and "
                f"--num-experts ({opts.num_experts}) must be divisible by --ep ({opts.ep})")
    return None


def launcher_main(opts) -> int:
    problem = _option_error(opts)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    prepared = launch.out_dir_or_error(opts.out_dir, "moc-ckpt-bench-")
    if prepared is None:
        return 2
    out_dir, created = prepared

    command = launch.command_line()
    launch.print_header("MoC checkpoint save benchmark", command)
    fs = filesystem_of(out_dir)
    print(f"out dir: {out_dir}" + (f" ({fs})" if fs else ""))
    sys.stdout.flush()

    started = time.perf_counter()
    codes, timed_out, save_errors = _launch(opts, out_dir)
    wall = time.perf_counter() - started
    results, launch_error = read_results(out_dir, codes, timed_out, opts.timeout)
    if timed_out and save_errors:
        launch_error += " (save errors before that: " + group_errors(save_errors) + ")"
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
    return launch.launcher_or_worker(build_parser().parse_args(), worker_main, launcher_main)


if __name__ == "__main__":
    launch.exit_after(main)
