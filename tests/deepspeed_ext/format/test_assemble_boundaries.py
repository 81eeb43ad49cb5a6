"""Boundaries of :mod:`deepspeed_ext.format.assemble` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``): a fragment's range one element past
its tensor."""

import pytest

from deepspeed_ext.format.assemble import FragmentSpec


def test_a_fragment_one_element_past_its_tensor_is_refused_with_its_range():
    # offset 2 + length 3 = 5 > 4 elements (2 | 3 = 3 would pass: the sum, not the bits).
    with pytest.raises(ValueError, match=r"\[2, 5\) is not a non-empty range of its 4 "):
        FragmentSpec(name="w", kind="fp32", offset=2, length=3, shape=(2, 2), dtype="float32")
    spec = FragmentSpec(name="w", kind="fp32", offset=2, length=2, shape=(2, 2), dtype="float32")
    assert (spec.offset, spec.length) == (2, 2)
