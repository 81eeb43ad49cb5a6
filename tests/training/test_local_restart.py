"""The localized in-job recovery's decisions (megatron.training.local_restart) and what a
survivor keeps (deepspeed_ext.exact.survivor), without processes. End to end:
tests/training/test_pipeline_training.py."""

import torch

from deepspeed_ext.exact import survivor
from megatron.training import local_restart
from megatron.training.local_restart import plan


def test_the_stage_without_state_replays_and_the_others_resume_where_they_stopped():
    # PP 2 x TP 2: rank 3 died; its spare has no state, rank 2 (the same stage) has
    got = plan([(0, 3, 24), (0, 3, 24), (1, 3, 24), (1, None, 0)])
    assert (got.failed_stage, got.iteration, got.popularity_from, got.consumed_train_samples,
            got.why) == (1, 3, 0, 24, "")
    # stage 0's rank died: stage 1's ranks give the iteration and the popularity
    got = plan([(0, None, 0), (0, 5, 40), (1, 5, 40), (1, 5, 40)])
    assert (got.failed_stage, got.iteration, got.popularity_from) == (0, 5, 2)


def test_anything_else_is_a_global_replay_with_the_reason():
    assert "stages [0, 1] kept no state" in plan([(0, None, 0), (1, None, 0)]).why
    # a survivor of stage 0 had begun its optimizer step: it kept nothing either
    assert "stages [0, 1]" in plan([(0, 3, 24), (0, None, 0), (1, None, 0), (1, 3, 24)]).why
    assert "iterations [3, 4]" in plan([(0, 3, 24), (0, 4, 32), (1, None, 0)]).why
    assert "every rank kept its state" in plan([(0, 3, 24), (1, 3, 24)]).why
    assert "no other stage" in plan([(0, None, 0), (0, None, 0)]).why


class _Engine:
    def __init__(self):
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.optimizer = torch.optim.Adam([self.weight])
        self.global_steps = 0

    def step(self):
        self.weight.grad = torch.ones(3)
        self.optimizer.step()
        self.global_steps += 1


def test_a_survivor_whose_update_ran_after_the_mark_keeps_nothing():
    """The optimizer's step counter moves as its update runs, before ZeRO's all-gather a
    dead peer can fail: a rank that updated its partition and then failed is not at the
    iteration its loop finished, and neither is one whose engine counted one more step."""
    engine = _Engine()
    engine.step()
    at = survivor.mark(engine)
    assert survivor.moved_past(engine, at) is None
    engine.optimizer.step()  # the update ran; the step was not counted yet
    assert survivor.moved_past(engine, at) == "the optimizer's update of the failed iteration ran"
    engine.global_steps += 1
    assert "counted 2 steps, the loop finished 1" in survivor.moved_past(engine, at)
    mark = local_restart.LoopMark(at, 1, 8, {}, {})
    assert local_restart.keep(engine, None, mark) == survivor.moved_past(engine, at)
    assert local_restart.take() is None
    assert local_restart.keep(engine, None, None) == "no iteration finished in the failed run"
    assert local_restart.take() is None


class _Recovery:
    def __init__(self, held):
        self.held = held

    def available_frames(self, save_dir):
        return self.held


class _Exact:
    save_dir, rank = "unused", 3

    def __init__(self, held):
        self.recovery = _Recovery(held)


def test_a_replaying_rank_needs_its_generators_state_at_the_recovered_iteration():
    """A replay draws what its steps drew, not what the evaluations between them did: a
    survivor of the failed stage takes its kept generators, a spare the failed rank's
    frame R; without that frame the recovery is global."""
    from megatron.training.local_restart import Kept, LoopMark, generators_after
    kept = Kept(survivor.SurvivorState({}, {}),
                LoopMark(survivor.StepMark(4, ()), 4, 32, {}, {"cpu": "kept"}))
    assert generators_after(_Exact({}), 4, kept) == ({"cpu": "kept"}, None)
    rng, why = generators_after(_Exact({3: ({}, "root")}), 4, None)
    assert rng is None and why == "holds no frame 4, which has its generators' state then"
    rng, why = generators_after(_Exact({4: ({}, "/nonexistent")}), 4, None)
    assert rng is None and why.startswith("its frame 4 cannot be read")
