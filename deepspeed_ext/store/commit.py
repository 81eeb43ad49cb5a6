"""Committing a checkpoint without a collective: per-rank report files and one committer.

A save whose files are written in the background cannot end in a collective: the
training loop has moved on, and a collective there would either block it or hang on a
slow writer. Instead, every writer publishes a small report next to its file when the
file is durable (or when writing failed), and one committer (rank 0's writer thread)
waits for all reports, with a deadline, before writing the manifest.

Order, per checkpoint directory ``<save_dir>/<tag>``::

    rank 0:        prepare_checkpoint_dir  ->  commit.claim (claim_dir: a fresh random id)
                   ->  the claim travels to every rank with the save's outcome exchange
    every writer:  rankNNNNN.safetensors (atomic)  ->  rankNNNNN.report.json (atomic, with
                   the claim; neither written once the directory holds another claim)
    committer:     wait_for_reports(..., claim): reports of another claim do not count
                   ->  manifest.json (if the claim is still there)  ->  latest (not over a later attempt)
                   ->  remove_reports (and the claim)

The claim guards against a committer that outlived its job: a keeper waiting for the
reports of a node that died keeps polling after the job restarted, and the new attempt
may meanwhile save the same tag again (emptying the directory and writing its own
reports) or retention may delete the directory. Without the claim, that old committer
would take the new attempt's reports, write a manifest with the old attempt's expert
selection and previous tag, and could mark the directory failed under the new
attempt's feet. With it, the old committer sees a different (or no) claim and stops
without writing anything (:class:`~deepspeed_ext.store.claims.Superseded`). The same holds for the other ranks'
writers of that earlier attempt (a keeper's queued job): each carries its attempt's claim,
stands down before writing into a directory claimed since, and its report, if it raced
the new claim, names the old claim, which the new committer does not count.

A report that names an error, a missing report at the deadline, or any failure of the
committer leaves the directory without a manifest: it is not a checkpoint, ``latest``
still names the previous one, and retention deletes the leftovers later.
"""

import logging
import os
from typing import Any, Callable, Dict, List, Mapping, Optional

from deepspeed_ext.format import fs
from deepspeed_ext.format.assemble import RankReport, assemble_manifest
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.expert_index import build_expert_index
from deepspeed_ext.format.manifest import (MANIFEST_FILE, FileEntry, get_field, read_manifest,
                                           write_manifest)
from deepspeed_ext.format.objects import OBJECTS_FILE
from deepspeed_ext.format.storage import SMALL_RECORD_MAX_BYTES, atomic_write_json, read_json
from deepspeed_ext.runtime.log import log_line
from deepspeed_ext.runtime.retry import Backoff, poll_until
from deepspeed_ext.store.claims import CLAIM_NAME, CommitError, Superseded, check_claim, read_claim
from deepspeed_ext.store.latest import advance_latest
from deepspeed_ext.store.locking import locked_dir
from deepspeed_ext.store.retention import retain_unless_superseded

logger = logging.getLogger(__name__)

REPORT_SUFFIX = ".report.json"
REPORT_MAX_BYTES = 256 << 20
"""Largest report read: a rank's report lists its fragments, never more than the whole
manifest (:data:`~deepspeed_ext.format.manifest.MANIFEST_MAX_BYTES`) holds."""



class MarkedFailed(Superseded):
    """The save was marked failed (its failure record names its claim) before its
    committer got to the manifest: a training process gave it up when its node's keeper
    died (:func:`fail_unless_committed`). The committer writes nothing, as when superseded."""


def report_name(rank: int) -> str:
    return f"rank{rank:05d}{REPORT_SUFFIX}"


def write_report(tag_dir: str, rank: int, payload: Optional[Mapping[str, Any]],
                 error: Optional[str] = None, claim: Optional[str] = None) -> None:
    """Publish one writer's outcome (atomic). Exactly one of ``payload``/``error``;
    ``claim``: the save's claim (rank 0's, sent to every rank), None when unknown."""
    if (payload is None) == (error is None):
        raise ValueError("a report carries either a payload or an error")
    atomic_write_json(os.path.join(tag_dir, report_name(rank)),
                      {"rank": rank, "ok": error is None, "payload": payload, "error": error,
                       "claim": claim})


def _foreign(record: Mapping[str, Any], claim: Optional[str]) -> bool:
    """Whether a report (or failure record) belongs to another save of the directory: an
    earlier attempt's writer that raced the new claim. Unchecked when ``claim`` is None."""
    return claim is not None and record.get("claim") != claim


def _read_report(path: str, rank: int) -> Optional[Dict[str, Any]]:
    try:
        report = read_json(path, REPORT_MAX_BYTES)
    except FileNotFoundError:
        return None
    except CheckpointError as err:  # reports are atomic: this is damage, not a race
        raise CommitError(f"unreadable report: {err}") from None
    if (not isinstance(report, dict) or report.get("rank") != rank
            or type(report.get("ok")) is not bool
            or not (report["ok"] or isinstance(report.get("error"), str))):
        raise CommitError(f"{path}: not a report of rank {rank}")
    return report


def wait_for_reports(tag_dir: str, world_size: int, timeout_s: float,
                     poll_s: float = 0.01, claim: Optional[str] = None,
                     given_up: Optional[Callable[[], bool]] = None) -> List[Dict[str, Any]]:
    """The committer: every rank's report payload, in rank order.

    Polls the directory (no collective) until every rank's report exists, backing off
    from ``poll_s`` to 0.2 s. Stops early at the first error report. A report that names
    another claim than ``claim`` does not count (as if absent): an earlier attempt's
    writer left it, and this save's writer will replace it.

    Args:
        claim: the committer's claim (rank 0's, from the save's prepare), checked every
            round and required in every report (None: no check).
        given_up: polled after each incomplete round; True: the save's run was abandoned
            (an in-job restart), and a dead rank's report will not come.

    Raises:
        Superseded: ``tag_dir`` lost ``claim`` (checked before the reports are read), or
            was marked failed (:class:`MarkedFailed`).
        CommitError: a rank reported an error (its message is included), or some
            reports were still missing after ``timeout_s`` (the ranks are named: their
            storage is slow or the process died) or when ``given_up``.
    """
    reports: Dict[int, Dict[str, Any]] = {}

    def missing_text() -> str:
        missing = [r for r in range(world_size) if r not in reports]
        return ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")

    def attempt() -> Optional[List[Dict[str, Any]]]:
        check_claim(tag_dir, claim)
        # A save given up meanwhile: its committer (run in a training process since its
        # keeper died) would otherwise wait for the lost shares until the timeout.
        _raise_if_marked_failed(tag_dir, claim)
        for rank in range(world_size):
            if rank in reports:
                continue
            report = _read_report(os.path.join(tag_dir, report_name(rank)), rank)
            if report is None or _foreign(report, claim):
                continue
            if not report["ok"]:
                raise CommitError(f"rank {rank}: {report['error']}")
            reports[rank] = report
        if len(reports) == world_size:
            return [reports[r]["payload"] for r in range(world_size)]
        if given_up is not None and given_up():
            # The committer's thread holds the run's engine: waiting out the timeout kept
            # the failed run's process groups, and a peer blocked in one, alive.
            raise CommitError(f"no report from rank(s) {missing_text()}, and the run was "
                              f"abandoned; {tag_dir} is not committed")
        return None

    def timed_out() -> List[Dict[str, Any]]:
        raise CommitError(f"no report from rank(s) {missing_text()} within {timeout_s:.0f} s "
                          f"(slow storage or a dead process; --moc-commit-timeout); "
                          f"{tag_dir} is not committed")

    return poll_until(attempt, timeout_s, Backoff(first_s=poll_s, max_s=0.2), timed_out)


def remove_reports(tag_dir: str, world_size: int, claim: Optional[str] = None) -> None:
    """Delete the reports, and the claim, once the manifest holds their content (best
    effort). With ``claim``, only the reports naming it and the claim if it is still
    ``claim``: a late committer of an earlier attempt must not delete what a restarted
    job's save of the same tag wrote since (its reports, its claim)."""
    for rank in range(world_size):
        path = os.path.join(tag_dir, report_name(rank))
        try:
            if claim is not None:
                report = _read_report(path, rank)
                if report is None or _foreign(report, claim):
                    continue
            fs.remove(path)
        except (OSError, CommitError):
            pass
    try:
        with locked_dir(os.path.dirname(tag_dir)):  # not between a re-claim's check and write
            if claim is None or read_claim(tag_dir) == claim:
                fs.remove(os.path.join(tag_dir, CLAIM_NAME))
    except (OSError, CommitError):
        pass


def commit_checkpoint(save_dir: str, tag: str, step: int, layout: Mapping[str, Any],
                      shares: List[Mapping[str, Any]], previous_tag: Optional[str],
                      selected: Optional[List], pec_k: Optional[int], save_latest: bool,
                      keep: int, log=None, pec_scope: str = "wo",
                      claim: Optional[str] = None,
                      attempt_started: Optional[float] = None) -> None:
    """The committer, after :func:`wait_for_reports`: manifest, then ``latest``, then retention.

    Run by rank 0's writer thread, or by the keeper process that persists rank 0's
    share. Everything it needs is plain data (no engine), so both can call it.

    Args:
        save_dir, tag, step: the checkpoint.
        layout: the manifest's layout record (``world_size``, ``ep_size``, ``zero_stage``,
            ``num_moe_layers``, ``num_experts``).
        shares: every rank's report payload (``{"report": ..., "objects": ...,
            "extra_files": ...}``); rank 0's ``objects`` is the ``objects.json`` record,
            its ``extra_files`` other files it wrote (name -> record), if any.
        previous_tag: the checkpoint in ``save_dir`` whose expert index this one extends.
        selected: ``(layer, expert)`` pairs this checkpoint holds; None without MoE.
        keep: retention (0: keep all).
        pec_scope: the PEC variant the save plan used (``--moc-pec-scope``).
        claim: the committer's claim, checked again right before the manifest is written.
        attempt_started: when the job attempt that saved it started (rank 0's clock),
            recorded in the manifest; ``latest`` is not moved over a later attempt's
            checkpoint (:func:`~deepspeed_ext.store.latest.advance_latest`).

    Raises:
        Superseded: ``claim`` is no longer the directory's, or the save was marked failed
            (:class:`MarkedFailed`); nothing was written.
    """
    if log is None:
        log = lambda line: log_line(logger, line)  # noqa: E731
    reports, extra_files = _parse_shares(shares)
    index = {}
    if layout["num_moe_layers"]:
        previous = (read_manifest(os.path.join(save_dir, previous_tag))
                    if previous_tag is not None else None)
        index = build_expert_index(previous, [tuple(x) for x in selected], step, tag,
                                   layout["num_moe_layers"], layout["num_experts"],
                                   scope=pec_scope)
    manifest = assemble_manifest(tag, step, layout["world_size"], layout, reports, index,
                                 extra_files=extra_files,
                                 extra={"pec_k": pec_k, "pec_scope": pec_scope,
                                        "attempt_started": attempt_started})
    _write_manifest_if_ours(save_dir, tag, manifest, claim)
    if save_latest:
        try:
            why = advance_latest(save_dir, tag, attempt_started, step)
        except Exception as e:
            # The checkpoint is complete (its manifest is written): failing the save now
            # would undo its expert marks on every rank while it stays on storage. A
            # restart still finds it (the loader takes the newest complete checkpoint,
            # latest or not), and the next commit moves latest.
            why = f"latest could not be moved ({type(e).__name__}: {e})"
        if why is not None:
            log(f"WARNING: {tag} (step {step}) committed; {why}")
    if keep:
        _retain_after_commit(save_dir, tag, keep, attempt_started, log)


def _write_manifest_if_ours(save_dir: str, tag: str, manifest, claim: Optional[str]) -> None:
    """The manifest, unless the save lost ``claim`` or was marked failed. Under the lock,
    neither a new claim nor a failure record (:func:`fail_unless_committed`) can land
    between the checks and the write: a save that a training process gave up must not be
    committed after all behind the back of the ranks that settled it as failed."""
    tag_dir = os.path.join(save_dir, tag)
    with locked_dir(save_dir):
        check_claim(tag_dir, claim)
        _raise_if_marked_failed(tag_dir, claim)
        write_manifest(tag_dir, manifest)


def _retain_after_commit(save_dir: str, tag: str, keep: int, attempt_started: Optional[float],
                         log) -> None:
    """:func:`commit_checkpoint`'s retention, once ``tag`` is committed; never raises."""
    try:
        # The check for a later attempt and the deletion in one step under the
        # directory's lock (a restart recording its start in between lost the
        # checkpoint it resumed from). Never the tag just committed, nor (inside
        # apply_retention) the one `latest` names.
        removed = retain_unless_superseded(save_dir, keep, attempt_started, protect=(tag,))
        if removed is None:
            log(f"retention after committing {tag} left to the later attempt of the job")
        for name in removed or ():
            log(f"retention: removed {name}")
    except Exception as e:
        # The checkpoint is committed and `latest` names it: a cleanup failing after
        # that (another attempt's retention removed a directory first, a store's
        # transient error) must not turn a good save into a failed one, which would
        # stop training on every rank. The next save's retention tries again.
        log(f"WARNING: retention after committing {tag} failed ({type(e).__name__}: {e}); "
            f"older checkpoints stay until the next save's retention")


def _parse_shares(shares: List[Any]):
    """``(reports, extra_files)`` of the ranks' report payloads, read back from their
    report files: a payload of the wrong shape raised KeyError/TypeError out of the
    committer. CommitError naming the rank instead; nothing is written then."""

    def record(value: Any, where: str) -> FileEntry:
        return FileEntry(sha256=get_field(value, "sha256", str, where),
                         nbytes=get_field(value, "nbytes", int, where), rank=0)
    reports, extra_files = [], {}
    for rank, share in enumerate(shares):
        where = f"rank {rank}'s report"
        try:
            reports.append(RankReport.from_json(get_field(share, "report", dict, where), where))
            if rank == 0:
                extra_files[OBJECTS_FILE] = record(get_field(share, "objects", dict, where),
                                                   f"{where}.objects")
                more = share.get("extra_files") or {}  # objects' tensors
                if not isinstance(more, dict):
                    raise ValueError(f"{where}.extra_files: expected an object")
                for name, value in more.items():
                    extra_files[name] = record(value, f"{where}.extra_files[{name!r}]")
        except ValueError as err:
            raise CommitError(f"{err} (a damaged report: not committed)") from None
    return reports, extra_files


FAILURE_NAME = "commit.failed.json"
FAILURE_MAX_BYTES = SMALL_RECORD_MAX_BYTES
"""Largest failure record read (it holds one error message)."""


def write_failure(tag_dir: str, message: str, claim: Optional[str] = None) -> None:
    """The committer gave up: say why, so that every rank's wait can end and report it."""
    atomic_write_json(os.path.join(tag_dir, FAILURE_NAME), {"error": message, "claim": claim})


def fail_unless_committed(tag_dir: str, message: str, claim: Optional[str] = None) -> bool:
    """Rank 0, giving up a save whose node keeper died: write its failure record unless
    its manifest is there already. Under the lock :func:`commit_checkpoint` writes the
    manifest under, so the save ends one way only, even with its committer still running
    in this process. Returns whether the save is now marked failed."""
    with locked_dir(os.path.dirname(tag_dir)):
        if fs.exists(os.path.join(tag_dir, MANIFEST_FILE)):
            return False
        write_failure(tag_dir, message, claim=claim)
        return True


def _raise_if_marked_failed(tag_dir: str, claim: Optional[str]) -> None:
    """Raise :class:`MarkedFailed` when ``tag_dir`` holds a failure record of ``claim``."""
    try:
        record = read_json(os.path.join(tag_dir, FAILURE_NAME), FAILURE_MAX_BYTES)
    except FileNotFoundError:
        return
    except (OSError, CheckpointError):  # unreadable: commit_outcome reports it as failed
        record = {"error": "unreadable failure record", "claim": claim}
    if isinstance(record, dict) and not _foreign(record, claim):
        raise MarkedFailed(f"{tag_dir} was marked failed ({record.get('error')}); not committing")


def commit_outcome(tag_dir: str, world_size: int, claim: Optional[str] = None) -> Optional[tuple]:
    """Non-blocking look at a checkpoint being committed in the background.

    Args:
        claim: the save's claim: error reports and failure records of another claim (an
            earlier attempt's, raced into the directory) are not this save's outcome.

    Returns:
        ``(True, None)`` once ``manifest.json`` exists, ``(False, reason)`` once the
        committer or a writer gave up, None while it is still in progress.
    """
    if fs.exists(os.path.join(tag_dir, MANIFEST_FILE)):
        return True, None
    failure = os.path.join(tag_dir, FAILURE_NAME)
    try:
        record = read_json(failure, FAILURE_MAX_BYTES)
        if not _foreign(record, claim):
            if not isinstance(record["error"], str):
                raise TypeError("error is not a string")
            return False, record["error"]
    except FileNotFoundError:
        pass
    except (OSError, CheckpointError, KeyError, TypeError, AttributeError):
        return False, f"{failure} (unreadable)"
    for rank in range(world_size):
        try:
            report = _read_report(os.path.join(tag_dir, report_name(rank)), rank)
        except CommitError as err:
            return False, str(err)
        if report is not None and not report["ok"] and not _foreign(report, claim):
            return False, f"rank {rank}: {report['error']}"
    return _superseded(tag_dir, claim)


def _superseded(tag_dir: str, claim: Optional[str]) -> Optional[tuple]:
    """``(False, why)`` when ``tag_dir`` no longer holds ``claim`` and has no manifest:
    its committer stood down (the tag was saved again, or the directory deleted), and
    nothing else would ever end the wait. None otherwise (or unchecked: no claim)."""
    if claim is None:
        return None
    try:
        now = read_claim(tag_dir)
    except CommitError:
        return None  # unreadable: the committer decides (it marks the save failed)
    if now == claim or fs.exists(os.path.join(tag_dir, MANIFEST_FILE)):
        return None if now == claim else (True, None)  # committed, claim just cleaned up
    return False, (f"{tag_dir} was claimed by another save" if now is not None else
                   f"{tag_dir} (or its claim) is gone") + "; this save's commit stood down"
