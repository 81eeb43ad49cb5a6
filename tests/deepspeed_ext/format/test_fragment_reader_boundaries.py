"""Boundaries of :mod:`deepspeed_ext.format.fragment_reader` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import uuid

import pytest
import torch

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.fragment_reader import FragmentReader, check_safetensors_header
from deepspeed_ext.format.storage import write_fragment_file


def test_a_read_without_a_length_runs_from_start_to_the_end(tmp_path):
    path = str(tmp_path / "rank00000.safetensors")
    flat = torch.arange(8, dtype=torch.float32)
    write_fragment_file(path, {"w|fp32|0": flat})
    with FragmentReader(path) as reader:
        # 8 - 3 = 5 elements (8 ^ 3 = 11 would run past the end).
        assert torch.equal(reader.read("w|fp32|0", 3), flat[3:])
        assert torch.equal(reader.read("w|fp32|0", 8), flat[8:])


def test_an_empty_range_reads_as_an_empty_tensor(tmp_path):
    path = str(tmp_path / "rank00000.safetensors")
    write_fragment_file(path, {"w|fp32|0": torch.arange(8, dtype=torch.float32)})
    with FragmentReader(path) as reader:
        for empty in (reader.read("w|fp32|0", 2, 0), reader.read("w|fp32|0", 8)):
            assert empty.dtype == torch.float32 and empty.shape == (0,)


def _header(**entries):
    return {key: {"dtype": dtype, "shape": shape, "data_offsets": offsets}
            for key, (dtype, shape, offsets) in entries.items()}


def test_a_header_span_shorter_than_its_shape_is_refused():
    with pytest.raises(ValueError, match=r"span 4 bytes, its F32 \[2\] needs 8"):
        check_safetensors_header(_header(w=("F32", [2], [0, 4])), 4)
    assert list(check_safetensors_header(_header(w=("F32", [2], [0, 8])), 8)) == ["w"]


def test_a_header_gap_and_overlap_are_told_apart():
    with pytest.raises(ValueError, match=r"start at 12, the previous tensor ends at 8 \(gap\)"):
        check_safetensors_header(_header(a=("F32", [2], [0, 8]), b=("F32", [1], [12, 16])), 16)
    with pytest.raises(ValueError, match=r"start at 4, the previous tensor ends at 8 \(overlap\)"):
        check_safetensors_header(_header(a=("F32", [2], [0, 8]), b=("F32", [1], [4, 8])), 8)


def test_bytes_after_the_last_tensor_are_refused():
    with pytest.raises(ValueError, match="3 bytes after the last tensor's data"):
        check_safetensors_header(_header(w=("F32", [2], [0, 8])), 11)
    with pytest.raises(ValueError, match="truncated"):
        check_safetensors_header(_header(w=("F32", [2], [0, 8])), 7)


@pytest.fixture
def url():
    base = f"memory://moc-test-{uuid.uuid4().hex[:10]}/ckpt"
    yield base
    fs.rmtree(fs.parent(base))


def test_a_url_file_with_a_zero_header_length_is_refused_by_that_field(url):
    path = fs.join(url, "zero.safetensors")
    fs.write_bytes(path, (0).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file \(header "
                                              r"length field 0 \(file of 10 bytes\)\)"):
        FragmentReader(path)


def test_a_url_file_with_unparsable_json_names_the_file_once(url):
    path = fs.join(url, "junk.safetensors")
    fs.write_bytes(path, (4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(CheckpointError) as err:
        FragmentReader(path)
    # The parser's own "PATH: " prefix is cut, whole, before the reader's is added.
    assert str(err.value).startswith(f"{path}: not a readable safetensors file (unreadable ")
