"""Hang and straggler detection through per-rank heartbeats in the rendezvous store
(``--moc-monitor``), and the start-up watch before them.

docs/monitor.md explains the whole and gives the call order every rank follows; each
module explains its own concern:

- :mod:`.config`: :class:`MonitorConfig` (the thresholds, checked on every rank) and
  :func:`add_monitor_args` (the flags);
- :mod:`.exits`: the exit statuses (:data:`EXIT_HANG`, :data:`EXIT_STRAGGLER`) and
  :func:`~.exits.exit_now`;
- :mod:`.beats`: the heartbeat's wire format: :class:`Heartbeat` publishes, :class:`Beat`
  reads back;
- :mod:`.clock`: :class:`CollectiveClock`, the seconds a rank is held by collectives, by
  wrapping ``torch.distributed``'s;
- :mod:`.rules`: the pure rules :func:`find_hang` and :func:`find_stragglers`;
- :mod:`.watchdog`: :class:`Watchdog`, the thread on every rank that applies them and can
  end the process;
- :mod:`.startup`: :class:`StartupWatch`, the start-up and loading phases timed per rank.

The names below are re-exported for the trainer's callers. ``exit_now`` is not: a test
that replaces it does so in the module that calls it (``watchdog`` or ``startup``).
"""

from megatron.training.monitor.beats import (Beat, Heartbeat, WindowMedian, default_store,
                                             heartbeat_key)
from megatron.training.monitor.clock import (COLLECTIVES, WAIT_METHODS, CollectiveClock,
                                             CudaEventTimer, DeviceTimer)
from megatron.training.monitor.config import STRAGGLER_ACTIONS, MonitorConfig, add_monitor_args
from megatron.training.monitor.exits import EXIT_HANG, EXIT_STRAGGLER
from megatron.training.monitor.rules import HangFinding, find_hang, find_stragglers
from megatron.training.monitor.startup import StartupWatch
from megatron.training.monitor.watchdog import Watchdog, event_key

__all__ = [
    "Beat", "COLLECTIVES", "CollectiveClock", "CudaEventTimer", "DeviceTimer", "EXIT_HANG",
    "EXIT_STRAGGLER", "HangFinding", "Heartbeat", "MonitorConfig", "STRAGGLER_ACTIONS",
    "StartupWatch", "WAIT_METHODS", "Watchdog", "WindowMedian", "add_monitor_args",
    "default_store", "event_key", "find_hang", "find_stragglers", "heartbeat_key",
]
