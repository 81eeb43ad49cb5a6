"""Reading a Megatron-DeepSpeed checkpoint file without running anything it pickled.

Upstream's files are ``torch.save`` pickles. A plain ``torch.load`` would call whatever
functions they name; ``weights_only=True`` refuses every global outside an allow-list.
Upstream's model file pickles its ``argparse.Namespace`` of arguments (holding
``megatron.core.enums.ModelType``) and NumPy's RNG state; its ZeRO files pickle three
small DeepSpeed types. Each is allowed here as a *stand-in* of our own registered under
upstream's name, so loading constructs nothing of megatron's or DeepSpeed's: an
enum, a named tuple and an attribute holder with the same fields.

Before a file is unpickled it is checked: a regular file (no link), inside the
checkpoint's directory, and under a size cap.
"""

import argparse
import enum
import os
from typing import Any, List

import torch

from deepspeed_ext.format.errors import CheckpointError

MAX_FILE_BYTES = 1 << 40
"""Largest upstream file read (one file of a large model's rank: well under a TiB)."""


class ModelType(enum.Enum):
    """Stand-in for ``megatron.core.enums.ModelType`` (inside upstream's ``args``)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (a ZeRO file's ``zero_stage``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class LossScaler:
    """Stand-in for DeepSpeed's static ``LossScaler``: its fields, nothing else."""


class FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address`` (a dataclass): a parameter's slice of
    a partition, ``numel`` elements from ``start``, set by the unpickler."""

    numel: int
    start: int


def _numpy_globals() -> List[Any]:
    """NumPy's pieces of a pickled RNG state, under NumPy 1's and 2's module names."""
    import numpy
    found: List[Any] = [numpy.ndarray, numpy.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
        except (ImportError, AttributeError):
            continue
    dtypes = getattr(numpy, "dtypes", None)
    for name in ("UInt32DType", "Float64DType", "Int64DType"):
        if dtypes is not None and hasattr(dtypes, name):
            found.append(getattr(dtypes, name))
    return found


def allowed_globals() -> List[Any]:
    """What ``weights_only`` may construct from an upstream file: plain containers and
    the stand-ins above, under upstream's names."""
    return [argparse.Namespace,
            (ModelType, "megatron.core.enums.ModelType"),
            (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
            (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
            *_numpy_globals()]


def check_inside(root: str, path: str) -> str:
    """``path``'s real location, refused unless it is a regular file inside ``root``.

    Raises:
        CheckpointError: a link, something other than a file, outside ``root``, or
            larger than :data:`MAX_FILE_BYTES`.
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.islink(path) or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(f"{path}: a link or a path outside {root}; an upstream "
                              f"checkpoint's files are read only from its own directory")
    if not os.path.isfile(real):
        raise CheckpointError(f"{path}: missing or not a regular file")
    if os.path.getsize(real) > MAX_FILE_BYTES:
        raise CheckpointError(f"{path}: {os.path.getsize(real)} bytes, above the "
                              f"{MAX_FILE_BYTES} read")
    return real


def load_upstream_file(root: str, path: str) -> Any:
    """Unpickle one of upstream's ``.pt`` files on the CPU with ``weights_only=True`` and
    :func:`allowed_globals`. Called by one process (``moc-ckpt import``).

    Raises:
        CheckpointError: the file fails :func:`check_inside`, or holds a global outside
            the allow-list (named in the message), or is not a torch file.
    """
    real = check_inside(root, path)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(real, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError, RuntimeError (not a zip), EOFError
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: cannot be read as a weights-only torch file ({first}); MoC never "
            f"runs a checkpoint's pickled code, so a file that needs more than tensors, "
            f"containers, argparse.Namespace, NumPy arrays and DeepSpeed's ZeRO records "
            f"is refused") from None
