"""Boundaries of :mod:`deepspeed_ext.format.image` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import pytest
import torch

from deepspeed_ext.format.image import fill_image, layout_of


def test_entry_finds_each_key_and_only_it():
    layout = layout_of({"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)})
    for key in ("a", "b", "c"):
        assert layout.entry(key).key == key
    with pytest.raises(KeyError):
        layout.entry("bb")


def test_a_tensor_of_the_same_size_but_another_shape_is_refused():
    # (3, 2) is not (2, 3), though it has as many elements and sorts after it.
    layout = layout_of({"w": torch.zeros(2, 3)})
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"tensor 'w' is float32 \[3, 2\], the image "
                                         r"expects float32 \[2, 3\]"):
        fill_image(buffer, layout, {"w": torch.zeros(3, 2)})


def test_filled_hands_out_the_whole_image_once_in_order():
    tensors = {"a": torch.arange(3, dtype=torch.float32), "b": torch.zeros(0),
               "c": torch.arange(5, dtype=torch.int64), "d": torch.ones(2, dtype=torch.bfloat16)}
    layout = layout_of(tensors, keep_order=True)
    buffer = torch.zeros(layout.nbytes + 16, dtype=torch.uint8)
    pieces = []
    fill_image(buffer, layout, tensors, filled=lambda piece: pieces.append(piece.clone()))
    assert len(pieces) >= 3
    assert torch.equal(torch.cat(pieces), buffer[:layout.nbytes])
