"""``--moc-monitor`` in the training loop: the start-up watch and, per iteration, this
rank's heartbeat, its hang/straggler watchdog thread and the collective clock
(:mod:`megatron.training.monitor` holds the parts; this module wires them to a run).

Every rank: :func:`startup_watch` first thing in a run, stopped when the loop begins;
one :class:`LoopWatch` for the loop, stopped before the final save. Both are no-ops
without the flag.
"""

import argparse
import os
import threading
import time

import torch.distributed as dist

from megatron.training.process import unlink_deepspeed_shm_buffer


def startup_watch(args: argparse.Namespace):
    """Every rank, first thing in :func:`megatron.training.training.pretrain`: the ``--moc-monitor`` watch of its
    start-up phases (:class:`megatron.training.monitor.StartupWatch`); without the flag
    the phases are recorded and nobody checks them."""
    from megatron.training import jit_ops, monitor
    watching = getattr(args, "moc_monitor", False)
    cfg = monitor.MonitorConfig.from_args(args) if watching else monitor.MonitorConfig()
    emit = None
    if watching and args.moc_event_file:
        from megatron.training.events import EventLog
        emit = EventLog(args.moc_event_file).append
    watch = monitor.StartupWatch(int(os.environ.get("RANK", "0")), cfg, emit=emit,
                                 hint=jit_ops.lock_hint)
    return watch.start() if watching else watch


class LoopWatch:
    """``--moc-monitor``: this rank's heartbeat and hang/straggler watchdog (every rank
    creates one before the loop; a no-op without the flag)."""

    def __init__(self, args: argparse.Namespace):
        self.heartbeat = self.watchdog = self.clock = None
        self._last_top = None
        self._in_job = getattr(args, "moc_restart", "relaunch") == "in-job"
        if not getattr(args, "moc_monitor", False):
            return
        from megatron.training import monitor
        from megatron.training.events import EventLog
        cfg = monitor.MonitorConfig.from_args(args)
        store = monitor.default_store()
        emit = EventLog(args.moc_event_file).append if args.moc_event_file else None
        self.heartbeat = monitor.Heartbeat(store, dist.get_rank(), cfg.straggler_window)
        self.watchdog = monitor.Watchdog(store, dist.get_rank(), dist.get_world_size(), cfg,
                                         emit=emit, on_hang=self._on_hang)
        self.watchdog.start()
        self.clock = monitor.CollectiveClock().install()

    def _on_hang(self, event) -> None:
        if not self._in_job:
            self._stop_job(event)
            return
        # Only the hung process ends; the others recover in place. One that is still
        # in this run a hang timeout later never left the failed round (a peer's
        # connection to it stayed open): it asks for its own end then.
        from megatron.training.in_job import on_hang_in_job
        if on_hang_in_job(event, dist.get_rank(), self._stop_job, self._exit_hung) == "kill":
            rank, timeout_s = dist.get_rank(), self.watchdog.config.hang_timeout_s
            timer = threading.Timer(timeout_s, self._still_here, args=(rank, timeout_s))
            timer.daemon = True
            timer.start()

    def _still_here(self, rank: int, timeout_s: float) -> None:
        if self.heartbeat is None:  # the run was left (stop() ran): nothing to do
            return
        # Where it is stuck, for whoever finds out why (a connection a peer left open,
        # a wait on the store, ...): every thread's stack, before it is killed.
        import faulthandler
        import sys
        print(f"[monitor] rank {rank}: still in the failed round {timeout_s:g} s after the "
              "hang was acted on; this process's threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        from megatron.training.in_job import request_kills
        request_kills([rank], f"still in the failed round {timeout_s:g} s after the hang "
                              "was acted on")

    def _stop_job(self, event) -> None:
        # os._exit skips the normal end: free DeepSpeed's /dev/shm buffer first (no
        # barrier: the other ranks may be the ones that hang).
        unlink_deepspeed_shm_buffer()
        self.watchdog.stop_job(event)

    def _exit_hung(self) -> None:
        from megatron.training.monitor.exits import EXIT_HANG, exit_now, print_line
        unlink_deepspeed_shm_buffer()
        print_line(f"[monitor] rank {dist.get_rank()}: this rank is the hung one: exiting "
                   f"with status {EXIT_HANG}; the others recover in place")
        exit_now(EXIT_HANG)

    def beat(self, iteration: int) -> None:
        """Top of each iteration: its number, the last iteration's wall time and the part
        of it this rank spent outside collectives (what tells a straggler apart)."""
        if self.heartbeat is None:
            return
        # take() first: it waits for the device to pass the last iteration's collectives
        # (CUDA), so that wait belongs to the iteration that queued them, not the next.
        comm_s, calls = self.clock.take()
        top = time.perf_counter()
        iter_s = top - self._last_top if self._last_top else None
        self.heartbeat.beat(iteration, iter_s=iter_s,
                            own_s=max(0.0, iter_s - comm_s) if iter_s is not None else None,
                            comm_s=comm_s if iter_s is not None else None,
                            collectives=calls if iter_s is not None else None)
        self._last_top = top

    def ready(self, iteration: int) -> None:
        """Before the loop: a beat of the iteration it resumes from (see Heartbeat.ready)."""
        if self.heartbeat is not None:
            self.heartbeat.ready(iteration)

    def touch(self) -> None:
        """Progress inside an iteration: after each evaluation step, before a save."""
        if self.heartbeat is not None:
            self.heartbeat.touch()

    def stop(self) -> None:
        """After the loop, before the final save (a long save must not look like a hang)."""
        if self.heartbeat is not None:
            self.heartbeat.finish()
            self.watchdog.stop()
            self.clock.uninstall()
            self.heartbeat = None
