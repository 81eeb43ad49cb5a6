"""A rank of the monitor tests: a training-like loop with heartbeats, a watchdog and faults.

Each iteration: the fault injector, the heartbeat (top of the loop, as in the real
loop), ``--compute-s`` seconds of "compute", then one collective. Writes
``<out>/detect-rank<R>.json`` when its watchdog detects a hang (before exiting),
``<out>/events.jsonl`` (emitted events) and ``<out>/done-rank<R>.json`` when it finished.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.training import faults  # noqa: E402
from megatron.training.monitor.beats import Heartbeat, default_store  # noqa: E402
from megatron.training.monitor.config import MonitorConfig  # noqa: E402
from megatron.training.monitor.watchdog import Watchdog  # noqa: E402


def _parse():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compute-s", type=float, default=0.03)
    p.add_argument("--collective", default="all_reduce", choices=["all_reduce", "all_to_all"])
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--hang-timeout", type=float, default=2.0)
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--factor", type=float, default=2.0)
    return p.parse_args()


def _append_line(path, obj):
    # One write of one line with O_APPEND: lines of several ranks never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())
    finally:
        os.close(fd)


def _collective(kind, world):
    if kind == "all_reduce":
        dist.all_reduce(torch.ones(4))
    else:
        out = torch.empty(world)
        dist.all_to_all_single(out, torch.ones(world))


def main():
    a = _parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = default_store()
    config = MonitorConfig(hang_timeout_s=a.hang_timeout, poll_s=a.poll,
                           straggler_window=a.window, straggler_factor=a.factor)
    injector = faults.FaultInjector([faults.parse_fault(t) for t in a.fault], rank, world,
                                    os.path.join(a.out, "faults.json"))

    def on_hang(event):
        with open(os.path.join(a.out, f"detect-rank{rank}.json"), "w") as f:
            json.dump({"event": event, "detected_at": time.time()}, f)
        watchdog.stop_job(event)

    heartbeat = Heartbeat(store, rank, window=a.window)
    watchdog = Watchdog(store, rank, world, config, on_hang=on_hang,
                        emit=lambda e: _append_line(os.path.join(a.out, "events.jsonl"), e))
    watchdog.start()
    # The wiring docs/monitor.md prescribes for the training loop.
    last_top = free_since = None
    for done in range(a.iters):
        injector.before_iteration(done + 1)  # a slow fault sleeps here, a hang never returns
        top = time.perf_counter()
        heartbeat.beat(done + 1, iter_s=None if last_top is None else top - last_top,
                       own_s=None if free_since is None else top - free_since)
        last_top = top
        time.sleep(a.compute_s)  # "compute"
        _collective(a.collective, world)
        free_since = time.perf_counter()  # from here to the next beat, this rank is alone
    heartbeat.finish()
    watchdog.stop()
    dist.barrier()
    with open(os.path.join(a.out, f"done-rank{rank}.json"), "w") as f:
        json.dump({"iterations": a.iters}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
