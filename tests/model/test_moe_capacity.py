"""The expert capacity padded to a multiple of the tensor-parallel size
(megatron/model/moe_capacity.py), on DeepSpeed 0.19's own gate in one process. The layers
that run on it (T = 2 against T = 1, every schedule) are compared in
tests/model/test_tensor_parallel.py and tests/model/test_moe_schedules.py."""

import logging

import pytest
import torch

from megatron.model.moe_capacity import capacity_padding, pad_capacity, padded_capacity


def _gate(topk):
    from deepspeed.moe.sharded_moe import TopKGate
    torch.manual_seed(0)
    return TopKGate(8, 4, k=topk, drop_tokens=False, use_rts=False)


def _odd_tokens(gate):
    """Tokens whose capacity (without token dropping: the largest expert count) is odd."""
    for seed in range(50):
        x = torch.randn(13, 8, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(1)
        if int(gate(x, None, True, False)[1]) % 2:
            return x
    raise AssertionError("no draw with an odd capacity")


def test_padded_capacity():
    assert [padded_capacity(c, 2) for c in (1, 2, 39, 40)] == [2, 2, 40, 40]
    assert [padded_capacity(c, 4) for c in (1, 4, 5, 8)] == [4, 4, 8, 8]


@pytest.mark.parametrize("topk", [1, 2])
def test_the_padded_gate_routes_as_before_with_empty_padding_slots(topk, caplog):
    """Sparse routes (what the MoE layer and Parm's schedules ask for): the same routes,
    the capacity odd before and even after. Dense combine weights and dispatch mask: the
    gate's, plus zero padding slots. One log line, on the first padded pass."""
    gate = _gate(topk)
    x = _odd_tokens(gate)
    torch.manual_seed(1)  # top-2's second-expert noise, the same in every call
    want = gate(x, None, True, False)
    torch.manual_seed(1)
    want_dense = gate(x, None, False, False)
    padding = pad_capacity(gate, 2)
    assert capacity_padding(gate) is padding and pad_capacity(gate, 2) is padding
    with caplog.at_level(logging.INFO, logger="megatron.model.moe_capacity"):
        torch.manual_seed(1)
        got = gate(x, None, True, False)
        torch.manual_seed(1)
        got_dense = gate(x, None, False, False)
    capacity = int(want[1])
    assert capacity % 2 == 1 and int(got[1]) == capacity + 1
    assert padding.last == (capacity, capacity + 1) and padding.padded_passes == 2
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    for a, b in zip(got_dense[1:3], want_dense[1:3]):  # combine weights, dispatch mask
        assert a.shape == b.shape[:2] + (capacity + 1,)
        assert torch.equal(a[..., :capacity], b) and not a[..., capacity:].any()
    assert [r.getMessage() for r in caplog.records] == [
        f"MoE capacity {capacity} padded to {capacity + 1} slots, a multiple of the "
        "tensor-parallel size 2 (the padding slots hold no token)"]


def test_nothing_is_padded_at_one_rank_or_on_an_even_capacity():
    gate = _gate(1)
    assert pad_capacity(gate, 1) is None and capacity_padding(gate) is None
    padding = pad_capacity(gate, 2)
    odd = 0
    for seed in range(50):
        x = torch.randn(13, 8, generator=torch.Generator().manual_seed(seed))
        capacity = int(gate(x, None, True, False)[1])
        if padding.last[0] % 2 == 0:
            break
        odd += 1
    assert padding.last == (capacity, capacity) and capacity % 2 == 0
    assert padding.padded_passes == odd  # only the odd draws before it
