"""The process groups of MoC's own collectives: one home for them.

Two kinds of collective run in a MoC job:

* the training's, on **device** tensors (gradients, losses, gate counts): DeepSpeed's
  and the trainer's, on the default group (NCCL on GPUs, gloo on CPU);
* MoC's **metadata**, on CPU tensors and Python objects (every rank's outcome of a save
  or load, the pieces of a write plan, RNG states, a window's figures, barriers that
  order file work on the host): on :func:`metadata_group`, always gloo.

An NCCL group has no CPU backend: ``all_reduce`` of a CPU tensor on it raises, and
``all_gather_object`` / ``broadcast_object_list`` only work by moving the pickled
bytes to the current CUDA device and back (a device round trip, and a wrong or unset
current device hangs or fails). So MoC's code never hands a CPU tensor or an object to
the default group; it passes ``group=metadata_group()`` to every such collective
(``tests/deepspeed_ext/runtime/test_groups.py`` fails on a call site that does not).

Creating a group is itself a collective: every rank of the world must create the same
groups in the same order. So the metadata group is never made on first use (a rank
that used it first in a code path the others skip would hang them all), but at known
points, the same on every rank:

1. the trainer, right after ``init_process_group``
   (``megatron.training.training.initialize_distributed``);
2. every :class:`deepspeed_ext.checkpointer.MoCCheckpointer` and
   :class:`deepspeed_ext.exact.ExactSnapshots` constructor (every rank builds them in
   the same order), for code that uses the library without the trainer.

:func:`init_metadata_group` is idempotent: the first of these calls creates the group,
the others return it. When the default group is already gloo (CPU training), it *is*
the metadata group and nothing is created: CPU runs behave as before.

Groups for a background thread's traffic (the snapshot redundancy's sends,
:class:`deepspeed_ext.peers.PeerRedundancy`) are separate groups made with
:func:`new_host_group`: collectives of one group must not interleave between threads.
"""

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

_metadata = None
"""``(default group it was made for, metadata group)``; None: not made yet."""

separate_on_gloo = False
"""Tests only: make a separate gloo group even when the default group is gloo, as on an
NCCL job, so that a collective handed the default group can be told apart from one on
the metadata group on CPU (``tests/deepspeed_ext/runtime/test_groups.py``). Set before the
first :func:`init_metadata_group`."""


def _needs_own_group() -> bool:
    return separate_on_gloo or dist.get_backend() != "gloo"


def _world_timeout() -> Optional[timedelta]:
    """The default group's timeout (what the job was started with), None if unknown."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except Exception:  # private API: torch's default then
        return None


def init_metadata_group(timeout: Optional[timedelta] = None):
    """Every rank, at the same point (see the module docstring): create the metadata
    group if it does not exist yet for the current default group; returns it.

    Args:
        timeout: of the new group's collectives; None: the default group's.

    Returns:
        The gloo group spanning the world (the default group itself when that is gloo).
    """
    global _metadata
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("init_metadata_group: torch.distributed is not initialized")
    if _metadata is not None and _metadata[0] is world:
        return _metadata[1]
    if _needs_own_group():
        timeout = timeout or _world_timeout()
        kwargs = {"timeout": timeout} if timeout is not None else {}
        group = dist.new_group(backend="gloo", **kwargs)
    else:
        group = world
    _metadata = (world, group)
    return group


def forget_metadata_group() -> None:
    """Every rank, after the default group was destroyed (the end of a run that may be
    followed by another in this process): drop the reference to the old metadata group,
    so nothing reaches a destroyed group and the next :func:`init_metadata_group` makes
    a new one for the new world."""
    global _metadata
    _metadata = None


def metadata_group():
    """The group for collectives on CPU tensors and Python objects (every rank).

    Returns:
        The group :func:`init_metadata_group` made; the default group when that is gloo
        (then no call to :func:`init_metadata_group` is needed).

    Raises:
        RuntimeError: on a non-gloo default group (NCCL) before
            :func:`init_metadata_group` ran; creating the group here, on first use,
            could hang the ranks that never reach this call.
    """
    world = dist.group.WORLD
    if _metadata is not None and _metadata[0] is world:
        return _metadata[1]
    if world is not None and not _needs_own_group():
        return world
    raise RuntimeError("MoC's metadata process group does not exist: every rank must call "
                       "deepspeed_ext.runtime.groups.init_metadata_group() at the same point after "
                       "init_process_group (MoCCheckpointer and ExactSnapshots do)")


def new_training_group(ranks):
    """Every rank of the world, at the same point, in the same order: a group of ``ranks``
    on the training's own backend (NCCL on GPUs), for device tensors only: the combined
    expert x tensor-parallel groups of the MoE schedules (``megatron.model.moe_schedules``).
    """
    return dist.new_group(list(ranks))


def new_host_group(timeout: timedelta):
    """Every rank, at the same point, in the same order: a new gloo group spanning the
    world, for one component's host traffic (one that may run on a background thread,
    where it must not share a group with the main thread's collectives)."""
    return dist.new_group(backend="gloo", timeout=timeout)
