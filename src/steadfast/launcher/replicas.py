"""The agent's part of the replica check (steadfast.sdc): the node's board started with
the launcher, bound to each round's store, told of each generation's workers, and asked
at each of the agent's looks whether the replicas disagreed.

A verdict stops the workers at once (each step they take after it may go into another
checkpoint). Then (:meth:`ReplicaWatch.after`):

- a script that saves through steadfast's ``CheckpointManager`` (its saves are noted in
  its rows) is **rolled back**: restarted in the job with ``$STEADFAST_CLEAN_STEP``, the
  newest checkpoint proven clean, which the manager restores (nothing newer); where the
  culprit is the odd one out on this node of several, this node leaves the job (a spare
  takes its place, or the job goes on smaller);
- a corruption that comes back on the same hardware (host and local rank) is a faulty
  device, one that follows the same rank onto other hardware a software bug: either
  ends the job (exit 80), as does a verdict with no restart left;
- an unchanged script (whose own snapshot steadfast cannot choose) ends the job with
  exit 80 (:class:`.errors.SilentCorruptionError`).

Where the workers failed, the board is asked once more before any restart: another
node that stopped its workers for a verdict makes this node's collectives fail first.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .. import events
from ..config import FaultToleranceConfig
from ..sdc.board import ReplicaBoard, RoundLink
from ..sdc.probe import CLEAN_ENV
from ..sdc.verdict import Verdict

__all__ = ["LEAVE", "RESTART", "STOP", "ReplicaWatch"]

#: what :meth:`ReplicaWatch.after` decides
STOP, RESTART, LEAVE = "stop", "restart", "leave"


class ReplicaWatch:
    """The board of one launcher, or nothing where the check is off (``replica_check``
    false, or the progress hooks that see the DDP model not installed)."""

    def __init__(self, ft: FaultToleranceConfig, rows: Any) -> None:
        on = ft.replica_check and ft.watch_progress
        self.host = socket.gethostname()
        self.board = ReplicaBoard(rows, self.host) if on else None
        self.stop_timeout = ft.workers_stop_timeout
        self._link: RoundLink | None = None
        self._seen: list[Verdict] = []  # this job's verdicts, as this launcher met them

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

    def after(self, verdict: Verdict, restarts_left: int) -> tuple[str, str]:
        """What the job does after ``verdict`` (its workers stopped): :data:`STOP`,
        :data:`RESTART` (rolled back) or :data:`LEAVE` (this node leaves, the others
        roll back), and why. For a roll-back, the workers' environment gets the step."""
        culprits = {(h, lr) for h, lr in zip(verdict.hosts, verdict.local_ranks, strict=True)}
        before = [v for v in self._seen
                  if culprits & set(zip(v.hosts, v.local_ranks, strict=True))]  # fmt: skip
        moved = [v for v in self._seen if set(v.culprits) & set(verdict.culprits)]
        self._seen.append(verdict)
        if before:
            return (
                STOP,
                "it came back on the same hardware: a faulty device (attribution: persistent)",
            )
        if moved:
            why = "it followed the same rank onto other hardware: a software bug"
            return STOP, why + " (attribution: software)"
        if not verdict.restorable:
            return STOP, "the script saves its own state, which steadfast cannot choose"
        if restarts_left <= 0:
            return STOP, "no in-job restart left to roll back with"
        clean = -1 if verdict.clean_step is None else verdict.clean_step
        os.environ[CLEAN_ENV] = str(clean)
        events.emit(
            "rollback",
            cause="silent_corruption",
            to_step=clean,
            culprits=list(verdict.culprits),
            attribution="first",
        )
        here = verdict.how == "odd_one_out" and self.host in verdict.hosts
        if here and self._link is not None:
            return LEAVE, "the culprit is this node's: it leaves, the others roll back"
        return RESTART, f"rolled back to checkpoint {clean} (proven clean)"

    def restarting(self) -> None:
        """Before a restart for another cause, after a roll-back: the bound moves up to
        what the ended generation's checks proved clean (its own saves; the corrupted
        run's newer checkpoints stay below the bound until saved again)."""
        bound = os.environ.get(CLEAN_ENV)
        proven = self.board.proven() if self.board is not None else None
        if bound is not None and proven is not None and proven > int(bound):
            os.environ[CLEAN_ENV] = str(proven)

    def close(self) -> None:
        os.environ.pop(CLEAN_ENV, None)
        if self.board is not None:
            self.board.close()
