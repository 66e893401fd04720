"""A round of the job as the node roster holds it: the nodes in it (:class:`Peer`, as
each launcher published itself), the ones seen lost (:class:`Loss`), the round itself
(:class:`Round`: its store, this node's rank in it, its token) and the keys the roster
keeps in the stores (:class:`RoundKeys`, the one place they are spelt)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...records import MalformedRecord, Refusals
from ...rendezvous.signed import RecordRefused
from .records import parse_hosts, parse_peer, parse_round, parse_token, read

__all__ = [
    "Loss",
    "Peer",
    "PeerBook",
    "Round",
    "RoundKeys",
    "every_peer",
    "own_connection",
    "previous_hosts",
    "round_token",
]


@dataclass(frozen=True)
class Peer:
    """A node of the running round, as its launcher published itself."""

    rank: int
    host: str
    addr: str
    port: int
    pid: int
    rdzv: list[Any] | None  # its node in torch's rendezvous (seam.rendezvous_node_id)

    @classmethod
    def read(cls, store: Any, key: str, rank: int, refused: Refusals) -> Peer:
        """Node ``rank``'s record at ``key`` (see :meth:`parse`)."""
        peer = read(store, key, refused, lambda raw: cls(**parse_peer(raw, rank)))
        return cls.stand_in(rank) if peer is None else peer

    @classmethod
    def parse(cls, raw: bytes | str, key: str, rank: int, refused: Refusals) -> Peer:
        """Node ``rank``'s record ``raw``; one its launcher did not write (refused, said
        once) gives a stand-in that names the node by its rank and has no address: never
        watched, so a forged address is not taken for the node lost."""
        try:
            return cls(**parse_peer(raw, rank))
        except MalformedRecord as exc:
            refused.malformed(key, raw, exc)
            return cls.stand_in(rank)

    @classmethod
    def stand_in(cls, rank: int) -> Peer:
        """Node ``rank`` whose record was refused: named by its rank, no address."""
        return cls(rank, f"node rank {rank}", "", 0, 0, None)

    @property
    def reachable(self) -> bool:
        """Whether its record gave an address to watch it at."""
        return self.port > 0


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

    def __init__(
        self,
        store: Any,
        keys: RoundKeys,
        known: dict[int, Peer],
        refused: Refusals | None = None,
    ) -> None:
        self._store, self._keys, self._known = store, keys, dict(known)
        #: the round's records refused so far (each said once)
        self.refused = refused or Refusals()

    def known(self) -> set[int]:
        """The node ranks already read (no store call to name them)."""
        return set(self._known)

    def __getitem__(self, rank: int) -> Peer:
        peer = self._known.get(rank)
        if peer is None:
            peer = Peer.read(self._store, self._keys.node(rank), rank, self.refused)
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
    waits: Any  # a connection of its own, for the calls that block (see own_connection)

    def job_token(self) -> str:
        """The token of the job's current round (a live read of the job's store): this
        round's :attr:`token` while the job has formed no newer one. A record no node
        wrote (refused, said once) tells of no newer round: this round's token."""
        token = read(self.job_store, self.keys.record, self.peers.refused, parse_round)
        return self.token if token is None else token


def own_connection(store: Any) -> Any:
    """A connection of its own to ``store`` (a TCPStore's ``clone``), made when the round
    forms, for the calls that block on the store (the fault's verdict, the exit barrier)
    without holding the roster's client. Never made at fault time: torch's store writes
    a new connection's peer address by a reverse DNS lookup, on the server's one event
    thread, so a slow resolver (a nameserver that drops a query: glibc retries it after
    5 s) holds every node's request to the store for as long, and a node's claim then
    came after the others' claim window (they sealed the verdict without it). The
    store's own client where it has no ``clone`` (etcd's: each call is a request of its
    own already)."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):
        return store


def every_peer(store: Any, keys: RoundKeys, nodes: int, refused: Refusals) -> dict[int, Peer]:
    """Every node's record, in one read (node rank 0's round record)."""
    everyone = [keys.node(r) for r in range(nodes)]
    try:
        found = store.multi_get(everyone)
    except RecordRefused:  # one not bound to the secret (said once): one by one, this once
        return {r: Peer.read(store, keys.node(r), r, refused) for r in range(nodes)}
    return {r: Peer.parse(raw, keys.node(r), r, refused) for r, raw in enumerate(found)}


def previous_hosts(job_store: Any, keys: RoundKeys, refused: Refusals) -> list[str] | None:
    """The job's previous round's hosts (None: no round before, or a record no node
    wrote: then no ``node_joined`` is said)."""
    if not job_store.check([keys.record_nodes]):
        return None
    return read(job_store, keys.record_nodes, refused, parse_hosts)


def round_token(store: Any, keys: RoundKeys, refused: Refusals, timeout: float) -> str:
    """The round's token as node rank 0 set it. A token no node wrote is read again (node
    rank 0's own may overwrite it) up to ``timeout`` seconds, then refused with one error
    naming the key."""
    deadline = time.monotonic() + timeout
    while True:
        token = read(store, keys.token, refused, parse_token)
        if token is not None:
            return token
        if time.monotonic() > deadline:
            raise MalformedRecord(
                f"the round's token ({keys.token}) is not one node rank 0 writes, and no "
                f"other came in {timeout:g} s (the log says why it was refused): give the "
                "job a secret, or keep its store to its own nodes (docs/control-plane.md)"
            )
        time.sleep(0.2)
