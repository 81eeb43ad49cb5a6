"""Boundaries of :mod:`deepspeed_ext.format.objects` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import copy

import numpy as np
import pytest

from deepspeed_ext.format.objects import decode, encode


def _array_tree():
    return encode({"a": np.arange(3, dtype=np.int64)})


def test_an_array_of_a_dtype_outside_the_plain_kinds_is_refused():
    tree, tensors = _array_tree()
    for dtype in ("O", "i8,i8"):   # objects (no fields), a record (fields)
        bad = copy.deepcopy(tree)
        bad["a"]["dtype"] = dtype
        with pytest.raises(ValueError, match=f"numpy dtype '{dtype}' is not allowed"):
            decode(bad, tensors)


def test_an_array_whose_bytes_do_not_match_its_shape_names_the_bytes_expected():
    tree, tensors = _array_tree()
    bad = copy.deepcopy(tree)
    bad["a"]["shape"] = [4]
    with pytest.raises(ValueError, match="holds 24 torch.uint8 elements, expected 32 uint8 bytes"):
        decode(bad, tensors)
