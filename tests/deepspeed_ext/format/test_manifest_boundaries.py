"""Boundaries of :mod:`deepspeed_ext.format.manifest` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import json

import pytest

from deepspeed_ext.format.manifest import (MANIFEST_FILE, ExpertVersion, FileEntry, Fragment,
                                           TensorEntry, coverage_problems, read_manifest,
                                           sign_manifest, tensor_problems)
from tests.deepspeed_ext.format.test_manifest import FakeRun


def test_both_parts_in_one_place_make_a_one_place_version():
    assert ExpertVersion.of_parts((10, "global_step10"), (10, "global_step10")) == \
        ExpertVersion(10, "global_step10")
    assert ExpertVersion.of_parts((10, "global_step10"), (20, "global_step20")) == \
        ExpertVersion(10, "global_step10", 20, "global_step20")


def test_a_one_rank_checkpoint_is_valid(tmp_path):
    manifest = FakeRun(tmp_path).save("global_step0", 0, 1)
    assert manifest.world_size == 1 and manifest.validate() == []


class _WeightsOnlyRun(FakeRun):
    """Saves as a run before its first optimizer step does: no Adam moments at all."""

    def tensors_to_save(self, experts, scope="wo"):
        for name, shape, expert, _ in super().tensors_to_save(experts, scope):
            yield name, shape, expert, ("fp32",)


def test_a_checkpoint_without_moments_is_valid_with_an_index_naming_it_for_both_parts(tmp_path):
    manifest = _WeightsOnlyRun(tmp_path).save("global_step0", 0, 2)
    assert {part for _, part in manifest.held_parts()} == {"w"}
    assert manifest.validate() == []


def test_a_fragment_key_past_its_offset_is_a_problem():
    entry = TensorEntry(shape=[4], dtype="float32", expert=None,
                        fragments=[Fragment(file="f", key="w|fp32|5", offset=0, length=4)])
    problems = tensor_problems("t", "w|fp32", entry, {"f": FileEntry(16, "0" * 64, 0)})
    assert problems == ["t: tensor w|fp32: fragment key 'w|fp32|5' does not match its offset 0"]


def _frag(key, offset, length):
    return Fragment(file="f", key=key, offset=offset, length=length)


def test_coverage_goes_on_after_an_empty_fragment():
    assert coverage_problems([_frag("a", 0, 0), _frag("b", 0, 4)], 4) == [
        "fragment 'a' has offset 0 length 0"]


def test_an_overlap_names_the_elements_written_twice():
    # [3, 4) is written twice: the second fragment ends at 3 + 1 (3 ^ 1 would say 2).
    assert coverage_problems([_frag("a", 0, 8), _frag("b", 3, 1)], 8) == [
        "elements [3, 4) are in more than one fragment (overlap)"]


def test_a_manifest_rewritten_with_its_keys_in_another_order_still_reads(tmp_path):
    # The checksum covers the content, not the order a JSON tool wrote the keys in.
    FakeRun(tmp_path).save("global_step0", 0, 1)
    path = tmp_path / "global_step0" / MANIFEST_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(data.items())))))
    assert read_manifest(str(tmp_path / "global_step0")).step == 0


def test_a_manifest_with_a_nan_cannot_be_signed():
    with pytest.raises(ValueError):
        sign_manifest({"tag": "t", "extra": {"loss": float("nan")}})
