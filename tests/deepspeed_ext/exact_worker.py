"""A rank of the automatic-window test: chooses W from measured figures, where one
rank's probe frame cannot be written (``fail``) or none fails (``ok``), and writes what
it got: the window, or the error every rank must raise instead of hanging."""

import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from deepspeed_ext import exact as ex  # noqa: E402
from deepspeed_ext.policy.operators import Operator  # noqa: E402


def _no_space():
    raise OSError(28, "No space left on device (injected)")


def main():
    out, case = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # The object without its engine: only what _choose_window uses.
    snaps = ex.ExactSnapshots.__new__(ex.ExactSnapshots)
    snaps.rank, snaps.world, snaps.cfg = rank, dist.get_world_size(), ex.ExactConfig()
    snaps._log = lambda message: None
    snaps.engine = types.SimpleNamespace(module=torch.nn.Linear(2, 2))
    snaps._probe = (0, time.perf_counter())
    snaps._local_operators = lambda: [Operator(f"op{i}", "dense", None, 1000, 250)
                                      for i in range(4)]
    snaps._new_grid = lambda iteration, window: setattr(snaps, "chosen", window)
    snaps._measure_frame_cost = _no_space if (case == "fail" and rank == 1) else (lambda: 1e-12)
    try:
        snaps._choose_window(3)
        result = {"window": snaps.chosen}
    except RuntimeError as e:
        result = {"error": str(e)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
