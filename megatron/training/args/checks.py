"""Small checks of flag values shared by every group of flags.

Each raises :class:`~megatron.errors.ConfigError` naming the flag; the trainer runs them
on every rank before any collective (:func:`megatron.training.arguments.validate_args`),
so a bad value stops every rank with the same message instead of one rank failing later
while the others wait for it.
"""

import argparse
import math
import os
import threading
from typing import Optional, Sequence

from megatron.errors import ConfigError

MAX_TIMEOUT_S = threading.TIMEOUT_MAX
"""The longest wait (seconds) Python's timed waits accept; longer ones raise OverflowError
(in the middle of a save or the shutdown) instead of waiting."""


def flag_name(dest: str) -> str:
    """The flag of an argparse destination: ``moc_pec_k`` -> ``--moc-pec-k``."""
    return f"--{dest.replace('_', '-')}"


def require(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Every one of ``names`` was given (a flag, or a key of a ``--config`` file)."""
    for name in names:
        if getattr(args, name) is None:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} is required (a flag, or the key '{flag}' in --config)")


def check_positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Every one of ``names`` that was given is at least 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"{flag_name(name)} must be >= 1, got {value}")


def check_at_least(args: argparse.Namespace, name: str, least: int, meaning: str = "") -> None:
    """``args.<name>`` (None: not given) is at least ``least``; ``meaning`` says what the
    smallest value means (`` (0: all experts)``)."""
    value = getattr(args, name)
    if value is not None and value < least:
        raise ConfigError(f"{flag_name(name)} must be >= {least}{meaning}, got {value}")


def check_float(flag: str, value: Optional[float], unit: str = "", *, zero_ok: bool = False,
                note: str = "", maximum: Optional[float] = None) -> None:
    """``value`` (None: not given) is finite and > 0 (>= 0 with ``zero_ok``), and at most
    ``maximum``; ``unit`` names what it counts (``seconds``), ``note`` what 0 means."""
    if value is None:
        return
    what = f"a finite number of {unit}" if unit else "a finite number"
    bound = ">= 0" if zero_ok else "> 0"
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ConfigError(f"{flag} must be {what} {bound}{note}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{flag} must be at most {maximum:g} {unit} (the longest wait "
                          f"Python can time), got {value:g}")


def check_finite(args: argparse.Namespace) -> None:
    """Every float flag is finite: NaN or infinity is never a meaningful setting."""
    for name, value in sorted(vars(args).items()):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_name(name)} must be a finite number, got {value}")


def check_output_file(flag: str, path: Optional[str]) -> None:
    """A file the job appends to (rank 0, after loading): refused here, on every rank,
    when it cannot be created, rather than failing on rank 0 alone later while the other
    ranks wait for it in a collective."""
    if not path or "://" in path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; name a file")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # created when the file is first written
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot create it ({parent} is not a writable "
                          f"directory)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: not writable")
