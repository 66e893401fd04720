"""``steadfast nodes``: the ledger's nodes by fault rate over a window, with the evidence
of each fault, as a table or as JSON (``--json``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

from .rates import NodeRecord, excluded
from .records import LedgerError

__all__ = ["LEDGER_ENV", "add_nodes_parser", "format_table", "parse_window"]

#: where ``steadfast nodes`` and ``steadfast slurm`` find the ledger by default
LEDGER_ENV = "STEADFAST_NODE_LEDGER"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_window(text: str) -> float:
    """Seconds in ``30d``, ``12h``, ``90m``, ``3600`` (s); ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--window: {text!r} is not a duration (30d, 12h, 90m, 3600)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _rate(record: NodeRecord) -> str:
    rate = record.rate
    return "no hours" if math.isinf(rate) else f"{rate:.3g}"


def format_table(records: list[NodeRecord], window: float, over: list[str]) -> str:
    """The table: one line per node, worst first, each fault's evidence below it."""
    days = window / 86400.0
    head = ("node", "faults", "node-hours", "faults/hour", "jobs")
    rows = [
        (r.node + (" *" if r.node in over else ""), str(len(r.faults)), f"{r.hours:.2f}",
         _rate(r), str(len(r.jobs)))
        for r in records
    ]  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [f"node ledger: {len(records)} nodes over the last {days:g} days"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for record, row in zip(records, rows, strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        for fault in sorted(record.faults, key=lambda f: f.time):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(fault.time))
            lines.append(f"    {when}  {fault.job}  {fault.cause}: {fault.evidence}")
    if over:
        lines.append(f"* kept out of jobs (node_ledger_max_faults): {', '.join(over)}")
    return "\n".join(lines)


def _nodes(ns: argparse.Namespace) -> int:
    from . import node_records

    location = ns.ledger or os.environ.get(LEDGER_ENV, "")
    if not location:
        print(f"steadfast nodes: give --ledger LOCATION or set ${LEDGER_ENV}", file=sys.stderr)
        return 2
    try:
        window = parse_window(ns.window)
        records = node_records(location, window / 86400.0)
    except (ValueError, LedgerError) as exc:
        print(f"steadfast nodes: {exc}", file=sys.stderr)
        return 2
    over = excluded(records, ns.max_faults)
    if ns.json:
        out: dict[str, Any] = {"window_seconds": window, "excluded": over,
                               "nodes": [r.as_json() for r in records]}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        print(format_table(records, window, over))
    return 0


def add_nodes_parser(sub: Any) -> None:
    """``steadfast nodes`` on the ``steadfast`` command's sub-parsers."""
    p = sub.add_parser("nodes", help="the node ledger: nodes by fault rate, with the evidence")
    where = f"a folder, or etcd://host:2379/prefix (default: ${LEDGER_ENV})"
    p.add_argument("--ledger", default=None, help=where)
    p.add_argument("--window", default="30d", help="the window: 30d, 12h, 90m (default 30d)")
    mark = "mark the nodes with N faults in the window (the site's threshold)"
    p.add_argument("--max-faults", type=int, default=0, metavar="N", help=mark)
    p.add_argument("--json", action="store_true", help="print the nodes as JSON")
    p.set_defaults(func=_nodes)
