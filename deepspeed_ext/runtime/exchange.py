"""One small collective per snapshot: a picklable value from every rank.

A snapshot must make one rank's copy error everyone's, tell every rank what rank 0 saw
of the pending persist, and collect every rank's RNG state, while the training loop
waits. ``all_gather_object`` takes two collectives (sizes, then data); an
:class:`Exchanger` takes one ``all_gather`` of a fixed-size byte tensor. The size is
learned on the first call (through ``all_gather_object``) and grown, with one more
round, whenever a value no longer fits. Both run on the host, on the metadata group
(:func:`deepspeed_ext.runtime.groups.metadata_group`, gloo): the training's device group is
never handed these CPU bytes, and an exchange does not wait for the device.

Values are pickled: they travel between the processes of one job, in memory, never
through a file.
"""

import pickle
import struct
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from deepspeed_ext.runtime.groups import metadata_group

_LENGTH = struct.Struct("<q")  # pickled length; -1: did not fit


class Exchanger:
    """Every rank creates one and calls :meth:`exchange` at the same points, in order."""

    def __init__(self, device: Optional[torch.device] = None, capacity: int = 0, group=None):
        """Args:
            device: where the gathered tensor lives (default: the group's device: the
                CPU on a gloo group).
            capacity: bytes per rank to start with (the same on every rank), for a few
                calls whose values are known to be small: the first call then takes one
                collective too. 0: learn it on the first call.
            group: the process group (default: :func:`metadata_group`, looked up at
                each call).
        """
        if capacity < 0 or 0 < capacity <= _LENGTH.size:  # the length field must fit
            raise ValueError(f"Exchanger capacity must be 0 or more than {_LENGTH.size} "
                             f"bytes, got {capacity}")
        self.capacity = capacity
        """Bytes per rank of the gathered tensor; 0 until the first call."""
        self.group = group
        self.device = device

    def _group(self):
        return self.group if self.group is not None else metadata_group()

    def _device(self, group) -> torch.device:
        if self.device is not None:
            return self.device
        # The metadata group is gloo (host tensors); a caller's NCCL group gathers
        # device tensors only.
        return (torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    def exchange(self, value: Any) -> List[Any]:
        """Every rank: every rank's ``value``, in rank order."""
        data = pickle.dumps(value)
        if self.capacity:
            fits = _LENGTH.size + len(data) <= self.capacity
            gathered = self._gather_fixed(_LENGTH.pack(len(data)) + data if fits
                                          else _LENGTH.pack(-1))
            lengths = [_LENGTH.unpack_from(g)[0] for g in gathered]
            if min(lengths) >= 0:
                return [pickle.loads(g[_LENGTH.size:_LENGTH.size + n])
                        for g, n in zip(gathered, lengths)]
        # First call, or some rank's value outgrew the buffer: every rank takes the slow
        # path together, and the buffer is sized for the largest value seen, twice over.
        group = self._group()
        objects: List = [None] * dist.get_world_size(group)
        dist.all_gather_object(objects, data, group=group)
        self.capacity = 2 * (_LENGTH.size + max(len(o) for o in objects))
        return [pickle.loads(o) for o in objects]

    def _gather_fixed(self, record: bytes) -> List[bytes]:
        buffer = torch.zeros(self.capacity, dtype=torch.uint8)
        buffer[:len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        group = self._group()
        buffer = buffer.to(self._device(group))
        out = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, buffer, group=group)
        return [t.cpu().numpy().tobytes() for t in out]
