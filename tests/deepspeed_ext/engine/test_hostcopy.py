"""Snapshot copies into a shared-memory slot: on CPU the background thread copies; on
CUDA (run where a GPU is present) the copies are queued on a side stream into the
slot's page-locked mapping and an event ends them."""

import shutil

import pytest
import torch

from deepspeed_ext.engine.hostcopy import HostCopier, wait_before_step
from deepspeed_ext.format.copy_plan import plan_copies
from deepspeed_ext.format.image import layout_of
from deepspeed_ext.snapshot import SlotImage, SnapshotSlots
from tests.shm import new_shm_dir


@pytest.fixture
def shm_dir():
    """Slots in shared memory, as in training: CUDA may refuse to page-lock a
    file-backed mapping on disk, which the test machine's temp directory may be."""
    path = new_shm_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _Engine:
    """The part of a DeepSpeed engine wait_before_step uses."""

    def __init__(self, boundary, managed):
        self.boundary, self.managed, self.steps = boundary, managed, 0

    def step(self):
        self.steps += 1

    def is_gradient_accumulation_boundary(self):
        return self.boundary

    def managed_gradient_accumulation(self):
        return self.managed


@pytest.mark.parametrize("boundary, managed, waits", [
    (True, True, True),    # the optimizer step of managed accumulation
    (False, True, False),  # a micro-step that only accumulates gradients
    (False, False, True),  # unmanaged: DeepSpeed says "boundary" only inside step()
])
def test_the_step_waits_for_a_copy_in_flight_only_when_it_steps_the_optimizer(
        boundary, managed, waits):
    engine, joined, stalls = _Engine(boundary, managed), [], []
    wait_before_step(engine, pending=lambda: True, join=lambda: joined.append(1), stalls=stalls)
    engine.step()
    assert engine.steps == 1
    assert joined == ([1] if waits else []) and len(stalls) == len(joined)


def _tensors(device):
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1000, 3, generator=gen).to(device),
            "m": torch.randn(17, generator=gen).to(device),
            "rng": torch.arange(5, dtype=torch.uint8)}  # objects stay on the host


def _snapshot(tmp_path, device):
    tensors = _tensors(device)
    copier = HostCopier(HostCopier.device_of(tensors))
    slots = SnapshotSlots(str(tmp_path), 0, on_map=copier.register, on_unmap=copier.unregister)
    layout = layout_of(tensors)
    buffer = slots.buffer(0, layout.nbytes)
    copier.copy_now(buffer, layout, plan_copies(layout, tensors), tensors)
    entries = {e.key: {"dtype": e.dtype, "nbytes": e.nbytes, "start": e.start, "key": e.key}
               for e in layout.entries}
    image = SlotImage(slots.image_path(0))
    try:
        return copier, tensors, {k: image.read(entries[k]) for k in tensors}
    finally:
        image.close()


def test_cpu_copy_runs_in_the_call_and_registers_nothing(tmp_path):
    copier, tensors, read = _snapshot(tmp_path, "cpu")
    assert not copier.cuda and copier.registered_bytes == 0
    for key, tensor in tensors.items():
        assert torch.equal(read[key], tensor.reshape(-1)), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_side_stream_into_registered_shared_memory(shm_dir):
    torch.cuda.synchronize()
    copier, tensors, read = _snapshot(shm_dir, "cuda")
    assert copier.cuda and copier.register_error is None and copier.registered_bytes > 0
    for key, tensor in tensors.items():
        assert torch.equal(read[key], tensor.cpu().reshape(-1)), key
    copier.unregister_all()
    assert copier.registered_bytes == 0
    torch.zeros(4, device="cuda").add_(1)  # no CUDA error was left behind
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_snapshot_sees_the_step_queued_before_it(shm_dir):
    """The side stream waits for the compute stream: a change queued just before the
    launch (as the optimizer step is) is in the snapshot."""
    tensors = {"w": torch.zeros(1 << 22, device="cuda")}
    copier = HostCopier(torch.device("cuda"))
    slots = SnapshotSlots(shm_dir, 0, on_map=copier.register)
    layout = layout_of(tensors)
    buffer = slots.buffer(0, layout.nbytes)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy
    tensors["w"].add_(1.0)
    copier.copy_now(buffer, layout, plan_copies(layout, tensors), tensors)
    entry = layout.entries[0]
    image = SlotImage(slots.image_path(0))
    got = image.read({"dtype": entry.dtype, "nbytes": entry.nbytes, "start": entry.start})
    image.close()
    assert torch.all(got == 1.0)
