"""What a keeper accepts as a persist job: every path inside the job's own directories.

The keeper copies files named in the jobs it receives. Only processes of the job's own
user can connect (the keeper checks the peer's credentials), but a job's fields are
still checked here before it is queued, so that neither a bug nor a process of the same
user that speaks for another job can make the keeper read or write outside:

* memory paths (``image``, ``done_marker``; ``data``, ``marker`` of a frame) must lie
  inside the keeper's own node directory after resolving links;
* storage paths must lie inside the job's ``save_dir`` (a tag is one directory name; a
  frame's destinations are under ``<save_dir>/exact/``), and when the keeper was
  started for one save directory, ``save_dir`` must be that one;
* the image layout is well-formed (non-negative integer offsets and sizes), so that a
  job cannot make the keeper read past its slot.

Pure checks on plain data (and ``realpath`` of local paths): no I/O beyond that, no
heavy imports (a frame job must not wait for torch).
"""

import os
import posixpath
from typing import Any, Dict, Optional


class JobRefused(ValueError):
    """A persist job the keeper will not run (the reason names the field)."""


def inside(path: Any, root: str) -> bool:
    """Whether ``path`` lies strictly inside ``root``: local paths after resolving
    links; URLs (``scheme://...``) by their normalized text, refusing ``..``."""
    if not isinstance(path, str) or not path or "\0" in path:
        return False
    if "://" in root or "://" in path:
        if ".." in path.split("/"):
            return False
        base = root.rstrip("/") + "/"
        return posixpath.normpath(path.split("://", 1)[-1]).startswith(
            posixpath.normpath(base.split("://", 1)[-1]) + "/") and path.startswith(base)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real.startswith(real_root.rstrip(os.sep) + os.sep)


def _component(name: Any, field: str) -> None:
    if (not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".")
            or "/" in name or "\\" in name or "\0" in name):
        raise JobRefused(f"{field} {name!r} is not one directory name")


def _int(value: Any, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JobRefused(f"{field} must be an integer >= {low}, got {value!r}")
    return value


def _same_dir(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def check_job(job: Any, directory: str, save_dir: Optional[str] = None) -> None:
    """Refuse a persist job whose paths leave its directories.

    Args:
        job: the ``job`` of a ``persist`` request (see
            :func:`deepspeed_ext.keeper.run_persist_job`).
        directory: the keeper's node directory (memory).
        save_dir: the save directory the keeper was started for; None: the job's own
            ``save_dir`` is taken as given.

    Raises:
        JobRefused: naming the first offending field.
    """
    if not isinstance(job, dict):
        raise JobRefused("a job must be a JSON object")
    target = job.get("save_dir")
    if not isinstance(target, str) or not target:
        raise JobRefused(f"save_dir must be a directory, got {target!r}")
    if save_dir is not None and not _same_dir(target, save_dir):
        raise JobRefused(f"save_dir {target!r} is not this job's save directory {save_dir!r}")
    for field in ("image", "done_marker", "data", "marker"):
        if field in job and job[field] is not None and not inside(job[field], directory):
            raise JobRefused(f"{field} {job[field]!r} is not inside the keeper's directory "
                             f"{directory}")
    if job.get("kind") == "frame":
        for field in ("data", "marker"):
            if field not in job:
                raise JobRefused(f"a frame job needs {field}")
        exact = target.rstrip("/") + "/exact"
        for field in ("dst_data", "dst_marker"):
            if not inside(job.get(field), exact):
                raise JobRefused(f"{field} {job.get(field)!r} is not inside {exact}")
        return
    if job.get("kind") not in (None, "snapshot"):
        raise JobRefused(f"unknown job kind {job.get('kind')!r}")
    _component(job.get("tag"), "tag")
    _int(job.get("rank"), "rank")
    _int(job.get("step"), "step")
    if "image" not in job:
        raise JobRefused("a snapshot job needs image")
    entries = job.get("entries")
    if not isinstance(entries, list):
        raise JobRefused("entries must be a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) \
                or not isinstance(entry.get("dtype"), str) \
                or not isinstance(entry.get("shape"), list):
            raise JobRefused(f"entries[{i}] is not a layout record")
        _int(entry.get("start"), f"entries[{i}].start")
        _int(entry.get("nbytes"), f"entries[{i}].nbytes")
        for d in entry["shape"]:
            _int(d, f"entries[{i}].shape")
    keys = job.get("keys")
    if keys is not None and (not isinstance(keys, list)
                             or not all(isinstance(k, str) for k in keys)):
        raise JobRefused("keys must be null or a list of strings")
    extra: Dict[str, Any] = job.get("extra_files") or {}
    if not isinstance(extra, dict):
        raise JobRefused("extra_files must be an object")
    for name in extra:
        _component(name, "extra_files name")
