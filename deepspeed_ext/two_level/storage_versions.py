"""What storage holds, as a recovery from memory sees it (:mod:`deepspeed_ext.two_level`):
the newest stored step, and the expert versions of the newest checkpoint at or before
the recovered step."""

import logging
import os
from typing import Dict, Optional

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.runtime.log import rank_zero_lines

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def newest_stored_step(load_dir: str) -> Optional[int]:
    """Rank 0, before recovery's first exchange (never raises): the step of the
    checkpoint ``latest`` names under ``load_dir``; None when there is none or it cannot
    be read (the storage load would then fall back to an older one: memory wins)."""
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.store import latest
    try:
        tag = latest.read_latest(load_dir) if fs.isdir(load_dir) else None
        return mf.read_manifest(os.path.join(load_dir, tag)).step if tag else None
    except Exception as e:
        _log(f"recovery: cannot read the newest checkpoint of {load_dir} ({type(e).__name__}: "
             f"{e}); memory decides")
        return None



class StorageVersions:
    """Expert versions of the newest committed checkpoint at or before ``step``, from its
    manifest, read only when a load asks for them (a snapshot holding every expert at
    ``step`` never does: storage cannot be newer); the checkpoint's files are opened (and
    verified) only if a fragment is actually read from storage."""

    def __init__(self, load_dir: str, step: int):
        from deepspeed_ext.format import errors
        from deepspeed_ext.format import manifest as mf
        from deepspeed_ext.store.catalog import scan_checkpoints
        from deepspeed_ext.store.latest import read_latest
        self.load_dir, self.step, self.tag = load_dir, step, None
        self._versions: Optional[Dict] = None
        self._reader = None
        self.latest: Optional[str] = None
        """The newest committed checkpoint (whatever its step)."""
        if not fs.isdir(load_dir):
            self._versions = {}
            return
        try:
            latest = read_latest(load_dir)
        except errors.CheckpointError:
            latest = None
        if latest and fs.exists(os.path.join(load_dir, latest, mf.MANIFEST_FILE)):
            self.latest = latest
        else:  # no or a dangling ``latest``: the newest complete checkpoint is it
            complete = scan_checkpoints(load_dir).complete
            self.latest = complete[-1][1] if complete else None

    def base_tag(self) -> Optional[str]:
        """The newest checkpoint of the step or older whose expert index can be read
        (None: none); the versions are resolved for it."""
        try:
            self.versions
        except (CheckpointError, OSError, ValueError) as e:
            _log(f"WARNING: no readable checkpoint at or before step {self.step} in "
                 f"{self.load_dir} ({type(e).__name__}: {e}); the next persist saves on its own")
            return None
        return self.tag

    @property
    def versions(self) -> Dict:
        """``{(layer, expert): step}`` of the chosen checkpoint's expert index."""
        if self._versions is None:
            self._versions = self._resolve()
        return self._versions

    def _resolve(self) -> Dict:
        from deepspeed_ext.format import errors, expert_index
        from deepspeed_ext.store import catalog
        # Normally ``latest`` is it: one manifest read. Only when storage is ahead of the
        # memory snapshot (or ``latest`` is damaged) are all manifests scanned.
        found = None
        try:
            if self.latest:
                found = (self.latest, *expert_index.read_expert_versions(
                    os.path.join(self.load_dir, self.latest)))
        except errors.CheckpointError:
            found = None
        if found is None or found[1] > self.step:
            complete = catalog.scan_checkpoints(self.load_dir).complete
            candidates = [t for s, t in complete if s <= self.step]
            found = ((candidates[-1], *expert_index.read_expert_versions(
                os.path.join(self.load_dir, candidates[-1]))) if candidates else None)
        if found is None:
            return {}
        self.tag = found[0]
        return found[2]

    def reader(self):
        from deepspeed_ext.store.reader import CheckpointReader
        if self._reader is None:
            # Each file this rank reads is checked (size, checksum) before its first read;
            # not every rank's files, which would make every rank open the whole
            # checkpoint. A failure here fails the memory recovery on every rank, and the
            # storage load that follows checks the structure on rank 0.
            self._reader = CheckpointReader(self.load_dir, self.tag, verify_checksums=True,
                                            check_structure=False)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
