"""Persisting a job: one rank's snapshot from memory to storage, its report, and (for the
committing rank) the commit of the checkpoint; or one exact-recovery frame's copy.

Who calls what: the keeper's persist thread runs :func:`run_persist_job` on each queued
job, in order (``background_commit=True``); a rank whose keeper is dead runs it
in-process. Frame jobs are plain file copies (:func:`persist_frame`) that must not wait
for torch; the writers of rank files import it, lazily (see :func:`write_image_subset`).
"""

import mmap
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from deepspeed_ext.jobs import FrameJob, Job, PersistJob, job_from_json
import deepspeed_ext.keeper.commits as commits
from deepspeed_ext.keeper.faults import crash_in_persist_if_due
from deepspeed_ext.keeper.log import default_log, logger
from deepspeed_ext.format import fs, memsum

HANG_PERSIST_ENV = "MOC_FAULT_HANG_PERSIST_STEP"
"""Fault injection: a persist of this step or a later one stops after writing a rank's
file and before its report, until the process is killed (tests SIGKILL a keeper in the
middle of a persist this way). The keeper inherits it from the rank that starts it."""


def write_image_subset(path: str, image_path: str, entries: List[Dict[str, Any]],
                       keys: Optional[List[str]], checksum: Optional[str] = None) -> Dict[str, Any]:
    """Write the tensors ``keys`` of the image file ``image_path`` as a safetensors file.

    ``entries`` is the image's layout (``key``, ``dtype``, ``shape``, ``start``,
    ``nbytes``); ``keys`` None writes every tensor. The output is written atomically
    (temp, fsync, rename) and its record returned.

    Args:
        checksum: the image's memory checksum (:mod:`deepspeed_ext.format.memsum`); when
            given, the image is verified first, so that damaged memory is never written to
            storage under a fresh SHA-256 that would vouch for it.

    Raises:
        RuntimeError: the image does not match ``checksum``, or is shorter than its layout.
    """
    # Imported here, not at the top: they import torch, and the keeper process must answer
    # its first ping (and copy frames) without waiting seconds for it.
    from deepspeed_ext.format.image import layout_image
    from deepspeed_ext.format.storage import FileRecord, write_image_file
    chosen = [e for e in entries if keys is None or e["key"] in set(keys)]
    layout = layout_image([(e["key"], tuple(e["shape"]), e["dtype"]) for e in chosen])
    by_key = {e["key"]: e for e in chosen}
    end = max((e["start"] + e["nbytes"] for e in entries), default=0)
    with open(image_path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                if len(view) < end:
                    raise RuntimeError(f"{image_path} holds {len(view)} bytes, its layout {end}")
                if checksum is not None:
                    problem = memsum.verify(view[:end], checksum)
                    if problem is not None:
                        raise RuntimeError(f"the snapshot in {image_path} is damaged in memory "
                                           f"({problem}); not persisting it")
                if keys is None:
                    # The image itself is already this file: write it as is.
                    return write_image_file(path, view[:max(end, len(layout.header))]).to_json()
                out = bytearray(layout.nbytes)
                out[:len(layout.header)] = layout.header
                for entry in layout.entries:
                    src = by_key[entry.key]
                    out[entry.start:entry.start + entry.nbytes] = \
                        view[src["start"]:src["start"] + src["nbytes"]]
                record = write_image_file(path, memoryview(out))
                return FileRecord(record.nbytes, record.sha256).to_json()
            finally:
                view.release()


def persist_frame(job: FrameJob) -> None:
    """Copy one exact-recovery frame of one rank from memory to storage: the data file
    (temp file, fsync, rename), then its marker, last (``deepspeed_ext.exact``).

    ``job``: ``data`` and ``marker`` (the files in memory), ``dst_data`` and
    ``dst_marker`` (their storage paths). Once both are on storage, a
    ``.copied`` file beside the marker in memory tells the rank it may retire the memory
    copy (``deepspeed_ext.exact``). A frame whose memory copy was already deleted (a lost
    node, or retired after waiting too long for this copy) is skipped, with a line in the
    keeper's log: its window stays incomplete on storage and recovery does not use it.
    """
    try:
        with open(job.data, "rb") as f:
            data = f.read()
        with open(job.marker, "rb") as f:
            marker = f.read()
    except FileNotFoundError:
        logger.warning(f"[moc keeper {os.getpid()}] WARNING: {job.marker} was gone before it "
                       f"reached storage; its window stays incomplete there")
        return
    frame_dir = os.path.dirname(job.dst_data)
    if not os.path.isdir(frame_dir):
        os.makedirs(frame_dir, exist_ok=True)
        # The new frame directory's own entry: without this fsync a power cut could lose
        # the directory with the durably written files in it.
        fs.fsync_dir(os.path.dirname(frame_dir))
    # Plain os (fs.atomic_write_local): a frame job must not wait for the keeper's
    # import of torch (seconds), or a node lost in the first seconds of a job would take
    # frames with it that storage never got.
    fs.atomic_write_local(job.dst_data, data)
    fs.atomic_write_local(job.dst_marker, marker)
    try:
        with open(copied_marker(job.marker), "w"):
            pass
    except FileNotFoundError:  # retired meanwhile: nothing left to tell
        pass


def copied_marker(marker: str) -> str:
    """The file that says a frame's memory copy (its marker ``marker``) is on storage."""
    return marker[:-len(".json")] + ".copied" if marker.endswith(".json") else marker + ".copied"


def run_persist_job(job: Union[Job, Dict[str, Any]], log: Optional[Callable[[str], None]] = None,
                    background_commit: bool = False) -> None:
    """Persist one rank's snapshot and, for the committing rank, commit the checkpoint;
    a :class:`~deepspeed_ext.jobs.FrameJob` is copied (:func:`persist_frame`). A plain
    dict is parsed first (:func:`deepspeed_ext.jobs.job_from_json`).

    The job's fields are described on :class:`~deepspeed_ext.jobs.PersistJob`: the slot
    image and the tensors of it to write, the rank file's specs, the save's claim, the
    objects (rank 0), the slot's done marker, and rank 0's
    :class:`~deepspeed_ext.jobs.CommitSpec` (the arguments of
    :func:`deepspeed_ext.store.commit.commit_checkpoint` plus ``timeout_s``).

    Args:
        background_commit: wait for the other ranks' reports on a separate thread. The
            keeper needs it: the reports of its other local ranks are written by jobs
            queued behind this one, so waiting here would deadlock its queue.
    """
    if log is None:
        log = default_log
    if not isinstance(job, (PersistJob, FrameJob)):
        job = job_from_json(job)
    if isinstance(job, FrameJob):
        persist_frame(job)
        return
    tag_dir = os.path.join(job.save_dir, job.tag)
    if not persist_share(job, tag_dir, log) or job.commit is None:
        return
    if background_commit:
        commits.start_background_commit(job, tag_dir, log)
    else:
        commits.commit_job(job, tag_dir, log)


def persist_share(job: PersistJob, tag_dir: str, log: Callable[[str], None]) -> bool:
    """Write one rank's share of a save (its file, the objects) and its report; on a
    failure, a failed report instead (while the save is still ours). Returns whether the
    report was written, i.e. whether a commit may follow."""
    from deepspeed_ext.store import claims, commit  # torch: see write_image_subset
    claim = job.claim
    try:
        # A job of an earlier attempt still queued when the restarted job saved the same
        # tag again: writing now would put the old attempt's file into the new save.
        claims.check_claim(tag_dir, claim)
        record, extra_files, objects_record = _write_rank_files(job, tag_dir)
        _report(job, tag_dir, record, extra_files, objects_record)
    except claims.Superseded as e:
        _remove_quietly(job.done_marker)
        log(f"not persisting rank {job.rank}'s share of {job.tag}: {e}")
        return False
    except Exception as e:
        traceback.print_exc()
        _remove_quietly(job.done_marker)
        if commits.still_ours(tag_dir, claim):
            commit.write_report(tag_dir, job.rank, None, error=f"{type(e).__name__}: {e}",
                                claim=claim)
        return False
    return True


def _write_rank_files(job: PersistJob, tag_dir: str) -> Tuple[Dict[str, Any], Dict[str, Any],
                                                               Optional[Dict[str, Any]]]:
    """The rank's file, its objects file (rank 0), and the objects' record."""
    from deepspeed_ext.format import naming
    from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE, write_objects_file
    entries = [e.to_json() for e in job.entries]
    file_name = naming.rank_file_name(job.rank)
    record = write_image_subset(os.path.join(tag_dir, file_name), job.image, entries,
                                list(job.keys) if job.keys is not None else None,
                                job.checksum)
    extra_files = dict(job.extra_files or {})
    objects_in = file_name if job.objects_in_file else None  # an older job
    if job.object_keys:
        # Their own small file: in rank 0's share, every rank of a load checksummed
        # that whole file to read its RNG state.
        extra_files[OBJECTS_TENSOR_FILE] = write_image_subset(
            os.path.join(tag_dir, OBJECTS_TENSOR_FILE), job.image, entries,
            list(job.object_keys))
        objects_in = OBJECTS_TENSOR_FILE
    _remove_quietly(job.done_marker)  # the slot is read: it may be reused
    # --moc-fault persist-crash, armed through the environment (keeper.faults);
    # returns at once in normal runs.
    crash_in_persist_if_due(job.step)
    if job.step >= int(os.environ.get(HANG_PERSIST_ENV, "-1")) >= 0:
        _hang(f"{HANG_PERSIST_ENV}: hanging after writing rank {job.rank}'s file of {job.tag}")
    objects_record = job.objects_record  # rank 0 wrote the objects itself
    if job.objects_tree is not None:
        objects_record = write_objects_file(tag_dir, job.objects_tree, objects_in).to_json()
    return record, extra_files, objects_record


def _report(job: PersistJob, tag_dir: str, record: Dict[str, Any], extra_files: Dict[str, Any],
            objects_record: Optional[Dict[str, Any]]) -> None:
    """The rank's report for the committer, once the save is checked to be still ours."""
    from deepspeed_ext.format import assemble, naming
    from deepspeed_ext.store import claims, commit
    specs = [assemble.FragmentSpec.from_json(s) for s in job.specs]
    report = assemble.RankReport(job.rank, naming.rank_file_name(job.rank), record["nbytes"],
                                 record["sha256"], specs)
    claims.check_claim(tag_dir, job.claim)  # the write took long: still this save's?
    commit.write_report(tag_dir, job.rank, {"report": report.to_json(), "objects": objects_record,
                                            "extra_files": extra_files}, claim=job.claim)


def _hang(message: str) -> None:
    logger.info(f"[moc keeper {os.getpid()}] {message}")
    while True:
        time.sleep(3600)


def _remove_quietly(path: Optional[str]) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass
