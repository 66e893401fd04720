"""steadfast's rendezvous handler: torch's ``RendezvousHandler`` with O(1) store
operations and bytes per node, whatever the number of nodes (issue 28).

torch's dynamic rendezvous keeps one pickled state that holds every node and that every
node rewrites (compare-and-set) to join, to beat and, through ``num_nodes_waiting``, reads
back whole once a second: the store moves O(N^2) bytes per keep-alive interval and the
join is a compare-and-set race on one value. Here (``keys.py`` has the key layout):

- **Join.** A node writes its heartbeat key, takes a ticket of the round with one
  ``add``, and writes which node holds it. A member of the round before keeps its seat
  (its node rank), and counts itself back first (one ``add``).
- **The round forms** when the nodes expected have all taken a ticket (the round
  before's size, minus the members expired as lost, plus the nodes that waited for it:
  one counter) and every member not lost is back (so a waiting spare never takes the
  seat of a member that is only slower to return), when ``max_nodes`` have (the first
  round), or ``last_call_timeout`` after ``min_nodes`` have. The node whose ticket
  completes it reads the holders and their heartbeats (two ``multi_get``, the one O(N)
  read, once per round) and writes the verdict once (compare-and-set): the seats left
  vacant and the newcomers admitted, as runs of numbers (its size grows with the holes,
  not with N). A newcomer (a spare) takes a vacant seat first, so that the survivors
  keep their ranks and the spare takes the lost node's. Every other node waits on the
  verdict key and computes its own rank.
- **Keep-alive.** None through the store while the round runs: a node's liveness is the
  node roster's ring (``launcher/nodes/ring.py``, O(1) per node). A joining node beats
  (its own key, a few bytes) so that a node dying during the join is left out.
  ``num_nodes_waiting`` reads one counter at most once per ``keep_alive_interval``.
- **Spares and late nodes.** A node that finds the round formed without room (a spare:
  ``max_nodes`` reached) or with room (a late node, which makes the members restart for
  it) counts itself into the next round and waits for this one to end.
- **A lost node.** :meth:`expire` marks it (once, whoever sees it first) and takes it
  out of the next round's expected size, so the survivors form the next round the
  moment the last of them arrives, without a last call.

Heartbeats compare wall clocks across nodes, as torch's dynamic rendezvous does: a clock
more than ``keep_alive_interval x keep_alive_max_attempt`` off makes its node look dead
while it joins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ..records import Refusals
from .keys import BACKEND, Keys, MalformedRecord, Verdict, encode_members, parse_holder
from .signed import RecordRefused, round_view

__all__ = ["BACKEND", "Settings", "SteadfastRendezvousHandler"]

logger = logging.getLogger(__name__)

CLOSED = "closed"


@dataclass(frozen=True)
class Settings:
    """A rendezvous' settings (torchrun's ``--nnodes`` and ``--rdzv-conf`` names)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    local_addr: str | None = None
    #: this node hosts the store (the endpoint's host): in a round of newcomers (the
    #: first) it takes rank 0, the others follow their tickets
    first: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"nnodes: min_nodes={self.min_nodes} and max_nodes={self.max_nodes} must "
                "satisfy 1 <= min_nodes <= max_nodes"
            )
        for name in ("join_timeout", "last_call_timeout", "keep_alive_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rdzv-conf {name}: {getattr(self, name)!r} must be > 0")
        if self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"rdzv-conf keep_alive_max_attempt: {self.keep_alive_max_attempt} must be >= 1"
            )

    @property
    def stale_after(self) -> float:
        """A joining node whose heartbeat is older than this is left out of the round."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


class SteadfastRendezvousHandler(RendezvousHandler):
    """A node's side of steadfast's rendezvous over a c10d ``Store`` (a ``TCPStore``, an
    :class:`~.etcd.EtcdV3Store`, the simulator's counting store). One per launcher; its
    calls come from the agent's thread."""

    def __init__(self, store: Any, settings: Settings, node: str | None = None) -> None:
        self.store = store
        self.settings = settings
        #: the join's timeout; the launcher shortens it after a loss (node_lost_timeout)
        self.join_timeout = settings.join_timeout
        self.keys = Keys(settings.run_id)
        host = settings.local_addr or socket.gethostname()
        #: this node's name in the store (a launcher started again is another node)
        self.node = node or f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._round: int | None = None  # the round this node is a member of
        self._seat, self._world = -1, 0  # its rank there, and that round's size
        # (round, ticket, seat, the round before's size) of a join awaiting its verdict
        self._pending: tuple[int, int, int, int | None] | None = None
        self._expired: set[str] = set()
        self._waiting = (0.0, 0)  # (when read, value) of num_nodes_waiting
        self._refused = Refusals()  # malformed records, each said once

    # ------------------------------------------------------------------ the handler API
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers get a store of their own (bootstrap_store_info)

    def get_run_id(self) -> str:
        return self.settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and return this node's rank in it and the round's store.
        Raises ``RendezvousClosedError`` (the job ended), ``RendezvousTimeoutError`` (no
        round within ``join_timeout``), ``RendezvousGracefulExitError`` (a spare when the
        job ended) or ``RendezvousConnectionError`` (the store did not answer)."""
        info: RendezvousInfo = self._call(self._join)
        return info

    def is_closed(self) -> bool:
        return bool(self._call(lambda: self.store.check([self.keys.closed])))

    def set_closed(self) -> None:
        """End the rendezvous: no round forms again; nodes waiting wake and leave (a
        spare gracefully)."""

        def close() -> None:
            s, k = self.store, self.keys
            s.set(k.closed, "1")
            r = self._current_round()
            # a round forming now forms no more, nor does the next (its members look no
            # further than their verdict)
            s.compare_set(k.verdict(r), "", CLOSED)
            s.compare_set(k.verdict(r + 1), "", CLOSED)
            s.set(k.ended(r), "1")  # spares waiting for it wake and see the end

        self._call(close)

    def num_nodes_waiting(self) -> int:
        """Nodes that arrived after this node's round formed while it has room (the
        agent restarts the workers for them). Read from the store at most once per
        ``keep_alive_interval``: one counter, a few bytes."""
        if self._round is None:
            return 0
        at, value = self._waiting
        now = time.monotonic()
        if now - at >= self.settings.keep_alive_interval:
            value = int(self._call(lambda: self.store.add(self.keys.waiting(self._round), 0)))
            self._waiting = (now, value)
        return value

    def shutdown(self) -> bool:
        try:
            self.set_closed()
            return True
        except RendezvousError as exc:
            logger.warning("could not close the rendezvous: %s", exc)
            return False

    # ------------------------------------------------------------ steadfast's additions
    def node_id(self) -> list[Any]:
        """This node in the rendezvous, JSON-able (the node roster passes it around)."""
        return [self.node]

    def expire(self, node_ids: list[list[Any]]) -> int:
        """Mark the nodes ``node_ids`` (from :meth:`node_id`) lost: they are left out of
        the next round, which then forms without waiting for them. Returns how many this
        call counted (a node is counted once job-wide, by whoever expired it first)."""
        counted = 0
        for node_id in node_ids:
            node = str(node_id[0])
            if node in self._expired:
                continue
            self._expired.add(node)
            counted += int(self._call(lambda node=node: self._mark_lost(node)))
        return counted

    def _mark_lost(self, node: str) -> bool:
        """Count ``node`` lost once job-wide (whoever marks it first), in this node's
        round: one fewer expected in the next round, and on the round's list of lost
        nodes, which the next round's decider leaves out should one of them come back."""
        s, k = self.store, self.keys
        s.set(k.heartbeat(node), "0")
        first = s.compare_set(k.lost(node), "", self.node) == self.node.encode()
        if first and self._round is not None:
            s.add(k.delta(self._round), -1)
            s.set(k.lost_seq(self._round, int(s.add(k.lost_count(self._round), 1))), node)
        return bool(first)

    @contextlib.contextmanager
    def join_timeout_of(self, seconds: float) -> Iterator[None]:
        """Within the block a join gives up after ``seconds``."""
        saved, self.join_timeout = self.join_timeout, seconds
        try:
            yield
        finally:
            self.join_timeout = saved

    # ---------------------------------------------------------------------- the protocol
    def _call(self, fn: Any) -> Any:
        """``fn()``, a store error (c10d's ``DistError``, an etcd member not answering)
        raised as ``RendezvousConnectionError``; the rendezvous' own errors as they are."""
        try:
            return fn()
        except (RuntimeError, OSError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the rendezvous store did not answer: {exc}") from exc

    def _closed(self) -> str:
        return f"the rendezvous {self.settings.run_id!r} is closed"

    def _verdict(self, r: int, raw: bytes) -> Verdict:
        """Round ``r``'s verdict; one no node of the job wrote is refused: no node acts on it."""
        try:
            return Verdict.from_json(raw)
        except MalformedRecord as exc:
            key = self.keys.verdict(r)
            self._refused.say(key, raw, "malformed")
            msg = f"round {r}'s verdict ({key}) is not one this job's nodes wrote ({exc})"
            raise RendezvousError(msg + ": give the job a secret (control-plane.md)") from None

    def _current_round(self) -> int:
        return int(self.store.compare_set(self.keys.round, "", "0"))

    def _wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` exists within ``seconds`` (a store wait; a check when no time
        is left)."""
        if seconds < 0.001:
            return bool(self.store.check([key]))
        return self._wait_all([key], seconds)

    def _wait_all(self, keys: list[str], seconds: float) -> bool:
        """Whether every one of ``keys`` exists within ``seconds`` (one store wait)."""
        try:
            self.store.wait(keys, timedelta(seconds=seconds))
            return True
        except RuntimeError as exc:  # DistStoreError: the wait timed out
            if "timeout" not in str(exc).lower():
                raise
            return False

    def _join(self) -> RendezvousInfo:
        s, k, cfg = self.store, self.keys, self.settings
        deadline = time.monotonic() + self.join_timeout
        previous: int | None = None  # the size of the round before r, where known
        seat = -1
        if self._round is not None:  # a member of round r starts the next one
            r, previous, seat = self._round, self._world, self._seat
            if int(s.add(k.leaving(r), 1)) == 1:  # the first member to leave ends it
                s.compare_set(k.round, str(r), str(r + 1))
                s.set(k.ended(r), "1")
            self._round, self._seat = None, -1
            r += 1
        elif self._pending is not None:  # joining again after the store failed
            r, _, seat, previous = self._pending
        else:
            if s.check([k.closed]):
                raise RendezvousClosedError(self._closed())
            r = self._current_round()
        while True:
            if self._pending is not None and self._pending[0] == r:
                ticket = self._pending[1]  # (its seat and the round before's, kept too)
            elif seat < 0 and s.check([k.verdict(r)]):  # round r formed without this node
                r, previous = self._wait_for_next(r, deadline)
                continue
            else:
                if seat >= 0:  # counted before its ticket: a ticket that completes the
                    s.add(k.members(r), 1)  # round sees every member before it
                ticket = int(s.add(k.ticket(r), 1))
                host, port = self.settings.local_addr or socket.getfqdn(), _free_port()
                record = [self.node, seat, time.time(), host, port, 0 if cfg.first else 1]
                s.set(k.holder(r, ticket), json.dumps(record))
                self._pending = (r, ticket, seat, previous)
            raw = self._await_verdict(r, ticket, seat, previous, deadline)
            self._pending = None
            if raw == CLOSED.encode():
                raise RendezvousClosedError(self._closed())
            verdict = self._verdict(r, raw)
            rank = verdict.rank(ticket, seat)
            if rank is None:  # a spare of round r, or too late for it
                r, previous = self._wait_for_next(r, deadline)
                seat = -1
                continue
            break
        self._round, self._seat, self._world = r, rank, verdict.world
        self._waiting = (time.monotonic(), 0)
        store = round_view(s, k.round_store(r))  # a signed store's can clone
        bootstrap = RendezvousStoreInfo(verdict.master_addr, verdict.master_port)
        return RendezvousInfo(store, rank, verdict.world, bootstrap)

    def _wait_for_next(self, r: int, deadline: float) -> tuple[int, int]:
        """Round ``r`` formed without this node: count it into the next round (and, if
        ``r`` has room, make its members restart for it), wait for ``r`` to end. Returns
        the next round and ``r``'s size."""
        s, k = self.store, self.keys
        raw = s.get(k.verdict(r))
        if raw == CLOSED.encode():
            raise RendezvousClosedError(self._closed())
        world = self._verdict(r, raw).world
        spare = world >= self.settings.max_nodes
        s.add(k.delta(r), 1)
        if not spare:
            s.add(k.waiting(r), 1)
        logger.info(
            "rendezvous round %d formed with %d nodes without this node: %s",
            r, world, "a spare, waiting for it to end" if spare else "waiting to join the next",
        )  # fmt: skip
        while not self._wait(k.ended(r), 60.0 if spare else min(60.0, self._left(deadline))):
            if not spare and self._left(deadline) <= 0:
                raise RendezvousTimeoutError(
                    f"round {r} of rendezvous {self.settings.run_id!r} did not make room for "
                    f"this node within join_timeout={self.join_timeout:g} s"
                )
        if s.check([k.closed]):
            message = self._closed()
            if spare:
                raise RendezvousGracefulExitError(message + ": the job ended without this spare")
            raise RendezvousClosedError(message)
        return r + 1, world

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _previous_world(self, r: int) -> int | None:
        """Round ``r - 1``'s size, from its verdict (None: no such round)."""
        s, k = self.store, self.keys
        if r == 0 or not s.check([k.verdict(r - 1)]):
            return None
        raw = s.get(k.verdict(r - 1))
        return None if raw == CLOSED.encode() else self._verdict(r - 1, raw).world

    def _completes(self, r: int, ticket: int, previous: int | None) -> bool:
        """Whether ``ticket`` completes round ``r``: ``max_nodes`` tickets in the first
        round; after it, the round before's size plus its delta (nodes waiting for it
        in, lost members out). A ticket below ``min_nodes`` never completes a round (no
        read)."""
        cfg = self.settings
        if ticket < cfg.min_nodes:
            return False
        if previous is None:
            previous = self._previous_world(r)
        if previous is None:
            return ticket >= cfg.max_nodes
        s, k = self.store, self.keys
        expected = max(1, previous + int(s.add(k.delta(r - 1), 0)))
        if not (ticket >= expected or (ticket >= cfg.max_nodes and expected <= cfg.max_nodes)):
            return False
        # and every member of the round before that was not lost is back: a spare that
        # waited for this round counts as a ticket, but must not take the seat of a member
        # that is only slower to come back (after a rank's failure, say); one that does
        # not come is left out by the last call
        lost = int(s.add(k.lost_count(r - 1), 0))
        return int(s.add(k.members(r), 0)) >= previous - lost

    def _await_verdict(
        self, r: int, ticket: int, seat: int, previous: int | None, deadline: float
    ) -> bytes:
        """Wait for round ``r``'s verdict; the node whose ticket completes the round (or
        reaches ``min_nodes``, after the last call; or any, late, if those died) writes
        it. A node waiting longer than a keep-alive interval beats (its own key), so the
        decider can tell it from a node that died during the join."""
        s, k, cfg = self.store, self.keys, self.settings
        now = time.monotonic()
        if self._completes(r, ticket, previous):
            act = now
        elif ticket == cfg.min_nodes:
            act = now + cfg.last_call_timeout
        else:  # a fallback, should the nodes above die before deciding
            act = now + cfg.last_call_timeout + cfg.stale_after + 0.5 * min(ticket - 1, 16)
        beat = now + cfg.keep_alive_interval
        while True:
            now = time.monotonic()
            if now >= act:
                self._decide(r)
                act = now + cfg.keep_alive_interval
            if now >= beat:
                s.set(k.heartbeat(self.node), f"{time.time():.3f}")
                beat = now + cfg.keep_alive_interval
            if now >= deadline:
                with contextlib.suppress(Exception):
                    s.set(k.heartbeat(self.node), "0")  # leave the round forming
                self._pending = None
                raise RendezvousTimeoutError(
                    f"round {r} of rendezvous {self.settings.run_id!r} did not form within "
                    f"join_timeout={self.join_timeout:g} s (min_nodes={cfg.min_nodes})"
                )
            if self._wait(k.verdict(r), min(act, beat, deadline) - now):
                return bytes(s.get(k.verdict(r)))

    def _alive(self, r: int, holders: list[str], infos: list[list[Any]]) -> list[bool]:
        """Which ticket holders of round ``r`` are alive: not expired in the round before,
        and beating (the time in the holder's key, or, for one that has waited longer,
        its heartbeat key: read only for those)."""
        s, k, cfg = self.store, self.keys, self.settings
        lost: set[str] = set()
        if r > 0:
            count = int(s.add(k.lost_count(r - 1), 0))
            keys = [k.lost_seq(r - 1, i) for i in range(1, count + 1)]
            if keys and s.check(keys):
                lost = {bytes(v).decode(errors="replace") for v in s.multi_get(keys)}
        now, alive = time.time(), []
        for info in infos:
            node, at = str(info[0]), float(info[2])
            if node in lost:
                alive.append(False)
                continue
            if now - at > cfg.stale_after:  # joined a while ago: its heartbeat says
                key = k.heartbeat(node)
                at = self._beat(key) if s.check([key]) else 0.0
            alive.append(at > 0 and now - at <= cfg.stale_after)
        return alive

    def _sealed(self, key: str) -> bytes | None:
        with contextlib.suppress(RecordRefused):
            return bytes(self.store.get(key))
        return None

    def _beat(self, key: str) -> float:
        """A heartbeat key's time (0: none a node wrote, reported once)."""
        raw = self.store.get(key)
        try:
            at = float(raw)
        except (ValueError, UnicodeDecodeError):
            at = math.nan
        if not math.isfinite(at):
            self._refused.say(key, raw, "malformed")
            return 0.0
        return at

    def _decide(self, r: int) -> None:
        """Write round ``r``'s verdict if ``min_nodes`` live ticket holders are there:
        the members of the round before keep their seats, newcomers by ticket fill the
        vacant seats, then new ones, up to ``max_nodes``; the master address is node rank
        0's."""
        s, k, cfg = self.store, self.keys, self.settings
        if s.check([k.verdict(r)]):
            return
        count = int(s.add(k.ticket(r), 0))
        holders = [k.holder(r, t) for t in range(1, count + 1)]
        # one wait, answered at once when every holder wrote its key (a poll's count grew
        # with a loaded machine's delays); one that died there: a check per holder, once
        if holders and not self._wait_all(holders, 1.0):
            holders = [h for h in holders if s.check([h])]
        if not holders:
            return
        try:
            raws: list[bytes | None] = list(s.multi_get(holders))
        except RecordRefused:  # one is not the job's (said once): one by one, this once
            raws = [self._sealed(h) for h in holders]
        infos, kept = [], []
        for holder, raw in zip(holders, raws, strict=True):
            try:  # a record not a node's is left out of the round, said once
                if raw is not None:
                    infos.append(parse_holder(raw))
                    kept.append(holder)
            except MalformedRecord:
                self._refused.say(holder, raw or b"", "malformed")
        holders = kept
        seats: dict[int, list[Any]] = {}
        newcomers: dict[int, list[Any]] = {}
        seen: set[str] = set()
        for holder, info, alive in zip(holders, infos, self._alive(r, holders, infos), strict=True):
            if not alive or info[0] in seen:
                continue  # expired, dead during the join, or twice
            seen.add(info[0])
            if int(info[1]) >= 0:
                seats[int(info[1])] = info
            else:
                newcomers[int(holder.rsplit("/", 1)[1])] = info
        if len(seats) + len(newcomers) < cfg.min_nodes:
            return
        previous = max(seats) + 1 if seats else 0
        previous = max(previous, self._previous_world(r) or 0)
        vacant = [x for x in range(previous) if x not in seats]
        # the store's host first (a holder's last field: 0), then by ticket: runs still
        admitted = sorted(newcomers, key=lambda t: (newcomers[t][5:6] != [0], t))
        admitted = admitted[: max(0, cfg.max_nodes - len(seats))]
        # node rank 0 (its address is the workers' store): seat 0 kept, else the newcomer
        # that takes it, else the lowest seat kept (the ranks close up before it)
        if 0 in seats:
            first = seats[0]
        elif admitted and (vacant[:1] == [0] or not seats):
            first = newcomers[admitted[0]]
        else:
            first = seats[min(seats)]
        verdict = Verdict(
            world=len(seats) + len(admitted),
            previous=previous,
            vacant=encode_members(vacant),
            newcomers=encode_members(admitted),
            master_addr=str(first[3]),
            master_port=int(first[4]),
        )
        s.compare_set(k.verdict(r), "", verdict.to_json())


def _free_port() -> int:
    """A port free on this node now (the workers' store, should this node be rank 0;
    as torch's rendezvous picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
