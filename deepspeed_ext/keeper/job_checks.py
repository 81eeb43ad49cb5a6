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

Types and bounds are checked by the records' ``from_json`` (:mod:`deepspeed_ext.jobs`),
paths here. Pure checks on plain data (and ``realpath`` of local paths): no I/O beyond
that, no heavy imports (a frame job must not wait for torch).
"""

import os
import posixpath
from typing import Any, Optional, Union

from deepspeed_ext.jobs import FrameJob, Job, JobRefused, PersistJob, job_from_json

__all__ = ["JobRefused", "check_job", "inside"]  # JobRefused: re-exported for the server


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


def _same_dir(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _in_memory(path: Optional[str], field: str, directory: str) -> None:
    if path is not None and not inside(path, directory):
        raise JobRefused(f"{field} {path!r} is not inside the keeper's directory {directory}")


def check_job(job: Union[Job, Any], directory: str, save_dir: Optional[str] = None) -> Job:
    """Parse a persist request's job (types and bounds: :mod:`deepspeed_ext.jobs`) and
    refuse one whose paths leave its directories.

    Args:
        job: the ``job`` of a ``persist`` request (JSON), or a record already parsed.
        directory: the keeper's node directory (memory).
        save_dir: the save directory the keeper was started for; None: the job's own
            ``save_dir`` is taken as given.

    Returns:
        The typed job (:class:`~deepspeed_ext.jobs.PersistJob` or
        :class:`~deepspeed_ext.jobs.FrameJob`).

    Raises:
        JobRefused: naming the first offending field.
    """
    if not isinstance(job, (PersistJob, FrameJob)):
        job = job_from_json(job)
    target = job.save_dir
    if save_dir is not None and not _same_dir(target, save_dir):
        raise JobRefused(f"save_dir {target!r} is not this job's save directory {save_dir!r}")
    if isinstance(job, FrameJob):
        _in_memory(job.data, "data", directory)
        _in_memory(job.marker, "marker", directory)
        exact = target.rstrip("/") + "/exact"
        for field, path in (("dst_data", job.dst_data), ("dst_marker", job.dst_marker)):
            if not inside(path, exact):
                raise JobRefused(f"{field} {path!r} is not inside {exact}")
        return job
    _in_memory(job.image, "image", directory)
    _in_memory(job.done_marker, "done_marker", directory)
    _component(job.tag, "tag")
    for name in job.extra_files or {}:
        _component(name, "extra_files name")
    return job
