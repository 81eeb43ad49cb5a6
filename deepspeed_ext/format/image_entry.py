"""Where one tensor lives inside a slot image: the record both sides of the keeper use.

Torch-free on purpose: :mod:`deepspeed_ext.format.image` lays images out with it (the
training side), and :mod:`deepspeed_ext.jobs` carries it in a persist job to the keeper,
which must answer its first ping and copy frames without waiting for torch's import.
"""

from dataclasses import dataclass
from typing import Any, Dict, Tuple


@dataclass(frozen=True)
class ImageEntry:
    """Where one tensor lives inside an image."""

    key: str
    """safetensors key."""
    dtype: str
    """dtype name (``float32``)."""
    shape: Tuple[int, ...]
    """Tensor shape."""
    start: int
    """Byte offset of the tensor's first byte from the start of the image."""
    nbytes: int
    """Bytes of tensor data."""

    def to_json(self) -> Dict[str, Any]:
        """The entry as a persist job carries it (the keys of the keeper's wire format;
        parsed back by :func:`deepspeed_ext.jobs.image_entry_from_json`)."""
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                "start": self.start, "nbytes": self.nbytes}
