"""Exact recovery's memory level: this rank's link to its node's shared-memory directory
and keeper, which keeps frames across a crash of the training process and copies them
to storage."""

import logging
import os
import shutil
from typing import Callable, List, Optional

import torch.distributed as dist

from deepspeed_ext.exact.config import UNCOPIED_WINDOWS, ExactConfig
from deepspeed_ext.exact.frames import data_path, frame_dir, frame_job, list_frames, marker_path
import deepspeed_ext.keeper as keeper
from deepspeed_ext.format.storage import ensure_dir
import deepspeed_ext.keeper.persist as persist
from deepspeed_ext.private_dir import make_private_dir
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import log_line

logger = logging.getLogger(__name__)


class NodeMemory:
    """Where this rank's frames go first: its node's memory directory (``node_dir``,
    None without a memory level) while the keeper answers, else storage (``save_dir``).

    Args:
        rank: this rank.
        save_dir: the job's ``--save``.
        log: rank 0's lines about the job.
    """

    def __init__(self, rank: int, save_dir: str, log: Callable[[str], None]):
        self.rank, self.save_dir, self.log = rank, save_dir, log
        self.node_dir: Optional[str] = None
        self.node: Optional[int] = None
        self.first_of_node = False
        self.keeper_error: Optional[str] = None
        self.run_id: Optional[str] = None
        """This job's identity (:mod:`deepspeed_ext.job_identity`), with a memory level."""
        self._uncopied_warned = False

    def attach(self, cfg: ExactConfig, world: int) -> None:
        """Every rank: attach to (or start) this node's keeper. Without one, frames go
        straight to storage, which the log says once; but a node directory that is not
        private or serves another job is refused on every rank (one collective), before
        training, naming ``--moc-shm-dir``."""
        from deepspeed_ext.job_identity import ForeignJobError, agree_run_id
        from deepspeed_ext.private_dir import UnsafeDirectoryError
        self.run_id = agree_run_id(self.save_dir, cfg.memory_dir, log=self.log)
        from deepspeed_ext.node_layout import first_of_node, node_of, ranks_per_node
        per_node = ranks_per_node(cfg.ranks_per_node, world)
        self.node = node_of(self.rank, per_node)
        self.first_of_node = first_of_node(self.rank, per_node)
        self.node_dir = keeper.node_directory(cfg.memory_dir, self.node)
        refused = None
        try:
            keeper.ensure_keeper(self.node_dir, cfg.keeper_idle_timeout_s,
                                 run_id=self.run_id, save_dir=self.save_dir)
        except (UnsafeDirectoryError, ForeignJobError) as e:
            refused = f"rank {self.rank}: {e}"
        except Exception as e:
            self.lost(e)
        problems: List = [None] * world
        dist.all_gather_object(problems, refused, group=metadata_group())
        problems = [p for p in problems if p]
        if problems:
            raise RuntimeError("exact recovery's shared memory: " + "; ".join(problems))

    def lost(self, error: Exception) -> None:
        """This rank's keeper did not answer (``error``): later frames go straight to
        storage; said once, by this rank."""
        if self.keeper_error is None:
            log_line(logger, f"[moc] rank {self.rank}: WARNING: no keeper for {self.node_dir} "
                             f"({type(error).__name__}: {error}); exact-recovery frames go "
                             f"straight to storage")
        self.keeper_error = f"{type(error).__name__}: {error}"

    def frame_root(self) -> str:
        """Where this rank's next frame goes: the node's memory while it has a keeper,
        else storage."""
        return self.save_dir if self.keeper_error or not self.node_dir else self.node_dir

    def drop(self) -> None:
        """Fault injection: this node loses its frames, as when the machine dies. Kills
        the node's keeper and deletes its shared memory; any rank of the node may call
        it, the node's other ranks are expected to die with it."""
        import signal
        if not self.node_dir:
            return
        try:
            os.kill(keeper.request(self.node_dir, {"op": "ping"})["pid"], signal.SIGKILL)
        except Exception as e:  # already gone: its memory is what matters
            self.log(f"[moc] node {self.node}: keeper not reachable ({e})")
        shutil.rmtree(self.node_dir, ignore_errors=True)

    def make_frame_parent(self, directory: str, in_memory: bool) -> None:
        """Create a frame's (or the probe's) directory. In the node's memory it is 0700
        like the rest of it (the restart refuses memory others may read), and the files
        are then written with ``make_parent=False``: a write after a wipe (lose-memory)
        fails instead of recreating the directory with the umask's mode."""
        if in_memory:
            make_private_dir(directory, root=self.node_dir)
        else:
            ensure_dir(directory)

    def hand_over(self, frame: int) -> None:
        """Frame writer's thread: queue frame ``frame``'s copy to storage with the node's
        keeper; a keeper that does not answer is given up (later frames go straight to
        storage) and this one is copied here."""
        job = frame_job(self.node_dir, self.save_dir, frame, self.rank, self.run_id,
                        keeper.job_id(f"frame{frame}", self.rank))
        why: Exception = keeper.KeeperError(f"it did not take the copy of frame {frame}")
        try:
            # A frame copied twice is the same bytes written atomically twice: a keeper
            # silent for 20 s is given up and the frame copied here (no slot is reused).
            handed = keeper.hand_over(self.node_dir, job.to_json(), patience_s=20.0)
        except Exception as e:  # no socket, or silent: the same as a dead keeper
            handed, why = False, e
        if not handed:
            self.lost(why)
            keeper.persist_frame(job)

    def retire(self, window_start: int, window: int) -> None:
        """Frame writer's thread: this rank's memory frames older than the previous
        window, once the keeper has copied them to storage: memory holds the window being
        written and the one before (complete unless a rank failed it; storage keeps the
        newest complete one anyway), and older frames still waiting for the keeper, up to
        :data:`UNCOPIED_WINDOWS` windows back (deleting them first would leave storage
        without them for ever)."""
        for f in list_frames(self.node_dir):
            if f >= window_start - window:
                continue
            if not os.path.exists(persist.copied_marker(marker_path(self.node_dir, f, self.rank))):
                if f >= window_start - UNCOPIED_WINDOWS * window:
                    continue
                if not self._uncopied_warned:
                    self._uncopied_warned = True
                    log_line(logger, f"[moc] rank {self.rank}: WARNING: frame {f} is still not "
                                     f"on storage {UNCOPIED_WINDOWS} windows later; dropping "
                                     f"its memory copy (frames come faster than the node's "
                                     f"keeper writes them: a larger --moc-window, or faster "
                                     f"storage)")
            self.remove_own_frame(f)

    def remove_own_frame(self, frame: int) -> None:
        """This rank's files of ``frame`` in the node's memory, the marker first (a frame
        without it does not count); the directory once the node's last rank is done."""
        marker = marker_path(self.node_dir, frame, self.rank)
        for path in (marker, data_path(self.node_dir, frame, self.rank), persist.copied_marker(marker)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(frame_dir(self.node_dir, frame))
        except OSError:
            pass

    def shutdown(self, memory_dir: str) -> None:
        """Every rank together, at the end of training (two barriers): the node's first
        rank has its keeper copy what it was given and delete the node's memory, then
        rank 0 removes the job's ``memory_dir`` if empty: a finished run leaves no shared
        memory behind."""
        dist.barrier(group=metadata_group())
        if self.first_of_node:
            keeper.shutdown_keeper(self.node_dir, run_id=self.run_id)
        dist.barrier(group=metadata_group())
        if self.rank == 0:
            try:
                os.rmdir(memory_dir)
            except OSError:
                pass
