"""Single-level saves: a host buffer per rank, written and committed in the background.

The backend :class:`deepspeed_ext.checkpointer.MoCCheckpointer` uses without
``MoCConfig.two_level``. Multi-rank call order of :meth:`SingleLevel.save` (every rank
calls it):

1. :meth:`SingleLevel.wait` finishes the previous save (below);
2. every rank describes its fragments (:mod:`deepspeed_ext.state`); the fragment
   metadata of all ranks is gathered once per layout (``all_gather_object``);
3. every rank computes the same PEC selection and the same write plan (pure
   functions, :mod:`deepspeed_ext.policy.pec` and :mod:`deepspeed_ext.policy.plan`);
4. rank 0 prepares ``<tag>/`` (its failure is broadcast); every rank copies its share
   into a reused host buffer laid out as its file's exact bytes
   (:mod:`deepspeed_ext.format.image`); rank 0 adds the non-tensor state; one
   ``all_gather_object`` of the outcomes makes any failure every rank's;
5. the training loop goes on while a writer thread per rank writes the buffer to
   ``<tag>/rankNNNNN.safetensors`` (temp file, fsync, rename) and publishes a report
   file; rank 0's thread waits for all reports, then writes ``manifest.json`` (the
   commit point), ``latest`` and applies retention (:mod:`deepspeed_ext.store.commit`; no
   collective, so a slow writer cannot hang anyone);
6. the next ``save``/``load`` (or an explicit ``wait``) joins the thread and gathers
   every rank's outcome once: a failure anywhere is raised on every rank, and the
   PEC policy counts that checkpoint's experts as unsaved again.

:meth:`SingleLevel.load` waits, then loads from storage (:mod:`deepspeed_ext.storage_load`).
"""

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.engine.rng import get_rng_state
from deepspeed_ext.format.assemble import FragmentSpec
from deepspeed_ext.format.image import ImageLayout
from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import (MoCCheckpointError, all_outcomes, broadcast_outcome,
                                            raise_if_failed)
from deepspeed_ext.session import CheckpointSession
from deepspeed_ext.state import describe_local_state
from deepspeed_ext.storage_load import StorageLoad
from deepspeed_ext.store import claims, commit
from deepspeed_ext.store.latest import extended_tag

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


@dataclass
class _Staged:
    """One rank's share of a save, in the host buffer and ready to write."""

    layout: ImageLayout
    """Bytes layout of the rank file (the buffer holds exactly these bytes)."""
    file_name: str
    """``rankNNNNN.safetensors``."""
    specs: List[FragmentSpec]
    """What the file holds, for the manifest."""
    objects_tree: Any
    """Rank 0: the JSON tree of the non-tensor state; other ranks: None."""
    object_tensors: Dict[str, torch.Tensor]
    """Rank 0: the tensors the tree references (every rank's RNG state), written to
    their own small file (:data:`OBJECTS_TENSOR_FILE`): in rank 0's file, every rank
    of a load checksummed that whole file to read its RNG state, one extra checkpoint's
    worth of reads aimed at one file."""


@dataclass
class _PendingSave:
    """A save whose files are being written in the background."""

    save_dir: str
    tag: str
    step: int
    rank: int
    world: int
    zero_stage: int
    pec_k: Optional[int]
    selected: Optional[frozenset]
    """Experts saved by this checkpoint (None: no MoE layer)."""
    policy_before: Optional[Dict]
    """PEC policy state before this save marked its experts saved."""
    save_latest: bool
    bytes_per_rank: List[int]
    max_over_mean: float
    started: float
    """``time.perf_counter()`` when the save began."""
    previous: Optional[Tuple[str, str]]
    """(save_dir, tag) the expert index builds on."""
    staged_s: float = 0.0
    """Seconds the training loop was blocked."""
    claim: Optional[str] = None
    """Rank 0's claim on the tag directory, which every rank's report carries."""
    thread: Optional[threading.Thread] = None
    outcome: Optional[Tuple[bool, Optional[str]]] = field(default=None)
    """(ok, error message), set by the writer thread as its last action."""


class SingleLevel:
    """Saves through a host buffer and a writer thread; loads from storage."""

    def __init__(self, session: CheckpointSession, storage: StorageLoad):
        self.session = session
        self.config = session.config
        self.storage = storage
        self._pending: Optional[_PendingSave] = None
        self._buffer: Optional[torch.Tensor] = None
        """Host buffer holding this rank's share of the newest save (reused)."""
        self.last_load_source: Optional[str] = None
        """Where the last load came from (``storage``), or the exact replay's source."""
        self.stall_s: List[float] = []
        """Snapshot stalls: none without two-level checkpointing."""
        self._abandoned = threading.Event()

    def host_memory_bytes(self) -> int:
        """Bytes of this rank's save buffer."""
        return self._buffer.numel() if self._buffer is not None else 0

    def note_exact_replay(self, where: str) -> None:
        """The job resumed through exact recovery's replay of frames from ``where``."""
        self.last_load_source = f"exact replay from {where}"

    def shutdown(self) -> None:
        """End of training, every rank: wait for the last save."""
        self.wait()

    def abandon(self, join_s: float = 30.0) -> None:
        """This rank alone, after its run failed (an in-job restart; no collective): the
        save being written is given up. This rank's share is still written (its file and
        report: a few seconds at most); rank 0's commit stops at its next poll instead of
        waiting ``--moc-commit-timeout`` for a dead rank's report, so that its thread lets
        go of the engine and the failed run's groups. Waits up to ``join_s`` for the
        thread."""
        self._abandoned.set()
        pending, self._pending = self._pending, None
        if pending is not None and pending.thread is not None:
            pending.thread.join(timeout=join_s)

    # -- save ---------------------------------------------------------------------

    def save(self, save_dir: str, tag: Optional[str], client_state: Optional[Dict],
             save_latest: bool) -> bool:
        """Every rank: see :meth:`deepspeed_ext.checkpointer.MoCCheckpointer.save`."""
        self.wait()
        start = time.perf_counter()
        step = int(self.session.engine.global_steps)
        tag = tag or f"global_step{step}"
        fragments = describe_local_state(self.session.engine, self.session.naming, for_save=True,
                                         chunk_elems=self.config.chunk_bytes // 4)
        pending, plan, rng_states = self._plan(save_dir, tag, step, fragments, save_latest, start)
        try:
            staged = self._stage_everywhere(pending, fragments, plan, rng_states, client_state)
        except MoCCheckpointError:
            self.session.undo_mark_saved(pending.policy_before, pending.selected)
            raise
        pending.staged_s = time.perf_counter() - start
        pending.thread = threading.Thread(target=self._persist, args=(pending, staged),
                                          name=f"moc-persist-{tag}")
        # Not a daemon: a script that ends without wait() still gets its files written.
        pending.thread.start()
        self._pending = pending
        if not self.config.async_save:
            self.wait()
        return True

    def _plan(self, save_dir: str, tag: str, step: int, fragments, save_latest: bool,
              start: float):
        """Every rank, in order: gather the pieces (a collective once per layout), select
        the experts, plan who writes what, mark the experts saved, gather every rank's
        RNG state (a collective). Returns ``(pending save, write plan, RNG states)``."""
        from deepspeed_ext.policy.plan import build_write_plan
        ses, engine, world = self.session, self.session.engine, dist.get_world_size()
        pieces = ses.gather_pieces(fragments)
        # Identical on every rank (same policy state); None: no MoE layer.
        selected = ses.select_experts(save_dir)
        plan = build_write_plan(pieces, world, selected, self.config.pec_scope)
        # The saved policy state must already count this checkpoint's experts as saved;
        # if the save fails, that is undone so the next save includes them again.
        policy_before = ses.policy.state_dict() if ses.policy is not None else None
        if ses.policy is not None:
            ses.policy.mark_saved(selected, step)
            ses.ledger.mark_saved(selected, step)
        rng_states: List = [None] * world
        dist.all_gather_object(rng_states, get_rng_state(), group=metadata_group())
        pending = _PendingSave(
            save_dir=save_dir, tag=tag, step=step, rank=dist.get_rank(), world=world,
            zero_stage=int(engine.zero_optimization_stage()),
            pec_k=ses.policy.k if ses.policy is not None else None, selected=selected,
            policy_before=policy_before, save_latest=save_latest,
            bytes_per_rank=list(plan.bytes_per_rank), max_over_mean=plan.max_over_mean(),
            started=start, previous=ses.previous)
        return pending, plan, rng_states

    def _stage_everywhere(self, pending: _PendingSave, fragments, plan, rng_states,
                          client_state) -> _Staged:
        """Every rank: rank 0 prepares the tag directory (its outcome broadcast), every
        rank stages its share; one outcome exchange raises any failure on every rank."""
        tag_dir = os.path.join(pending.save_dir, pending.tag)
        # Every rank's report carries rank 0's claim on the directory (commit.py).
        pending.claim = broadcast_outcome(
            lambda: claims.read_claim(self.session.prepare_save_dir(pending.save_dir,
                                                                     pending.tag, pending.step)),
            f"MoC save to {tag_dir}")
        ok, payload = True, None
        try:
            staged = self._stage(pending.rank, fragments, plan, rng_states, client_state)
        except Exception as e:  # reported to every rank below, never swallowed
            ok, payload = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        raise_if_failed(all_outcomes(ok, payload), f"MoC save of {tag_dir}")
        return staged

    def _stage(self, rank, fragments, plan, rng_states, client_state) -> "_Staged":
        """Copy this rank's share (rank 0: also the non-tensor state) into the host buffer."""
        from deepspeed_ext.format import assemble, dtypes, naming
        from deepspeed_ext.format.image import fill_image, layout_of
        from deepspeed_ext.format.objects import encode
        mine = set(plan.keys_for(rank))
        tensors, specs = {}, []
        for frag in fragments:
            if frag.key in mine:
                tensors[frag.key] = frag.tensor
                specs.append(assemble.FragmentSpec(frag.name, frag.kind, frag.offset, frag.length,
                                             frag.shape, dtypes.dtype_name(frag.tensor.dtype),
                                             frag.expert, frag.split))
        tree, object_tensors = None, {}
        if rank == 0:
            objects = self.session.objects(client_state)
            objects["rng_states"] = rng_states
            tree, object_tensors = encode(objects)
        layout = layout_of(tensors)
        # On a GPU the buffer is page-locked and filled by DMA: a pageable buffer is
        # copied through a bounce buffer at a fraction of the bandwidth, all of it in the
        # save call. CPU: as before.
        on_cuda = any(t.device.type == "cuda" for t in tensors.values())
        if (self._buffer is None or self._buffer.numel() < layout.nbytes
                or (on_cuda and not self._buffer.is_pinned())):
            # Allocated once and reused; grows only when a save's share is larger (PEC
            # selections differ in size). A new tensor: never resize memory that a
            # failed earlier writer might still be reading.
            self._buffer = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        with torch.no_grad():
            fill_image(self._buffer, layout, tensors, non_blocking=on_cuda)
            if on_cuda:  # the writer thread reads the buffer next
                torch.cuda.current_stream().synchronize()
        return _Staged(layout, naming.rank_file_name(rank), specs, tree, object_tensors)

    def _persist(self, pending: "_PendingSave", staged: "_Staged") -> None:
        """Background thread of every rank: write, fsync, report; rank 0 then commits."""
        tag_dir = os.path.join(pending.save_dir, pending.tag)
        try:
            self._write_share(tag_dir, pending, staged)
        except Exception as e:
            traceback.print_exc()
            pending.outcome = (False, f"{type(e).__name__}: {e}")
            try:  # lets the committer stop waiting at once
                commit.write_report(tag_dir, pending.rank, None, error=pending.outcome[1],
                                    claim=pending.claim)
            except Exception:
                pass
            return
        if pending.rank == 0:
            try:
                self._commit(tag_dir, pending)
            except Exception as e:
                if not self._abandoned.is_set():
                    traceback.print_exc()
                pending.outcome = (False, f"{type(e).__name__}: {e}")
                return
        pending.outcome = (True, None)

    def _write_share(self, tag_dir: str, pending: "_PendingSave", staged: "_Staged") -> None:
        """Writer thread: this rank's file (rank 0: also the objects), then its report."""
        from deepspeed_ext.format import assemble, storage
        from deepspeed_ext.format.image import image_view
        from deepspeed_ext.format.objects import write_objects_file
        record = storage.write_image_file(os.path.join(tag_dir, staged.file_name),
                                          image_view(self._buffer, staged.layout))
        objects_record, extra_files = None, {}
        if staged.objects_tree is not None:
            if staged.object_tensors:
                extra_files[OBJECTS_TENSOR_FILE] = storage.write_fragment_file(
                    os.path.join(tag_dir, OBJECTS_TENSOR_FILE), staged.object_tensors).to_json()
            objects_record = write_objects_file(
                tag_dir, staged.objects_tree,
                OBJECTS_TENSOR_FILE if staged.object_tensors else None)
        report = assemble.RankReport(pending.rank, staged.file_name, record.nbytes, record.sha256,
                                     staged.specs)
        commit.write_report(tag_dir, pending.rank, {
            "report": report.to_json(),
            "objects": objects_record.to_json() if objects_record is not None else None,
            "extra_files": extra_files}, claim=pending.claim)

    def _commit(self, tag_dir: str, pending: "_PendingSave") -> None:
        """Rank 0's writer thread: wait for every rank's report, then commit."""
        shares = commit.wait_for_reports(tag_dir, pending.world, self.config.commit_timeout_s,
                                         claim=pending.claim, given_up=self._abandoned.is_set)
        commit.commit_checkpoint(
            pending.save_dir, pending.tag, pending.step,
            self.session.layout_record(pending.world, pending.zero_stage),
            shares, extended_tag(pending.previous, pending.save_dir),
            sorted(pending.selected) if pending.selected is not None else None,
            pending.pec_k, pending.save_latest, self.config.keep, log=_log,
            pec_scope=self.config.pec_scope, claim=pending.claim,
            attempt_started=self.session.timeline.attempt_started)
        commit.remove_reports(tag_dir, pending.world, pending.claim)

    def wait(self) -> None:
        """Every rank: see :meth:`deepspeed_ext.checkpointer.MoCCheckpointer.wait`. Joins
        this rank's writer thread, then one ``all_gather_object`` of every rank's outcome
        (rank 0's includes the commit)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        ok, message = pending.outcome or (False, "writer thread ended without an outcome")
        try:
            raise_if_failed(all_outcomes(ok, message),
                             f"MoC save of {os.path.join(pending.save_dir, pending.tag)}")
        except MoCCheckpointError:
            self.session.undo_mark_saved(pending.policy_before, pending.selected)
            raise
        self.session.previous = (pending.save_dir, pending.tag)
        busiest = max(pending.bytes_per_rank)
        _log(f"saved {os.path.join(pending.save_dir, pending.tag)}: training waited "
             f"{pending.staged_s:.2f} s, committed {time.perf_counter() - pending.started:.2f} s "
             f"after the save began; {sum(pending.bytes_per_rank) / 2**20:.2f} MiB of tensors, "
             f"busiest rank {busiest / 2**20:.2f} MiB (max/mean {pending.max_over_mean:.2f})"
             + (f", {len(pending.selected)} expert(s) saved" if pending.selected is not None else ""))

    # -- load ---------------------------------------------------------------------

    def load(self, load_dir: str, tag: Optional[str], load_optimizer_states: bool,
             load_lr_scheduler_states: bool,
             from_memory: bool = True) -> Tuple[Optional[str], Optional[Dict]]:
        """Every rank: wait for the pending save, start a new timeline, load from storage
        (``from_memory`` has no meaning without two-level checkpointing)."""
        self.wait()  # a save of the old timeline commits under its own attempt
        self.session.timeline.new_timeline()
        self.last_load_source = "storage"
        return self.storage.load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
