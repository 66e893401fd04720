"""Who is to blame for a failed worker group: the ranks that failed first
(``rank_failed``) and those that only went down after them (``rank_stopped``), and, with
more than one node, the one culprit agreed job-wide (:mod:`.nodes.culprit`), a lost
node's included (``fault_culprit``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import events
from ..monitor import Watcher
from .failures import emit_agreed, emit_failures, failure_fields, first_failures
from .generations import wall_times
from .nodes import Loss, NodeRoster
from .nodes.culprit import Verdict, node_claim, rank_claim

__all__ = ["agree_loss", "loss_cause", "nodes_named", "record_failures", "record_loss"]


def record_failures(
    failures: Mapping[int, Any],
    *,
    roster: NodeRoster | None,
    watcher: Watcher,
    node_rank: int,
    rounds: int,
    global_rank: Callable[[int], int],
    grace: float,
) -> None:
    """``rank_failed`` for the rank(s) that failed first, ``rank_stopped`` for the
    ranks that went down after them: torch's agent reports every worker of a failed
    group as failed, the survivors it stopped (and those that ended on their own
    when a collective lost its peer) included, but the fault is counted once. With more
    than one node the culprit is agreed job-wide first (:mod:`.nodes.culprit`): the
    ranks of a node whose workers only followed another node's fault are all
    ``rank_stopped``, pointing to it, and every node writes ``fault_culprit``.

    The order is the watcher's (a pidfd per worker, ms resolution); without pidfds,
    torch's failure timestamps (1 s resolution) decide, and ties count as failed."""
    seen = time.time()
    if roster is not None:
        # a rank that lost its peer exits as fast as the peer's node is seen lost:
        # give the roster a moment (grace) to tell which it was
        lost = roster.wait_for_loss(grace)
        isolated = roster.isolated()
        if lost or isolated:
            verdict = agree_loss(roster, lost) if not isolated else None
            if verdict is not None:
                stops = {int(r): failure_fields(f) for r, f in failures.items()}
                emit_agreed(stops, verdict, roster.name, rounds)
            else:
                emit_failures(failures, {}, loss=loss_cause(lost, isolated))
            return
    exits = watcher.exit_times()  # once the watcher thread took in every exit
    if roster is not None:  # one culprit for the job, not one per node
        claim = rank_claim(
            roster.name,
            node_rank,
            failures,
            wall_times(exits),
            watcher.hung(),
            first_failures(failures, exits),
            detected=seen,
            global_rank=global_rank,
        )
        verdict = roster.agree_culprit(claim)
        if verdict is not None:
            stops = {int(r): failure_fields(f) for r, f in failures.items()}
            emit_agreed(stops, verdict, roster.name, rounds)
            return
    emit_failures(failures, exits)


def agree_loss(roster: NodeRoster | None, lost: list[Loss]) -> Verdict | None:
    """The round's culprit where this node saw nodes lost: its claim is the earliest
    of them (a node lost takes its ranks down with it)."""
    if roster is None or not lost:
        return None
    claims = [node_claim(loss.peer.host, loss.peer.rank, loss.cause, loss.latency) for loss in lost]
    best = claims[0]
    for claim in claims[1:]:
        best = claim if claim.beats(best) else best
    return roster.agree_culprit(best, absent=len(lost))


def record_loss(
    roster: NodeRoster, lost: list[Loss], isolated: str | None, stops: Mapping[int, Any],
    rounds: int,
) -> None:  # fmt: skip
    """The events of workers stopped for a lost node (``stops``: global rank -> fields):
    the loss agreed job-wide as the culprit where it can be, else ``rank_stopped`` each
    with the loss's cause."""
    verdict = agree_loss(roster, lost) if not isolated else None
    if verdict is not None:
        emit_agreed(stops, verdict, roster.name, rounds)
        return
    cause = loss_cause(lost, isolated)
    for rank, fields in stops.items():
        events.emit("rank_stopped", cause=cause, rank=rank, **fields)


def loss_cause(lost: list[Loss], isolated: str | None) -> str:
    if lost:
        return f"after the loss of {nodes_named(loss.peer.host for loss in lost)}"
    return f"this node is cut off from the job: {isolated}"


def nodes_named(hosts: Iterable[str]) -> str:
    """``node node2`` / ``nodes node2, node5``, for messages."""
    names = list(hosts)
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(names)
