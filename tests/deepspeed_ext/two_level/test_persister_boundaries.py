"""Boundaries of :mod:`deepspeed_ext.two_level.persister` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/two_level``): a persist's directory and its
outcome, in a one-rank world."""

import types

import pytest

from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.store import prepare
from deepspeed_ext.store.claims import read_claim
from deepspeed_ext.store.commit import write_failure
from deepspeed_ext.two_level import PendingPersist
from deepspeed_ext.two_level.persister import Persister
from tests.deepspeed_ext.runtime.world_of_one import world_of_one


class _Policy:
    def __init__(self):
        self.loaded = []

    def load_state_dict(self, state):
        self.loaded.append(state)


def _persister(prepare_save_dir):
    session = types.SimpleNamespace(prepare_save_dir=prepare_save_dir, policy=_Policy(),
                                    previous=None, undone=[])
    session.undo_mark_saved = lambda before, selected: session.undone.append((before, selected))
    place = types.SimpleNamespace(rank=0, world=1, session=session,
                                  cfg=types.SimpleNamespace(commit_timeout_s=30.0))
    return Persister(place, handover=None), session


def test_rank_0_prepares_the_directory_and_every_rank_gets_its_claim(tmp_path):
    persister, session = _persister(
        lambda save_dir, tag, step: prepare.prepare_checkpoint_dir(save_dir, tag))
    with world_of_one(tmp_path):
        claim = persister.prepare_dir(str(tmp_path), "global_step4", 4, {"before": 1})
    assert claim == read_claim(str(tmp_path / "global_step4")) and claim
    assert session.policy.loaded == []


def test_a_directory_rank_0_could_not_prepare_fails_every_rank_and_undoes_the_marks(tmp_path):
    def refuse(save_dir, tag, step):
        raise OSError("read-only file system")
    persister, session = _persister(refuse)
    assert persister.prepare_on_rank0(str(tmp_path), "global_step4", 4) == (
        False, "OSError: read-only file system", None)
    with world_of_one(tmp_path):
        with pytest.raises(MoCCheckpointError, match=r"global_step4 failed on rank 0: OSError: "
                                                     r"read-only file system$"):
            persister.prepare_dir(str(tmp_path), "global_step4", 4, {"before": 1})
    assert session.policy.loaded == [{"before": 1}]
    with pytest.raises(MoCCheckpointError, match="rank 0 did not prepare it"):
        persister.raise_if_unprepared(None, str(tmp_path), "global_step4", {"before": 2})
    assert session.policy.loaded == [{"before": 1}, {"before": 2}]


def _pending(tmp_path, tag):
    tag_dir = prepare.prepare_checkpoint_dir(str(tmp_path), tag)
    return PendingPersist(save_dir=str(tmp_path), tag=tag, selected=frozenset({(0, 1)}),
                          policy_before={"b": 1}, slot=0, in_process=False,
                          claim=read_claim(tag_dir))


def test_the_view_of_a_persist_and_its_settling(tmp_path):
    persister, session = _persister(None)
    assert persister.persist_view() == "none"
    persister.settle("none")
    persister.pending = _pending(tmp_path, "global_step2")
    assert persister.persist_view() is None   # running
    persister.settle(None)
    assert persister.pending is not None
    write_failure(str(tmp_path / "global_step2"), "disk full", claim=persister.pending.claim)
    view = persister.persist_view()
    assert view == [False, "disk full"]
    persister.settle(view)
    assert persister.pending is None and session.undone == [({"b": 1}, frozenset({(0, 1)}))]
    persister.pending = _pending(tmp_path, "global_step3")
    persister.settle([True, None])
    assert persister.pending is None and session.previous == (str(tmp_path), "global_step3")
