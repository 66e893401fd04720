"""A running job read at a glance: each launcher's Prometheus endpoint
(:mod:`.exporter`, ``steadfast launch --metrics-port PORT``), fed by the run's event log
as it grows (:mod:`.figures`, :mod:`.follow`)."""

from __future__ import annotations

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
) -> MetricsServer:
    """The launcher's endpoint: the run's figures from ``log``."""
    collector = JobCollector(Figures(log), lead, learned, node)
    return MetricsServer(collector, port, addr=addr, sd_dir=sd_dir, labels=labels)
