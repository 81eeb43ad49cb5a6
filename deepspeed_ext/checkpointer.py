"""MoC's save and load for a DeepSpeed engine: fully sharded, PEC, reshardable.

Multi-rank call order of :meth:`MoCCheckpointer.save` (every rank calls it):

1. :meth:`MoCCheckpointer.wait` finishes the previous save (below);
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

:meth:`MoCCheckpointer.load` is called by every rank; rank 0 picks the checkpoint
(the newest valid one), every rank reads exactly the byte ranges of its own
partitions, and one ``all_gather_object`` makes any rank's failure every rank's.
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

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.engine.rng import get_rng_state, set_rng_state
from deepspeed_ext.format import fs
from deepspeed_ext.format.assemble import FragmentSpec
from deepspeed_ext.format.image import ImageLayout
from deepspeed_ext.format.objects import OBJECTS_TENSOR_FILE
from deepspeed_ext.runtime.groups import init_metadata_group, metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.runtime.outcomes import (MoCCheckpointError, all_outcomes, broadcast_outcome,
                                          raise_if_failed)
from deepspeed_ext.state import (ExpertNaming, LocalFragment, MomentPresence, describe_local_state,
                                 expert_naming, loss_scaler_state, moment_presence,
                                 optimizer_scalars, prepare_optimizer_state,
                                 refresh_compute_weights, set_loss_scaler_state,
                                 set_optimizer_scalars)
from deepspeed_ext.store import claims, commit
from deepspeed_ext.store.latest import extended_tag
from deepspeed_ext.store.prepare import prepare_checkpoint_dir, set_aside_checkpoints_after


logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


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


class MoCCheckpointer:
    """Saves and loads one engine's state in MoC's format. Create on every rank."""

    def __init__(self, engine, config: Optional[MoCConfig] = None):
        from deepspeed_ext.policy.pec import ExpertLayout, make_policy
        from deepspeed_ext.policy.plt import TokenLedger
        init_metadata_group()  # every rank, here: the group of all of MoC's collectives
        self.engine = engine
        self.config = config or MoCConfig()
        self.naming: ExpertNaming = expert_naming(engine.module)
        self.layout = None
        self.policy = None
        self.ledger = None
        """Token assignments per expert and at its saved versions (lost-token accounting)."""
        self.last_recovery = None
        """:class:`deepspeed_ext.policy.plt.RecoveryLoss` of the last load (None: none, or a
        checkpoint written before the ledger existed)."""
        if self.naming.moe_prefixes:
            num_experts = self.naming.num_experts[0]
            if any(n != num_experts for n in self.naming.num_experts):
                raise ValueError("MoC checkpointing needs the same expert count in every MoE layer")
            ep_size = num_experts // self._num_local_experts()
            self.layout = ExpertLayout(len(self.naming.moe_prefixes), num_experts, ep_size)
            k = self.config.pec_k or num_experts
            self.policy = make_policy(self.config.pec_policy, self.layout, min(k, num_experts))
            self.ledger = TokenLedger(self.layout.num_moe_layers, num_experts)
        self._piece_cache: Optional[Tuple[tuple, list, list]] = None
        self._previous: Optional[Tuple[str, str]] = None
        self._warned_new_dir = False
        # When this attempt of the job started (rank 0's is what its committers record):
        # a committer of an earlier attempt never moves ``latest`` over this one's work.
        self.attempt_started = time.time()
        self._timeline_used = False  # a save or load happened in this process
        self._save_dirs_checked: set = set()  # prepare_save_dir's first-save check, done
        """(save_dir, tag) of the checkpoint the current state descends from."""
        self._pending: Optional[_PendingSave] = None
        self._buffer: Optional[torch.Tensor] = None
        """Host buffer holding this rank's share of the newest save (reused)."""
        self.expert_versions_loaded: Dict[Tuple[int, int], int] = {}
        """Step of each expert's version the last storage load gave."""
        self._last_load_source: Optional[str] = None
        self.rng_restored = False
        """Whether the last load set this rank's RNG state from the checkpoint."""
        self.two_level = None
        if self.config.two_level:
            from deepspeed_ext.two_level import TwoLevel
            self.two_level = TwoLevel(self)

    @property
    def last_load_source(self) -> Optional[str]:
        """Where the last load came from: ``memory``, ``storage`` or ``storage+memory``."""
        if self.two_level is not None:
            return self.two_level.last_load_source
        return self._last_load_source

    def mark_exact_replay(self, where: str) -> None:
        """The job resumed through exact recovery's replay (``deepspeed_ext.exact``) of
        frames read from ``where`` (memory, storage), not a load of ours: nothing was
        lost, and no token ledger applies."""
        self._last_load_source, self.last_recovery = f"exact replay from {where}", None

    @property
    def stall_s(self) -> List[float]:
        """Seconds ``engine.step`` waited for each snapshot copy (two-level only)."""
        return self.two_level.stall_s if self.two_level is not None else []

    def host_memory_bytes(self) -> int:
        """Shared-memory bytes of this rank's snapshot slots (two-level), or its save buffer."""
        if self.two_level is not None:
            return self.two_level.host_memory_bytes()
        return self._buffer.numel() if self._buffer is not None else 0

    def shutdown(self) -> None:
        """End of training, every rank: wait for the last save; stop the node's keeper and
        free its shared memory (two-level)."""
        if self.two_level is not None:
            self.two_level.shutdown()
        else:
            self.wait()

    def _num_local_experts(self) -> int:
        from deepspeed.moe.layer import MoE
        for module in self.engine.module.modules():
            if isinstance(module, MoE):
                return module.num_local_experts
        raise ValueError("no MoE layer")

    # -- token accounting (load-aware PEC) ---------------------------------------

    def observe_tokens(self, counts) -> None:
        """Feed one iteration's gate counts, summed over all ranks, ``[moe_layers][experts]``.

        Every rank calls it with the same counts (the policy state must stay identical).
        """
        if self.policy is not None:
            self.policy.observe_tokens(counts)
        if self.ledger is not None:
            self.ledger.observe(counts)

    # -- save ---------------------------------------------------------------------

    def _gather_pieces(self, fragments: List[LocalFragment]):
        """The write-plan pieces of the whole world (cached while the layout holds)."""
        from deepspeed_ext.policy.pec import part_of_kind
        from deepspeed_ext.policy.plan import Piece
        if self._piece_cache is not None and self._piece_cache[2] is fragments:
            return self._piece_cache[1]  # the same (never modified) list: two-level's cache
        signature = tuple((f.key, f.length) for f in fragments)
        if self._piece_cache is not None and self._piece_cache[0] == signature:
            self._piece_cache = (signature, self._piece_cache[1], fragments)
            return self._piece_cache[1]
        local = [(f.key, f.length * f.tensor.element_size(), f.holders, f.expert, f.kind)
                 for f in fragments]
        gathered: List = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local, group=metadata_group())
        pieces: Dict[str, Piece] = {}
        for rank_pieces in gathered:
            for key, nbytes, holders, expert, kind in rank_pieces:
                pieces.setdefault(key, Piece(key, nbytes, tuple(holders),
                                             tuple(expert) if expert is not None else None,
                                             part_of_kind(kind)))
        result = sorted(pieces.values(), key=lambda p: p.key)
        self._piece_cache = (signature, result, fragments)
        return result

    def _objects(self, client_state) -> Dict:
        """Non-tensor state of the engine and of MoC (rank 0 writes it)."""
        engine = self.engine
        return {"client_state": client_state or {},
                "engine": {"global_steps": engine.global_steps,
                           "global_samples": engine.global_samples,
                           "skipped_steps": engine.skipped_steps},
                "optimizer_scalars": optimizer_scalars(engine),
                # which groups have moments yet (none before the first fp16 step that
                # does not overflow): a load must not create what was not saved
                "optimizer_moments": moment_presence(engine).to_record(),
                "lr_scheduler": (engine.lr_scheduler.state_dict()
                                 if getattr(engine, "lr_scheduler", None) is not None else None),
                "loss_scaler": loss_scaler_state(engine),
                "pec_policy": self.policy.state_dict() if self.policy is not None else None,
                "token_ledger": self.ledger.state_dict() if self.ledger is not None else None}

    def save(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict] = None,
             save_latest: bool = True) -> bool:
        """Save a checkpoint; all ranks call it. Returns True (DeepSpeed's contract).

        Stages this rank's share into a reused host buffer and returns; the buffer is
        written, fsynced and committed by a background thread (see the module
        docstring). With ``MoCConfig.async_save`` off, waits for the commit. The
        previous save is always waited for first (:meth:`wait`).

        Raises:
            MoCCheckpointError: on every rank, when any rank failed to stage this save or
                to persist the previous one; ``latest`` then names the last committed
                checkpoint.
        """
        from deepspeed_ext.policy.plan import build_write_plan
        self._timeline_used = True
        if self.two_level is not None:
            return self.two_level.save(save_dir, tag, client_state, save_latest)
        self.wait()
        start = time.perf_counter()
        engine, rank, world = self.engine, dist.get_rank(), dist.get_world_size()
        step = int(engine.global_steps)
        tag = tag or f"global_step{step}"
        tag_dir = os.path.join(save_dir, tag)
        fragments = describe_local_state(engine, self.naming, for_save=True,
                                         chunk_elems=self.config.chunk_bytes // 4)
        pieces = self._gather_pieces(fragments)
        # Identical on every rank (same policy state); None: no MoE layer.
        selected = self.select_experts(save_dir)
        plan = build_write_plan(pieces, world, selected, self.config.pec_scope)
        # The saved policy state must already count this checkpoint's experts as saved;
        # if the save fails, that is undone so the next save includes them again.
        policy_before = self.policy.state_dict() if self.policy is not None else None
        if self.policy is not None:
            self.policy.mark_saved(selected, step)
            self.ledger.mark_saved(selected, step)
        rng_states: List = [None] * world
        dist.all_gather_object(rng_states, get_rng_state(), group=metadata_group())
        pending = _PendingSave(
            save_dir=save_dir, tag=tag, step=step, rank=rank, world=world,
            zero_stage=int(engine.zero_optimization_stage()),
            pec_k=self.policy.k if self.policy is not None else None, selected=selected,
            policy_before=policy_before, save_latest=save_latest,
            bytes_per_rank=list(plan.bytes_per_rank), max_over_mean=plan.max_over_mean(),
            started=start, previous=self._previous)
        try:
            # Every rank's report carries rank 0's claim on the directory (commit.py).
            pending.claim = broadcast_outcome(
                lambda: claims.read_claim(self.prepare_save_dir(save_dir, tag, step)),
                f"MoC save to {tag_dir}")
            ok, payload = True, None
            try:
                staged = self._stage(rank, fragments, plan, rng_states, client_state)
            except Exception as e:  # reported to every rank below, never swallowed
                ok, payload = False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            raise_if_failed(all_outcomes(ok, payload), f"MoC save of {tag_dir}")
        except MoCCheckpointError:
            self._undo_mark_saved(pending.policy_before, pending.selected)
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

    def _undo_mark_saved(self, before: Optional[Dict], selected) -> None:
        """A failed save: its experts count as unsaved again, with every token routed to
        them since the previous save (tokens observed after it are kept, not lost)."""
        if self.policy is None or before is None:
            return
        state = self.policy.state_dict()
        for layer, expert in selected:
            state["unsaved_tokens"][layer][expert] += before["unsaved_tokens"][layer][expert]
        state["last_saved_step"] = before["last_saved_step"]
        state["checkpoints"] = before["checkpoints"]
        self.policy.load_state_dict(state)

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
                                             frag.expert))
        tree, object_tensors = None, {}
        if rank == 0:
            objects = self._objects(client_state)
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
        from deepspeed_ext.format import assemble, storage
        from deepspeed_ext.format.image import image_view
        from deepspeed_ext.format.objects import write_objects_file
        tag_dir = os.path.join(pending.save_dir, pending.tag)
        rank = pending.rank
        claim = pending.claim
        try:
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
            report = assemble.RankReport(rank, staged.file_name, record.nbytes, record.sha256, staged.specs)
            commit.write_report(tag_dir, rank, {
                "report": report.to_json(),
                "objects": objects_record.to_json() if objects_record is not None else None,
                "extra_files": extra_files}, claim=claim)
        except Exception as e:
            traceback.print_exc()
            pending.outcome = (False, f"{type(e).__name__}: {e}")
            try:  # lets the committer stop waiting at once
                commit.write_report(tag_dir, rank, None, error=pending.outcome[1], claim=claim)
            except Exception:
                pass
            return
        if rank == 0:
            try:
                shares = commit.wait_for_reports(tag_dir, pending.world, self.config.commit_timeout_s,
                                                 claim=claim)
                commit.commit_checkpoint(
                    pending.save_dir, pending.tag, pending.step, self._layout_record(pending.world, pending.zero_stage),
                    shares, extended_tag(pending.previous, pending.save_dir),
                    sorted(pending.selected) if pending.selected is not None else None,
                    pending.pec_k, pending.save_latest, self.config.keep, log=_log,
                    pec_scope=self.config.pec_scope, claim=claim,
                    attempt_started=self.attempt_started)
                commit.remove_reports(tag_dir, pending.world, claim)
            except Exception as e:
                traceback.print_exc()
                pending.outcome = (False, f"{type(e).__name__}: {e}")
                return
        pending.outcome = (True, None)

    def select_experts(self, save_dir: str):
        """Every rank, identically: the experts the next checkpoint into ``save_dir``
        holds (None: no MoE). The policy's choice, or every expert when no earlier
        checkpoint of this run is in ``save_dir`` for its index to extend (a run resumed
        from another directory, ``--load`` and ``--save`` differing): an expert index only
        names checkpoints of its own directory, and the committer would otherwise refuse
        every save ("saved in no checkpoint")."""
        if self.policy is None:
            return None
        if extended_tag(self._previous, save_dir) is None:
            if self._previous is not None and not self._warned_new_dir:
                self._warned_new_dir = True
                _log(f"first checkpoint into {save_dir}: it holds every expert (the run "
                     f"resumed from {self._previous[0]}, which its expert index cannot name)")
            return self.policy.layout.all_experts()
        return self.policy.select()

    def prepare_save_dir(self, save_dir: str, tag: str, step: int) -> str:
        """Rank 0 (the caller sends its outcome to every rank): create ``<save_dir>/<tag>``
        for a save of ``step``.

        Before this attempt's first save into ``save_dir``, checkpoints of ``step`` or
        later that an earlier attempt committed are set aside: the run resumed from an older
        checkpoint (a newer one was damaged, or ``latest`` named an older one), and this
        run's saves of those steps would otherwise collide with them
        (:func:`~deepspeed_ext.store.prepare.set_aside_checkpoints_after`). The checkpoint
        this run resumed from is never touched: the new expert indexes extend it.
        """
        resumed = extended_tag(self._previous, save_dir)
        if save_dir not in self._save_dirs_checked:
            moved = set_aside_checkpoints_after(save_dir, step, self.attempt_started, resumed)
            if moved:
                _log(f"WARNING: set aside checkpoint(s) {', '.join(moved)} of {save_dir}: steps "
                     f"from this run's {step} on, saved by an earlier attempt (an abandoned "
                     f"timeline); kept as .moc-set-aside.<tag>.* on a local disk")
            self._save_dirs_checked.add(save_dir)
        return prepare_checkpoint_dir(save_dir, tag, attempt_started=self.attempt_started,
                                      keep=resumed, log=_log)

    def _layout_record(self, world: int, zero_stage: int) -> Dict[str, int]:
        """The manifest's layout record."""
        return {"world_size": world,
                "ep_size": self.layout.ep_size if self.layout else 1,
                "zero_stage": zero_stage,
                "num_moe_layers": self.layout.num_moe_layers if self.layout else 0,
                "num_experts": self.layout.num_experts if self.layout else 0}

    def wait(self) -> None:
        """Finish the pending save, if any; all ranks call it.

        Joins this rank's writer thread, then one ``all_gather_object`` of every rank's
        outcome (rank 0's includes the commit). Called by :meth:`save` and :meth:`load`;
        call it at the end of training so that the last save's failure is raised.

        Raises:
            MoCCheckpointError: on every rank, when any rank failed to persist or rank 0
                failed to commit; the checkpoint then has no manifest.
        """
        if self.two_level is not None:
            return self.two_level.wait()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        ok, message = pending.outcome or (False, "writer thread ended without an outcome")
        try:
            raise_if_failed(all_outcomes(ok, message),
                             f"MoC save of {os.path.join(pending.save_dir, pending.tag)}")
        except MoCCheckpointError:
            self._undo_mark_saved(pending.policy_before, pending.selected)
            raise
        self._previous = (pending.save_dir, pending.tag)
        busiest = max(pending.bytes_per_rank)
        _log(f"saved {os.path.join(pending.save_dir, pending.tag)}: training waited "
             f"{pending.staged_s:.2f} s, committed {time.perf_counter() - pending.started:.2f} s "
             f"after the save began; {sum(pending.bytes_per_rank) / 2**20:.2f} MiB of tensors, "
             f"busiest rank {busiest / 2**20:.2f} MiB (max/mean {pending.max_over_mean:.2f})"
             + (f", {len(pending.selected)} expert(s) saved" if pending.selected is not None else ""))

    # -- load ---------------------------------------------------------------------

    def _choose(self, load_dir: str, tag: Optional[str], exclude: Dict[str, str]):
        """Rank 0: the tag to load (the newest valid one, not in ``exclude``, when ``tag``
        is None) and its resolution, or None. Checks the structure (files, sizes,
        fragments) only: the checksums are verified by each rank on the files it reads
        (:meth:`_load_storage`), in parallel, rather than here by one rank for the
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

    def load(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True,
             from_memory: bool = True) -> Tuple[Optional[str], Optional[Dict]]:
        """Load into this engine; all ranks call it.

        With two-level checkpointing, recovers from the keepers' memory when every rank
        holds the same step there (``from_memory=False`` forces storage); see
        :mod:`deepspeed_ext.two_level`. Otherwise, or then, from storage.
        """
        if self.two_level is None:
            self.wait()  # a save of the old timeline commits under its own attempt
        self._new_timeline()
        if self.two_level is not None:
            return self.two_level.load(load_dir, tag, load_optimizer_states,
                                       load_lr_scheduler_states, from_memory)
        self._last_load_source = "storage"
        return self._load_storage(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def _new_timeline(self) -> None:
        """A load starts a new timeline, in a new job or in this process (a library user
        or a benchmark reloading an older step): checkpoints saved before it count as an
        earlier attempt's. Otherwise ``latest`` stayed at this process's higher,
        abandoned step, and saving one of its tags again was refused as "a complete
        checkpoint" instead of setting it aside."""
        if self._timeline_used:  # the job's first load keeps the start it recorded
            self.attempt_started = max(time.time(), self.attempt_started + 1e-3)
            self._save_dirs_checked.clear()
        self._timeline_used = True

    def _load_storage(self, load_dir: str, tag: Optional[str] = None,
                      load_optimizer_states: bool = True,
                      load_lr_scheduler_states: bool = True) -> Tuple[Optional[str], Optional[Dict]]:
        """Load from storage into this engine, whatever layout saved it; all ranks call it.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no
            checkpoint.

        Raises:
            MoCCheckpointError: on every rank, when any rank failed (a corrupt file, a
                tensor this model does not have, ...).
        """
        self.wait()  # a save still being written must be committed (or failed) first
        start = time.perf_counter()
        described: List = []

        def fragments(moments=None):
            if not described:  # only once there is something to load into them:
                # creating the moments advances Adam's step counters; ``moments``: the
                # checkpoint's MomentPresence (None: an older checkpoint, every group's)
                if load_optimizer_states:
                    prepare_optimizer_state(self.engine, moments)
                described.append(describe_local_state(self.engine, self.naming,
                                                      with_moments=load_optimizer_states))
            return described[0]

        def restore(objects):
            self._restore_objects(objects, load_optimizer_states, load_lr_scheduler_states)

        unusable: Dict[str, str] = {}  # tag -> the damage some rank found while reading it
        while True:
            choice = self._broadcast_choice(load_dir, tag, unusable)
            if choice is None:
                _log(f"no MoC checkpoint in {load_dir}")
                return None, None
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
            objects, self.expert_versions_loaded = result
            break
        self.account_recovery(objects, self.expert_versions_loaded)
        refresh_compute_weights(self.engine)
        self._previous = (load_dir, chosen)
        self._piece_cache = None
        _log(f"loaded {os.path.join(load_dir, chosen)} (step {self.engine.global_steps}) "
             f"in {time.perf_counter() - start:.2f} s")
        return os.path.join(load_dir, chosen), objects["client_state"]

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
            ``(True, (objects, expert versions))``, or ``(False, (kind, message))`` with
            kind ``damaged`` for a file that failed its checks, else ``error``.
        """
        from deepspeed_ext.format.errors import CheckpointError
        from deepspeed_ext.store.reader import CheckpointReader, check_saved_shape
        try:
            # Rank 0 checked the structure while choosing; each rank checks the bytes it
            # reads, so no rank hashes (or opens) the whole checkpoint alone.
            with CheckpointReader(load_dir, chosen, verify_checksums=self.config.verify_on_load,
                                  check_structure=False, resolution=resolution) as reader, \
                    torch.no_grad():
                objects = reader.objects()  # first: which moments the fragments include
                for frag in fragments(MomentPresence.from_record(objects.get("optimizer_moments"))):
                    check_saved_shape(reader, frag, load_dir, chosen)
                    data = reader.read(frag.name, frag.kind, frag.offset, frag.length)
                    frag.tensor.copy_(data.to(device=frag.tensor.device, dtype=frag.tensor.dtype))
                versions = {k: v[0] for k, v in reader.expert_versions().items()}
            restore(objects)
            return True, (objects, versions)
        except CheckpointError as e:
            traceback.print_exc()
            return False, ("damaged", str(e))
        except Exception as e:  # reported to every rank by the caller
            traceback.print_exc()
            return False, ("error", f"{type(e).__name__}: {e}")

    def account_recovery(self, objects: Dict, versions: Dict[Tuple[int, int], int]) -> None:
        """After a load: restore the token ledger saved with it and record what the load
        lost (:attr:`last_recovery`), given the step of each expert version it took."""
        self.last_recovery = None
        if self.ledger is None:
            return
        saved = objects.get("token_ledger")
        if not saved:
            _log("the loaded checkpoint has no token ledger (saved by an older MoC): lost "
                 "tokens of this recovery are not known")
            return
        self.ledger.load_state_dict(saved)
        self.last_recovery = self.ledger.loss(int(objects["engine"]["global_steps"]), versions)

    def set_k(self, k: int) -> None:
        """Experts per MoE layer in each checkpoint from now on (dynamic K); every rank
        calls it with the same value."""
        if self.policy is not None:
            self.policy.k = k

    def _restore_objects(self, objects: Dict, load_optimizer_states: bool,
                         load_lr_scheduler_states: bool = True) -> None:
        engine = self.engine
        if (load_lr_scheduler_states and objects.get("lr_scheduler") is not None
                and getattr(engine, "lr_scheduler", None) is not None):
            engine.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        for key, value in objects["engine"].items():
            setattr(engine, key, value)
        if load_optimizer_states:
            set_optimizer_scalars(engine, objects["optimizer_scalars"])
            set_loss_scaler_state(engine, objects.get("loss_scaler"))
        if self.policy is not None and objects.get("pec_policy") is not None:
            k = self.policy.k
            saved = dict(objects["pec_policy"])
            # The bookkeeping (what was saved when, tokens since) is per global expert and
            # survives a change of expert-parallel size; only the rotation order follows
            # the new layout.
            saved["layout"] = dict(saved["layout"], ep_size=self.layout.ep_size)
            self.policy.load_state_dict(saved)
            self.policy.k = k  # the flag of this run wins over the saved K
        rng_states = objects.get("rng_states") or []
        self.rng_restored = len(rng_states) == dist.get_world_size()
        if self.rng_restored:
            set_rng_state(rng_states[dist.get_rank()])
        else:
            _log(f"RNG states saved by {len(rng_states)} ranks, loading on "
                 f"{dist.get_world_size()}: not restored")
