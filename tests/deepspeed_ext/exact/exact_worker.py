"""A rank of the automatic-window test: chooses W from measured figures, where one
rank's probe frame cannot be written (``fail``) or none fails (``ok``), and writes what
it got: the window, or the error every rank must raise instead of hanging."""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import torch.distributed as dist  # noqa: E402

from deepspeed_ext import exact as ex  # noqa: E402
from deepspeed_ext.policy.operators import Operator  # noqa: E402


def _no_space():
    raise OSError(28, "No space left on device (injected)")


def main():
    out, case = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # The window sizing without an engine: the operators and the frame cost are given.
    index = types.SimpleNamespace(
        local_operators=lambda: [Operator(f"op{i}", "dense", None, 1000, 250) for i in range(4)],
        on_gpu=lambda: False)
    sizer = ex.WindowSizer(ex.ExactConfig(), rank, index, memory=None, log=lambda message: None)
    sizer.measure_frame_cost = _no_space if (case == "fail" and rank == 1) else (lambda: 1e-12)
    sizer.start_probe(0)
    try:
        result = {"window": sizer.choose_window(3)}
    except RuntimeError as e:
        result = {"error": str(e)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)  # a clean end is exit 0, never a teardown abort (-6)
