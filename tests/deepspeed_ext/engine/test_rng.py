"""A rank's RNG state (deepspeed_ext.engine.rng): CUDA's is the current device's
generator only; checkpoints that saved every device's still load."""

import random

import numpy as np
import pytest
import torch

from deepspeed_ext.engine import rng


def test_a_saved_cuda_state_is_restored_into_the_ranks_own_device():
    one = torch.tensor([1, 2, 3], dtype=torch.uint8)
    every_device = [torch.tensor([9], dtype=torch.uint8), one]  # older checkpoints: all visible
    assert rng.cuda_state_for_device(one, 0) is one
    assert rng.cuda_state_for_device(every_device, 1) is one
    # a restart that sees fewer devices than the run that saved (or more) does not fail
    assert rng.cuda_state_for_device(every_device, 5) is None
    assert rng.cuda_state_for_device(None, 0) is None


def test_cpu_state_round_trip():
    state = rng.get_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(4))
    rng.set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(4))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    if not torch.cuda.is_available():
        assert state["cuda"] is None


def test_set_seed_gives_every_generator_the_same_stream():
    rng.set_seed(1234)
    first = (random.random(), np.random.rand(), torch.rand(4))
    rng.set_seed(1234)
    again = (random.random(), np.random.rand(), torch.rand(4))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_state_is_one_devices_and_round_trips():
    state = rng.get_rng_state()
    assert isinstance(state["cuda"], torch.Tensor)  # not a list of every visible device's
    first = torch.rand(4, device="cuda")
    rng.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_common_state_is_found_only_when_every_rank_drew_alike():
    """A load on another number of ranks restores the saved stream only when every saved
    rank held the same one (ranks seeded alike, drawing alike), as read back from a
    checkpoint (tuples come back as lists)."""
    from deepspeed_ext.format.objects import decode, encode
    rng.set_seed(7)
    same = rng.get_rng_state()
    tree, tensors = encode([same, rng.get_rng_state()])
    saved = decode(json_round_trip(tree), tensors)
    assert rng.common_state(saved) is saved[0]
    torch.rand(1)  # one rank drew once more
    assert rng.common_state(saved + [rng.get_rng_state()]) is None
    assert rng.common_state([]) is None


def json_round_trip(tree):
    import json
    return json.loads(json.dumps(tree))
