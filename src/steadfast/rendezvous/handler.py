"""steadfast's rendezvous handler: torch's ``RendezvousHandler`` with O(1) store
operations and bytes per node, whatever the number of nodes (issue 28).

torch's dynamic rendezvous keeps one pickled state that holds every node and that every
node rewrites (compare-and-set) to join, to beat and, through ``num_nodes_waiting``, reads
back whole once a second: the store moves O(N^2) bytes per keep-alive interval and the
join is a compare-and-set race on one value. Here (``keys.py`` has the key layout):

- **Join.** A node writes its heartbeat key, takes a ticket of the round with one
  ``add``, and writes which node holds it. A member of the round before keeps its seat
  (its node rank).
- **The round forms** when the nodes expected have all taken a ticket (the round
  before's size, minus the members expired as lost, plus the nodes that waited for it:
  one counter), when ``max_nodes`` have (the first round), or ``last_call_timeout`` after
  ``min_nodes`` have. The node whose ticket completes it reads the holders and their
  heartbeats (two ``multi_get``, the one O(N) read, once per round) and writes the
  verdict once (compare-and-set): the seats left vacant and the newcomers admitted, as
  runs of numbers (its size grows with the holes, not with N). A newcomer (a spare)
  takes a vacant seat first, so that the survivors keep their ranks and the spare takes
  the lost node's. Every other node waits on the verdict key and computes its own rank.
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
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from .keys import Keys, decode_members, encode_members, rank_of

__all__ = ["BACKEND", "Settings", "SteadfastRendezvousHandler", "create_handler"]

logger = logging.getLogger(__name__)

BACKEND = "steadfast"
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


@dataclass(frozen=True)
class Verdict:
    """A formed round: its size, the round before's size (``previous``), the seats of
    that round left vacant (``vacant``, encoded runs) and the newcomers admitted, by
    ticket (``newcomers``, encoded runs), who fill the vacant seats first, in order."""

    world: int
    previous: int
    vacant: str
    newcomers: str

    def to_json(self) -> str:
        return json.dumps(
            {"w": self.world, "p": self.previous, "v": self.vacant, "n": self.newcomers}
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Verdict:
        data = json.loads(raw)
        return cls(int(data["w"]), int(data["p"]), str(data["v"]), str(data["n"]))

    def rank(self, ticket: int, seat: int) -> int | None:
        """The rank of the node that holds ``ticket`` (``seat``: its rank in the round
        before, -1 for a newcomer); None when it is not admitted."""
        if seat >= 0:
            if rank_of(self.vacant, seat) is not None:
                return None  # judged lost (or its seat given away): it was too late
            return seat - self._removed_before(seat)
        filled = rank_of(self.newcomers, ticket)
        if filled is None:
            return None
        seat = self._seat_of_newcomer(filled)
        return seat - self._removed_before(seat)

    def _seat_of_newcomer(self, index: int) -> int:
        """Newcomer ``index`` (0-based, by ticket) takes the index-th vacant seat, or a
        new seat after the round before's once the vacant ones are taken."""
        position = 0
        for first, last in decode_members(self.vacant):
            if index < position + last - first + 1:
                return first + index - position
            position += last - first + 1
        return self.previous + index - position

    def _removed_before(self, seat: int) -> int:
        """How many vacant seats no newcomer took lie before ``seat`` (the ranks after
        them close up)."""
        admitted = sum(last - first + 1 for first, last in decode_members(self.newcomers))
        position = removed = 0
        for first, last in decode_members(self.vacant):
            for s in range(first, last + 1):
                if position >= admitted and s < seat:
                    removed += 1
                position += 1
        return removed


class SteadfastRendezvousHandler(RendezvousHandler):
    """A node's side of steadfast's rendezvous over a c10d store (``TCPStore``, or any
    object with the store's ``set``/``get``/``add``/``check``/``wait``/``compare_set``/
    ``multi_get``). One per launcher; its calls come from the agent's thread."""

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
        self._seat = -1  # its rank there
        self._world = 0
        self._pending: tuple[int, int] | None = None  # (round, ticket) awaiting a verdict
        self._expired: set[str] = set()
        self._waiting = (0.0, 0)  # (when read, value) of num_nodes_waiting

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
        try:
            return self._join()
        except RendezvousError:
            raise
        except (RuntimeError, OSError, TimeoutError) as exc:  # the store's (DistError...)
            raise RendezvousConnectionError(f"the rendezvous store did not answer: {exc}") from exc

    def is_closed(self) -> bool:
        return bool(self._call(lambda: self.store.check([self.keys.closed])))

    def set_closed(self) -> None:
        """End the rendezvous: no round forms again; nodes waiting wake and leave (a
        spare gracefully)."""

        def close() -> None:
            s, k = self.store, self.keys
            s.set(k.closed, "1")
            r = self._current_round()
            s.compare_set(k.verdict(r), "", CLOSED)  # a round forming now forms no more
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
        s, k = self.store, self.keys
        s.set(k.heartbeat(node), "0")
        first = s.compare_set(k.lost(node), "", self.node) == self.node.encode()
        if first and self._round is not None:
            s.add(k.delta(self._round), -1)
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
        try:
            return fn()
        except (RuntimeError, OSError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the rendezvous store did not answer: {exc}") from exc

    def _current_round(self) -> int:
        return int(self.store.compare_set(self.keys.round, "", "0"))

    def _beat(self) -> None:
        self.store.set(self.keys.heartbeat(self.node), f"{time.time():.3f}")

    def _wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` exists within ``seconds`` (a store wait; a check when no time
        is left)."""
        if seconds < 0.001:
            return bool(self.store.check([key]))
        try:
            self.store.wait([key], timedelta(seconds=seconds))
            return True
        except RuntimeError as exc:  # DistStoreError: the wait timed out
            if "timeout" not in str(exc).lower():
                raise
            return False

    def _join(self) -> RendezvousInfo:
        s, k = self.store, self.keys
        deadline = time.monotonic() + self.join_timeout
        if s.check([k.closed]):
            raise RendezvousClosedError(f"the rendezvous {self.settings.run_id!r} is closed")
        previous: int | None = None  # the size of the round before r, where known
        seat = -1
        if self._round is not None:  # a member of round r starts the next one
            r, previous, seat = self._round, self._world, self._seat
            s.set(k.ended(r), "1")
            s.compare_set(k.round, str(r), str(r + 1))
            self._round, self._seat = None, -1
            r += 1
        elif self._pending is not None:  # joining again after the store failed
            r = self._pending[0]
        else:
            r = self._current_round()
        while True:
            if self._pending is not None and self._pending[0] == r:
                ticket = self._pending[1]
            elif s.check([k.verdict(r)]):  # round r formed without this node
                r, previous = self._wait_for_next(r, deadline)
                seat = -1
                continue
            else:
                self._beat()
                ticket = int(s.add(k.ticket(r), 1))
                s.set(k.holder(r, ticket), json.dumps([self.node, seat]))
                self._pending = (r, ticket)
            raw = self._await_verdict(r, ticket, previous, deadline)
            self._pending = None
            if raw == CLOSED.encode():
                raise RendezvousClosedError(f"the rendezvous {self.settings.run_id!r} is closed")
            verdict = Verdict.from_json(raw)
            rank = verdict.rank(ticket, seat)
            if rank is None:  # a spare of round r, or too late for it
                r, previous = self._wait_for_next(r, deadline)
                seat = -1
                continue
            break
        self._round, self._seat, self._world = r, rank, verdict.world
        self._waiting = (time.monotonic(), 0)
        store = _prefixed(k.round_store(r), s)
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self.settings.local_addr)
        return RendezvousInfo(store, rank, verdict.world, bootstrap)

    def _wait_for_next(self, r: int, deadline: float) -> tuple[int, int]:
        """Round ``r`` formed without this node: count it into the next round (and, if
        ``r`` has room, make its members restart for it), wait for ``r`` to end. Returns
        the next round and ``r``'s size."""
        s, k = self.store, self.keys
        raw = s.get(k.verdict(r))
        if raw == CLOSED.encode():
            raise RendezvousClosedError(f"the rendezvous {self.settings.run_id!r} is closed")
        world = Verdict.from_json(raw).world
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
            message = f"the rendezvous {self.settings.run_id!r} is closed"
            if spare:
                raise RendezvousGracefulExitError(message + ": the job ended without this spare")
            raise RendezvousClosedError(message)
        return r + 1, world

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _expected(self, r: int, previous: int | None) -> int:
        """How many tickets complete round ``r``: ``max_nodes`` for the first round;
        after it, the round before's size plus its delta (waiting nodes in, lost out)."""
        s, k = self.store, self.keys
        if r == 0:
            return self.settings.max_nodes
        if previous is None:
            if not s.check([k.verdict(r - 1)]):
                return self.settings.max_nodes
            raw = s.get(k.verdict(r - 1))
            if raw == CLOSED.encode():
                return self.settings.max_nodes
            previous = Verdict.from_json(raw).world
        return max(1, previous + int(s.add(k.delta(r - 1), 0)))

    def _await_verdict(self, r: int, ticket: int, previous: int | None, deadline: float) -> bytes:
        """Wait for round ``r``'s verdict, beating; the node whose ticket completes the
        round (or reaches ``min_nodes``, after the last call; or any, late, if those
        died) writes it."""
        s, k, cfg = self.store, self.keys, self.settings
        now = time.monotonic()
        expected = self._expected(r, previous)
        if ticket >= expected or (ticket >= cfg.max_nodes and expected <= cfg.max_nodes):
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
                self._beat()
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

    def _decide(self, r: int) -> None:
        """Write round ``r``'s verdict if ``min_nodes`` live ticket holders are there:
        the members of the round before keep their seats, newcomers by ticket fill the
        vacant seats, then new ones, up to ``max_nodes``."""
        s, k, cfg = self.store, self.keys, self.settings
        if s.check([k.verdict(r)]):
            return
        count = int(s.add(k.ticket(r), 0))
        holders = [k.holder(r, t) for t in range(1, count + 1)]
        if holders and not s.check(holders):  # a node between its ticket and its key
            time.sleep(0.05)
            holders = [h for h in holders if s.check([h])]
        if not holders:
            return
        infos = [json.loads(raw) for raw in s.multi_get(holders)]
        beats = s.multi_get([k.heartbeat(str(info[0])) for info in infos])
        now = time.time()
        seats: set[int] = set()
        newcomers: list[int] = []
        seen: set[str] = set()
        for holder, (node, seat), beat in zip(holders, infos, beats, strict=True):
            try:
                at = float(beat)
            except ValueError:
                continue
            if node in seen or at <= 0 or now - at > cfg.stale_after:
                continue  # expired, dying during the join, or twice
            seen.add(node)
            if seat >= 0:
                seats.add(int(seat))
            else:
                newcomers.append(int(holder.rsplit("/", 1)[1]))
        if len(seats) + len(newcomers) < cfg.min_nodes:
            return
        previous = max(seats) + 1 if seats else 0
        if r > 0 and s.check([k.verdict(r - 1)]):
            raw = s.get(k.verdict(r - 1))
            if raw != CLOSED.encode():
                previous = max(previous, Verdict.from_json(raw).world)
        vacant = [x for x in range(previous) if x not in seats]
        room = cfg.max_nodes - len(seats)
        admitted = sorted(newcomers)[: max(0, room)]
        verdict = Verdict(
            world=len(seats) + len(admitted),
            previous=previous,
            vacant=encode_members(vacant),
            newcomers=encode_members(admitted),
        )
        s.compare_set(k.verdict(r), "", verdict.to_json())


class _Prefixed:
    """Keys under a prefix, for a store that is not a c10d ``Store`` (the simulator's
    counting client); a real store gets torch's ``PrefixStore``."""

    def __init__(self, prefix: str, store: Any) -> None:
        self.prefix, self.underlying_store = prefix, store

    def set(self, key: str, value: Any) -> None:
        self.underlying_store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.underlying_store.get(self.prefix + key))

    def add(self, key: str, amount: int) -> int:
        return int(self.underlying_store.add(self.prefix + key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.underlying_store.check([self.prefix + x for x in keys]))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self.underlying_store.multi_get([self.prefix + x for x in keys])]


def _prefixed(prefix: str, store: Any) -> Any:
    import torch.distributed as dist

    if isinstance(store, dist.Store):  # type: ignore[attr-defined]
        return dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    return _Prefixed(prefix, store)


def _seconds(params: RendezvousParameters, name: str, default: float) -> float:
    raw = params.get(name, None)
    if raw is None:
        return default
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf {name}: {raw!r} is not a number of seconds") from None


def create_handler(params: RendezvousParameters) -> SteadfastRendezvousHandler:
    """torch's rendezvous registry's creator for ``--rdzv-backend steadfast``: the store
    as torch's c10d backend makes it (``--rdzv-endpoint``; ``is_host``, ``read_timeout``
    and ``store_type`` in ``--rdzv-conf``), the settings from ``--nnodes`` and
    ``--rdzv-conf`` (``join_timeout``, ``last_call_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``). A requeued Slurm job (``SLURM_RESTART_COUNT``) uses
    keys of its own, so that a store that outlived the job's first run (etcd) does not
    hand it the closed rendezvous of the run before."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    run_id = params.run_id
    restart = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    if restart and restart != "0":
        run_id = f"{run_id}.requeue{restart}"
    settings = Settings(
        run_id=run_id,
        min_nodes=int(params.min_nodes),
        max_nodes=int(params.max_nodes),
        join_timeout=_seconds(params, "join_timeout", 600.0),
        last_call_timeout=_seconds(params, "last_call_timeout", 30.0),
        keep_alive_interval=_seconds(params, "keep_alive_interval", 5.0),
        keep_alive_max_attempt=int(_seconds(params, "keep_alive_max_attempt", 3)),
        local_addr=params.local_addr,
    )
    _, store = create_backend(params)
    return SteadfastRendezvousHandler(store, settings)
