"""What every ``moc-ckpt`` subcommand shares: the usage error (exit status 2), messages
on stderr, byte sizes for people, and the checks of the directory and ``--tag`` given.
"""

import os
import sys
from typing import Optional

from deepspeed_ext.format import fs


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


def stderr(text: str) -> None:
    """A message on stderr (every subcommand's warnings and notes, and :func:`main`'s
    errors)."""
    print(text, file=sys.stderr, flush=True)


def size_text(nbytes: float) -> str:
    """``nbytes`` for people (inspect's and consolidate's output)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover


def check_dir(path: str) -> None:
    """Every subcommand's first check of its ``dir`` argument.

    Raises:
        UsageError: ``path`` is no directory, or a URL fsspec cannot open.
    """
    try:
        found = fs.isdir(path)
    except ValueError as err:  # a URL fsspec cannot open
        raise UsageError(str(err)) from None
    if not found:
        raise UsageError(f"{path} is not a directory (pass the checkpoint save directory)")


def check_tag_dir(save_dir: str, tag: Optional[str]) -> None:
    """inspect's, verify's and consolidate's check of ``--tag``, after :func:`check_dir`.

    Raises:
        UsageError: no directory ``tag`` in ``save_dir``.
    """
    if tag is not None and not fs.isdir(os.path.join(save_dir, tag)):
        raise UsageError(f"no checkpoint {tag!r} in {save_dir} (--tag)")
