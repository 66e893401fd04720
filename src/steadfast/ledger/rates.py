"""The ledger read as an operator reads it: each node's faults and node-hours over a
window, its fault rate (faults per node-hour), and the nodes to keep out of jobs.

A fault seen by two writers (a launcher that restarted and read the same verdict again)
counts once: faults are told apart by node, job, cause and time. A node with faults and
no recorded hours (its launchers never wrote a stint: the node was lost before its
first publication) has an infinite rate and sorts first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .records import Entry, Fault

__all__ = ["NodeRecord", "excluded", "tally"]


@dataclass
class NodeRecord:
    """One node over the window."""

    node: str
    hours: float = 0.0
    jobs: set[str] = field(default_factory=set)
    faults: list[Fault] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Faults per node-hour (inf: faults with no hours recorded)."""
        if not self.faults:
            return 0.0
        return len(self.faults) / self.hours if self.hours > 0 else math.inf

    def as_json(self) -> dict[str, Any]:
        rate = self.rate
        return {
            "node": self.node,
            "faults": len(self.faults),
            "node_hours": self.hours,  # unrounded: a short stint is still one
            "rate_per_hour": None if math.isinf(rate) else round(rate, 6),
            "jobs": sorted(self.jobs),
            "evidence": [
                {"time": f.time, "job": f.job, "cause": f.cause, "evidence": f.evidence}
                for f in sorted(self.faults, key=lambda f: f.time)
            ],
        }


def tally(entries: Iterable[Entry], window: float, now: float | None = None) -> list[NodeRecord]:
    """Every node seen in the last ``window`` seconds: its hours in the window, the jobs,
    the faults; worst first (rate, then faults, then name)."""
    now = time.time() if now is None else now
    since = now - window
    nodes: dict[str, NodeRecord] = {}
    seen: set[tuple[str, str, str, float]] = set()
    for entry in entries:
        for stint in entry.stints:
            overlap = min(stint.end, now) - max(stint.start, since)
            if overlap > 0 or since <= stint.start <= now:
                record = nodes.setdefault(stint.node, NodeRecord(stint.node))
                record.hours += max(0.0, overlap) / 3600.0
                record.jobs.add(stint.job)
        for fault in entry.faults:
            key = (fault.node, fault.job, fault.cause, round(fault.time, 3))
            if not since <= fault.time <= now or key in seen:
                continue
            seen.add(key)
            record = nodes.setdefault(fault.node, NodeRecord(fault.node))
            record.faults.append(fault)
            record.jobs.add(fault.job)
    return sorted(nodes.values(), key=lambda r: (-r.rate, -len(r.faults), r.node))


def excluded(records: Iterable[NodeRecord], max_faults: int) -> list[str]:
    """The nodes with at least ``max_faults`` faults in the window (none when 0: off)."""
    if max_faults <= 0:
        return []
    return sorted(r.node for r in records if len(r.faults) >= max_faults)
