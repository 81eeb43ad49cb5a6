"""Parm's MoE schedules (megatron/model/moe_schedules.py) against DeepSpeed 0.19's own MoE
layer: one MoE layer at tensor-parallel size 2 with expert sharding, expert-parallel size
2 (4 ranks) and 4 (8 ranks), top-1 and top-2, with and without capacity drops, every
schedule forward and backward on the same tokens (tests/model/moe_schedule_worker.py)."""

import pytest
import torch

from tests.launch import describe, run_ranks


def _scaled_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)


@pytest.mark.parametrize("ep", [2, 4])
def test_every_schedule_computes_deepspeeds_outputs_and_gradients(tmp_path, ep):
    """Outputs, aux loss, input gradient and every parameter gradient (gate, both expert
    shards, biases):

    * ``parm-s2`` moves the same bytes to the same places as DeepSpeed and computes the
      same operations: equal to the bit.
    * ``parm-s1`` sums the expert shards' partial outputs in another order (the bias is
      added to shard 0's partial, before the sum, not after an all-reduce) and sums the
      shards' input gradients inside its all-to-all: within 1e-5 of each tensor's scale
      (float32; measured 1.4e-7).

    Drops happen where they should: with drop_tokens the capacity factor 0.5 drops
    routes (top-1 and top-2), without it none. Without drops the tokens are drawn so that
    the gate's capacity (the largest expert count) is odd: every schedule runs on it
    padded to the next multiple of T = 2 (megatron/model/moe_capacity.py); T = 1 is
    compared in tests/model/test_tensor_parallel.py."""
    nproc = 2 * ep
    results = run_ranks(nproc, [str(tmp_path), str(ep)], script="tests/model/moe_schedule_worker.py",
                        timeout=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    for rank in range(nproc):
        runs = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["results"]
        assert len(runs) == 2 * 2 * 3
        for (topk, drop, schedule), got in runs.items():
            want = runs[(topk, drop, "deepspeed")]
            assert (got["dropped"] > 0) == drop, (topk, drop, got["dropped"])
            gates_capacity, capacity = got["capacity"]
            if not drop:
                assert gates_capacity % 2 == 1 and capacity == gates_capacity + 1, got["capacity"]
            assert torch.equal(got["counts"], want["counts"])
            pairs = [("out", got["out"], want["out"]), ("l_aux", got["l_aux"], want["l_aux"]),
                     ("x_grad", got["x_grad"], want["x_grad"])]
            pairs += [(name, got["grads"][name], grad) for name, grad in want["grads"].items()]
            assert len(pairs) == 3 + 1 + 2 * 4  # the gate, 2 local experts x 4 tensors
            for name, a, b in pairs:
                if schedule == "parm-s1":
                    assert _scaled_diff(a, b) <= 1e-5, (rank, topk, drop, name, _scaled_diff(a, b))
                else:
                    assert torch.equal(a, b), (rank, topk, drop, schedule, name)
