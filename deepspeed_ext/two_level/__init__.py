"""Two-level checkpointing: snapshots into the keeper's memory, persistence in the background.

Switched on by ``MoCConfig.two_level``; :class:`deepspeed_ext.checkpointer.MoCCheckpointer`
then routes ``save``/``load``/``wait`` to :class:`~deepspeed_ext.two_level.mode.TwoLevel`.
Every rank calls them, in the same order.

``save`` (a snapshot), per rank:

1. waits for the previous snapshot's copy (normally finished long before: the wrapped
   ``engine.step`` waits for it, and for nothing else, before the optimizer touches the
   tensors);
2. only if this snapshot is due for storage (every ``persist_interval``-th): one small
   collective (:class:`deepspeed_ext.runtime.exchange.Exchanger`) of (copy errors, rank 0's view
   of the previous persist, every rank's RNG state). A failed copy is raised on every
   rank; a persist still running defers this one (training never waits for storage); a
   failed persist is logged and its experts count as unsaved again. Snapshots not due
   for storage run no collective at all: they keep only their own rank's RNG state, and
   a copy error surfaces at the next due snapshot or ``wait``;
3. picks the experts: ``k_snapshot`` per MoE layer for memory (sequential rotation),
   plus, when persisting, the PEC policy's ``pec_k`` for storage (always also in the
   snapshot);
4. copies every fragment this rank needs to restore itself into a free slot (one not
   being sealed; every slot was prepared at start-up, :mod:`deepspeed_ext.snapshot`) by
   a cached copy plan (on CUDA queued on a side stream, :mod:`deepspeed_ext.engine.hostcopy`;
   on CPU on a copy thread). Then a seal thread, off the step's path
   (:mod:`~deepspeed_ext.two_level.stages`), checksums the image, marks the slot complete
   and hands it to the keeper for persistence (:func:`deepspeed_ext.keeper.run_persist_job`),
   which commits through report files (:mod:`deepspeed_ext.store.commit`), no collective.

``wait`` (every rank): joins the copies and seals, waits for the pending persist, and persists the
newest snapshot if it was not (gathering the RNG states it lacks), so that the end of a
job never frees state that storage does not have.

``load``: ranks agree (one ``all_gather`` of a small fixed-size buffer) on the newest
step every rank holds complete in memory with this layout, and restore from memory
(one more such ``all_gather`` makes any rank's failure everyone's); experts not in that
snapshot come from the newest version among older slots and storage. Otherwise they
load from storage, and ranks whose memory survived then take their experts' newer
snapshots from memory (two-level recovery). Every load logs where pieces came from.

The package's modules, one collaborator each:

* :mod:`~deepspeed_ext.two_level.mode`: :class:`TwoLevel`, the backend that puts them together;
* :mod:`~deepspeed_ext.two_level.records`: plain records (this rank's place, the newest
  snapshot, the pending persist, a snapshot's plan);
* :mod:`~deepspeed_ext.two_level.budget`: the node's home, the memory budget, the keeper's start;
* :mod:`~deepspeed_ext.two_level.layouts`: fragments, specs and image layouts, cached;
* :mod:`~deepspeed_ext.two_level.snapshotter`: snapshots into the slots (``save``);
* :mod:`~deepspeed_ext.two_level.stages`: a snapshot's copy and seal, on their threads;
* :mod:`~deepspeed_ext.two_level.persister`: persists, their directory, outcome and wait;
* :mod:`~deepspeed_ext.two_level.handover`: jobs to the keeper, in-process persists, drain;
* :mod:`~deepspeed_ext.two_level.recovery`: ``load`` from memory or storage, the overlay;
* :mod:`~deepspeed_ext.two_level.memory_images`, :mod:`~deepspeed_ext.two_level.peer_rebuild`,
  :mod:`~deepspeed_ext.two_level.storage_versions`: what a recovery reads.
"""

from deepspeed_ext.two_level.budget import default_shm_dir, short_nodes
from deepspeed_ext.two_level.mode import TwoLevel
from deepspeed_ext.two_level.records import NewestSnapshot, PendingPersist

__all__ = ["NewestSnapshot", "PendingPersist", "TwoLevel", "default_shm_dir", "short_nodes"]
