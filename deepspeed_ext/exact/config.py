"""Exact recovery's settings (:class:`ExactConfig`) and the constants its parts share."""

from dataclasses import dataclass

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's moments, counted before they exist (:meth:`OperatorIndex.local_operators`)."""
PROBE_ITERATIONS = 2
"""Iterations timed (after a first, untimed one) before the automatic window is chosen."""
UNCOPIED_WINDOWS = 4
"""Windows back a memory frame the keeper has not yet copied to storage is kept for it."""


@dataclass
class ExactConfig:
    """Exact recovery (``--moc-mode exact``)."""

    window: int = 0
    """Iterations per window, ``W``; 0: chosen from the first measured iteration
    (``--moc-window``)."""
    reorder_threshold: float = 0.25
    """Re-order the experts (least popular first) at a window boundary when the
    popularity order moved by more than this fraction of pairs."""
    write_frames: bool = True
    """Persist frames to storage (tests turn it off to measure the copy alone)."""
    memory_dir: str = ""
    """The job's shared-memory directory (one ``node<N>/`` per node, each with a keeper
    that persists frames to storage); empty: frames go straight to storage."""
    ranks_per_node: int = 0
    """Ranks per node for the memory level; 0: the launcher's count
    (:mod:`deepspeed_ext.node_layout`)."""
    keeper_idle_timeout_s: float = 600.0
    """A keeper exits when none of its training processes has been alive this long."""
    expected_mtbf_s: float = 0.0
    """Expected seconds between failures; when set, the automatic window weighs a frame's
    cost against the replay a failure costs (``--moc-expected-mtbf``); 0: unknown."""
    hide_fraction: float = 0.0
    """The automatic window's budget: a frame's copy and writes may take this fraction
    of an iteration; 0: 1 on GPUs (the host works while the GPU computes), 0.1 on CPU
    (the frame's work takes the training's own cores)."""
    host_memory_gb: float = 0.0
    """Budget for what one rank holds in host memory: a whole window during a replay;
    0: unchecked (``--moc-host-memory-gb``)."""

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"--moc-window must be an int >= 0 (0: automatic), got {self.window!r}")
        if self.expected_mtbf_s < 0:
            raise ValueError(f"--moc-expected-mtbf must be >= 0 (0: unknown), got {self.expected_mtbf_s}")
        if not 0.0 <= self.hide_fraction <= 1.0:
            raise ValueError(f"hide_fraction must be in [0, 1] (0: automatic), got {self.hide_fraction}")
        if not 0.0 <= self.reorder_threshold <= 1.0:
            raise ValueError(f"reorder_threshold must be in [0, 1], got {self.reorder_threshold}")
