"""Exact recovery's window sizing: the automatic window ``W`` chosen from timed
iterations and what a frame's bytes cost, and the host-memory check of a window."""

import logging
import os
import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_ext.exact.config import PROBE_ITERATIONS, ExactConfig
from deepspeed_ext.exact.frames import EXACT_DIR
from deepspeed_ext.policy import window as win
from deepspeed_ext.runtime.groups import metadata_group
from deepspeed_ext.runtime.log import log_line

logger = logging.getLogger(__name__)


class WindowSizer:
    """Times the first iterations (the probe) and chooses ``W`` from them, the same on
    every rank; checks a window's bytes against ``--moc-host-memory-gb``.

    Args:
        cfg: the exact configuration.
        rank: this rank.
        index: the operator index (:class:`OperatorIndex`: ``local_operators``,
            ``fragments_by_op``, ``on_gpu``).
        memory: the node's memory level (:class:`NodeMemory`), where the probe frame is
            written; unused when :meth:`measure_frame_cost` is replaced.
        log: rank 0's lines about the job.
    """

    def __init__(self, cfg: ExactConfig, rank: int, index, memory, log: Callable[[str], None]):
        self.cfg, self.rank, self.index, self.memory, self.log = cfg, rank, index, memory, log
        self.probe: Optional[Tuple[int, float]] = None
        """``(first timed iteration, its start time)`` while the probe runs, else None."""
        self._probe_warm = False
        self.window_bytes = 0

    @property
    def measuring(self) -> bool:
        """Whether the automatic window is still being measured."""
        return self.probe is not None

    def start_probe(self, iteration: int) -> None:
        """Every rank, before the loop: start timing from ``iteration``."""
        self.probe = (iteration, time.perf_counter())

    def probe_done(self, iteration: int) -> bool:
        """Every rank, at each frame while :attr:`measuring`: whether enough iterations
        are timed to :meth:`choose_window` at ``iteration``."""
        first, _ = self.probe
        if not self._probe_warm:
            # The first iteration warms up (allocations, first collectives) and would
            # make the iteration look slower than it is: time the next ones.
            self.probe, self._probe_warm = (iteration, time.perf_counter()), True
            return False
        return iteration >= first + PROBE_ITERATIONS

    def check_memory(self, schedule: win.Schedule) -> None:
        """Every rank, when a grid starts: report the largest frame and a window's bytes
        on the busiest rank (a replay holds a whole window), and refuse a smaller
        ``--moc-host-memory-gb`` on every rank alike (one all_reduce)."""
        by_name = {op.name: op for op in self.index.local_operators()}
        figures = torch.tensor([win.max_bytes_per_iteration(schedule, by_name),
                                win.window_host_bytes(schedule, by_name)],
                               dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=metadata_group())
        frame, window = (int(x) for x in figures.tolist())
        self.window_bytes = window
        self.log(f"[moc] exact recovery: W = {schedule.window}; per rank at most "
                 f"{frame / 2**20:.2f} MiB per frame, {window / 2**20:.2f} MiB per window "
                 f"(held in host memory while a replay runs)")
        budget = self.cfg.host_memory_gb * 2**30
        if budget and window > budget:
            raise MemoryError(f"--moc-host-memory-gb {self.cfg.host_memory_gb:g} is below the "
                              f"{window / 2**30:.3f} GiB one rank needs to replay a window of "
                              f"{schedule.window} frames; raise it or lower --moc-window")

    def choose_window(self, iteration: int) -> int:
        """Every rank, after :data:`PROBE_ITERATIONS` timed iterations (one all_reduce):
        W from their time and what a frame's bytes cost on their way (copy, write to
        memory, the keeper's copy to storage), the same on every rank (the slowest rank's
        figures). Ends the probe.

        Raises:
            RuntimeError: on every rank, when any rank could not write its probe frame.
        """
        first, began = self.probe
        iter_s = (time.perf_counter() - began) / max(1, iteration - first)
        try:
            seconds_per_byte, failed = self.measure_frame_cost(), None
        except Exception as e:  # the probe frame could not be written (its memory full)
            seconds_per_byte, failed = None, f"{type(e).__name__}: {e}"
            log_line(logger, f"[moc] rank {self.rank}: ERROR: cannot write a probe frame "
                             f"({failed})")
        # The background work hides behind compute only where it runs elsewhere (a GPU
        # computes while the host copies); on CPU it takes the training's own cores,
        # so a frame may cost at most a tenth of an iteration.
        fraction = self.cfg.hide_fraction or (1.0 if self.index.on_gpu() else 0.1)
        mine = [1.0, iter_s, 0.0, 1.0]  # a failed probe: only its flag counts
        if failed is None:
            mine = self._rank_choice(seconds_per_byte, iter_s, iter_s * fraction)
        figures = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=metadata_group())
        if figures[3]:  # on every rank: one rank raising alone would hang the others
            raise RuntimeError("exact recovery: a rank could not write a probe frame where its "
                               "frames go (its node's --moc-shm-dir memory, or --save without "
                               "a keeper); see that rank's ERROR line")
        window, iter_s, snapshot_s = int(figures[0]), float(figures[1]), float(figures[2])
        fits = snapshot_s <= iter_s * fraction
        mtbf = self.cfg.expected_mtbf_s
        why = (f"least time lost to frames and to replays at a failure every {mtbf:g} s"
               if mtbf else f"budget {fraction:g} of an iteration"
               + ("" if fits else ": no window fits, expect a slowdown"))
        self.log(f"[moc] exact recovery: window W = {window} (iteration {iter_s * 1e3:.0f} ms, "
                 f"largest frame {snapshot_s * 1e3:.1f} ms to copy and write; {why})")
        self.probe = None
        return window

    def _rank_choice(self, seconds_per_byte: float, iter_s: float, budget_s: float):
        """This rank's figures ``[W, iteration s, largest frame s, failed]``. The schedule
        must be the same everywhere, but what a rank copies is its own share: choose on
        this rank's bytes, then take the largest W any rank needs."""
        mtbf = self.cfg.expected_mtbf_s
        ops, bandwidth = self.index.local_operators(), 1.0 / seconds_per_byte
        if mtbf:
            hidden_s = iter_s if self.index.on_gpu() else 0.0
            choice = win.choose_window_for_failures(ops, bandwidth, iter_s, hidden_s, mtbf)
        else:
            choice = win.choose_window(ops, bandwidth, budget_s)
        return [choice.window, iter_s, choice.snapshot_s, 0.0]

    def measure_frame_cost(self) -> float:
        """Seconds per byte of this rank's state: a copy into host memory, plus writing
        it where frames go (memory), plus the keeper's copy to storage when there is one."""
        from deepspeed_ext.format.storage import write_fragment_file
        frags = [f for fs in self.index.fragments_by_op().values() for f in fs]
        nbytes = max(1, sum(f.tensor.numel() * f.tensor.element_size() for f in frags))
        if self.index.on_gpu():
            # The step's kernels may still be queued: the first copy would wait for them,
            # and the copy would look slower than it is.
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        copies = self._copy_to_host(frags)
        copy_s = time.perf_counter() - t0
        root = self.memory.frame_root()
        probe = os.path.join(root, EXACT_DIR, f"probe{self.rank:05d}.safetensors")
        self.memory.make_frame_parent(os.path.dirname(probe), in_memory=root != self.memory.save_dir)
        t0 = time.perf_counter()
        try:
            write_fragment_file(probe, copies, make_parent=False)
        finally:
            write_s = time.perf_counter() - t0
            try:
                os.remove(probe)
            except FileNotFoundError:
                pass
        writes = 2 if root != self.memory.save_dir else 1  # the keeper writes it once more
        return max(copy_s + writes * write_s, 1e-9) / nbytes

    def _copy_to_host(self, frags):
        """The probe's copy of ``frags`` into host memory, as a frame's is."""
        with torch.no_grad():
            if not self.index.on_gpu():
                return {f.key: f.tensor.detach().to("cpu", copy=True) for f in frags}
            # As real frames are copied (FrameWriter.copy_from_gpu): into page-locked
            # memory. A pageable .to("cpu") is several times slower, and the window was
            # sized for that bandwidth.
            copies = {}
            for f in frags:
                host = torch.empty(f.tensor.shape, dtype=f.tensor.dtype, pin_memory=True)
                copies[f.key] = host.copy_(f.tensor.detach(), non_blocking=True)
            torch.cuda.synchronize()
            return copies
