"""Where the fragments of a tensor-parallel tensor lie: the storage order of a tensor split
over the ranks of a tensor-parallel group.

A checkpoint names every tensor by its global shape and stores elements
``[offset, offset + length)`` of one flat order of it. For a tensor that no rank splits,
that order is the row-major order of the global tensor. A rank of a tensor-parallel
group holds a *slice* of a split tensor: for a row-parallel weight ``[out, in / T]``,
a slice whose rows are ``out`` separate runs of the row-major order; its ZeRO partition
would be hundreds of fragments. So a split tensor is stored in **part-major order**
instead, as megatron-core's ``ShardedTensor`` keeps each rank's shard whole: the global
tensor is viewed as :attr:`TensorSplit.view`, cut into :attr:`TensorSplit.parts` equal
slices along :attr:`TensorSplit.dim`, and the slices are laid end to end, each in its
own row-major order. Part ``p``'s element ``i`` (its flat index in the rank's local
parameter) is stored at ``p * part_numel + i``, so any contiguous range of a rank's
parameter (a ZeRO partition) is one contiguous range of the stored order.

A load under the same split reads its ranges directly; under another (another
tensor-parallel size, or none) :func:`convert` re-orders the tensor through the
row-major order. Pure functions, no I/O.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class TensorSplit:
    """How a tensor is cut into the parts of a tensor-parallel group (part ``p`` is rank
    ``p``'s local parameter)."""

    view: Tuple[int, ...]
    """The shape the global tensor is viewed as before cutting (its own shape, unless the
    cut dimension is an inner one, as for a fused QKV projection ``[3, heads, ...]``)."""
    dim: int
    """The dimension of ``view`` cut into ``parts`` equal slices."""
    parts: int
    """Number of parts (the tensor-parallel size)."""

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError(problems)

    def problems(self) -> str:
        """Why this split is malformed ('' when it is not)."""
        if not self.view or not all(type(s) is int and s > 0 for s in self.view):
            return f"split view {list(self.view)}: expected positive ints"
        if type(self.dim) is not int or not 0 <= self.dim < len(self.view):
            return f"split dim {self.dim!r} is not a dimension of the view {list(self.view)}"
        if type(self.parts) is not int or self.parts < 1 or self.view[self.dim] % self.parts:
            return (f"split into {self.parts!r} parts: dimension {self.dim} of the view "
                    f"{list(self.view)} is not a multiple of it")
        return ""

    @property
    def numel(self) -> int:
        return math.prod(self.view)

    @property
    def part_numel(self) -> int:
        """Elements of one part."""
        return self.numel // self.parts

    def stored_offset(self, part: int, local_offset: int) -> int:
        """Where element ``local_offset`` of part ``part`` (flat, in the rank's own
        parameter) is stored."""
        if not 0 <= part < self.parts:
            raise IndexError(f"part {part} of {self.parts}")
        return part * self.part_numel + local_offset

    def _cut_shape(self) -> Tuple[int, ...]:
        d = self.dim
        return self.view[:d] + (self.parts, self.view[d] // self.parts) + self.view[d + 1:]

    def to_row_major(self, stored: torch.Tensor) -> torch.Tensor:
        """The row-major flat tensor from its part-major flat order (a new tensor)."""
        d = self.dim
        cut = self._cut_shape()
        part_major = (cut[d],) + cut[:d] + cut[d + 1:]
        order = list(range(1, d + 1)) + [0] + list(range(d + 1, len(cut)))
        return stored.reshape(part_major).permute(order).reshape(-1).contiguous()

    def from_row_major(self, flat: torch.Tensor) -> torch.Tensor:
        """The part-major flat order of a row-major flat tensor (a new tensor)."""
        d = self.dim
        cut = self._cut_shape()
        order = [d] + list(range(d)) + list(range(d + 1, len(cut)))
        return flat.reshape(cut).permute(order).reshape(-1).contiguous()

    def to_json(self) -> Dict[str, Any]:
        return {"view": list(self.view), "dim": self.dim, "parts": self.parts}

    @classmethod
    def from_json(cls, data: Any, where: str = "split") -> "TensorSplit":
        """Inverse of :meth:`to_json`; ValueError naming ``where`` for anything else."""
        if not isinstance(data, Mapping) or set(data) != {"view", "dim", "parts"}:
            raise ValueError(f"{where}: expected {{view, dim, parts}}, got {data!r}")
        view = data["view"]
        if not isinstance(view, list):
            raise ValueError(f"{where}.view: expected a list of ints, got {view!r}")
        try:
            return cls(tuple(view), data["dim"], data["parts"])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: {err}") from None


def effective(split: Optional[TensorSplit]) -> Optional[TensorSplit]:
    """``split``, or None when it has one part (whose order is the row-major one)."""
    return split if split is not None and split.parts > 1 else None


def same_order(a: Optional[TensorSplit], b: Optional[TensorSplit]) -> bool:
    """Whether two splits store a tensor in the same order (a one-part split's order is
    the row-major one, like no split)."""
    return effective(a) == effective(b)


def convert(flat: torch.Tensor, source: Optional[TensorSplit],
            target: Optional[TensorSplit]) -> torch.Tensor:
    """``flat``, a whole tensor in ``source``'s stored order, in ``target``'s (None: the
    row-major order). Returns ``flat`` itself when the orders are the same.

    Raises:
        ValueError: the splits describe tensors of other sizes than ``flat``.
    """
    for split in (source, target):
        if split is not None and split.numel != flat.numel():
            raise ValueError(f"a split of {split.numel} elements for a tensor of {flat.numel()}")
    if same_order(source, target):
        return flat
    row_major = effective(source).to_row_major(flat) if effective(source) else flat
    return effective(target).from_row_major(row_major) if effective(target) else row_major


def check_split_shape(split: TensorSplit, shape: Sequence[int]) -> str:
    """Why ``split`` cannot describe a tensor of ``shape`` ('' when it can)."""
    if split.numel != math.prod(shape):
        return (f"split view {list(split.view)} does not hold the {math.prod(shape)} "
                f"elements of {list(shape)}")
    return ""
