"""The node roster: this launcher's front on the round's nodes, the owner of a round's
lifetime here (enter, leave, finish, close) and of what this node knows of it: which
nodes are lost (seen by its ring watch, or confirmed in the store by another launcher)
and whether it is cut off. Its parts: the ring watch (:mod:`.ring`), the losses in the
store (:mod:`.confirm`), the fence's answers (:mod:`.fence`), both on store threads of
their own (:mod:`.store_calls`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from enum import Enum
from typing import Any

from ...config import FaultToleranceConfig
from ...fence import FENCE_ENV, FENCE_TIMEOUT_ENV
from ...records import Refusals
from .confirm import (
    claim_loss,
    emit_isolated,
    emit_joined,
    emit_lost,
    record_leaving,
    recorded_losses,
)
from .culprit import CLAIM_WINDOW, Claim, Verdict, agree
from .exit_barrier import exit_barrier
from .fence import Fence
from .ring import WATCHERS, Ring
from .round import (
    Loss,
    Peer,
    PeerBook,
    Round,
    RoundKeys,
    every_peer,
    own_connection,
    previous_hosts,
    round_token,
)
from .store_calls import Deadlines, StoreCalls

__all__ = ["CONFIRM_MIN", "NodeRoster", "RosterState"]

logger = logging.getLogger(__name__)

#: The least time a loss gets to be confirmed in the store (see NodeRoster). Above
#: etcd's own request timeout (5 s + 2 election timeouts: 7 s with etcd's defaults), which
#: a write in flight when the leader dies waits out before it fails and is tried again:
#: at 5 s, a node whose etcd lost its leader with the killed node took itself for the
#: one cut off (seen in tests/multinode: "etcdserver: request timed out" after 7 s).
CONFIRM_MIN = 10.0


class RosterState(str, Enum):
    """Where a :class:`NodeRoster` is in the job's rounds.

    - ``IDLE``: in no round: before the first, and between leaving one and entering the
      next. The fence fences; nothing is watched.
    - ``WATCHING``: in a round: its ring watched, its losses confirmed in its store, the
      fence answering from a live probe.
    - ``ISOLATED``: in a round but cut off from the job (:meth:`NodeRoster.isolated`
      says why): the fence fences, and the agent stops this node's workers.
    - ``CLOSED``: closed; its sockets and threads are gone.

    Transitions:

    - ``IDLE``, ``WATCHING``, ``ISOLATED`` -> ``WATCHING``: :meth:`~NodeRoster.enter_round`
      (a round formed);
    - ``WATCHING`` -> ``ISOLATED``: a loss this node saw could not be confirmed in the
      store (cause ``partition``), the job formed a newer round without this node (cause
      ``replaced``), or the other nodes recorded this one lost;
    - ``WATCHING``, ``ISOLATED`` -> ``IDLE``: :meth:`~NodeRoster.leave_round`;
    - any -> ``CLOSED``: :meth:`~NodeRoster.close`.

    This node's workers finishing (:meth:`~NodeRoster.finish`) is no state of the
    roster's: from then on its ring says goodbye instead of beating (see :mod:`.ring`),
    and the roster goes on in the round it holds (the exit barrier needs its losses).
    A confirmation that ends after this node left its round changes no state: it only
    reports the loss, where it was the first to record it.
    """

    IDLE = "idle"
    WATCHING = "watching"
    ISOLATED = "isolated"
    CLOSED = "closed"


class NodeRoster:
    """This launcher's view of the round's nodes (see :mod:`steadfast.launcher.nodes`)."""

    def __init__(
        self, ft: FaultToleranceConfig, host: str | None = None, name: str | None = None
    ) -> None:
        """``host``: the address the other nodes reach this one at (the launcher's
        ``--local-addr``, else the fully qualified name); ``name``: what events and
        exclusions call this node (by default ``host``; the launcher passes the host name
        every event carries, so a report matches a lost node to its own events)."""
        self.interval = ft.node_heartbeat_interval
        self.timeout = ft.node_heartbeat_timeout
        #: how long a loss may take to confirm in the store before this node takes
        #: itself for the one cut off: an etcd cluster that lost its leader (with the
        #: node) needs a second or two to elect another
        self.confirm_timeout = max(self.timeout, CONFIRM_MIN)
        self.host = host or socket.getfqdn()
        self.name = name or self.host
        self._lock = threading.Condition()
        self._state = RosterState.IDLE
        self._round: Round | None = None  # held while WATCHING or ISOLATED
        self._why: str | None = None  # why it is ISOLATED
        self._losses: dict[int, Loss] = {}
        self._pending: set[int] = set()  # node ranks seen gone, not yet confirmed
        self._calls = StoreCalls()  # fence probes, round bookkeeping
        self._confirms = StoreCalls()  # loss confirmations: never queued behind probes
        self._culprits = StoreCalls()  # a fault's agreement: never queued behind either
        self._deadlines = Deadlines()  # of store calls: close cancels them
        self._ring = Ring(self.interval, self.timeout, self._lost, self._peer_finished)
        #: the nodes of the round heard finishing over the ring (node rank -> when,
        #: monotonic): the job's end as this node sees it, whatever the store says
        self._finished: dict[int, float] = {}
        self.port = self._ring.port
        self._fence = Fence(self._lock, self._view, self._calls, self._deadlines, self.timeout)
        self.fence_address = self._fence.address
        self._ring.serve(self._fence.sock, self._fence.accept)
        self._ring.start()

    # ------------------------------------------------------------------ for the agent
    def env(self) -> dict[str, str]:
        """What the workers need: the fence's address and how long it may take."""
        return {FENCE_ENV: self.fence_address, FENCE_TIMEOUT_ENV: f"{self.timeout + 1:g}"}

    def enter_round(
        self,
        store: Any,
        rank: int,
        nodes: int,
        run_id: str,
        rdzv: list[Any] | None,
        generation: int | None = None,
    ) -> PeerBook:
        """Publish this node in the round that just formed, learn the nodes it watches,
        start watching them and (node rank 0) record the round job-wide, emitting
        ``node_joined`` for each node that the previous round did not have. Returns the
        round's nodes by node rank (read when first asked for). ``generation``: the
        round's number, the same on every node, where the rendezvous hands out one store
        for every round (static)."""
        if self._state is RosterState.CLOSED:
            raise RuntimeError("the node roster is closed")
        keys = RoundKeys(run_id, generation)
        refused = Refusals()
        me = Peer(rank, self.name, self.host, self.port, os.getpid(), rdzv)
        self._ring.admit()  # before the others can find this node: they watch it again
        store.set(keys.node(rank), json.dumps(me.__dict__))
        watched = {(rank + k) % nodes for k in range(1, min(WATCHERS, nodes - 1) + 1)}
        known = {rank: me}
        for r in sorted(watched):  # the few this node watches: O(1) reads per node
            known[r] = Peer.read(store, keys.node(r), r, refused)
        job_store = getattr(store, "underlying_store", store)
        if rank == 0:  # the round's record: every node's host, one read of them all
            known.update(every_peer(store, keys, nodes, refused))
            token = uuid.uuid4().hex
            previous = previous_hosts(job_store, keys, refused)
            job_store.set(keys.record_nodes, json.dumps([known[r].host for r in range(nodes)]))
            job_store.set(keys.record, json.dumps({"token": token}))
            store.set(keys.token, token)
            if previous is not None:
                emit_joined({r: known[r] for r in range(nodes)}, previous)
        else:
            token = round_token(store, keys, refused, self.timeout)
        peers = PeerBook(store, keys, known, refused)
        waits = own_connection(store)
        with self._lock:
            self._round = Round(store, job_store, rank, nodes, peers, token, keys, waits)
            self._state, self._why = RosterState.WATCHING, None
            self._losses = {}
            self._pending = set()
            self._finished = {}
            self._fence.forget()
        for k in range(1, min(WATCHERS, nodes - 1) + 1):
            if peers[(rank + k) % nodes].reachable:  # a refused record: not watched
                self._ring.watch(peers[(rank + k) % nodes])
        return peers

    def leave_round(self, reason: str | None = None, cause: str = "unhealthy") -> None:
        """Stop watching; the fence is closed until the next round. ``reason``: this node
        leaves the job (``cause``: ``unhealthy``, or ``left`` when its launcher stops on
        a fault of its own), recorded for the launchers that see it go."""
        with self._lock:
            current = self._round
            self._round = None
            if self._state is not RosterState.CLOSED:
                self._state, self._why = RosterState.IDLE, None
        watched = self._ring.unwatch()
        if current is not None and reason is not None:
            with contextlib.suppress(Exception):
                self._calls.call(lambda: record_leaving(current, cause, reason), self.timeout)
        # with a reason, the nodes watching this one see it go at once
        self._ring.release(watched, watchers=current is not None and reason is not None)

    def finish(self) -> None:
        """This node's workers finished the job: say goodbye to the launchers that watch
        it, so that its launcher exiting is not reported as a lost node."""
        self._ring.finish()  # the goodbye goes at once, then instead of beats

    def exit_barrier(self, timeout: float) -> tuple[list[str], list[str]]:
        """Wait until every node of the round has finished its workers (or is lost), up
        to ``timeout`` seconds (see :mod:`.exit_barrier`). Returns the nodes it did not
        hear finish and those found lost."""
        with self._lock:
            current = self._round
        if current is None or current.nodes <= 1:
            return [], []
        return exit_barrier(current, timeout, self)

    # what the exit barrier reads of the ring (exit_barrier.Heard)
    def heard(self) -> tuple[dict[int, float], set[int]]:
        """The nodes heard finishing over the ring (node rank -> when, monotonic), and
        the nodes found lost by this launcher: copies, read under the lock."""
        with self._lock:
            return dict(self._finished), set(self._losses)

    def wait_heard(self, nodes: set[int], timeout: float) -> None:
        """Wait up to ``timeout`` until each of ``nodes`` was heard finishing or found
        lost."""
        with self._lock:
            self._lock.wait_for(
                lambda: nodes <= set(self._finished) | set(self._losses), timeout=timeout
            )

    def job_ended_at(self) -> float | None:
        """When (``time.monotonic()``) this node first heard another node of its round
        finish its workers (a goodbye over the ring), or None: the job's end as seen
        from here, for the workers that outlive it."""
        with self._lock:
            return min(self._finished.values(), default=None)

    def agree_culprit(self, mine: Claim | None, absent: int = 0) -> Verdict | None:
        """The one culprit of the round's fault, agreed job-wide (see :mod:`.culprit`):
        ``mine`` is this node's claim (None: its workers went down for another node's
        fault); ``absent`` nodes of the round will not take part (lost). None when this
        node holds no round, no node claimed anything, or the store did not answer: the
        agent then reports its own view."""
        with self._lock:
            current = self._round
        if current is None:
            return None
        expected = max(1, current.nodes - absent)
        try:
            verdict: Verdict | None = self._culprits.call(
                lambda: agree(current, mine, expected, CLAIM_WINDOW),
                CLAIM_WINDOW + self.timeout,
            )
        except Exception as exc:  # the store gone with a lost node, say
            logger.warning("could not agree on the fault's culprit: %s", exc)
            return None
        return verdict

    def fault_claimed(self) -> bool:
        """Whether a node claimed a fault in the running round (a restart for a
        membership change may then be that fault's consequence)."""
        with self._lock:
            current = self._round
        if current is None:
            return False
        try:
            return bool(
                self._calls.call(
                    lambda: current.store.check([current.keys.fault_claim]), self.timeout
                )
            )
        except Exception:
            return False

    def losses(self) -> list[Loss]:
        """The round's confirmed losses so far."""
        with self._lock:
            return list(self._losses.values())

    def isolated(self) -> str | None:
        """Why this node is cut off from the job (None while it is not)."""
        with self._lock:
            return self._why if self._state is RosterState.ISOLATED else None

    def wait_for_loss(self, timeout: float) -> list[Loss]:
        """Wait up to ``timeout`` for a loss to be known (seen here, or recorded in the
        store by another launcher); returns the round's losses (empty: none known)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                known = self._known()
                if known is not None:
                    return known
                current = self._round
            if current is None:
                return []
            self._learn_losses(current, max(0.05, deadline - time.monotonic()))
            with self._lock:
                known = self._known()
                if known is not None:
                    return known
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._lock.wait(min(0.1, left))

    def settle(self, timeout: float) -> list[Loss]:
        """Wait up to ``timeout`` for the losses being confirmed now (a store electing a
        leader may take seconds) to be confirmed or found out as isolation; returns the
        round's losses. The agent asks before its next rendezvous, so that it expires
        every node it saw go."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending and self._state is not RosterState.ISOLATED:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(0.1, left))
            return list(self._losses.values())

    def close(self) -> None:
        """Close every socket and stop the threads."""
        with self._lock:
            self._state = RosterState.CLOSED
        self._ring.stop()  # with the goodbye, where the loop stopped before it went
        self._deadlines.close()  # a deadline still waiting: the roster is gone
        self._calls.close()
        self._confirms.close(wait=1.0)
        self._culprits.close(wait=1.0)
        self._fence.close()
        with self._lock:
            self._round = None  # and the round's store connection with it
        self._ring.close()

    # ------------------------------------------------------------------ the round
    def _peer_finished(self, peer: Peer) -> None:
        """A watched node said goodbye: its workers finished (the ring's thread)."""
        with self._lock:
            current = self._round
            if current is not None and peer.rank not in self._finished:
                self._finished[peer.rank] = time.monotonic()
                self._lock.notify_all()

    def _view(self) -> tuple[Round | None, str | None]:
        """The round and why this node is cut off, for the fence (the lock held)."""
        return self._round, self._why if self._state is RosterState.ISOLATED else None

    def _known(self) -> list[Loss] | None:
        """The round's losses once one is known or this node is cut off, else None (the
        lock held)."""
        if self._losses or self._state is RosterState.ISOLATED:
            return list(self._losses.values())
        return None

    def _isolate(self, current: Round, why: str) -> bool:
        """Cut this node off from ``current`` (the lock held): True when it was watching
        that round, False when it had left it or was cut off already."""
        if self._round is not current or self._state is not RosterState.WATCHING:
            return False
        self._state, self._why = RosterState.ISOLATED, why
        self._lock.notify_all()
        return True

    def _learn_losses(self, current: Round, timeout: float) -> None:
        """Losses recorded in the round's store by other launchers."""
        try:
            found = self._calls.call(lambda: recorded_losses(current), timeout)
        except Exception:
            return
        with self._lock:
            if self._round is not current:
                return
            for r, how in found:
                cause, _, words = how.partition(":")
                if r == current.rank:  # the others lost this one
                    self._isolate(
                        current, f"the other nodes found this node lost ({cause}: {words})"
                    )
                elif r not in self._losses:
                    self._losses[r] = Loss(current.peers[r], cause, words, None)
            self._lock.notify_all()

    def _lost(self, peer: Peer, cause: str, how: str, latency: float | None) -> None:
        """A watched node is gone: confirm it in the store (the first launcher to do so
        reports it), or, with the store out of reach too, this node is the one cut off."""
        with self._lock:
            current = self._round
            if current is None:
                return
            self._pending.add(peer.rank)

        def done(value: Any, exc: BaseException | None) -> None:
            with self._lock:
                held = self._round is current  # else this node has left that round since
                if held:
                    self._pending.discard(peer.rank)
                    self._lock.notify_all()
                if exc is not None or value is None:
                    if exc is None:
                        cut = "replaced"
                        why = (
                            f"lost {peer.host} ({how}), and the job formed a newer round "
                            "without this node meanwhile"
                        )
                    else:
                        cut = "partition"
                        why = (
                            f"lost {peer.host} ({how}) and cannot reach the rendezvous store "
                            f"({type(exc).__name__}: {exc})"
                        )
                    if self._isolate(current, why):
                        emit_isolated(cut, why, current.nodes)
                    return
                first, real_cause, real_how = value
                if held:
                    self._losses[peer.rank] = Loss(peer, real_cause, real_how, latency)
                    self._lock.notify_all()
            if first:  # reported even when confirmed after this node left the round
                emit_lost(peer, real_cause, real_how, latency, current.nodes)

        deadline = time.monotonic() + self.confirm_timeout

        def bounded() -> Any:
            while True:  # a store that fails for a moment (etcd electing a leader): again
                if self._state is RosterState.CLOSED:
                    raise RuntimeError("the node roster closed")
                if time.monotonic() > deadline:
                    raise TimeoutError("the store did not answer in time")
                try:
                    return claim_loss(current, peer, cause, how)
                except Exception:
                    if time.monotonic() + 0.2 > deadline:
                        raise
                    time.sleep(0.2)

        # the deadline also covers a store call stuck in the store's own timeout
        timer = self._deadlines.start(
            self.confirm_timeout, self._confirm_timeout, current, peer, how
        )

        def finished(value: Any, exc: BaseException | None) -> None:
            timer.cancel()
            done(value, exc)

        self._confirms.submit(bounded, finished)

    def _confirm_timeout(self, current: Round, peer: Peer, how: str) -> None:
        """The store did not confirm ``peer``'s loss in time: this node is the one cut
        off."""
        why = (
            f"lost {peer.host} ({how}) and cannot reach the rendezvous store: it did not answer in "
            f"{self.confirm_timeout:g} s"
        )
        with self._lock:
            if peer.rank in self._losses or not self._isolate(current, why):
                return
            self._pending.discard(peer.rank)
        emit_isolated("partition", why, current.nodes)
