"""Boundaries of :mod:`deepspeed_ext.format.splits` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import torch

from deepspeed_ext.format.splits import TensorSplit


def test_a_split_along_every_dimension_of_a_3d_view_round_trips():
    flat = torch.arange(2 * 3 * 4)
    for dim, parts in ((0, 2), (1, 3), (2, 2)):
        split = TensorSplit((2, 3, 4), dim, parts)
        stored = split.from_row_major(flat)
        # Part p holds the p-th slice of the view along dim, row-major within it.
        first = flat.reshape(2, 3, 4).chunk(parts, dim)[0].reshape(-1)
        assert torch.equal(stored[:split.part_numel], first), dim
        assert torch.equal(split.to_row_major(stored), flat), dim
