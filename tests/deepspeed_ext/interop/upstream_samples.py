"""Upstream's training samples of the fixture, read as upstream's GPTDataset reads them:
its ``.idx`` (sizes and pointers as recorded), its document, sample and shuffle indexes
from the fixture's ``index-cache/``. Written here from the format's description in
tests/fixtures/megatron_deepspeed_moe/RECIPE.md; used to feed MoC's model upstream's
exact samples."""

import os
import struct

import numpy as np
import torch

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fixtures",
                       "megatron_deepspeed_moe")
TRAIN_CACHE = "5c80def92e73c97c6147486cf24a3483"
PREFIX = os.path.join(FIXTURE, "data", "bytes_text_document")


def read_index(path: str):
    """``(sizes, pointers in bytes, dtype)`` of a Megatron ``.idx`` (MMIDIDX, version 1)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00", "not a Megatron index file"
    version, = struct.unpack_from("<Q", data, 9)
    assert version == 1
    code, = struct.unpack_from("<B", data, 17)
    count, _docs = struct.unpack_from("<QQ", data, 18)
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
             6: np.float64, 7: np.float32, 8: np.uint16}[code]
    offset = 34
    sizes = np.frombuffer(data, np.int32, count, offset)
    pointers = np.frombuffer(data, np.int64, count, offset + 4 * count)
    return sizes, pointers, dtype


def train_samples(first: int, count: int) -> torch.Tensor:
    """Global training samples ``first .. first+count-1`` (each ``seq_length + 1``
    tokens) in upstream's order, as an int64 tensor ``[count, 65]``."""
    sizes, pointers, dtype = read_index(PREFIX + ".idx")
    tokens = np.fromfile(PREFIX + ".bin", dtype=dtype)
    cache = os.path.join(FIXTURE, "index-cache", TRAIN_CACHE)
    doc_idx = np.load(cache + "_doc_idx.npy")
    sample_idx = np.load(cache + "_sample_idx.npy")
    shuffle_idx = np.load(cache + "_shuffle_idx.npy")
    itemsize = np.dtype(dtype).itemsize

    def doc(d, offset=0, length=None):
        start = int(pointers[d]) // itemsize + offset
        length = int(sizes[d]) - offset if length is None else length
        return tokens[start:start + length]

    out = []
    for g in range(first, first + count):
        i = int(shuffle_idx[g])
        (df, of), (dl, ol) = sample_idx[i], sample_idx[i + 1]
        if df == dl:
            parts = [doc(doc_idx[df], of, ol - of + 1)]
        else:
            parts = [doc(doc_idx[df], of)] + [doc(doc_idx[k]) for k in range(df + 1, dl)]
            parts.append(doc(doc_idx[dl], 0, ol + 1))
        out.append(np.concatenate(parts).astype(np.int64))
    return torch.from_numpy(np.stack(out))
