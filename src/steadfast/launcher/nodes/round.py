"""A round of the job as the node roster holds it: the nodes in it (:class:`Peer`, as
each launcher published itself), the ones seen lost (:class:`Loss`), the round itself
(:class:`Round`: its store, this node's rank in it, its token) and the keys the roster
keeps in the stores (:class:`RoundKeys`, the one place they are spelt)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Loss", "Peer", "PeerBook", "Round", "RoundKeys"]


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


class RoundKeys:
    """Every key the roster reads or writes, in the round's store and in the job's.

    In the round's store, under :attr:`prefix` (``steadfast/``, or ``steadfast/g<N>/``
    where the rendezvous hands out one store for every round (static): the round's
    number keeps the rounds apart):

    - ``node/<R>``: node rank R's :class:`Peer`, as JSON (:meth:`node`);
    - ``token``: the round's token, which node rank 0 sets (:attr:`token`);
    - ``left/<R>``: why node R leaves the job, written before it goes (:meth:`left`);
    - ``lost_how/<R>`` (``cause:how``), then ``lost/<R>`` (a count: the launcher that
      adds the first reports the loss), ``lost_count`` (the losses recorded) and
      ``lost_seq/<i>`` (the i-th node recorded lost: a reader reads the losses, not
      every node's key) (:meth:`lost_how`, :meth:`lost`, :attr:`lost_count`,
      :meth:`lost_seq`);
    - ``exit/<R>``, ``exit/count`` and ``exit/all``: the exit barrier (:meth:`exit`,
      :attr:`exit_count`, :attr:`exit_all`);
    - ``fault/claim``, ``fault/claims``, ``fault/count`` and ``fault/verdict``: the
      round's fault's one culprit (:mod:`.culprit`).

    In the job's store, across rounds: ``steadfast/<run id>/round``, the job's current
    round's token (JSON, :attr:`record`: every fence probe reads it, so it stays a few
    bytes), ``steadfast/<run id>/round/nodes``, its nodes' hosts (JSON, node rank 0's
    only, :attr:`record_nodes`), and ``steadfast/<run id>/round/fence``, which each fence
    probe adds to (:attr:`fence`).
    """

    def __init__(self, run_id: str, generation: int | None = None) -> None:
        """``generation``: the round's number, where every round has the same store."""
        self.prefix = "steadfast/" if generation is None else f"steadfast/g{generation}/"
        self.record = f"steadfast/{run_id}/round"
        self.fence = f"{self.record}/fence"
        self.record_nodes = f"{self.record}/nodes"
        self.token = f"{self.prefix}token"
        self.lost_count = f"{self.prefix}lost_count"
        self.exit_count = f"{self.prefix}exit/count"
        self.exit_all = f"{self.prefix}exit/all"
        self.fault_claim = f"{self.prefix}fault/claim"
        self.fault_claims = f"{self.prefix}fault/claims"
        self.fault_count = f"{self.prefix}fault/count"
        self.fault_verdict = f"{self.prefix}fault/verdict"

    def node(self, rank: int) -> str:
        """Where node ``rank`` publishes itself."""
        return f"{self.prefix}node/{rank}"

    def left(self, rank: int) -> str:
        """Why node ``rank`` left the job."""
        return f"{self.prefix}left/{rank}"

    def lost(self, rank: int) -> str:
        """How many launchers recorded node ``rank`` lost."""
        return f"{self.prefix}lost/{rank}"

    def lost_seq(self, index: int) -> str:
        """The node rank recorded lost ``index``-th (1-based) in the round."""
        return f"{self.prefix}lost_seq/{index}"

    def lost_how(self, rank: int) -> str:
        """How node ``rank`` was lost (``cause:how``)."""
        return f"{self.prefix}lost_how/{rank}"

    def exit(self, rank: int) -> str:
        """Node ``rank`` finished its workers (the exit barrier)."""
        return f"{self.prefix}exit/{rank}"


class PeerBook:
    """The round's nodes by node rank, read from the round's store when first asked
    for: a node needs the few it watches, and the description of a node only when it is
    lost, so entering a round costs it O(1) store reads whatever the job's size (reading
    every node's key made each round O(N^2) reads job-wide)."""

    def __init__(self, store: Any, keys: RoundKeys, known: dict[int, Peer]) -> None:
        self._store, self._keys, self._known = store, keys, dict(known)

    def known(self) -> set[int]:
        """The node ranks already read (no store call to name them)."""
        return set(self._known)

    def __getitem__(self, rank: int) -> Peer:
        peer = self._known.get(rank)
        if peer is None:
            peer = Peer(**json.loads(self._store.get(self._keys.node(rank))))
            self._known[rank] = peer
        return peer


@dataclass
class Round:
    """The round this node entered: what every part of the roster reads it by."""

    store: Any  # the round's (prefixed) store
    job_store: Any  # the job's store, across rounds
    rank: int
    nodes: int
    peers: PeerBook
    token: str
    keys: RoundKeys

    def job_token(self) -> str:
        """The token of the job's current round (a live read of the job's store): this
        round's :attr:`token` while the job has formed no newer one."""
        return str(json.loads(self.job_store.get(self.keys.record))["token"])
