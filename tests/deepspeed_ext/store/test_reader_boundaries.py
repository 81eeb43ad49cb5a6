"""Boundaries of :mod:`deepspeed_ext.store.reader` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import math
import types

import pytest
import torch

from deepspeed_ext.format.vocab import PaddedVocab, RowPlan
from deepspeed_ext.runtime.outcomes import MoCCheckpointError
from deepspeed_ext.store.latest import update_latest
from deepspeed_ext.store.reader import (CheckpointReader, check_saved_shape, find_loadable,
                                        vocab_plan)
from tests.deepspeed_ext.format.test_manifest import FakeRun


class _FrozenNormRun(FakeRun):
    """The final norm without Adam moments (frozen), every other tensor with them."""

    def tensors_to_save(self, experts, scope="wo"):
        for name, shape, expert, kinds in super().tensors_to_save(experts, scope):
            yield name, shape, expert, (kinds[:1] if name == "final_norm.weight" else kinds)


def test_kinds_of_one_tensor_are_that_tensors_only(tmp_path):
    _FrozenNormRun(tmp_path).save("global_step10", 10, 2)
    with CheckpointReader(str(tmp_path)) as ckpt:
        # embed.weight sorts before final_norm.weight, the layers' tensors after it.
        assert ckpt.kinds("final_norm.weight") == ["fp32"]
        assert ckpt.kinds("embed.weight") == ["exp_avg", "exp_avg_sq", "fp32"]
        info = ckpt.info("embed.weight", "fp32")
        assert info.numel == math.prod(info.shape) == 60


def test_a_corrupt_checkpoint_sorting_before_latest_is_reported_as_skipped(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step1", 1, 1)
    run.save("global_step2", 2, 1)
    update_latest(str(tmp_path), "global_step2")
    (tmp_path / "global_step1" / "manifest.json").write_text("{not json")
    tag, skipped = find_loadable(str(tmp_path), checksums=False)
    assert tag == "global_step2"
    assert any(line.startswith("skipped checkpoint global_step1: ") for line in skipped), skipped


def test_reads_with_other_rows_trim_or_pad_the_first_dimension(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    truth = run.truth[("embed.weight", "fp32")]   # (10, 6)
    with CheckpointReader(str(tmp_path)) as ckpt:
        more = ckpt.read("embed.weight", "fp32", rows=12)
        assert more.shape == (72,)
        assert torch.equal(more[:60], truth.reshape(-1)) and not more[60:].any()
        assert torch.equal(ckpt.read("embed.weight", "fp32", rows=7), truth[:7].reshape(-1))
        assert torch.equal(ckpt.read("embed.weight", "fp32", rows=1), truth[:1].reshape(-1))
        # From element 50 to the end of the 12-row tensor: 22 elements.
        assert torch.equal(ckpt.read("embed.weight", "fp32", 50, rows=12), more[50:])
        for bad in (0, -1, "7"):
            with pytest.raises(ValueError, match="cannot read a tensor of shape"):
                ckpt.read("embed.weight", "fp32", rows=bad)
        with pytest.raises(IndexError, match=r"range \[58, 63\) outside its 60 elements"):
            ckpt.read("embed.weight", "fp32", 58, 5)
        assert torch.equal(ckpt.read_full("embed.weight", "fp32", rows=12), more.view(12, 6))


def test_a_saved_shape_is_checked_against_the_model_and_its_row_plan(tmp_path):
    FakeRun(tmp_path).save("global_step10", 10, 2)
    plan = RowPlan(("embed.weight",), saved_rows=10, rows=12, real_rows=9)

    def check(name, shape, row_plan):
        frag = types.SimpleNamespace(name=name, kind="fp32", shape=shape)
        return check_saved_shape(ckpt, frag, str(tmp_path), "global_step10", row_plan)
    with CheckpointReader(str(tmp_path)) as ckpt:
        assert check("embed.weight", (10, 6), None) is None
        assert check("embed.weight", (12, 6), plan) == 12
        assert check("final_norm.weight", (7,), plan) is None   # not in the plan: as saved
        for wrong in ((12, 5), (12, 7), (11, 6)):   # narrower, wider, other rows than planned
            with pytest.raises(MoCCheckpointError, match="only its vocabulary rows may differ"):
                check("embed.weight", wrong, plan)
        with pytest.raises(MoCCheckpointError, match="was saved with shape"):
            check("final_norm.weight", (8,), plan)


def test_the_vocabulary_plan_reads_the_rows_of_the_models_vocabulary_tensors(tmp_path):
    FakeRun(tmp_path).save("global_step10", 10, 2)   # embed.weight: 10 rows
    saved = {"names": ["embed.weight"], "rows": 10, "real_rows": 9}
    with CheckpointReader(str(tmp_path)) as ckpt:
        assert vocab_plan(ckpt, None, saved) is None
        assert vocab_plan(ckpt, PaddedVocab(("embed.weight",), 10, 9), saved) is None
        assert vocab_plan(ckpt, PaddedVocab(("embed.weight",), 12, 9), saved) == RowPlan(
            ("embed.weight",), saved_rows=10, rows=12, real_rows=9)
