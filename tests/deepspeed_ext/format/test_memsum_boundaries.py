"""Boundaries of :mod:`deepspeed_ext.format.memsum` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import numpy as np

from deepspeed_ext.format import memsum


def test_a_chunked_checksum_counts_bytes_whatever_the_buffers_shape_or_type():
    # A big-endian float buffer (format ">f") and a 2-D byte buffer: chunks are bytes,
    # not items or rows.
    for data in (np.arange(40000, dtype=">f4"), np.arange(200, dtype=np.uint8).reshape(10, 20)):
        for algorithm in ("crc32x64k", "crc32x1m"):
            assert memsum.digest(data, algorithm) == memsum.digest(data.tobytes(), algorithm)
