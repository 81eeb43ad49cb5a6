"""The job's event file and progress record: what happened to a job across its restarts.

Failures, detections and recoveries are appended as JSON lines to one event file
(``--moc-event-file``, by default ``<save>/moc-events.jsonl``), readable by people
(``jq``) and by the next restart of the same job, which needs them: the accumulated PLT
and dynamic K are computed from every recovery so far, and "iterations lost" from the
progress the failed run had made (:class:`Progress`, a small file rank 0 rewrites each
iteration).

Writers: any rank may append (a hang is reported by whichever rank saw it first); each
event is one ``write`` of one line to a file opened with ``O_APPEND``, which local and
POSIX shared file systems apply atomically for lines this small, so concurrent writers
never interleave. Local paths only: the event file is for the job's own restarts.
"""

import json
import os
import time
from typing import Dict, List, Optional

EVENT_FILE = "moc-events.jsonl"
"""Default event file name, inside ``--save``."""
PROGRESS_FILE = "moc-progress.json"
"""Rank 0's progress record, beside the event file."""


class EventLog:
    """Append-only JSON-lines event file. Every method is safe on any rank."""

    def __init__(self, path: str):
        self.path = path

    def append(self, event: Dict) -> Dict:
        """Add ``event`` (a JSON-serialisable dict; ``time`` is filled in if missing),
        durably (fsync: it is read after a crash). Returns the event as written."""
        event = dict(event)
        event.setdefault("time", time.time())
        line = (json.dumps(event, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return event

    def read(self, kind: Optional[str] = None) -> List[Dict]:
        """Every event (of ``kind``), oldest first; [] when there is no file. A line cut
        short by a crash while it was written is skipped."""
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and (kind is None or event.get("kind") == kind):
                events.append(event)
        return events


class Progress:
    """The newest iteration a run finished, rewritten by rank 0 after every iteration
    (temp file and rename, no fsync: losing the last update to a power cut only makes
    "iterations lost" one lower). The next start reads it to report what a failure cost."""

    def __init__(self, path: str):
        self.path = path
        self._tmp = f"{path}.tmp.{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def record(self, iteration: int, run_id: str, loop: Optional[Dict] = None) -> None:
        """``loop``: the run's measured iteration time so far
        (:meth:`megatron.training.recovery.LoopTime.record`), for a restart's ETTR."""
        with open(self._tmp, "w", encoding="utf-8") as f:
            json.dump({"iteration": iteration, "time": time.time(), "run": run_id,
                       "loop": loop}, f)
        os.replace(self._tmp, self.path)

    def read(self) -> Optional[Dict]:
        """``{"iteration", "time", "run", "loop"}`` of the last record, or None."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        return data if isinstance(data, dict) and "iteration" in data else None


def default_event_file(save: Optional[str]) -> Optional[str]:
    """``<save>/moc-events.jsonl`` for a local ``--save``; None for none or a URL."""
    from deepspeed_ext.format import fs
    if not save or fs.is_url(save):
        return None
    return os.path.join(save, EVENT_FILE)
