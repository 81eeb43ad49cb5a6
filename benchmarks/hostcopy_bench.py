#!/usr/bin/env python
"""Snapshot copy benchmark: how fast one rank's state reaches a shared-memory slot, and
how much of that copy the training loop sees, on the machine it runs on.

This is the measurement the two-level issue asks for on a GPU (copy bandwidth and stall
of the CUDA path), and it runs on CPU too. One process, no DeepSpeed engine: a set of fp32
tensors of ``--mib`` MiB stands for a rank's master weights and moments, and a loop of
``--compute-iters`` matrix products of size ``--matmul`` stands for the next
forward/backward.

Measured, each the median of ``--repeats``:

1. **Copy**: MoC's snapshot copy into a slot in ``/dev/shm`` (``HostCopier``: on CUDA the
   slot is page-locked with ``cudaHostRegister`` and the copy is queued on a side stream;
   on CPU a background thread copies), from launch until the copy is done. On CUDA also
   two references: a plain ``.to("cpu")`` (pageable memory) and a copy into memory torch
   pins itself.
2. **Overlap**: the compute loop alone; then the same loop with a snapshot launched just
   before it and joined after it, as the optimizer step joins it. ``stall`` is how much
   longer the loop plus the join took than the loop alone (DESIGN Eq. 10:
   ``max(0, T_snapshot - T_fwd_bwd)`` when the copy hides perfectly); ``join`` is the
   wait at the join alone.

It prints a table (``--json FILE`` writes it too) and asserts nothing about the numbers.

    python benchmarks/hostcopy_bench.py [--mib 256] [--repeats 5] [--json FILE]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepspeed_ext.engine.hostcopy import HostCopier  # noqa: E402
from deepspeed_ext.format.copy_plan import plan_copies  # noqa: E402
from deepspeed_ext.format.image import layout_of  # noqa: E402
from deepspeed_ext.snapshot import SnapshotSlots  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of fp32 state to copy.")
    p.add_argument("--tensors", type=int, default=8, help="How many tensors share it.")
    p.add_argument("--repeats", type=int, default=5, help="Timed repetitions per measure.")
    p.add_argument("--matmul", type=int, default=0,
                   help="Size of the compute loop's square matrices (0: 4096 on CUDA, 512 on CPU).")
    p.add_argument("--compute-iters", type=int, default=0,
                   help="Matrix products per compute loop (0: 50 on CUDA, 20 on CPU).")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="Where the state lives (auto: CUDA when available).")
    p.add_argument("--shm-root", default="/dev/shm",
                   help="Where the slot is created (shared memory, as in training).")
    p.add_argument("--json", metavar="FILE", help="Also write the results here.")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.tensors <= 0 or args.repeats <= 0:
        p.error("--mib, --tensors and --repeats must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if not os.path.isdir(args.shm_root):
        p.error(f"--shm-root {args.shm_root} is not a directory")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state(device, mib, count):
    per = (mib << 20) // 4 // count
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=gen).to(device) for i in range(count)}


def _median_s(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Snapshot:
    """One slot, one copier, one copy thread: the parts of a two-level snapshot that
    move bytes (no keeper, no metadata)."""

    def __init__(self, node_dir, tensors, device):
        self.copier = HostCopier(device)
        self.slots = SnapshotSlots(node_dir, 0, slots=1, on_map=self.copier.register,
                                   on_unmap=self.copier.unregister)
        self.tensors = tensors
        self.layout = layout_of(tensors)
        self.plan = plan_copies(self.layout, tensors)
        self.buffer = self.slots.buffer(0, self.layout.nbytes)
        self.pool = ThreadPoolExecutor(max_workers=1)

    def launch(self):
        """The snapshot's copy as training starts it (deepspeed_ext.two_level.stages):
        CUDA: queued on the side stream now, the thread waits for it; CPU: on the thread."""
        if self.copier.cuda:
            copy = self.copier.launch_plan(self.buffer, self.layout, self.plan, self.tensors)
            return self.pool.submit(self.copier.wait_host, copy)
        return self.pool.submit(self.copier.copy_plan, self.buffer, self.layout, self.plan,
                                self.tensors)

    def close(self):
        self.pool.shutdown(wait=True)
        self.copier.unregister_all()


def _compute(device, size, iters):
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)

    def loop():
        c = a
        for _ in range(iters):
            c = torch.mm(c, b)
            c = c / c.norm()  # keeps the values finite
        return c
    return loop


def _copies(snap, tensors, device, repeats):
    """(what, median seconds) of MoC's snapshot copy (after a warm-up one: the slot's
    first touch, its registration) and, on CUDA, of the two reference copies."""
    snap.launch().result()  # warm-up: first-touch of the slot, registration
    copy_s = _median_s(lambda: snap.launch().result(), repeats)
    how = ("CPU copy thread" if device.type == "cpu" else
           "side stream, page-locked" if snap.copier.registered_bytes else
           "side stream, pageable")
    rows = [(f"moc snapshot into shared memory ({how})", copy_s)]
    if device.type == "cuda":
        rows.append(("reference: .to('cpu'), pageable",
                     _median_s(lambda: [t.to("cpu") for t in tensors.values()], repeats)))
        pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                  for k, t in tensors.items()}

        def pinned_copy():
            for k, t in tensors.items():
                pinned[k].copy_(t, non_blocking=True)
            _sync(device)
        pinned_copy()
        rows.append(("reference: torch-pinned memory", _median_s(pinned_copy, repeats)))
    return rows


def _overlap(snap, loop, device, repeats):
    """(median of the loop alone, loop + snapshot per repeat, join waits per repeat): the
    snapshot launched just before the loop and joined after it, as the step joins it."""
    loop()
    _sync(device)

    def alone():
        loop()
        _sync(device)
    compute_s = _median_s(alone, repeats)
    joins, totals = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        job = snap.launch()
        loop()
        before_join = time.perf_counter()
        job.result()  # what the optimizer step does (wait_before_step)
        _sync(device)
        end = time.perf_counter()
        joins.append(end - before_join)
        totals.append(end - start)
    return compute_s, totals, joins


def run(args):
    device = torch.device("cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu")
    size = args.matmul or (4096 if device.type == "cuda" else 512)
    iters = args.compute_iters or (50 if device.type == "cuda" else 20)
    tensors = _state(device, args.mib, args.tensors)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    node_dir = os.path.join(args.shm_root, f"moc-hostcopy-bench-{uuid.uuid4().hex[:8]}")
    snap = _Snapshot(node_dir, tensors, device)
    try:
        rows = _copies(snap, tensors, device, args.repeats)
        compute_s, totals, joins = _overlap(snap, _compute(device, size, iters), device,
                                            args.repeats)
        result = {
            "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "bytes": nbytes, "register_error": snap.copier.register_error,
            "copies": [{"what": what, "seconds": s, "gb_per_s": nbytes / s / 1e9}
                       for what, s in rows],
            "compute_s": compute_s, "compute_with_snapshot_s": statistics.median(totals),
            "join_s": statistics.median(joins),
            "stall_s": max(0.0, statistics.median(totals) - compute_s),
            "matmul": size, "compute_iters": iters, "repeats": args.repeats}
    finally:
        snap.close()
        shutil.rmtree(node_dir, ignore_errors=True)
    return result


def print_table(r):
    print(f"device: {r['device']}; state {r['bytes'] / 2**20:.0f} MiB fp32; "
          f"median of {r['repeats']}")
    if r["register_error"]:
        print(f"page-locking the slot failed: {r['register_error']}")
    print(f"{'copy':<58} | {'seconds':>8} | {'GB/s':>6}")
    for c in r["copies"]:
        print(f"{c['what']:<58} | {c['seconds']:8.4f} | {c['gb_per_s']:6.2f}")
    print(f"compute loop ({r['compute_iters']} x matmul {r['matmul']}): "
          f"{r['compute_s']:.4f} s alone, {r['compute_with_snapshot_s']:.4f} s with a snapshot "
          f"launched before it and joined after it; join waited {r['join_s']:.4f} s; "
          f"stall {r['stall_s']:.4f} s (+{100 * r['stall_s'] / r['compute_s']:.1f} % on the loop"
          + ("; the copy thread and the loop share the CPU cores)" if r["device"] == "cpu"
             else ")"))


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
