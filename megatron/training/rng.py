"""Capture and restore the random-number state of a rank (Python, NumPy, torch, CUDA)."""

import random
from typing import Dict

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
    """This rank's generator states, as a picklable dict."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: Dict) -> None:
    """Restore what :func:`get_rng_state` returned (the CUDA part only where there is CUDA)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
