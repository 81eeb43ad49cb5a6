"""Boundaries of :mod:`deepspeed_ext.runtime.groups` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/runtime``), in a one-rank world."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.runtime import groups
from tests.deepspeed_ext.runtime.world_of_one import world_of_one


def test_without_a_world_there_is_no_metadata_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        groups.init_metadata_group()


def test_on_gloo_the_world_is_the_metadata_group(tmp_path):
    with world_of_one(tmp_path):
        assert groups.metadata_group() is dist.group.WORLD
        assert groups.init_metadata_group() is dist.group.WORLD
        assert groups.metadata_group() is dist.group.WORLD


def test_a_separate_metadata_group_is_made_once_and_forgotten_with_its_world(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(groups, "separate_on_gloo", True)
    with world_of_one(tmp_path):
        with pytest.raises(RuntimeError, match="metadata process group does not exist"):
            groups.metadata_group()
        made = groups.init_metadata_group(timeout=timedelta(seconds=30))
        assert made is not dist.group.WORLD and dist.get_world_size(made) == 1
        assert groups.init_metadata_group() is made and groups.metadata_group() is made
        groups.forget_metadata_group()
        with pytest.raises(RuntimeError, match="metadata process group does not exist"):
            groups.metadata_group()
        again = groups.init_metadata_group()
        assert again is not made and groups.metadata_group() is again


def test_new_groups_span_the_given_ranks(tmp_path):
    with world_of_one(tmp_path):
        assert dist.get_world_size(groups.new_training_group([0])) == 1
        host = groups.new_host_group(timedelta(seconds=30))
        assert dist.get_backend(host) == "gloo" and dist.get_world_size(host) == 1


def _timeout(group):
    # torch's own (private) record of a gloo group's timeout, as test_groups reads it.
    return group._get_backend(torch.device("cpu")).options._timeout


def test_a_separate_metadata_group_takes_the_jobs_timeout_unless_given_one(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(groups, "separate_on_gloo", True)
    with world_of_one(tmp_path, timeout=timedelta(seconds=77)):
        assert _timeout(groups.init_metadata_group()) == timedelta(seconds=77)
        groups.forget_metadata_group()
        assert _timeout(groups.init_metadata_group(timedelta(seconds=30))) == timedelta(seconds=30)
