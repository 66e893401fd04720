"""Losses as the round's store holds them, and the events that report them.

A launcher that sees a watched node go records the loss in the round's store
(:func:`claim_loss`: the description under ``lost_how/R``, then a count under ``lost/R``
and, the first time, ``lost_count`` and ``lost_seq/<i>``, so that a reader reads the
losses and not every node's key; the keys are :class:`~.round.RoundKeys`); the first
to record it emits ``node_lost`` (:func:`emit_lost`), so a loss is reported once for the
job. A node that leaves on purpose records why first (:func:`record_leaving`), and
whoever finds it gone reports that instead. The other launchers read the losses back
when their own workers fail (:func:`recorded_losses`) and in the exit barrier
(:func:`confirmed_losses`). A launcher that cannot record a loss is the one cut off
(``node_isolated``, :func:`emit_isolated`).

The calls here block on the store: the roster makes them on its store threads
(:mod:`.store_calls`) and keeps the state they lead to.
"""

from __future__ import annotations

import json
from typing import Any

from ... import events
from ...events import Kind
from .records import parse_leaving, parse_loss, parse_rank, read
from .round import Peer, Round

__all__ = [
    "claim_loss",
    "confirmed_losses",
    "emit_isolated",
    "emit_joined",
    "emit_lost",
    "record_leaving",
    "recorded_losses",
]

#: the longest reason for leaving recorded (its readers refuse longer records)
MAX_REASON = 2000


def claim_loss(current: Round, peer: Peer, cause: str, how: str) -> tuple[bool, str, str] | None:
    """Record ``peer`` lost in the round's store: ``(first to record it, cause, how)``,
    where a node that recorded why it left is reported as it said; None when the job
    went on without this node (the round's token is no longer the job's)."""
    if current.job_token() != current.token:
        return None  # a stale claim (a partition healed): this node was replaced
    keys, store = current.keys, current.store
    real_cause, real_how = cause, how
    if store.check([keys.left(peer.rank)]):
        # a reason no node wrote is refused: the loss is reported as seen
        leaving = read(store, keys.left(peer.rank), current.peers.refused, parse_leaving)
        if leaving is not None:
            real_cause, real_how = leaving[0], f"it left the job: {leaving[1]}"
    # the description first: whoever reads lost/R finds lost_how/R
    if not store.check([keys.lost_how(peer.rank)]):
        store.set(keys.lost_how(peer.rank), f"{real_cause}:{real_how}")
    first = int(store.add(keys.lost(peer.rank), 1)) == 1
    if first:
        store.set(keys.lost_seq(int(store.add(keys.lost_count, 1))), str(peer.rank))
    return first, real_cause, real_how


def _lost_ranks(store: Any, current: Round, count: int) -> list[int]:
    """The node ranks recorded lost, in order (the first ``count``): O(losses) reads,
    not one per node of the round. A rank whose key its recorder has yet to write (it
    added the count a moment ago) is read at the next look."""
    keys = current.keys
    found: list[int] = []
    for i in range(1, min(count, current.nodes) + 1):  # no more losses than nodes
        if store.check([keys.lost_seq(i)]):  # not a node of the round: skipped
            rank = read(
                store, keys.lost_seq(i), current.peers.refused,
                lambda raw: parse_rank(raw, current.nodes),
            )  # fmt: skip
            if rank is not None:
                found.append(rank)
    return found


def recorded_losses(current: Round) -> list[tuple[int, str]]:
    """The losses recorded in the round's store: ``(node rank, "cause:how")`` each (the
    lost nodes' descriptions read into the round's book, off the caller's lock)."""
    keys, store = current.keys, current.store
    count = int(store.add(keys.lost_count, 0))
    found: list[tuple[int, str]] = []
    for r in _lost_ranks(store, current, count):
        if not store.check([keys.lost_how(r)]):
            continue  # a place with no description first: no node recorded it (never waited for)
        current.peers[r]
        loss = read(store, keys.lost_how(r), current.peers.refused, parse_loss)
        cause, how = ("unknown", "its record of how was refused") if loss is None else loss
        found.append((r, f"{cause}:{how}"))
    return found


def confirmed_losses(store: Any, current: Round, known: set[int]) -> set[int]:
    """The other nodes recorded lost in ``store`` (the round's, on a connection of the
    caller's): ``known`` as it is while the store counts no more losses than it holds."""
    count = int(store.add(current.keys.lost_count, 0))
    if count <= len(known):
        return known
    return known | {r for r in _lost_ranks(store, current, count) if r != current.rank}


def record_leaving(current: Round, cause: str, reason: str) -> None:
    """Record in the round's store that this node leaves the job, and why."""
    record = json.dumps({"cause": cause[:64], "reason": reason[:MAX_REASON]})
    current.store.set(current.keys.left(current.rank), record)


def emit_lost(peer: Peer, cause: str, how: str, latency: float | None, nodes: int) -> None:
    """``node_lost``: ``peer`` is gone from a round of ``nodes`` nodes."""
    events.emit(
        Kind.NODE_LOST,
        cause=cause,
        node=peer.host,
        node_rank=peer.rank,
        how=how,
        latency=latency,
        nodes=nodes,
    )


def emit_isolated(cause: str, how: str, nodes: int) -> None:
    """``node_isolated``: this node is cut off from a round of ``nodes`` nodes."""
    events.emit(Kind.NODE_ISOLATED, cause=cause, how=how, nodes=nodes)


def emit_joined(peers: dict[int, Peer], before: list[str]) -> None:
    """``node_joined`` for each node of the round (``peers``) that the previous round's
    hosts (``before``) did not have: a spare when it replaced one, else a scale-up."""
    hosts = [peers[r].host for r in sorted(peers)]
    replaced = sorted(set(before) - set(hosts))
    for rank, peer in sorted(peers.items()):
        if peer.host not in before:
            events.emit(
                Kind.NODE_JOINED,
                cause="spare" if replaced else "scale_up",
                node=peer.host,
                node_rank=rank,
                nodes=len(hosts),
                replaced=replaced,
            )
