"""The node ledger: a record of every node's faults that outlives the job.

Meta's study of its clusters (arXiv 2410.21680) names detecting "lemon" nodes as a key
mitigation: a node that keeps failing should be caught once and never trusted blindly
again. Each launcher records, where the site keeps shared state (a folder on the shared
file system, or etcd: :mod:`.store`), the hours its node took part in the job and the
faults it saw that point at a node (:mod:`.records` says which count: never a Python
exception, which is the script's). Then:

- ``steadfast nodes`` lists the nodes by fault rate (faults per node-hour) over a
  window, with their evidence (:mod:`.rates`);
- ``steadfast slurm`` leaves the nodes over the site's threshold out of the allocation
  (``--exclude``), and a requeue leaves out the job's nodes that crossed it;
- a launcher started on such a node refuses to join (exit 74, ``node_unhealthy``
  cause ``ledger``).
"""

from __future__ import annotations

import socket

from .rates import NodeRecord, excluded, tally
from .recorder import Recorder
from .records import CAUSES, Entry, Fault, LedgerError, Stint
from .store import EtcdLedger, FileLedger, open_ledger

__all__ = [
    "CAUSES",
    "Entry",
    "EtcdLedger",
    "Fault",
    "FileLedger",
    "LedgerError",
    "NodeRecord",
    "Recorder",
    "Stint",
    "excluded",
    "excluded_nodes",
    "node_records",
    "open_ledger",
    "refusal",
    "tally",
]

DAY = 86400.0


def node_records(location: str, window_days: float) -> list[NodeRecord]:
    """Every node in the ledger at ``location`` over the last ``window_days``, worst
    first."""
    store = open_ledger(location)
    try:
        return tally(store.entries(), window_days * DAY)
    finally:
        store.close()


def excluded_nodes(location: str, max_faults: int, window_days: float) -> list[str]:
    """The nodes the ledger at ``location`` keeps out (none when ``max_faults`` is 0)."""
    if max_faults <= 0:
        return []
    return excluded(node_records(location, window_days), max_faults)


def refusal(location: str, max_faults: int, window_days: float, host: str = "") -> str | None:
    """Why this node (``host``, default this machine's name) must not join, or None."""
    if max_faults <= 0:
        return None
    host = host or socket.gethostname()
    records = node_records(location, window_days)
    mine = next((r for r in records if r.node in (host, host.split(".")[0])), None)
    if mine is None or len(mine.faults) < max_faults:
        return None
    causes = ", ".join(sorted({f.cause for f in mine.faults}))
    return (
        f"the node ledger ({location}) holds {len(mine.faults)} faults of {mine.node} in the "
        f"last {window_days:g} days ({causes}), at least node_ledger_max_faults={max_faults}"
    )
