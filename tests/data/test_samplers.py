import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.data.samplers import (  # noqa: E402
    PretrainingSampler,
    build_pretraining_data_loader,
    collate_pretraining_batch,
)


def rank_batches(total, consumed, mbs, dp, steps=None):
    """Per step: the list of per-rank index lists."""
    iters = [iter(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    out = []
    while steps is None or len(out) < steps:
        try:
            out.append([next(it) for it in iters])
        except StopIteration:
            break
    return out


def test_first_batches_are_dataset_order():
    steps = rank_batches(total=20, consumed=0, mbs=2, dp=3, steps=2)
    assert steps[0] == [[0, 1], [2, 3], [4, 5]]
    assert steps[1] == [[6, 7], [8, 9], [10, 11]]


@pytest.mark.parametrize("mbs,dp", [(1, 1), (2, 2), (3, 4), (4, 1)])
def test_resume_matches_uninterrupted_run(mbs, dp):
    total = 203
    step = mbs * dp
    uninterrupted = rank_batches(total, 0, mbs, dp)
    assert len(uninterrupted) == total // step
    for stop_after in (0, 1, 5, len(uninterrupted) // 2, len(uninterrupted)):
        first_half = rank_batches(total, 0, mbs, dp, steps=stop_after)
        consumed = stop_after * step
        second_half = rank_batches(total, consumed, mbs, dp)
        assert first_half + second_half == uninterrupted


def test_resume_at_arbitrary_consumed_samples():
    # consumed need not be a multiple of the step: indices continue from it
    steps = rank_batches(total=30, consumed=7, mbs=2, dp=2, steps=2)
    assert steps == [[[7, 8], [9, 10]], [[11, 12], [13, 14]]]


def test_ranks_partition_each_global_batch():
    mbs, dp, total = 3, 4, 100
    for step_index, per_rank in enumerate(rank_batches(total, 12, mbs, dp)):
        flat = [i for batch in per_rank for i in batch]
        assert len(flat) == len(set(flat)) == mbs * dp
        start = 12 + step_index * mbs * dp
        assert sorted(flat) == list(range(start, start + mbs * dp))
        for rank, batch in enumerate(per_rank):
            assert batch == list(range(start + rank * mbs, start + (rank + 1) * mbs))


def test_len_matches_iteration():
    for total, consumed, mbs, dp, rank in [(10, 0, 2, 2, 1), (11, 3, 2, 2, 0), (8, 8, 1, 2, 0)]:
        sampler = PretrainingSampler(total, consumed, mbs, rank, dp)
        assert len(sampler) == len(list(sampler)) == (total - consumed) // (mbs * dp)


def test_drop_last_false_tail():
    # 11 samples, steps of 4: two full steps, tail [8, 9, 10]
    rank0 = list(PretrainingSampler(11, 0, 2, 0, 2, drop_last=False))
    rank1 = list(PretrainingSampler(11, 0, 2, 1, 2, drop_last=False))
    assert rank0[-1] == [8, 9] and rank1[-1] == [10]
    assert len(PretrainingSampler(11, 0, 2, 1, 2, drop_last=False)) == 3
    # a rank with an empty tail yields nothing more
    rank1_short = list(PretrainingSampler(9, 0, 2, 1, 2, drop_last=False))
    assert rank1_short == [[2, 3], [6, 7]]
    assert len(PretrainingSampler(9, 0, 2, 1, 2, drop_last=False)) == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(total_samples=0), "total_samples"),
        (dict(consumed_samples=-1), "consumed_samples"),
        (dict(consumed_samples=101), "exceeds total_samples"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(data_parallel_size=0), "data_parallel_size"),
        (dict(data_parallel_rank=2), "data_parallel_rank"),
        (dict(micro_batch_size=True), "micro_batch_size"),
        (dict(micro_batch_size=2.0), "micro_batch_size"),
    ],
)
def test_validation(kwargs, match):
    base = dict(
        total_samples=100, consumed_samples=0, micro_batch_size=2,
        data_parallel_rank=0, data_parallel_size=2,
    )
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PretrainingSampler(**base)


class FakeGPT(torch.utils.data.Dataset):
    def __init__(self, n, seq):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        text = torch.arange(idx, idx + self.seq + 1)
        return {
            "tokens": text[:-1].clone(),
            "labels": text[1:].clone(),
            "loss_mask": torch.ones(self.seq, dtype=torch.float),
            "position_ids": torch.arange(self.seq),
            "dataset_id": idx % 2,
        }


def test_data_loader_batches_and_resume():
    data = FakeGPT(50, 8)
    loader = build_pretraining_data_loader(data, 0, 3, 1, 2)
    batches = list(loader)
    assert len(batches) == len(loader) == 50 // 6
    first = batches[0]
    assert set(first) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert first["tokens"].shape == (3, 8) and first["tokens"].dtype == torch.int64
    assert first["labels"].dtype == torch.int64
    assert first["loss_mask"].dtype == torch.float32
    assert first["position_ids"].dtype == torch.int64
    assert first["tokens"][:, 0].tolist() == [3, 4, 5]  # rank 1 of 2, mbs 3
    assert torch.equal(first["labels"][:, :-1], first["tokens"][:, 1:])

    resumed = list(build_pretraining_data_loader(data, 12, 3, 1, 2))
    assert len(resumed) == len(batches) - 2
    for a, b in zip(resumed, batches[2:]):
        assert torch.equal(a["tokens"], b["tokens"])


@pytest.mark.e2e  # starts worker processes (multiprocessing)
def test_data_loader_none_and_workers():
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
    data = FakeGPT(12, 4)
    single = [b["tokens"] for b in build_pretraining_data_loader(data, 0, 2, 0, 1)]
    multi = [b["tokens"] for b in build_pretraining_data_loader(data, 0, 2, 0, 1, num_workers=2)]
    assert len(single) == 6
    assert all(torch.equal(a, b) for a, b in zip(single, multi))


def test_collate_rejects_empty():
    with pytest.raises(ValueError):
        collate_pretraining_batch([])
