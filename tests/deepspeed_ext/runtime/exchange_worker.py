"""A rank of the Exchanger test: gathers values of growing size, writes what it got
(then the same with a preset capacity)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import torch.distributed as dist  # noqa: E402

from deepspeed_ext.runtime.exchange import Exchanger  # noqa: E402


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    exchanger = Exchanger()
    got = []
    # small, same size again (fast path), one rank far larger (slow path, regrow), fast again
    for value in [("a", rank), ("b", rank), ("c" * (100000 if rank == 1 else 1), rank), ("d", rank)]:
        got.append(exchanger.exchange(value))
    got.append(exchanger.capacity)
    # A preset capacity: the first call already takes the fixed-size path (the capacity
    # stays as set), and a value too large for it still arrives (and regrows it).
    preset = Exchanger(capacity=64)
    got.append(preset.exchange(["e", rank]))
    got.append(preset.capacity)
    got.append(preset.exchange(["f" * 200, rank]))
    got.append(preset.capacity)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
