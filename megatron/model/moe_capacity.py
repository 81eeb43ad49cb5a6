"""An MoE layer's expert capacity rounded up to a multiple of the tensor-parallel size.

With ``T`` > 1 tensor-parallel ranks, DeepSpeed 0.19's ``MOELayer`` (and Parm's schedules,
``megatron.model.moe_schedules``) splits each expert's ``C`` capacity slots over the ``T``
ranks (``deepspeed.moe.mappings.drop_tokens`` along the slots), which asserts that ``T``
divides ``C``. DeepSpeed's gate rounds ``C`` up to a multiple of ``T`` only without token
dropping *and* without expert tensor parallelism. Elsewhere ``T`` need not divide ``C``:

* without token dropping, with expert tensor parallelism, ``C`` is the largest expert
  count of the micro-batch over the expert-parallel group: T = 2 stopped at the first
  batch with an odd one ("input dimension 1 (39) is not divisible by tensor parallel
  world size (2)", on configs/tiny.yaml's first batch);
* with token dropping ``C = max(ceil(S k cf / E), min capacity)`` (``S`` tokens, top-``k``,
  capacity factor ``cf``, ``E`` experts), odd for some settings (``--topk 1
  --moe-train-capacity-factor 1.3`` on configs/tiny.yaml: 21), with or without expert
  tensor parallelism.

:func:`pad_capacity` wraps the gate's forward so that it returns ``C`` rounded up to a
multiple of ``T``. The routing is the gate's own: every route keeps its slot (a location
below the gate's ``C``), and the padding slots hold no token. The encode fills them with
zeros, the decode never reads them, so their outputs get no gradient and the experts'
weights none from them: the layer computes T = 1's result (the tests compare).
"""

import logging
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def padded_capacity(capacity: int, multiple: int) -> int:
    """``capacity`` rounded up to a multiple of ``multiple``."""
    return -(-capacity // multiple) * multiple


class CapacityPadding:
    """A DeepSpeed ``TopKGate``'s forward with the capacity padded to a multiple of
    ``multiple`` (installed by :func:`pad_capacity`; called on every rank, like the gate).

    Handles both of the gate's outputs: with ``sparse_routes`` (what ``MOELayer`` and
    Parm's schedules ask for) ``(l_aux, capacity, experts, indices, locations, gates,
    exp_counts)``, where only the capacity changes; without, ``(l_aux, combine_weights,
    dispatch_mask, exp_counts)``, whose ``[S, E, C]`` tensors get zero padding slots.
    """

    def __init__(self, forward: Callable, multiple: int):
        self.forward = forward
        self.multiple = multiple
        self.padded_passes = 0
        """Forward passes whose capacity was padded (for tests and diagnostics)."""
        self.last: Optional[Tuple[int, int]] = None
        """``(gate's capacity, capacity returned)`` of the latest pass."""

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        sparse = len(out) == 7
        capacity = int(out[1]) if sparse else out[1].shape[-1]
        padded = padded_capacity(capacity, self.multiple)
        self.last = (capacity, padded)
        if padded == capacity:
            return out
        if self.padded_passes == 0:
            logger.info("MoE capacity %d padded to %d slots, a multiple of the tensor-parallel "
                        "size %d (the padding slots hold no token)", capacity, padded, self.multiple)
        self.padded_passes += 1
        if sparse:
            # the gate returns a tensor capacity; the layers read it with int()
            return out[:1] + (torch.as_tensor(padded),) + out[2:]
        l_aux, combine, dispatch, exp_counts = out
        extra = (0, padded - capacity)
        return l_aux, F.pad(combine, extra), F.pad(dispatch, extra), exp_counts


def pad_capacity(gate: torch.nn.Module, tensor_parallel_size: int) -> Optional[CapacityPadding]:
    """Make ``gate`` (a DeepSpeed ``TopKGate``) return capacities padded to a multiple of
    ``tensor_parallel_size``; every rank calls it when it builds the layer. Nothing to do
    (None) at size 1. The gate's parameters and their names do not change."""
    if tensor_parallel_size == 1:
        return None
    installed = capacity_padding(gate)
    if installed is not None:  # a second wrapper would only count each pass twice
        return installed
    padding = CapacityPadding(gate.forward, tensor_parallel_size)
    gate.forward = padding
    return padding


def capacity_padding(gate: torch.nn.Module) -> Optional[CapacityPadding]:
    """The :class:`CapacityPadding` :func:`pad_capacity` installed on ``gate``, or None."""
    forward = vars(gate).get("forward")
    return forward if isinstance(forward, CapacityPadding) else None
