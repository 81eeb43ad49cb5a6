"""Boundaries of :mod:`deepspeed_ext.runtime.outcomes` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/runtime``), in a one-rank world."""

import pytest
import torch.distributed as dist

from deepspeed_ext.runtime import groups, outcomes
from deepspeed_ext.runtime.outcomes import (MoCCheckpointError, all_outcomes, broadcast_outcome,
                                            raise_if_failed)
from tests.deepspeed_ext.runtime.world_of_one import world_of_one


def test_raise_if_failed_names_every_failed_rank_and_nothing_when_all_are_ok():
    raise_if_failed([(True, None), (True, "x")], "save of global_step10")
    with pytest.raises(MoCCheckpointError) as err:
        raise_if_failed([(False, "disk full"), (True, None), (False, "gone")],
                        "save of global_step10")
    assert str(err.value) == ("save of global_step10 failed on 2 rank(s): rank 0: disk full; "
                              "rank 2: gone")


def test_all_outcomes_gathers_each_ranks_ok_and_payload(tmp_path):
    with world_of_one(tmp_path):
        assert all_outcomes(True, {"step": 10}) == [(True, {"step": 10})]
        assert all_outcomes(False, "boom") == [(False, "boom")]


def test_broadcast_outcome_returns_the_action_or_raises_its_error_on_every_rank(tmp_path):
    def fail():
        raise OSError("disk full")
    with world_of_one(tmp_path):
        assert broadcast_outcome(lambda: {"tag": "global_step10"}, "commit") == {
            "tag": "global_step10"}
        assert broadcast_outcome(lambda: None, "commit") is None
        with pytest.raises(MoCCheckpointError,
                           match="^commit failed on rank 0: OSError: disk full$"):
            broadcast_outcome(fail, "commit")


def test_on_a_rank_other_than_0_the_action_is_not_run_and_rank_0s_outcome_returned(
        tmp_path, monkeypatch):
    class Rank1:
        """torch.distributed as rank 1 sees it: rank 0's broadcast arrives."""

        def __getattr__(self, name):
            return getattr(dist, name)

        def get_rank(self):
            return 1

        def broadcast_object_list(self, objects, src, group):
            assert src == 0 and group is groups.metadata_group()
            objects[0] = (False, "OSError: disk full")
    ran = []
    with world_of_one(tmp_path):
        monkeypatch.setattr(outcomes, "dist", Rank1())
        with pytest.raises(MoCCheckpointError, match="^commit failed on rank 0: OSError"):
            broadcast_outcome(lambda: ran.append(1), "commit")
    assert ran == []
