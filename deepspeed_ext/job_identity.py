"""Job identity: which job a node's shared memory belongs to.

Two jobs given the same ``--moc-shm-dir`` would otherwise share a keeper and its
directory: one could recover the other's snapshots as its own, and the first keeper to
exit would delete the other's memory. So every job has a *run id*, created at its first
start and kept in its save directory (:data:`RUN_ID_FILE`), the same across restarts.
A node directory records the run id of the job it serves (:data:`NODE_RECORD`, written
under the node's lock when its keeper starts); a job with another run id is refused
there, and every snapshot slot, frame and peer replica records the run id too, so that
recovery skips anything another job left.

Only rank 0 calls :func:`read_or_create_run_id` (the caller broadcasts the result);
:func:`bind_node_dir` runs on every rank under the node's lock (see
:func:`deepspeed_ext.keeper.ensure_keeper`).
"""

import hashlib
import json
import os
import re
import uuid
from typing import Optional

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError

RUN_ID_FILE = "moc-run-id"
"""In the save directory: the job's run id, one line of 32 hex digits."""
NODE_RECORD = "job.json"
"""In a node's shared-memory directory: ``{"run_id": ...}`` of the job it serves."""
RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_MAX_RECORD = 4096
"""Bytes read of either file at most: anything longer is not ours (a link to /dev/zero)."""


class ForeignJobError(RuntimeError):
    """A node directory that serves another job."""


def run_id_for_memory_only(shm_dir: str) -> str:
    """The run id of a job that keeps no save directory to hold one: derived from its
    shared-memory directory, which then names the job alone (as before run ids)."""
    return hashlib.sha256(("shm:" + os.path.abspath(shm_dir)).encode()).hexdigest()[:32]


def read_or_create_run_id(save_dir: str, log=None) -> str:
    """Rank 0: the run id kept in ``save_dir``, created (atomically) at the job's first
    start. A damaged file is replaced by a new id: the job then treats the memory its
    earlier attempts left as another job's (recovery falls back to storage), which is
    safe; trusting an unreadable id is not.

    Raises:
        OSError: the save directory cannot be written.
    """
    path = fs.join(save_dir, RUN_ID_FILE)
    found = _read_small(path)
    if found is not None:
        text = found.strip()
        if RUN_ID_RE.match(text):
            return text
        if log is not None:
            log(f"WARNING: {path} does not hold a run id; starting a new one (snapshots in "
                f"shared memory from earlier attempts will not be used)")
    run_id = uuid.uuid4().hex
    if not fs.is_url(save_dir):
        os.makedirs(save_dir, exist_ok=True)
        from deepspeed_ext.format.storage import atomic_write_text
        atomic_write_text(path, run_id + "\n")
    else:
        fs.makedirs(save_dir)
        fs.write_bytes(path, (run_id + "\n").encode())
    return run_id


def _read_small(path: str) -> Optional[str]:
    """A small text file's contents; None when missing, unreadable or too long."""
    try:
        if fs.is_url(path):
            data = fs.read_bytes(path, limit=_MAX_RECORD)
        else:
            # O_NOFOLLOW is not wanted here (a save directory may be reached through a
            # link), but the read is bounded: a FIFO or /dev/zero must not hang it.
            if not os.path.isfile(path):
                return None
            with open(path, "rb") as f:
                data = f.read(_MAX_RECORD + 1)
        if len(data) > _MAX_RECORD:
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None


def bind_node_dir(node_dir: str, run_id: str, flag: str = "--moc-shm-dir") -> bool:
    """Every rank of a node, under the node's lock, before using its directory: record
    that it serves ``run_id``, or check that it already does. Returns True when the
    directory was new to this job (first start on this node).

    Raises:
        ForeignJobError: the directory serves another job (or holds a record that is not
            one), naming ``flag``.
    """
    from deepspeed_ext.private_dir import open_private
    path = os.path.join(node_dir, NODE_RECORD)
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    except OSError as e:  # a link planted at the name (ELOOP), say
        raise ForeignJobError(f"{path} cannot be read ({e}); point {flag} at a directory of "
                              f"this job's own") from None
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_RECORD + 1)
        try:
            theirs = json.loads(data.decode("utf-8"))["run_id"] if len(data) <= _MAX_RECORD \
                else None
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            theirs = None
        if theirs == run_id:
            return False
        raise ForeignJobError(
            f"{node_dir} holds the shared memory of another job (run id {theirs!r}; this "
            f"job's is {run_id!r}): two jobs must not share {flag}. Give this job its own "
            f"{flag} (by default each --save gets one), or, if that job is over, stop its "
            f"keeper (pkill -f 'deepspeed_ext.keeper --dir {node_dir}') and remove {node_dir}")
    tmp = f"{path}.tmp.{os.getpid()}"
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        json.dump({"run_id": run_id}, f)
    os.replace(tmp, path)
    return True


def node_run_id(node_dir: str) -> Optional[str]:
    """The run id ``node_dir`` is bound to; None when it has no (readable) record."""
    from deepspeed_ext.private_dir import open_private
    try:
        with os.fdopen(open_private(os.path.join(node_dir, NODE_RECORD), os.O_RDONLY), "rb") as f:
            data = f.read(_MAX_RECORD + 1)
        run_id = json.loads(data.decode("utf-8"))["run_id"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return run_id if isinstance(run_id, str) and RUN_ID_RE.match(run_id) else None


def agree_run_id(save_dir: str, shm_dir: str, log=None) -> str:
    """Every rank, at start-up: this job's run id, read (or created) by rank 0 in
    ``save_dir`` and broadcast (one collective; rank 0's failure is raised on every
    rank; on the metadata group, which the caller has made: the checkpointer and exact
    mode's constructors do, before this). Without a save directory the job is known by
    ``shm_dir`` (:func:`run_id_for_memory_only`), and no collective runs.

    Raises:
        RuntimeError: rank 0 could not read or create the run id file.
    """
    import torch.distributed as dist

    from deepspeed_ext.runtime.groups import metadata_group
    if not save_dir:
        return run_id_for_memory_only(shm_dir)
    status = [None]
    if dist.get_rank() == 0:
        try:
            status[0] = (True, read_or_create_run_id(save_dir, log))
        except OSError as e:
            # A read-only --load without --save, say: the job is then known by its
            # shared-memory directory, as a job without a save directory is.
            if log is not None:
                log(f"WARNING: cannot keep a run id in {save_dir} ({e}); the job's shared "
                    f"memory is known by {shm_dir} alone")
            status[0] = (True, run_id_for_memory_only(shm_dir))
        except Exception as e:
            status[0] = (False, f"{type(e).__name__}: {e}")
    # Never the default group: on NCCL the pickled object would go through the device.
    dist.broadcast_object_list(status, src=0, group=metadata_group())
    if not status[0][0]:
        raise RuntimeError(f"cannot keep the job's run id in {fs.join(save_dir, RUN_ID_FILE)} "
                           f"(rank 0: {status[0][1]}); check that --save is writable")
    return status[0][1]


def record_matches(record, run_id: str) -> bool:
    """Whether a slot's, frame's or replica's metadata ``record`` was written by the job
    ``run_id`` (records without one, from older versions, are another job's)."""
    return isinstance(record, dict) and record.get("run_id") == run_id
