"""Exact recovery's frames on disk: where a frame's files lie, reading their markers,
and which window of frames is complete.

Frames go to ``<save>/exact/frame<f>/rank<r>.safetensors`` (or the same names under the
node's memory directory) with ``rank<r>.json``, the frame's marker, written last. A frame
is complete when every rank's marker exists; a window when its ``W`` frames are."""

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from deepspeed_ext.jobs import FrameJob

EXACT_DIR = "exact"
FRAME_RE = re.compile(r"^frame(\d{8,})$")
LP_PREFIX = "lp|"
"""Key prefix of a frozen compute weight in a frame file (then the global parameter name)."""
MARKER_MAX_BYTES = 64 << 20
"""Longest frame marker read (its objects: RNG state, counters, the schedule's groups)."""


def frame_dir(save_dir: str, frame: int) -> str:
    """The directory of frame ``frame`` under ``save_dir`` (storage or a node's memory)."""
    return os.path.join(save_dir, EXACT_DIR, f"frame{frame:08d}")


def marker_path(save_dir: str, frame: int, rank: int) -> str:
    """Rank ``rank``'s marker (``rank<r>.json``) of frame ``frame`` under ``save_dir``:
    written last by the frame's writer, read by recovery and by the keeper's copy."""
    return os.path.join(frame_dir(save_dir, frame), f"rank{rank:05d}.json")


def data_path(save_dir: str, frame: int, rank: int) -> str:
    """Rank ``rank``'s tensors (``rank<r>.safetensors``) of frame ``frame`` under
    ``save_dir``: written by the frame's writer before its marker."""
    return os.path.join(frame_dir(save_dir, frame), f"rank{rank:05d}.safetensors")


def frame_layout(naming, world_size: int, rank: int) -> Dict[str, Any]:
    """What a frame of ``rank`` depends on: the world and this rank's experts (recorded
    in every marker; recovery refuses frames of another layout)."""
    return {"world_size": world_size, "rank": rank,
            "num_moe_layers": len(naming.moe_prefixes),
            "first_expert": list(naming.first_expert),
            "num_experts": list(naming.num_experts)}


def frame_job(node_dir: str, save_dir: str, frame: int, rank: int, run_id: Optional[str],
              job_id: Optional[str] = None) -> FrameJob:
    """The keeper's job copying frame ``frame`` of ``rank`` from the node's memory
    directory ``node_dir`` to ``save_dir`` (its ``id``: ``job_id``)."""
    return FrameJob(data=data_path(node_dir, frame, rank),
                    marker=marker_path(node_dir, frame, rank),
                    dst_data=data_path(save_dir, frame, rank),
                    dst_marker=marker_path(save_dir, frame, rank),
                    save_dir=save_dir, run_id=run_id, id=job_id)


def list_frames(save_dir: str) -> List[int]:
    """Frame numbers present under ``<save_dir>/exact`` (complete or not), ascending."""
    root = os.path.join(save_dir, EXACT_DIR)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(FRAME_RE.match, names) if m)


def read_marker(save_dir: str, frame: int, rank: int) -> Optional[Dict[str, Any]]:
    """A rank's frame record, or None if it is missing, unreadable, too long, nested too
    deeply or not a JSON object (the frame counts as incomplete)."""
    path = marker_path(save_dir, frame, rank)
    try:
        if not os.path.isfile(path):  # a FIFO or device planted there must not block
            return None
        with open(path, "rb") as f:
            data = f.read(MARKER_MAX_BYTES + 1)
        if len(data) > MARKER_MAX_BYTES:
            return None
        record = json.loads(data)
    except (OSError, ValueError, RecursionError, MemoryError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class WindowOnDisk:
    """A complete window found by :func:`find_window`."""

    start: int
    window: int
    groups: List[List[str]]
    world_size: int


def find_window(save_dir: str, world_size: int) -> Optional[WindowOnDisk]:
    """The newest window under ``save_dir`` whose ``W`` frames every rank completed."""
    per_rank = [{f: m for f in list_frames(save_dir)
                 for m in [read_marker(save_dir, f, r)] if m is not None}
                for r in range(world_size)]
    return agree_window(per_rank)


def agree_window(per_rank: List[Dict[int, Dict[str, Any]]]) -> Optional[WindowOnDisk]:
    """The newest window whose ``W`` frames every rank holds (pure; every rank computes
    the same answer from the same gathered records).

    Args:
        per_rank: for each rank, frame -> its record (from memory or storage).

    Frames of one window agree on ``window_start``, ``window`` and the schedule (each
    record repeats them); a frame whose records disagree does not count.
    """
    world_size = len(per_rank)
    records: Dict[int, Dict[str, Any]] = {}
    for f in sorted(set().union(*per_rank)) if per_rank else []:
        marks = [mine.get(f) for mine in per_rank]
        if all(m is not None and m.get("world_size") == world_size for m in marks):
            first = marks[0]
            if all((m["window_start"], m["window"], m["groups"]) ==
                   (first["window_start"], first["window"], first["groups"]) for m in marks):
                records[f] = first
    for f in sorted(records, reverse=True):
        rec = records[f]
        s, w = rec["window_start"], rec["window"]
        if f != s:
            continue
        if all(s + t in records and (records[s + t]["window_start"], records[s + t]["groups"])
               == (s, rec["groups"]) for t in range(w)):
            return WindowOnDisk(start=s, window=w, groups=rec["groups"], world_size=world_size)
    return None
