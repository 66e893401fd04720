"""The agent's part of the replica check (steadfast.sdc): the node's board started with
the launcher, bound to each round's store, told of each generation's workers, and asked
at each of the agent's looks whether the replicas disagreed.

A verdict stops the workers at once (each check they pass after it may go into another
checkpoint) and ends the launcher with exit 80 (:class:`.errors.SilentCorruptionError`):
in-job restarts would resume from the script's own newest state, which the verdict says
may hold the corruption. Where the workers failed, the board is asked once more before
any restart: another node that stopped its workers for a verdict makes this node's
collectives fail first.
"""

from __future__ import annotations

import socket
from typing import Any

from ..config import FaultToleranceConfig
from ..sdc.board import ReplicaBoard, RoundLink
from ..sdc.verdict import Verdict

__all__ = ["ReplicaWatch"]


class ReplicaWatch:
    """The board of one launcher, or nothing where the check is off (``replica_check``
    false, or the progress hooks that see the DDP model not installed)."""

    def __init__(self, ft: FaultToleranceConfig, rows: Any) -> None:
        on = ft.replica_check and ft.watch_progress
        self.board = ReplicaBoard(rows, socket.gethostname()) if on else None
        self.stop_timeout = ft.workers_stop_timeout
        self._link: RoundLink | None = None

    def bind(self, store: Any, prefix: str, node: int, nodes: int) -> None:
        """The round that formed: its store, where it has several nodes."""
        self._link = RoundLink(store, prefix, node, nodes) if nodes > 1 else None

    def started(self, ranks: dict[int, int]) -> None:
        """A generation's workers started: ``ranks`` local -> global."""
        if self.board is not None:
            self.board.watch(ranks, self._link)

    def stopped(self) -> None:
        if self.board is not None:
            self.board.unwatch()

    def verdict(self, ended: bool) -> Verdict | None:
        """The verdict, if the replicas disagreed; ``ended``: the workers ended, so look
        once more now, at their last checks (and, across nodes, at the store a while:
        another node's verdict may be why they failed)."""
        if self.board is None:
            return None
        found = self.board.verdict()
        if found is None and ended and self.board.checked():
            found = self.board.poll(3 * self.board.store_interval if self._link else 0.0)
        return found

    def told(self) -> None:
        """After the verdict stopped this node's workers: wait until every node read it
        (up to a few store rounds plus ``workers_stop_timeout``: a node whose workers
        take that long to stop reads it after)."""
        if self.board is not None:
            self.board.wait_seen(3 * self.board.store_interval + self.stop_timeout)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
