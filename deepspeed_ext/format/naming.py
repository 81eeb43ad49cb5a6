"""Names in a MoC checkpoint: tensor, fragment and expert keys, rank file names, tags."""

import os
import re
from typing import Optional, Tuple

LATEST_FILE = "latest"
"""``<save_dir>/latest``: the tag of the newest complete checkpoint (written by
:mod:`deepspeed_ext.store.latest`); reserved here because no tag may be named so."""
ITERATION_FILE = "latest_checkpointed_iteration.txt"
"""``<save_dir>/latest_checkpointed_iteration.txt``: the step of the checkpoint ``latest``
names, as Megatron-DeepSpeed writes it (its tools read it); written after ``latest``."""


def tensor_key(name: str, kind: str) -> str:
    """Manifest key of a global tensor: ``"name|kind"``."""
    check_key_part(name, "tensor name")
    check_key_part(kind, "tensor kind")
    return f"{name}|{kind}"


def split_tensor_key(key: str) -> Tuple[str, str]:
    """Inverse of :func:`tensor_key`."""
    parts = key.split("|")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"bad tensor key {key!r}; expected 'name|kind'")
    return parts[0], parts[1]


def fragment_key(name: str, kind: str, offset: int) -> str:
    """safetensors key of a fragment: ``"name|kind|offset"``."""
    return f"{tensor_key(name, kind)}|{int(offset)}"


def expert_key(layer: int, expert: int) -> str:
    """expert_index key: ``"layer/expert"``."""
    return f"{int(layer)}/{int(expert)}"


def parse_expert_key(key: str) -> Tuple[int, int]:
    """Inverse of :func:`expert_key`."""
    match = re.fullmatch(r"(\d+)/(\d+)", key)
    if not match:
        raise ValueError(f"bad expert key {key!r}; expected 'layer/expert'")
    return int(match.group(1)), int(match.group(2))


def rank_file_name(rank: int) -> str:
    """File a rank writes its fragments to: ``rank00003.safetensors``."""
    return f"rank{int(rank):05d}.safetensors"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory, else raise ValueError.

    A tag is one path component: a ``latest`` file or an expert index saying
    ``../elsewhere`` must not make a reader (or retention!) leave ``save_dir``.
    """
    if (not isinstance(tag, str) or not tag or tag in (".", "..", LATEST_FILE)
            or tag.startswith(".") or "/" in tag or "\\" in tag or "\0" in tag
            or tag != tag.strip()):
        raise ValueError(f"bad checkpoint tag {tag!r}: a tag is one directory name, not "
                         f"starting with '.', not {LATEST_FILE!r}")
    return tag


def check_key_part(text: str, what: str) -> None:
    """ValueError unless ``text`` can be one part of a tensor key (``what`` names it)."""
    if not isinstance(text, str) or not text or "|" in text:
        raise ValueError(f"bad {what} {text!r}: must be a non-empty string without '|'")


def plain_file_name(name: str) -> bool:
    """Whether ``name`` is one plain file name (no directory part, no NUL)."""
    # A NUL made os.stat raise ValueError out of verification and the load's search.
    return (isinstance(name, str) and name not in ("", ".", "..")
            and os.path.basename(name) == name and "\\" not in name and "\0" not in name)


def split_or_raw(tkey: str) -> Tuple[str, str]:
    """:func:`split_tensor_key`, or ``(tkey, "")`` for a malformed key (reported by
    validation; the entry stays visible)."""
    try:
        return split_tensor_key(tkey)
    except ValueError:  # reported by tensor_problems; keep the entry visible
        return tkey, ""


def try_parse_expert_key(ekey: str) -> Optional[Tuple[int, int]]:
    """:func:`parse_expert_key`, or None for a malformed key."""
    try:
        return parse_expert_key(ekey)
    except ValueError:
        return None

