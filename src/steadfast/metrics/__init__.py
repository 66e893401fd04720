"""A running job read at a glance: each launcher's Prometheus endpoint
(:mod:`.exporter`, ``steadfast launch --metrics-port PORT``), fed by the run's event log
as it grows (:mod:`.figures`, :mod:`.follow`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

from .exporter import JobCollector, MetricsServer
from .figures import FAULT_KINDS, NODE_STATES, Figures
from .follow import LogFollower

__all__ = [
    "FAULT_KINDS",
    "NODE_STATES",
    "Figures",
    "JobCollector",
    "LogFollower",
    "MetricsServer",
    "learned_in_force",
    "ledger_counts",
    "serve",
]


def learned_in_force(learned: Any, ft: Any) -> dict[str, float]:
    """The learned timeouts ready to apply (seconds by kind: ``heartbeat``,
    ``out_of_section``, ``section:<name>``) of a launcher's :class:`~steadfast.monitor.
    learned.Learned`."""
    from ..monitor.learned import learned_timeout

    out = {}
    for kind, (longest, count) in dict(getattr(learned, "kinds", {})).items():
        value = learned_timeout(longest, count, ft, math.inf)
        if value is not None:
            out[kind] = value
    return out


def serve(
    log: str,
    port: int,
    *,
    addr: str = "",
    sd_dir: str | None = None,
    node: str,
    lead: Callable[[], bool],
    learned: Callable[[], Mapping[str, float]],
    labels: Mapping[str, str] | None = None,
    ledger: Callable[[], Mapping[str, int]] | None = None,
) -> MetricsServer:
    """The launcher's endpoint: the run's figures from ``log``."""
    collector = JobCollector(Figures(log), lead, learned, node, ledger)
    return MetricsServer(collector, port, addr=addr, sd_dir=sd_dir, labels=labels)


def ledger_counts(
    location: str, window_days: float, every: float = 60.0
) -> Callable[[], dict[str, int]]:
    """The node ledger's faults by node, read at most every ``every`` seconds (a scrape
    a second must not list the ledger's folder each time); an unreadable ledger gives
    the last counts."""
    import time

    from ..ledger import LedgerError, node_records

    cache: dict[str, Any] = {"at": -math.inf, "counts": {}}

    def counts() -> dict[str, int]:
        now = time.monotonic()
        if now - cache["at"] >= every:
            cache["at"] = now
            with contextlib.suppress(LedgerError):  # unreadable: the last counts
                found = node_records(location, window_days)
                cache["counts"] = {r.node: len(r.faults) for r in found}
        return dict(cache["counts"])

    return counts
