"""The snapshot's one collective returns every rank's value in rank order, also when one
rank's value outgrows the buffer sized by the first call."""

import json

import pytest
import torch

from deepspeed_ext.runtime.exchange import Exchanger
from tests.launch import describe, run_ranks


def test_exchange_fast_and_regrown_paths(tmp_path):
    results = run_ranks(3, [str(tmp_path)], script="tests/deepspeed_ext/runtime/exchange_worker.py",
                        timeout=120)
    assert all(r.returncode == 0 for r in results), describe(results)
    for rank in range(3):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        assert got[0] == [["a", 0], ["a", 1], ["a", 2]]
        assert got[1] == [["b", 0], ["b", 1], ["b", 2]]
        assert got[2] == [["c", 0], ["c" * 100000, 1], ["c", 2]]
        assert got[3] == [["d", 0], ["d", 1], ["d", 2]]
        assert got[4] > 100000  # regrown for the largest value
        assert got[5] == [["e", 0], ["e", 1], ["e", 2]] and got[6] == 64
        assert got[7] == [["f" * 200, 0], ["f" * 200, 1], ["f" * 200, 2]] and got[8] > 200


@pytest.mark.parametrize("capacity", [-1, 1, 8])
def test_exchange_capacity_must_hold_the_length_field(capacity):
    with pytest.raises(ValueError, match="capacity"):
        Exchanger(device=torch.device("cpu"), capacity=capacity)
