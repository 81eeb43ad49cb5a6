"""What a checkpointer's backends share: one engine's policy state and bookkeeping.

:class:`CheckpointSession` is created by :class:`deepspeed_ext.checkpointer.MoCCheckpointer`
on every rank and handed to its backend (single-level saves,
:mod:`deepspeed_ext.single_level`, or two-level snapshots, :mod:`deepspeed_ext.two_level`)
and to the storage load (:mod:`deepspeed_ext.storage_load`). It holds the PEC policy and
its marks, the checkpoint the state descends from (:attr:`CheckpointSession.previous`),
the non-tensor objects a checkpoint saves and restores, the gathered write-plan pieces,
the lost-token accounting of a load, and the attempt's timeline
(:class:`AttemptTimeline`).

Every method that changes the policy state is called by every rank with the same
arguments, in the same order: the policy state must stay identical on every rank.
"""

import logging
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.engine.rng import common_state, set_rng_state
from deepspeed_ext.engine.stages import STAGE_NAMING_ATTR, pipeline_place
from deepspeed_ext.format.vocab import OBJECTS_KEY
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import rank_zero_lines
from deepspeed_ext.state import (ExpertNaming, LocalFragment, expert_naming, loss_scaler_state,
                                 moment_presence, optimizer_scalars, set_loss_scaler_state,
                                 set_optimizer_scalars)
from deepspeed_ext.store.latest import extended_tag
from deepspeed_ext.store.prepare import prepare_checkpoint_dir, set_aside_checkpoints_after

logger = logging.getLogger(__name__)
_log = rank_zero_lines(logger)
"""Rank 0's ``[moc] ...`` lines about the job (the package's logger: runtime.log)."""


class AttemptTimeline:
    """When this attempt of the job started, and the save directories it checked.

    Rank 0's start is what its committers record: a committer of an earlier attempt never
    moves ``latest`` over this one's work.
    """

    def __init__(self):
        self.attempt_started = time.time()
        """When this attempt (or this process's newest timeline) started."""
        self.used = False
        """Whether a save or load happened in this process."""
        self.save_dirs_checked: set = set()
        """Save directories whose first-save check (:meth:`prepare_save_dir`) is done."""

    def mark_used(self) -> None:
        """Every rank, at the start of a save."""
        self.used = True

    def new_timeline(self) -> None:
        """Every rank, at the start of a load: a load starts a new timeline, in a new job or
        in this process (a library user or a benchmark reloading an older step):
        checkpoints saved before it count as an earlier attempt's. Otherwise ``latest``
        stayed at this process's higher, abandoned step, and saving one of its tags again
        was refused as "a complete checkpoint" instead of setting it aside."""
        if self.used:  # the job's first load keeps the start it recorded
            self.attempt_started = max(time.time(), self.attempt_started + 1e-3)
            self.save_dirs_checked.clear()
        self.used = True

    def prepare_save_dir(self, save_dir: str, tag: str, step: int,
                         resumed: Optional[str]) -> str:
        """Rank 0: see :meth:`CheckpointSession.prepare_save_dir`; ``resumed`` is the tag
        in ``save_dir`` the run resumed from (never set aside)."""
        if save_dir not in self.save_dirs_checked:
            moved = set_aside_checkpoints_after(save_dir, step, self.attempt_started, resumed)
            if moved:
                _log(f"WARNING: set aside checkpoint(s) {', '.join(moved)} of {save_dir}: steps "
                     f"from this run's {step} on, saved by an earlier attempt (an abandoned "
                     f"timeline); kept as .moc-set-aside.<tag>.* on a local disk")
            self.save_dirs_checked.add(save_dir)
        return prepare_checkpoint_dir(save_dir, tag, attempt_started=self.attempt_started,
                                      keep=resumed, log=_log)


class CheckpointSession:
    """One engine's checkpointing state shared by the facade and its backends. Create on
    every rank (the checkpointer does)."""

    def __init__(self, engine, config: Optional[MoCConfig] = None):
        from deepspeed_ext.policy.pec import ExpertLayout, make_policy
        from deepspeed_ext.policy.plt import TokenLedger
        self.engine = engine
        self.config = config or MoCConfig()
        self.naming: ExpertNaming = expert_naming(engine.module)
        if pipeline_place(engine) is not None and self.naming.stage is None:
            raise ValueError(
                f"MoC checkpoints of a pipeline need the whole model's names: set "
                f"module.{STAGE_NAMING_ATTR} to a deepspeed_ext.engine.stages.StageNaming "
                "on the PipelineModule given to deepspeed.initialize")
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
            ep_size = num_experts // _num_local_experts(engine)
            self.layout = ExpertLayout(self.naming.num_moe_layers, num_experts, ep_size)
            k = self.config.pec_k or num_experts
            self.policy = make_policy(self.config.pec_policy, self.layout, min(k, num_experts))
            self.ledger = TokenLedger(self.layout.num_moe_layers, num_experts)
        self._piece_cache: Optional[Tuple[tuple, list, list]] = None
        self.previous: Optional[Tuple[str, str]] = None
        """(save_dir, tag) of the checkpoint the current state descends from: set by a
        committed save, a load, or a settled persist (every rank the same)."""
        self._warned_new_dir = False
        self.timeline = AttemptTimeline()
        self.expert_versions_loaded: Dict[Tuple[int, int], int] = {}
        """Step of each expert's version the last storage load gave."""
        self.rng_restored = False
        """Whether the last load set this rank's RNG state from the checkpoint."""

    # -- token accounting (load-aware PEC) ---------------------------------------

    def observe_tokens(self, counts) -> None:
        """Feed one iteration's gate counts, summed over all ranks, ``[moe_layers][experts]``.

        Every rank calls it with the same counts (the policy state must stay identical).
        """
        if self.policy is not None:
            self.policy.observe_tokens(counts)
        if self.ledger is not None:
            self.ledger.observe(counts)

    def set_k(self, k: int) -> None:
        """Experts per MoE layer in each checkpoint from now on (dynamic K); every rank
        calls it with the same value."""
        if self.policy is not None:
            self.policy.k = k

    # -- what a save writes -------------------------------------------------------------

    def gather_pieces(self, fragments: List[LocalFragment]):
        """Every rank: the write-plan pieces of the whole world (one ``all_gather_object``
        of the fragment metadata, then cached while the layout holds)."""
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

    def forget_pieces(self) -> None:
        """Every rank, after a load: the next save gathers the pieces again."""
        self._piece_cache = None

    def objects(self, client_state) -> Dict:
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
                "token_ledger": self.ledger.state_dict() if self.ledger is not None else None,
                # which rows hold tokens: a load under another padding keeps those only
                OBJECTS_KEY: (self.config.padded_vocab.to_record()
                              if self.config.padded_vocab is not None else None)}

    def layout_record(self, world: int, zero_stage: int) -> Dict[str, int]:
        """The manifest's layout record."""
        return {"world_size": world,
                "ep_size": self.layout.ep_size if self.layout else 1,
                "zero_stage": zero_stage,
                "num_moe_layers": self.layout.num_moe_layers if self.layout else 0,
                "num_experts": self.layout.num_experts if self.layout else 0}

    def select_experts(self, save_dir: str):
        """Every rank, identically: the experts the next checkpoint into ``save_dir``
        holds (None: no MoE). The policy's choice, or every expert when no earlier
        checkpoint of this run is in ``save_dir`` for its index to extend (a run resumed
        from another directory, ``--load`` and ``--save`` differing): an expert index only
        names checkpoints of its own directory, and the committer would otherwise refuse
        every save ("saved in no checkpoint")."""
        if self.policy is None:
            return None
        if extended_tag(self.previous, save_dir) is None:
            if self.previous is not None and not self._warned_new_dir:
                self._warned_new_dir = True
                _log(f"first checkpoint into {save_dir}: it holds every expert (the run "
                     f"resumed from {self.previous[0]}, which its expert index cannot name)")
            return self.policy.layout.all_experts()
        return self.policy.select()

    def undo_mark_saved(self, before: Optional[Dict], selected) -> None:
        """Every rank, after a failed save or persist: its experts count as unsaved again,
        with every token routed to them since the previous save (tokens observed after
        it are kept, not lost)."""
        if self.policy is None or before is None:
            return
        state = self.policy.state_dict()
        for layer, expert in selected:
            state["unsaved_tokens"][layer][expert] += before["unsaved_tokens"][layer][expert]
        state["last_saved_step"] = before["last_saved_step"]
        state["checkpoints"] = before["checkpoints"]
        self.policy.load_state_dict(state)

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
        return self.timeline.prepare_save_dir(save_dir, tag, step,
                                              extended_tag(self.previous, save_dir))

    # -- what a load restores -----------------------------------------------------------

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

    def restore_objects(self, objects: Dict, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool = True) -> None:
        """This rank, before a load's outcome exchange: put the saved non-tensor state
        back into the engine and the policy, and this rank's RNG state."""
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
            return
        # Another number of ranks (a reshard): when every saved rank drew the same stream,
        # each rank here continues it, as a run that was never resharded would.
        common = common_state(rng_states)
        self.rng_restored = common is not None
        if common is not None:
            set_rng_state(common)
            _log(f"RNG states saved by {len(rng_states)} ranks are all equal: restored on "
                 f"each of the {dist.get_world_size()} ranks")
        else:
            _log(f"RNG states saved by {len(rng_states)} ranks, loading on "
                 f"{dist.get_world_size()}: not restored (they differ)")


def _num_local_experts(engine) -> int:
    from deepspeed.moe.layer import MoE
    for module in engine.module.modules():
        if isinstance(module, MoE):
            return module.num_local_experts
    raise ValueError("no MoE layer")
