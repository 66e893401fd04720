"""A round of the job as the node roster holds it: the nodes in it (:class:`Peer`, as
each launcher published itself), the ones seen lost (:class:`Loss`), and the round
itself (:class:`Round`: its store, this node's rank in it, its token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Loss", "Peer", "Round"]


@dataclass(frozen=True)
class Peer:
    """A node of the running round, as its launcher published itself."""

    rank: int
    host: str
    addr: str
    port: int
    pid: int
    rdzv: list[Any] | None  # its node in torch's rendezvous (seam.rendezvous_node_id)


@dataclass(frozen=True)
class Loss:
    """A node of the round seen lost (by this launcher or another)."""

    peer: Peer
    cause: str  # connection_reset, silent, left, unhealthy
    how: str
    latency: float | None


@dataclass
class Round:
    """The round this node entered: what every part of the roster reads it by."""

    store: Any  # the round's (prefixed) store
    job_store: Any  # the job's store, across rounds
    rank: int
    nodes: int
    peers: dict[int, Peer]
    token: str
    key: str  # the job-wide round record
    prefix: str  # the roster's keys in the round's store
