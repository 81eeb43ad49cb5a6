"""Boundaries of :mod:`deepspeed_ext.store.prepare` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

from deepspeed_ext.store.catalog import list_checkpoints
from deepspeed_ext.store.latest import read_latest, update_latest
from deepspeed_ext.store.prepare import set_aside_checkpoints_after
from tests.deepspeed_ext.commit_helpers import commit_two_ranks


def test_only_an_earlier_attempts_checkpoints_of_the_step_or_later_are_set_aside(tmp_path):
    save_dir = str(tmp_path)
    started = {5: 50.0, 10: 50.0, 20: 100.0, 30: 150.0, 40: 50.0}
    for step, attempt in started.items():
        commit_two_ranks(save_dir, f"global_step{step}", step, 1.0, attempt_started=attempt)
    update_latest(save_dir, "global_step40")
    # This attempt (started at 100) saves step 10 next: 40 and 10 are an abandoned
    # timeline's; 5 is older, 20 its own, 30 a later attempt's.
    assert set_aside_checkpoints_after(save_dir, 10, 100.0) == ["global_step40", "global_step10"]
    assert [tag for _, tag in list_checkpoints(save_dir)] == [
        "global_step5", "global_step20", "global_step30"]
    assert read_latest(save_dir) == "global_step30"   # moved off, onto the newest left
