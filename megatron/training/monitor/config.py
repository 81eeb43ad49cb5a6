"""The monitor's thresholds (:class:`MonitorConfig`) and the flags that set them
(:func:`add_monitor_args`).

Every rank builds the same :class:`MonitorConfig` from the same flags; a value out of
range raises :class:`~megatron.errors.ConfigError` naming the flag, on every
rank, before any collective.
"""

import argparse
from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.training.monitor.exits import EXIT_HANG, EXIT_STRAGGLER


STRAGGLER_ACTIONS = ("report", "stop")
"""Values of ``--moc-straggler-action``."""


@dataclass
class MonitorConfig:
    """Thresholds of the hang and straggler detection (same on every rank).

    Every rank builds it from its flags (:meth:`from_args`) when it validates its
    arguments, and again for the :class:`~megatron.training.monitor.startup.StartupWatch`
    and the :class:`~megatron.training.monitor.watchdog.Watchdog`.

    Raises:
        ConfigError: (a ValueError) a value out of range; the message names the flag.
    """

    hang_timeout_s: float = 300.0
    """The job hangs once no rank made progress for this long (``--moc-hang-timeout``);
    must exceed the longest legitimate iteration, evaluation step or synchronous save."""
    straggler_factor: float = 2.0
    """A rank slowing iterations down more than this is a straggler (``--moc-straggler-factor``)."""
    straggler_window: int = 5
    """Beats whose median is compared (``--moc-straggler-window``)."""
    straggler_action: str = "report"
    """``report``: emit an event only; ``stop``: exit like a hang (``--moc-straggler-action``)."""
    poll_s: float = 5.0
    """Seconds between two reads of all heartbeats (``--moc-monitor-poll``)."""
    startup_timeout_s: float = 600.0
    """A start-up or loading phase (process group, data, model and engine, checkpoint
    load) lasting longer than this is a hang (``--moc-startup-timeout``): longer than an
    iteration, since a phase may legitimately take minutes (a large load)."""

    def __post_init__(self):
        if not 0 < self.startup_timeout_s < float("inf"):
            raise ConfigError(f"--moc-startup-timeout {self.startup_timeout_s}: must be a "
                              "finite number > 0 seconds")
        if not self.hang_timeout_s > 0:
            raise ConfigError(f"--moc-hang-timeout {self.hang_timeout_s}: must be > 0 seconds")
        if not self.straggler_factor > 1:
            raise ConfigError(f"--moc-straggler-factor {self.straggler_factor}: must be > 1")
        if self.straggler_window < 3:
            raise ConfigError(f"--moc-straggler-window {self.straggler_window}: must be >= 3 "
                              "(the median of fewer beats follows a single slow iteration)")
        if self.straggler_action not in STRAGGLER_ACTIONS:
            raise ConfigError(f"--moc-straggler-action {self.straggler_action!r}: must be one "
                              f"of {', '.join(STRAGGLER_ACTIONS)}")
        if not 0 < self.poll_s < self.hang_timeout_s:
            raise ConfigError(f"--moc-monitor-poll {self.poll_s}: must be > 0 and below "
                              f"--moc-hang-timeout {self.hang_timeout_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MonitorConfig":
        """From the flags :func:`add_monitor_args` adds."""
        return cls(hang_timeout_s=args.moc_hang_timeout, straggler_factor=args.moc_straggler_factor,
                   straggler_window=args.moc_straggler_window,
                   straggler_action=args.moc_straggler_action, poll_s=args.moc_monitor_poll,
                   startup_timeout_s=getattr(args, "moc_startup_timeout", cls.startup_timeout_s))


def add_monitor_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--moc-monitor`` and its thresholds to ``parser``.

    Called once by the trainer's parser (``megatron/training/arguments.py``) on every rank,
    and by tests.
    """
    d = MonitorConfig()
    g = parser.add_argument_group("hang and straggler detection")
    g.add_argument("--moc-monitor", action="store_true",
                   help="Publish a heartbeat per iteration and watch all ranks' heartbeats.")
    g.add_argument("--moc-hang-timeout", type=float, default=d.hang_timeout_s,
                   help="Seconds without progress of any rank after which every rank exits "
                        f"with status {EXIT_HANG} (for the launcher to restart the job).")
    g.add_argument("--moc-straggler-factor", type=float, default=d.straggler_factor,
                   help="Report a rank that slows iterations down by more than this factor.")
    g.add_argument("--moc-straggler-window", type=int, default=d.straggler_window,
                   help="Iterations whose median time is compared (>= 3).")
    g.add_argument("--moc-straggler-action", default=d.straggler_action, choices=STRAGGLER_ACTIONS,
                   help=f"On a straggler: report it, or stop the job (exit {EXIT_STRAGGLER}).")
    g.add_argument("--moc-monitor-poll", type=float, default=d.poll_s,
                   help="Seconds between two checks of the heartbeats.")
    g.add_argument("--moc-startup-timeout", type=float, default=d.startup_timeout_s,
                   help="Seconds a start-up or loading phase (process group, data, model and "
                        "engine, checkpoint load) may last before the rank reports a hang "
                        f"naming the phase and exits with status {EXIT_HANG}.")
