"""megatron/training/process.py's undoing of a run's groups after an abort, in process:
a one-rank gloo world through DeepSpeed, as the trainer makes it. torch's abort of every
group is made for NCCL; gloo groups take the same call, so the path after it (torch's
tables gone, DeepSpeed's and MoC's references left) runs here; the NCCL communicators
themselves are scripts/gpu_check.sh's."""

import pytest
import torch
import torch.distributed as dist

from megatron.training import process
from tests.ds_world import deepspeed_world_of_one


def test_an_aborted_world_is_closed_and_the_next_run_forms_its_groups_again(monkeypatch):
    import deepspeed
    from deepspeed.utils import groups
    from deepspeed_ext.runtime.groups import init_metadata_group, metadata_group
    from datetime import timedelta
    monkeypatch.setattr(process, "nccl_in_use", lambda: dist.is_initialized())
    with deepspeed_world_of_one():
        init_metadata_group(timedelta(seconds=60))
        groups._create_expert_and_data_parallel(1)
        assert groups._EXPERT_PARALLEL_GROUP
        assert process.abort_communicators()
        assert not dist.is_initialized()  # torch's tables went with the communicators
        assert not process.abort_communicators()  # nothing left: a second call is a no-op
        process.close_process_groups()
        assert not groups._EXPERT_PARALLEL_GROUP and groups._WORLD_GROUP is None
        with pytest.raises(RuntimeError):
            metadata_group()  # the old world's reference is gone too
        deepspeed.init_distributed(dist_backend="gloo")  # the next round, same process
        init_metadata_group(timedelta(seconds=60))
        groups._create_expert_and_data_parallel(1)
        t = torch.ones(2)
        dist.all_reduce(t, group=groups._get_expert_parallel_group("ep_size_1"))
        assert t.tolist() == [1.0, 1.0]
        assert dist.get_world_size(group=metadata_group()) == 1


def test_without_nccl_nothing_is_aborted_and_the_world_closes_as_before():
    """gloo: abort_communicators returns False and leaves the world; close destroys it."""
    with deepspeed_world_of_one():
        assert not process.nccl_in_use()
        assert not process.abort_communicators()
        assert dist.is_initialized()
    assert not dist.is_initialized()
