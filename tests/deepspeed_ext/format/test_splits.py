"""Tensor-parallel splits in checkpoints (deepspeed_ext.format.splits): the part-major
order, its conversions, and a checkpoint saved by 2 tensor-parallel parts read whole, as
2 parts and as 4 (the reader re-orders; the manifest says how it was split)."""

import json
import os

import pytest
import torch

from deepspeed_ext.format import manifest as mf
from deepspeed_ext.format.assemble import FragmentSpec, RankReport, assemble_manifest
from deepspeed_ext.format.naming import rank_file_name
from deepspeed_ext.format.splits import TensorSplit, convert
from deepspeed_ext.format.storage import write_fragment_file
from deepspeed_ext.store.latest import update_latest
from deepspeed_ext.store.prepare import prepare_checkpoint_dir
from deepspeed_ext.store.reader import CheckpointReader

# (global shape, view, dim): a column-parallel weight, a row-parallel one, a fused QKV
# kept as [3, heads, head_dim] rows split along the heads, its bias.
CASES = [((8, 3), (8, 3), 0), ((3, 8), (3, 8), 1), ((24, 5), (3, 4, 2, 5), 1), ((24,), (3, 8), 1)]


def _part(full: torch.Tensor, view, dim, part, parts) -> torch.Tensor:
    """Rank ``part``'s local parameter, the way a tensor-parallel layer holds it."""
    return full.reshape(view).chunk(parts, dim=dim)[part].contiguous().reshape(-1)


@pytest.mark.parametrize("shape, view, dim", CASES)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_part_major_order_lays_each_rank_s_part_end_to_end(shape, view, dim, parts):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    split = TensorSplit(view, dim, parts)
    stored = split.from_row_major(full.reshape(-1))
    for p in range(parts):
        start = split.stored_offset(p, 0)
        assert torch.equal(stored[start:start + split.part_numel], _part(full, view, dim, p, parts))
    assert torch.equal(split.to_row_major(stored), full.reshape(-1))


@pytest.mark.parametrize("shape, view, dim", CASES)
def test_convert_between_tensor_parallel_sizes(shape, view, dim):
    full = torch.randn(shape)
    two, four = TensorSplit(view, dim, 2), TensorSplit(view, dim, 4)
    stored = two.from_row_major(full.reshape(-1))
    assert torch.equal(convert(stored, two, None), full.reshape(-1))
    assert torch.equal(convert(stored, two, four), four.from_row_major(full.reshape(-1)))
    assert convert(stored, two, TensorSplit(view, dim, 2)) is stored
    # one part is the row-major order itself
    assert torch.equal(convert(full.reshape(-1), TensorSplit(view, dim, 1), two), stored)
    with pytest.raises(ValueError, match="split of"):
        convert(stored[:-1], two, None)


@pytest.mark.parametrize("record, needle", [
    ({"view": [6, 4], "dim": 2, "parts": 2}, "not a dimension"),
    ({"view": [6, 4], "dim": 1, "parts": 3}, "not a multiple"),
    ({"view": [6, 0], "dim": 0, "parts": 2}, "positive ints"),
    ({"view": [6, 4], "dim": 0}, "expected {view, dim, parts}"),
    ({"view": "6x4", "dim": 0, "parts": 2}, "list of ints"),
])
def test_malformed_splits_are_refused_naming_the_field(record, needle):
    with pytest.raises(ValueError, match=needle) as err:
        TensorSplit.from_json(record, "tensors['w|fp32'].split")
    assert "tensors['w|fp32'].split" in str(err.value)


def save_split_checkpoint(save_dir, full, split, parts_per_fragment=2):
    """Save tensor ``w`` as ``split.parts`` tensor-parallel ranks would under ZeRO: each
    part cut into ``parts_per_fragment`` partitions, every partition from its own rank."""
    tag_dir = prepare_checkpoint_dir(str(save_dir), "global_step1")
    stored = split.from_row_major(full.reshape(-1))
    reports, rank = [], 0
    for p in range(split.parts):
        local = _part(full, split.view, split.dim, p, split.parts)
        for chunk_start in range(0, local.numel(), local.numel() // parts_per_fragment):
            n = local.numel() // parts_per_fragment
            spec = FragmentSpec("w", "fp32", split.stored_offset(p, chunk_start), n,
                                tuple(full.shape), "float32", None, split)
            piece = local[chunk_start:chunk_start + n]
            assert torch.equal(stored[spec.offset:spec.offset + n], piece)
            record = write_fragment_file(os.path.join(tag_dir, rank_file_name(rank)),
                                         {spec.key: piece.clone()})
            reports.append(RankReport.from_record(rank, rank_file_name(rank), record, [spec]))
            rank += 1
    manifest = assemble_manifest("global_step1", 1, rank, {}, [RankReport.from_json(r.to_json())
                                                               for r in reports], {})
    mf.write_manifest(tag_dir, manifest)
    update_latest(str(save_dir), "global_step1")
    return manifest


def test_a_checkpoint_of_two_parts_reads_whole_as_two_and_as_four(tmp_path):
    shape, view, dim = CASES[2]  # the QKV layout, split along an inner dimension
    full = torch.randn(shape)
    two = TensorSplit(view, dim, 2)
    manifest = save_split_checkpoint(tmp_path, full, two)
    # An older MoC (version 2) would read the part-major order as row-major: refused there.
    assert manifest.version == mf.SPLIT_VERSION
    on_disk = json.load(open(tmp_path / "global_step1" / mf.MANIFEST_FILE))
    assert on_disk["tensors"]["w|fp32"]["split"] == {"view": list(view), "dim": dim, "parts": 2}
    with CheckpointReader(str(tmp_path)) as reader:
        assert reader.info("w", "fp32").split == two
        assert torch.equal(reader.read_full("w", "fp32"), full)
        for parts in (1, 2, 4):
            target = TensorSplit(view, dim, parts)
            for p in range(parts):
                n = target.part_numel
                got = reader.read("w", "fp32", target.stored_offset(p, 0), n, split=target)
                assert torch.equal(got, _part(full, view, dim, p, parts)), (parts, p)
        # a range inside one part, in the stored order: the direct path
        got = reader.read("w", "fp32", two.stored_offset(1, 3), 5, split=two)
        assert torch.equal(got, _part(full, view, dim, 1, 2)[3:8])


def test_a_split_tensor_in_a_version_2_manifest_is_a_problem(tmp_path):
    shape, view, dim = CASES[0]
    manifest = save_split_checkpoint(tmp_path, torch.randn(shape), TensorSplit(view, dim, 2))
    manifest.version = 2
    assert any("is split, which version 2 manifests cannot say" in p for p in manifest.validate())
    # a split that does not hold the tensor's elements
    manifest.version = mf.SPLIT_VERSION
    manifest.tensors["w|fp32"].split = TensorSplit((4, 3), 0, 2)
    assert any("does not hold the 24 elements" in p for p in manifest.validate())


def test_fragments_of_one_tensor_must_agree_on_its_split():
    split = TensorSplit((8, 3), 0, 2)
    specs = [FragmentSpec("w", "fp32", 0, 12, (8, 3), "float32", None, split),
             FragmentSpec("w", "fp32", 12, 12, (8, 3), "float32", None, None)]
    reports = [RankReport(rank, rank_file_name(rank), 1, "0" * 64, [spec])
               for rank, spec in enumerate(specs)]
    with pytest.raises(ValueError, match="split"):
        assemble_manifest("global_step1", 1, 2, {}, reports, {})
    assert FragmentSpec.from_json(specs[0].to_json()) == specs[0]
