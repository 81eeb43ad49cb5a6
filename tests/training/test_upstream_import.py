"""``--load`` naming a Megatron-DeepSpeed checkpoint (megatron.training.upstream_import):
which directories count as one, and the refusals that name the fix (the import itself
runs in tests/training/test_import_upstream.py)."""

import argparse
import os
import shutil

import pytest

from megatron.errors import ConfigError
from megatron.training.upstream_import import import_target, upstream_tag
from tests.deepspeed_ext.interop.upstream_samples import FIXTURE

UPSTREAM = os.path.join(FIXTURE, "checkpoint")


def _args(**kw):
    base = dict(load=UPSTREAM, save=None, moc_checkpoint=True, moe_expert_parallel_size=2)
    base.update(kw)
    return argparse.Namespace(**base)


def test_only_upstream_s_own_checkpoints_count(tmp_path):
    assert upstream_tag(UPSTREAM) == "global_step6"
    assert upstream_tag(str(tmp_path)) is None and upstream_tag("") is None
    ours = tmp_path / "ours"
    shutil.copytree(UPSTREAM, ours)
    (ours / "global_step6" / "megatron_meta.json").write_text("{}")  # this trainer's
    assert upstream_tag(str(ours)) is None
    assert import_target(_args(load=str(ours), save=str(tmp_path / "new"))) is None


@pytest.mark.parametrize("kw,needle", [
    (dict(moc_checkpoint=False), "add --moc-checkpoint"),
    (dict(save=None), "give --save a new local directory"),
    (dict(save=UPSTREAM), "give --save a new local directory")])
def test_an_import_with_nowhere_to_go_names_the_flag_and_the_command(kw, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        import_target(_args(**kw))
    assert "moc-ckpt import" in str(info.value)


def test_a_save_directory_that_holds_checkpoints_is_resumed_not_overwritten(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest").write_text("global_step8")
    assert import_target(_args(save=str(save))) == str(save)
    assert sorted(os.listdir(save)) == ["latest"]
