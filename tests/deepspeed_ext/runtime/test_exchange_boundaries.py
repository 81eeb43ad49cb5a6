"""Boundaries of :mod:`deepspeed_ext.runtime.exchange` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/runtime``), in a one-rank world."""

import pickle

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.runtime import groups
from deepspeed_ext.runtime.exchange import Exchanger
from tests.deepspeed_ext.runtime.world_of_one import world_of_one


def test_capacity_zero_learns_and_capacity_nine_is_the_least_given():
    assert Exchanger().capacity == 0
    assert Exchanger(capacity=0).capacity == 0
    assert Exchanger(capacity=9).capacity == 9


def test_a_value_that_fits_exactly_takes_the_fixed_buffer_one_more_byte_regrows(tmp_path):
    with world_of_one(tmp_path):
        ex = Exchanger()
        assert ex.exchange("a") == ["a"]
        # "a" pickles to 16 bytes: the buffer is twice (8-byte length + 16).
        assert len(pickle.dumps("a")) == 16 and ex.capacity == 48
        for value in ("b", "x" * 25):   # 16 and 40 bytes pickled: 8 + 40 = 48 fits exactly
            assert ex.exchange(value) == [value]
            assert ex.capacity == 48
        over = "y" * 26   # 41 bytes: one over
        assert ex.exchange(over) == [over]
        assert ex.capacity == 2 * (8 + 41)
        assert ex.exchange("z") == ["z"] and ex.capacity == 98


def test_a_given_capacity_is_used_from_the_first_call(tmp_path):
    with world_of_one(tmp_path):
        ex = Exchanger(capacity=64)
        assert ex.exchange({"rng": 1}) == [{"rng": 1}]
        assert ex.capacity == 64


def test_the_default_group_is_the_metadata_group_and_a_given_one_is_used(tmp_path, monkeypatch):
    # As on an NCCL job: the metadata group is a group of its own, made at a known point.
    monkeypatch.setattr(groups, "separate_on_gloo", True)
    with world_of_one(tmp_path):
        with pytest.raises(RuntimeError, match="metadata process group does not exist"):
            Exchanger(capacity=64).exchange(1)
        assert Exchanger(capacity=64, group=dist.group.WORLD).exchange(1) == [1]
        assert Exchanger(group=dist.group.WORLD).exchange(2) == [2]
        groups.init_metadata_group()
        assert Exchanger(capacity=64).exchange(3) == [3]
        assert Exchanger(capacity=64, device=torch.device("cpu")).exchange(4) == [4]
