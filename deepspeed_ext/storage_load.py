"""A load from storage, whatever layout saved it; every rank calls it.

Rank 0 picks the checkpoint (the newest valid one), every rank reads exactly the byte
ranges of its own partitions, and one ``all_gather_object`` makes any rank's failure
every rank's. A checkpoint whose file fails its checks on the rank reading it is passed
over by every rank together, and the next one is tried.

Used by both backends of :class:`deepspeed_ext.checkpointer.MoCCheckpointer`: the
single-level one (:mod:`deepspeed_ext.single_level`) and two-level recovery when memory
cannot serve (:mod:`deepspeed_ext.two_level`). The caller finishes its pending save
first (its ``wait``).
"""

import logging
import os
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.format import fs
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import MoCCheckpointError, all_outcomes, raise_if_failed
from deepspeed_ext.session import CheckpointSession
from deepspeed_ext.state import (MomentPresence, describe_local_state, prepare_optimizer_state,
                                 refresh_compute_weights)

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


class StorageLoad:
    """Loads checkpoints from storage into the session's engine."""

    def __init__(self, session: CheckpointSession):
        self.session = session

    def load(self, load_dir: str, tag: Optional[str] = None,
             load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True) -> Tuple[Optional[str], Optional[Dict]]:
        """Load from storage into this engine, whatever layout saved it; all ranks call it,
        after their backend's ``wait`` (a save still being written must be committed, or
        failed, first).

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no
            checkpoint.

        Raises:
            MoCCheckpointError: on every rank, when any rank failed (a corrupt file, a
                tensor this model does not have, ...).
        """
        ses = self.session
        start = time.perf_counter()
        found = self._read_first_usable(load_dir, tag, load_optimizer_states,
                                        load_lr_scheduler_states)
        if found is None:
            _log(f"no MoC checkpoint in {load_dir}")
            return None, None
        chosen, objects, ses.expert_versions_loaded, rows = found
        if rows is not None:
            _log(rows.describe())
        ses.account_recovery(objects, ses.expert_versions_loaded)
        refresh_compute_weights(ses.engine)
        ses.previous = (load_dir, chosen)
        ses.forget_pieces()
        _log(f"loaded {os.path.join(load_dir, chosen)} (step {ses.engine.global_steps}) "
             f"in {time.perf_counter() - start:.2f} s")
        return os.path.join(load_dir, chosen), objects["client_state"]

    def _read_first_usable(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
                           load_lr_scheduler_states: bool):
        """Every rank: read the newest checkpoint no rank found damaged (or ``tag``);
        ``(tag, objects, expert versions, row plan)``, or None when there is none."""
        described: List = []

        def fragments(moments=None):
            if not described:  # only once there is something to load into them:
                # creating the moments advances Adam's step counters; ``moments``: the
                # checkpoint's MomentPresence (None: an older checkpoint, every group's)
                if load_optimizer_states:
                    prepare_optimizer_state(self.session.engine, moments)
                described.append(describe_local_state(self.session.engine, self.session.naming,
                                                      with_moments=load_optimizer_states))
            return described[0]

        def restore(objects):
            self.session.restore_objects(objects, load_optimizer_states, load_lr_scheduler_states)

        unusable: Dict[str, str] = {}  # tag -> the damage some rank found while reading it
        while True:
            choice = self._broadcast_choice(load_dir, tag, unusable)
            if choice is None:
                return None
            chosen, resolution = choice
            ok, result = self._read_into(load_dir, chosen, resolution, fragments, restore)
            outcomes = all_outcomes(ok, None if ok else result)  # kind, message
            damaged = [f"rank {r}: {why[1]}" for r, (good, why) in enumerate(outcomes)
                       if not good and why[0] == "damaged"]
            if damaged and len(damaged) == sum(not good for good, _ in outcomes):
                # A file failed its checksum (or size) on the rank that read it: every
                # rank passes this checkpoint over, together, and the next one is tried
                # (the engine's tensors are overwritten by that load).
                unusable[chosen] = "; ".join(damaged)
                continue
            raise_if_failed([(good, why if good else why[1]) for good, why in outcomes],
                             f"MoC load of {load_dir}/{chosen}")
            return (chosen, *result)

    def _choose(self, load_dir: str, tag: Optional[str], exclude: Dict[str, str]):
        """Rank 0: the tag to load (the newest valid one, not in ``exclude``, when ``tag``
        is None) and its resolution, or None. Checks the structure (files, sizes,
        fragments) only: the checksums are verified by each rank on the files it reads
        (:meth:`_read_into`), in parallel, rather than here by one rank for the
        whole checkpoint; and the resolution goes to the other ranks, so that they do
        not all read every manifest it names."""
        from deepspeed_ext.store import catalog, verify
        from deepspeed_ext.store.reader import find_loadable
        manifests: Dict = {}
        if tag is not None:
            problems = [exclude[tag]] if tag in exclude else \
                verify.verify_checkpoint(load_dir, tag, checksums=False, cache=manifests)
            if problems:
                raise MoCCheckpointError(f"checkpoint {tag} in {load_dir} cannot be loaded: "
                                         + "; ".join(problems))
            chosen = tag
        else:
            if not fs.isdir(load_dir):
                return None
            chosen, skipped = find_loadable(load_dir, checksums=False, exclude=exclude,
                                            cache=manifests)
            for line in skipped:
                _log(f"WARNING: {line}")
            if chosen is None:
                return None
        return chosen, catalog.resolve_checkpoint(load_dir, chosen, manifests)

    def _broadcast_choice(self, load_dir: str, tag: Optional[str], unusable: Dict[str, str]):
        """Every rank: rank 0's :meth:`_choose`, ``(tag, resolution)`` or None (nothing
        to load), or its error raised on every rank."""
        choice = [None]
        if dist.get_rank() == 0:
            try:
                choice[0] = (True, self._choose(load_dir, tag, unusable))
            except Exception as e:
                choice[0] = (False, f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(choice, src=0, group=metadata_group())
        ok, chosen = choice[0]
        if not ok:
            raise MoCCheckpointError(f"MoC load from {load_dir}: {chosen}")
        return chosen

    def _read_into(self, load_dir: str, chosen: str, resolution, fragments,
                   restore) -> Tuple[bool, Any]:
        """This rank's part of a storage load: copy its fragments of checkpoint
        ``chosen`` (resolved by rank 0) into the engine, checksumming each file before
        its first read (when ``verify_on_load``), then ``restore`` its objects.

        Everything rank-local happens here, before the caller's outcome exchange: the
        fragments are described (``fragments()``: creating the optimizer's moments can
        run out of memory on one rank) and the objects restored (``restore(objects)``),
        so that a failure on one rank is reported to all instead of leaving the others
        in the collective after the exchange.

        Returns:
            ``(True, (objects, expert versions, row plan))`` (the
            :class:`~deepspeed_ext.format.vocab.RowPlan` of the padded vocabulary, None
            when its rows are as saved), or ``(False, (kind, message))`` with kind
            ``damaged`` for a file that failed its checks, else ``error``.
        """
        from deepspeed_ext.format.errors import CheckpointError
        from deepspeed_ext.format.vocab import OBJECTS_KEY
        from deepspeed_ext.store.reader import CheckpointReader, check_saved_shape, vocab_plan
        try:
            # Rank 0 checked the structure while choosing; each rank checks the bytes it
            # reads, so no rank hashes (or opens) the whole checkpoint alone.
            with CheckpointReader(load_dir, chosen,
                                  verify_checksums=self.session.config.verify_on_load,
                                  check_structure=False, resolution=resolution) as reader, \
                    torch.no_grad():
                objects = reader.objects()  # first: which moments the fragments include
                # The same plan on every rank (the same checkpoint): all or none refuse.
                plan = vocab_plan(reader, self.session.config.padded_vocab,
                                  objects.get(OBJECTS_KEY))
                for frag in fragments(MomentPresence.from_record(objects.get("optimizer_moments"))):
                    rows = check_saved_shape(reader, frag, load_dir, chosen, plan)
                    data = reader.read(frag.name, frag.kind, frag.offset, frag.length,
                                       split=frag.split, rows=rows)
                    frag.tensor.copy_(data.to(device=frag.tensor.device, dtype=frag.tensor.dtype))
                versions = {k: v[0] for k, v in reader.expert_versions().items()}
            restore(objects)
            return True, (objects, versions, plan)
        except CheckpointError as e:
            traceback.print_exc()
            return False, ("damaged", str(e))
        except Exception as e:  # reported to every rank by the caller
            traceback.print_exc()
            return False, ("error", f"{type(e).__name__}: {e}")
