"""Tensor dtypes a checkpoint may hold: the names the manifest stores and the
safetensors header codes."""

from typing import Dict

import torch

DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                 "int8", "uint8", "bool", "uint16", "uint32", "uint64", "complex64",
                 "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""Tensor dtypes a checkpoint may hold, by the name the manifest stores (``float32``)."""


SAFETENSORS_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
"""safetensors header dtype codes -> our dtype names."""
CODES_BY_NAME = {name: code for code, name in SAFETENSORS_CODES.items()}
"""Our dtype names -> safetensors header codes."""

ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8, "F8_E4M3": 1,
               "F8_E5M2": 1}
"""Bytes per element of each safetensors dtype code of :data:`SAFETENSORS_CODES`."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name the manifest stores for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: for a dtype safetensors cannot store (the save would fail later,
            on a background thread, with a less helpful message).
    """
    name = str(dtype).rsplit(".", 1)[-1]
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint; "
                         f"supported: {', '.join(sorted(DTYPES))}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for an unknown name."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tensor dtype {name!r}; expected one of "
                         f"{', '.join(sorted(DTYPES))}") from None


