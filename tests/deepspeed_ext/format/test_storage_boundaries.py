"""Boundaries of :mod:`deepspeed_ext.format.storage` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import json

import pytest
import torch

from deepspeed_ext.format.storage import (atomic_write_json, atomic_write_text,
                                          write_safetensors_streaming)


def test_atomic_text_and_json_writes_make_their_folder_by_default(tmp_path):
    path = tmp_path / "new" / "deeper" / "latest"
    record = atomic_write_text(str(path), "global_step10")
    assert path.read_text() == "global_step10" and record.nbytes == len("global_step10")
    path = tmp_path / "other" / "deeper" / "report.json"
    atomic_write_json(str(path), {"rank": 0})
    assert json.loads(path.read_text()) == {"rank": 0}


def test_a_streamed_tensor_of_another_dtype_is_refused(tmp_path):
    # int64 sorts after float32: the check is for any other dtype, not an order.
    with pytest.raises(ValueError, match=r"'w' produced torch.int64 \[2\], layout says "
                                         r"float32 \[2\]"):
        write_safetensors_streaming(str(tmp_path / "f.safetensors"), [("w", (2,), torch.float32)],
                                    lambda key: torch.zeros(2, dtype=torch.int64))
    assert list(tmp_path.iterdir()) == []
