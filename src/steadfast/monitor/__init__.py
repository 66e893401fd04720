"""Rank monitoring: heartbeats and sections in a shared-memory table, and the watcher.

See :mod:`steadfast.monitor.table` (the table), :mod:`steadfast.monitor.client`
(``RankMonitorClient``, the rank's side) and :mod:`steadfast.monitor.watcher` (the
launcher's side).
"""

from __future__ import annotations

from .client import (
    FT_CONFIG_ENV,
    RankMonitorClient,
    RankMonitorClientError,
    load_ft_state,
    save_ft_state,
)
from .table import HB_TABLE_ENV, HeartbeatTable
from .timeouts import HeartbeatTimeouts, SectionTimeouts
from .watcher import Hang, Watcher

__all__ = [
    "FT_CONFIG_ENV",
    "HB_TABLE_ENV",
    "Hang",
    "HeartbeatTable",
    "HeartbeatTimeouts",
    "RankMonitorClient",
    "RankMonitorClientError",
    "SectionTimeouts",
    "Watcher",
    "load_ft_state",
    "save_ft_state",
]
