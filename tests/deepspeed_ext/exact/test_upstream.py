"""The upstream log's bookkeeping (deepspeed_ext.exact.upstream) without an engine: keys,
bytes, retention, the error naming a missing entry, and the sizing functions. What it
logs from DeepSpeed's pipeline engine, and that a replay from it is exact, is tested in
test_local_replay.py."""

import pytest
import torch

from deepspeed_ext.exact.upstream import (ACTIVATION, GRADIENT, UpstreamLog, log_bytes_per_iteration,
                                          log_capacity_bytes)


def _step(log, iteration, micro_batches=3):
    log.begin(iteration)
    for m in range(micro_batches):
        log.record(ACTIVATION, (torch.full((4,), float(10 * iteration + m)), torch.zeros(2, dtype=torch.int64)))
    log.end()


def test_entries_are_copies_keyed_by_step_and_micro_batch_and_old_steps_are_freed():
    log = UpstreamLog(engine=None, retain_iterations=2)
    for it in (1, 2, 3):
        _step(log, it)
    assert log.iterations() == [2, 3]
    assert log.bytes == 2 * 3 * (4 * 4 + 2 * 8) and log.peak_bytes == 3 * 3 * (4 * 4 + 2 * 8)
    assert torch.equal(log.get(3, 2, ACTIVATION)[0], torch.full((4,), 32.0))
    with pytest.raises(KeyError, match="no gradient of micro-batch 0 of iteration 3 "
                                       "\\(it holds iterations 2..3\\)"):
        log.get(3, 0, GRADIENT)
    log.begin(None)  # evaluation: nothing kept
    log.record(ACTIVATION, torch.ones(4))
    log.end()
    assert log.iterations() == [2, 3]
    sent = torch.ones(4)
    log.begin(4)
    log.record(ACTIVATION, sent)
    sent.add_(1)  # the engine reuses its buffers: the log keeps what was sent
    assert torch.equal(log.get(4, 0, ACTIVATION)[0], torch.ones(4))


def test_log_sizes():
    assert log_bytes_per_iteration(100, 60, 4, stage=0, stages=3) == 400
    assert log_bytes_per_iteration(100, 60, 4, stage=1, stages=3) == 640
    assert log_bytes_per_iteration(100, 60, 4, stage=2, stages=3) == 240
    assert log_capacity_bytes(640, 6) == 7 * 640
    with pytest.raises(ValueError, match="retain_iterations must be >= 1"):
        UpstreamLog(engine=None, retain_iterations=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sends_are_copied_to_pinned_memory_on_a_side_stream():
    """A send on the GPU: its host copy is pinned, made on the log's own stream after the
    compute that produced the tensor, and equal to what was sent even when the tensor is
    freed at once and its memory wanted by the next micro-batch (the allocator must not
    hand it out before the copy ran: ``record_stream``)."""
    log = UpstreamLog(engine=None, retain_iterations=1)
    log.begin(1)
    sent = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 2  # queued compute
    log.record(ACTIVATION, sent)
    del sent
    torch.empty(1 << 20, dtype=torch.float32, device="cuda").fill_(-1)  # the next one
    got = log.get(1, 0, ACTIVATION)[0]
    assert got.is_pinned() and got.device.type == "cpu"
    assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) * 2)
