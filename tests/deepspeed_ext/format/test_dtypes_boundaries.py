"""Boundaries of :mod:`deepspeed_ext.format.dtypes` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import torch

from deepspeed_ext.format.dtypes import ITEM_SIZES, SAFETENSORS_CODES


def test_every_item_size_is_torchs_element_size_of_its_dtype():
    # A wrong size misplaces every tensor after one of that dtype in a slot image.
    for code, name in SAFETENSORS_CODES.items():
        dtype = getattr(torch, name, None)
        if dtype is None:   # a float8 dtype this torch lacks
            continue
        assert ITEM_SIZES[code] == torch.empty(0, dtype=dtype).element_size(), code
    assert set(ITEM_SIZES) == set(SAFETENSORS_CODES)
