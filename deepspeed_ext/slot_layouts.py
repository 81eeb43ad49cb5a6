"""The static half of a snapshot's metadata, written once per layout: the files
``layout-<id>-<sha256 prefix>.json`` of one rank directory (:mod:`deepspeed_ext.snapshot`).

Every snapshot of one layout has the same ``entries`` (a layout record per tensor) and
``specs`` (a manifest spec per tensor): hundreds of KB of JSON. Writing them with every
snapshot held the GIL for 15-25 ms while the training thread needed it; written once
per layout, a snapshot's own ``slotI.json`` is a few hundred bytes that name the
layout file and its SHA-256, which a reader checks before trusting it.
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Set, Tuple

from deepspeed_ext.format.storage import atomic_write_bytes
from deepspeed_ext.private_dir import open_private

MAX_FILE_BYTES = 256 << 20
"""Longest slot metadata or layout file read (a layout record per tensor: far below this)."""

LAYOUT_KEYS = ("entries", "specs")
"""The static part of a snapshot's metadata, written once per layout (:class:`LayoutFiles`)."""

LAYOUT_REF_KEYS = ("layout", "layout_sha256")
"""What a compact ``slotI.json`` holds instead: the layout id and its file's SHA-256."""

_LAYOUT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAYOUT_FILE = re.compile(r"layout-[A-Za-z0-9_-]{1,64}-[0-9a-f]{16}\.json(\.tmp\.(\d+))?")


def check_layout_id(layout_id: Any) -> str:
    """``layout_id`` if it is a valid layout id (1-64 of ``[A-Za-z0-9_-]``).

    Raises:
        ValueError: anything else; a file name is built from it, and ``/`` or ``..`` would
            put that file outside the rank directory.
    """
    if not isinstance(layout_id, str) or not _LAYOUT_ID.fullmatch(layout_id):
        raise ValueError(f"layout id {layout_id!r}: expected 1-64 characters of [A-Za-z0-9_-]")
    return layout_id


def layout_file_name(layout_id: str, sha256: str) -> str:
    """The file holding the static metadata of ``layout_id`` whose bytes hash to ``sha256``.

    The hash is part of the name so that a restarted process reusing an id for another
    layout writes a new file instead of replacing one a complete slot still names.
    """
    return f"layout-{check_layout_id(layout_id)}-{sha256[:16]}.json"


def compact_json(obj: Any) -> bytes:
    """Strict JSON without whitespace (C encoder; NaN/Infinity refused as in
    :func:`deepspeed_ext.format.storage.atomic_write_json`)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def read_capped(path: str) -> Optional[bytes]:
    """The file's bytes, never through a planted link; None when over MAX_FILE_BYTES."""
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    return data if len(data) <= MAX_FILE_BYTES else None


@dataclass
class _Written:
    """A layout file this process wrote for one id (compared against the next publish)."""
    static: Dict[str, Any]
    """What was written: the caller's own ``entries``/``specs`` objects, so that the next
    publish of the same objects compares by identity (tens of microseconds; a deep copy
    compared element by element cost 0.26 ms of GIL for 648 entries)."""
    sha256: str
    name: str


class LayoutFiles:
    """The static metadata files of one rank directory: ``layout-<id>-<sha16>.json``.

    Written by the seal thread (through :meth:`SnapshotSlots.publish`), read by whichever
    thread reads a slot's metadata first (start-up, recovery, the seal thread's clean-up).
    Parsed files are cached by ``(id, sha256)``; callers must not change what
    :meth:`load` returns (it is shared by every slot of that layout), nor the
    ``entries``/``specs`` they gave :meth:`store` (kept and compared by identity).
    """

    def __init__(self, directory: str):
        self.dir = directory
        self._parsed: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self._written: Dict[str, _Written] = {}
        self.writes = 0
        """Layout files written by this process (one per layout id, unless it changes)."""

    def store(self, layout_id: str, static: Dict[str, Any]) -> Tuple[str, str, bool]:
        """Make sure a file holds ``static`` for ``layout_id``; ``(sha256, file name,
        written now)``. Written once per id and process while ``static`` stays equal (an
        equality check, far cheaper than encoding it again); other content under the
        id (a caller's mistake) gets a file of its own, as in a restarted process.

        Raises:
            ValueError: an invalid id. FileNotFoundError: the directory is gone.
        """
        check_layout_id(layout_id)
        done = self._written.get(layout_id)
        if done is not None and done.static == static:
            return done.sha256, done.name, False
        data = compact_json(static)
        sha = hashlib.sha256(data).hexdigest()
        name = layout_file_name(layout_id, sha)
        atomic_write_bytes(os.path.join(self.dir, name), data, make_parent=False)
        self._written[layout_id] = _Written(dict(static), sha, name)
        self._parsed[(layout_id, sha)] = dict(static)
        self.writes += 1
        return sha, name, True

    def load(self, layout_id: Any, sha256: Any) -> Optional[Dict[str, Any]]:
        """The static metadata recorded as ``(layout_id, sha256)``, or None when the id
        or hash is malformed, the file is missing, too large, not that hash or not a
        layout (a planted or damaged file is no snapshot's layout)."""
        if (not isinstance(layout_id, str) or not _LAYOUT_ID.fullmatch(layout_id)
                or not isinstance(sha256, str) or not _SHA256.fullmatch(sha256)):
            return None
        hit = self._parsed.get((layout_id, sha256))
        if hit is not None:
            return hit
        try:
            data = read_capped(os.path.join(self.dir, layout_file_name(layout_id, sha256)))
            if data is None or hashlib.sha256(data).hexdigest() != sha256:
                return None
            static = json.loads(data)
        except (OSError, ValueError, RecursionError):
            return None
        if (not isinstance(static, dict) or not set(static) <= set(LAYOUT_KEYS)
                or not isinstance(static.get("entries", []), list)
                or not isinstance(static.get("specs", {}), dict)):
            return None
        self._parsed[(layout_id, sha256)] = static
        return static

    def remove_unreferenced(self, keep: Set[str]) -> None:
        """Remove every layout file (and another process's leftover temp file) not named
        in ``keep``, and forget it: an id whose file is removed is written again by its
        next :meth:`store` (a slot must never name a file that is gone)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        mine = str(os.getpid())
        for name in names:
            match = _LAYOUT_FILE.fullmatch(name)
            if match is None or name in keep or match.group(2) == mine:
                continue
            try:
                os.remove(os.path.join(self.dir, name))
            except OSError:
                pass
        self._written = {k: w for k, w in self._written.items() if w.name in keep}
        self._parsed = {k: s for k, s in self._parsed.items()
                        if layout_file_name(k[0], k[1]) in keep}
