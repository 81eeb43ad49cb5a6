"""MoC's save and load for a DeepSpeed engine: fully sharded, PEC, reshardable.

:class:`MoCCheckpointer` is the facade ``engine.moc`` is (``patch.enable_moc_checkpointing``
creates it on every rank). It holds the state both kinds of checkpointing share, a
:class:`deepspeed_ext.session.CheckpointSession` (policy, ledger, the checkpoint the
state descends from, the attempt's timeline), and hands ``save``, ``wait``, ``load`` and
``shutdown`` to one backend, picked once from the config:

* single-level (:class:`deepspeed_ext.single_level.SingleLevel`): each save is staged
  into a host buffer and written and committed by a background thread;
* two-level (:class:`deepspeed_ext.two_level.TwoLevel`, ``MoCConfig.two_level``):
  snapshots into the node keeper's shared memory, persisted in the background, and
  recovery from memory, the peers, or storage.

Both load from storage through :class:`deepspeed_ext.storage_load.StorageLoad`. Every
rank calls every method below in the same order; each backend's module describes its
collectives.
"""

from typing import Dict, List, Optional, Tuple

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.runtime.groups import init_metadata_group
from deepspeed_ext.runtime.outcomes import MoCCheckpointError  # noqa: F401 (the trainer imports it here)
from deepspeed_ext.session import CheckpointSession
from deepspeed_ext.single_level import SingleLevel
from deepspeed_ext.state import ExpertNaming
from deepspeed_ext.storage_load import StorageLoad


class MoCCheckpointer:
    """Saves and loads one engine's state in MoC's format. Create on every rank."""

    def __init__(self, engine, config: Optional[MoCConfig] = None):
        init_metadata_group()  # every rank, here: the group of all of MoC's collectives
        self.engine = engine
        self.config = config or MoCConfig()
        self.session = CheckpointSession(engine, self.config)
        """What the backends share (policy marks, previous checkpoint, timeline, ...)."""
        storage = StorageLoad(self.session)
        self.two_level = None
        """The two-level backend (None: single-level); the trainer reaches its fault
        hooks and slots through it."""
        if self.config.two_level:
            from deepspeed_ext.two_level.mode import TwoLevel
            self.two_level = TwoLevel(self.session, storage)
            self.backend = self.two_level
        else:
            self.backend = SingleLevel(self.session, storage)

    # -- the session's state, as engine.moc shows it ---------------------------------

    @property
    def naming(self) -> ExpertNaming:
        """How this model names its experts' parameters."""
        return self.session.naming

    @property
    def layout(self):
        """The expert layout (:class:`deepspeed_ext.policy.pec.ExpertLayout`; None: no MoE)."""
        return self.session.layout

    @property
    def policy(self):
        """The PEC policy (None: no MoE layer)."""
        return self.session.policy

    @property
    def ledger(self):
        """Token assignments per expert and at its saved versions (lost-token accounting)."""
        return self.session.ledger

    @property
    def last_recovery(self):
        """:class:`deepspeed_ext.policy.plt.RecoveryLoss` of the last load (None: none, or a
        checkpoint written before the ledger existed)."""
        return self.session.last_recovery

    @property
    def expert_versions_loaded(self) -> Dict[Tuple[int, int], int]:
        """Step of each expert's version the last storage load gave."""
        return self.session.expert_versions_loaded

    @property
    def rng_restored(self) -> bool:
        """Whether the last load set this rank's RNG state from the checkpoint."""
        return self.session.rng_restored

    @property
    def attempt_started(self) -> float:
        """When this attempt of the job started (rank 0's is what its committers record):
        a committer of an earlier attempt never moves ``latest`` over this one's work."""
        return self.session.timeline.attempt_started

    @property
    def last_load_source(self) -> Optional[str]:
        """Where the last load came from: ``memory``, ``storage`` or ``storage+memory``."""
        return self.backend.last_load_source

    @property
    def stall_s(self) -> List[float]:
        """Seconds ``engine.step`` waited for each snapshot copy (two-level only)."""
        return self.backend.stall_s

    def host_memory_bytes(self) -> int:
        """Shared-memory bytes of this rank's snapshot slots (two-level), or its save buffer."""
        return self.backend.host_memory_bytes()

    def mark_exact_replay(self, where: str) -> None:
        """The job resumed through exact recovery's replay (``deepspeed_ext.exact``) of
        frames read from ``where`` (memory, storage), not a load of ours: nothing was
        lost, and no token ledger applies."""
        self.backend.note_exact_replay(where)
        self.session.last_recovery = None

    def shutdown(self) -> None:
        """End of training, every rank: wait for the last save; stop the node's keeper and
        free its shared memory (two-level)."""
        self.backend.shutdown()

    def abandon(self) -> None:
        """This rank alone, after its run failed and before the same process trains again
        (an in-job restart): the backend's threads stop without a collective; the keeper
        and the snapshots in its memory stay for the next round's recovery."""
        abandon = getattr(self.backend, "abandon", None)
        if abandon is not None:
            abandon()

    # -- policy -------------------------------------------------------------------

    def observe_tokens(self, counts) -> None:
        """Feed one iteration's gate counts, summed over all ranks, ``[moe_layers][experts]``.

        Every rank calls it with the same counts (the policy state must stay identical).
        """
        self.session.observe_tokens(counts)

    def set_k(self, k: int) -> None:
        """Experts per MoE layer in each checkpoint from now on (dynamic K); every rank
        calls it with the same value."""
        self.session.set_k(k)

    def select_experts(self, save_dir: str):
        """Every rank, identically: the experts the next checkpoint into ``save_dir``
        holds (None: no MoE); see :meth:`CheckpointSession.select_experts`."""
        return self.session.select_experts(save_dir)

    def prepare_save_dir(self, save_dir: str, tag: str, step: int) -> str:
        """Rank 0: create ``<save_dir>/<tag>`` for a save of ``step``; see
        :meth:`CheckpointSession.prepare_save_dir`."""
        return self.session.prepare_save_dir(save_dir, tag, step)

    def account_recovery(self, objects: Dict, versions: Dict[Tuple[int, int], int]) -> None:
        """After a load: restore the token ledger saved with it and record what the load
        lost (:attr:`last_recovery`), given the step of each expert version it took."""
        self.session.account_recovery(objects, versions)

    # -- save, wait, load ---------------------------------------------------------------

    def save(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict] = None,
             save_latest: bool = True) -> bool:
        """Save a checkpoint; all ranks call it. Returns True (DeepSpeed's contract).

        Single-level: stages this rank's share into a reused host buffer and returns; the
        buffer is written, fsynced and committed by a background thread
        (:mod:`deepspeed_ext.single_level`). With ``MoCConfig.async_save`` off, waits
        for the commit. The previous save is always waited for first (:meth:`wait`).
        Two-level: a snapshot into shared memory (:mod:`deepspeed_ext.two_level`).

        Raises:
            MoCCheckpointError: on every rank, when any rank failed to stage this save or
                to persist the previous one; ``latest`` then names the last committed
                checkpoint.
        """
        self.session.timeline.mark_used()
        return self.backend.save(save_dir, tag, client_state, save_latest)

    def wait(self) -> None:
        """Finish the pending save, if any; all ranks call it.

        Called by :meth:`save` and :meth:`load`; call it at the end of training so that
        the last save's failure is raised.

        Raises:
            MoCCheckpointError: on every rank, when any rank failed to persist or rank 0
                failed to commit; the checkpoint then has no manifest.
        """
        self.backend.wait()

    def load(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True,
             from_memory: bool = True) -> Tuple[Optional[str], Optional[Dict]]:
        """Load into this engine; all ranks call it.

        With two-level checkpointing, recovers from the keepers' memory when every rank
        holds the same step there (``from_memory=False`` forces storage); see
        :mod:`deepspeed_ext.two_level`. Otherwise, or then, from storage.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when there is nothing to load.
        """
        return self.backend.load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                 from_memory)
