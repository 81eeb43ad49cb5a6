"""One small collective per snapshot: a picklable value from every rank.

A snapshot must make one rank's copy error everyone's, tell every rank what rank 0 saw
of the pending persist, and collect every rank's RNG state, while the training loop
waits. ``all_gather_object`` takes two collectives (sizes, then data); an
:class:`Exchanger` takes one ``all_gather`` of a fixed-size byte tensor. The size is
learned on the first call (through ``all_gather_object``) and grown, with one more
round, whenever a value no longer fits.

Values are pickled: they travel between the processes of one job, in memory, never
through a file.
"""

import pickle
import struct
from typing import Any, List, Optional

import torch
import torch.distributed as dist

_LENGTH = struct.Struct("<q")  # pickled length; -1: did not fit


class Exchanger:
    """Every rank creates one and calls :meth:`exchange` at the same points, in order."""

    def __init__(self, device: Optional[torch.device] = None, capacity: int = 0):
        """Args:
            device: where the gathered tensor lives (default: the backend's).
            capacity: bytes per rank to start with (the same on every rank), for a few
                calls whose values are known to be small: the first call then takes one
                collective too. 0: learn it on the first call.
        """
        if capacity < 0 or 0 < capacity <= _LENGTH.size:  # the length field must fit
            raise ValueError(f"Exchanger capacity must be 0 or more than {_LENGTH.size} "
                             f"bytes, got {capacity}")
        self.capacity = capacity
        """Bytes per rank of the gathered tensor; 0 until the first call."""
        if device is None:  # NCCL gathers device tensors only
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
        self.device = device

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
        objects: List = [None] * dist.get_world_size()
        dist.all_gather_object(objects, data)
        self.capacity = 2 * (_LENGTH.size + max(len(o) for o in objects))
        return [pickle.loads(o) for o in objects]

    def _gather_fixed(self, record: bytes) -> List[bytes]:
        buffer = torch.zeros(self.capacity, dtype=torch.uint8)
        buffer[:len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        buffer = buffer.to(self.device)
        out = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
        dist.all_gather(out, buffer)
        return [t.cpu().numpy().tobytes() for t in out]
