"""File images: the layout is standard safetensors, and writing a filled buffer gives a
file that safetensors reads back bit for bit."""

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from deepspeed_ext.format.image import fill_image, image_view, layout_image, layout_of
from deepspeed_ext.format.storage import write_image_file


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "b.bf16": torch.randn(7, generator=gen).to(torch.bfloat16),  # odd byte count
        "a.f32": torch.randn(3, 5, generator=gen),
        "c.i64": torch.arange(3, dtype=torch.int64),
        "d.u8": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "e.empty": torch.empty(0, dtype=torch.float32),
        "f.bool": torch.tensor([True, False]),
    }


def test_filled_image_is_a_safetensors_file(tmp_path):
    tensors = _tensors()
    layout = layout_of(tensors, metadata={"step": "3"})
    buffer = torch.full((layout.nbytes + 100,), 0xAB, dtype=torch.uint8)  # reused, larger
    fill_image(buffer, layout, tensors)
    record = write_image_file(str(tmp_path / "x.safetensors"), image_view(buffer, layout))
    data = (tmp_path / "x.safetensors").read_bytes()
    assert record.nbytes == len(data) == layout.nbytes
    assert record.sha256 == hashlib.sha256(data).hexdigest()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_entries_are_aligned_to_their_element_size():
    layout = layout_of(_tensors())
    assert len(layout.header) % 8 == 0
    for entry in layout.entries:
        size = torch.empty(0, dtype=getattr(torch, entry.dtype)).element_size()
        assert entry.start % size == 0, entry
    # larger elements first, so a 2-byte tensor never pushes a 4-byte one off alignment
    sizes = [torch.empty(0, dtype=getattr(torch, e.dtype)).element_size() for e in layout.entries]
    assert sizes == sorted(sizes, reverse=True)


def test_layout_is_pure_and_refuses_duplicates():
    spec = [("x", (2, 3), "float32"), ("y", (4,), "bfloat16")]
    assert layout_image(spec) == layout_image(list(reversed(spec)))
    assert layout_image(spec).nbytes == len(layout_image(spec).header) + 24 + 8
    with pytest.raises(ValueError, match="duplicate"):
        layout_image(spec + [("x", (1,), "float32")])
    with pytest.raises(ValueError, match="cannot be stored|unknown"):
        layout_image([("z", (1,), "nonsense")])


def test_fill_refuses_a_small_buffer_and_a_mismatched_tensor():
    tensors = _tensors()
    layout = layout_of(tensors)
    with pytest.raises(ValueError, match="needs"):
        fill_image(torch.empty(layout.nbytes - 1, dtype=torch.uint8), layout, tensors)
    wrong = dict(tensors, **{"a.f32": torch.zeros(3, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="a.f32"):
        fill_image(torch.empty(layout.nbytes, dtype=torch.uint8), layout, wrong)


def test_failed_image_write_leaves_no_file(tmp_path, monkeypatch):
    import os
    tensors = _tensors()
    layout = layout_of(tensors)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    fill_image(buffer, layout, tensors)

    def broken_fsync(fd):
        raise OSError(5, "Input/output error (injected)")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="injected"):
        write_image_file(str(tmp_path / "x.safetensors"), image_view(buffer, layout))
    assert os.listdir(tmp_path) == []
