"""Resumable, data-parallel batch sampling for pretraining.

Samples are consumed in dataset order (the GPT dataset is already shuffled by its
shuffle index). Every step takes the next ``micro_batch_size * data_parallel_size``
consecutive indices and data-parallel rank ``r`` gets the slice
``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of them. The indices seen
therefore depend only on ``consumed_samples``: a run restarted with
``consumed_samples = C`` sees exactly what an uninterrupted run sees after ``C``.
"""

from typing import Dict, Iterator, List, Optional

import torch

_BATCH_KEYS = (
    ("tokens", torch.int64),
    ("labels", torch.int64),
    ("loss_mask", torch.float32),
    ("position_ids", torch.int64),
)


def _require_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class PretrainingSampler:
    """Batch sampler yielding this rank's dataset indices for each micro batch.

    Args:
        total_samples: number of samples in the dataset (``len(dataset)``).
        consumed_samples: samples already consumed by all data-parallel ranks together
            (0 for a fresh run); ``consumed_samples == total_samples`` yields nothing.
        micro_batch_size: samples per rank per micro batch.
        data_parallel_rank: this rank, ``0 <= rank < data_parallel_size``.
        data_parallel_size: number of data-parallel ranks.
        drop_last: drop the trailing partial step (default). With ``False`` the
            remaining ``n < micro_batch_size * data_parallel_size`` indices are split
            the same way, so ranks get short or no last batches (ranks with nothing
            left yield nothing): only meant for single-rank evaluation.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        self.total_samples = _require_int("total_samples", total_samples, 1)
        self.consumed_samples = _require_int("consumed_samples", consumed_samples, 0)
        self.micro_batch_size = _require_int("micro_batch_size", micro_batch_size, 1)
        self.data_parallel_size = _require_int("data_parallel_size", data_parallel_size, 1)
        self.data_parallel_rank = _require_int("data_parallel_rank", data_parallel_rank, 0)
        if self.consumed_samples > self.total_samples:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) exceeds total_samples ({total_samples}): "
                "the run has consumed more samples than the dataset holds"
            )
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({data_parallel_rank}) must be < data_parallel_size "
                f"({data_parallel_size})"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last must be a bool, got {drop_last!r}")
        self.drop_last = drop_last
        self.step_size = self.micro_batch_size * self.data_parallel_size

    def _rank_slice(self, step_start: int, step_end: int) -> range:
        begin = step_start + self.data_parallel_rank * self.micro_batch_size
        return range(min(begin, step_end), min(begin + self.micro_batch_size, step_end))

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full_steps, tail = divmod(remaining, self.step_size)
        if self.drop_last or tail == 0:
            return full_steps
        tail_start = self.consumed_samples + full_steps * self.step_size
        return full_steps + (1 if len(self._rank_slice(tail_start, self.total_samples)) else 0)

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples
        while start + self.step_size <= self.total_samples:
            yield list(self._rank_slice(start, start + self.step_size))
            start += self.step_size
        if not self.drop_last and start < self.total_samples:
            tail = self._rank_slice(start, self.total_samples)
            if len(tail):
                yield list(tail)


def collate_pretraining_batch(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack GPT samples into ``[micro_batch_size, seq_length]`` tensors.

    Keeps exactly ``tokens``/``labels``/``position_ids`` (int64) and ``loss_mask``
    (float32); other keys (``dataset_id`` of blended datasets, an attention mask) are
    dropped so single-source and blended data give the same batch layout.
    """
    if not samples:
        raise ValueError("cannot collate an empty batch")
    batch = {}
    for key, dtype in _BATCH_KEYS:
        batch[key] = torch.stack([torch.as_tensor(s[key]) for s in samples]).to(dtype)
    return batch


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over ``dataset`` for this data-parallel rank, resuming after
    ``consumed_samples``; ``None`` when ``dataset`` is None (e.g. a split of weight 0).
    """
    if dataset is None:
        return None
    num_workers = _require_int("num_workers", num_workers, 0)
    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_pretraining_batch,
        pin_memory=torch.cuda.is_available(),
    )
