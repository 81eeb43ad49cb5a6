"""Capture and restore the random-number state of a rank (Python, NumPy, torch, CUDA).

Every rank calls these on its own generators, no collective: a save gathers every
rank's :func:`get_rng_state` (the checkpointer's ``all_gather_object``), a load hands
each rank its own entry for :func:`set_rng_state`. The trainer calls :func:`set_seed`
on every rank before it builds the model.

Saved CUDA state: the current device's generator only (the one this rank draws from).
Checkpoints of older versions saved every visible device's generator (a list);
:func:`cuda_state_for_device` picks this rank's entry from those, so they still load.
"""

import random
from typing import Dict, Optional

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed every generator the training uses, the same way on every rank."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rng_state() -> Dict:
    """This rank's generator states, as a picklable dict. CUDA: the current device's
    generator only, the one this rank draws from (every visible device's, as saved
    before, made a restart that sees fewer devices fail, and restored the wrong stream
    when ranks were mapped to devices differently).

    Python's Mersenne Twister words are an array, not a tuple of 625 ints: a snapshot's
    objects then carry them as a tensor in the image instead of 7 KB of JSON written
    with every snapshot's metadata (states saved as a tuple still restore)."""
    version, words, gauss = random.getstate()
    return {"python": (version, np.array(words, dtype=np.uint32), gauss),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def cuda_state_for_device(saved, device: int) -> Optional[torch.Tensor]:
    """The CUDA generator state to restore on ``device`` from a saved ``cuda`` entry: the
    state itself (one device's, as saved now), or, from a checkpoint that saved every
    visible device's (a list), that device's entry; None when there is none for it."""
    if saved is None:
        return None
    if isinstance(saved, (list, tuple)):
        return saved[device] if 0 <= device < len(saved) else None
    return saved


def set_rng_state(state: Dict) -> None:
    """Restore what :func:`get_rng_state` returned (the CUDA part only where there is CUDA,
    into the current device's generator)."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(int(w) for w in words), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda = cuda_state_for_device(state["cuda"], torch.cuda.current_device())
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def _canonical(value):
    """A comparable form of a saved state's entry (tensors and arrays as bytes, tuples
    and lists alike: a state read back from a checkpoint has lists where tuples were)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.cpu().numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return value


def common_state(states) -> Optional[Dict]:
    """The one state every entry of ``states`` holds, or None when they differ (or there
    are none). Ranks seeded alike that draw alike (every rank of our trainer: the same
    dropout shapes and gate noise per micro-batch) stay equal, so a load on another
    number of ranks can still give every rank the saved stream."""
    if not states:
        return None
    first = _canonical(states[0])
    return states[0] if all(_canonical(s) == first for s in states[1:]) else None
