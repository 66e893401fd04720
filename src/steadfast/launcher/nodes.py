"""The node roster of one launcher: which nodes are in the running round, which of them
are lost, and whether this node still holds the job's rendezvous.

Each launcher of a job of more than one node runs a :class:`NodeRoster`:

- a **beacon**: a TCP socket that the launchers watching this node connect to; it sends
  them one byte every ``node_heartbeat_interval``;
- a **ring watch**: after each rendezvous every launcher publishes its beacon in the
  round's store and connects to the beacons of the next two nodes of the round (by node
  rank, wrapping), so each node is watched by two others and each launcher holds two
  connections whatever the job's size. A node killed outright (power loss, kernel panic,
  OOM killer taking the launcher) resets those connections at once; one that goes silent
  (a NIC, a partition) is lost after ``node_heartbeat_timeout`` without a beat. A
  launcher whose workers finished says goodbye (one byte) before it closes, so that its
  leaving at the end of the job is not taken for a loss;
- **confirmation**: a watcher that sees a loss records it in the round's store (the
  first to do so emits ``node_lost``), where the other launchers find it when their own
  workers fail. A watcher that cannot reach the store either is the one cut off: it
  emits ``node_isolated`` and stops its workers instead;
- the **fence**: a local socket on which the launcher answers its ranks whether the node
  is still in the job's current round (a live round trip to the rendezvous store: the
  round's token must still be the job's). :mod:`steadfast.fence` is the ranks' side.

Everything runs in one thread (a selector over the beacon, the watched and the
watching connections and the fence socket) plus one thread for store calls, which can
block for as long as the store's own timeout: a call that overruns its deadline is
answered as failed and the thread goes on with it in the background.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import events
from ..config import FaultToleranceConfig
from ..fence import FENCE_ENV, FENCE_TIMEOUT_ENV

__all__ = [
    "Loss",
    "NodeRoster",
    "Peer",
    "health_check",
]

logger = logging.getLogger(__name__)

_BEAT = b"\x01"
_BYE = b"\x02"  # instead of beats once this node's workers finished
#: Successors each node watches (each node is watched by as many predecessors).
WATCHERS = 2
#: The least time a loss gets to be confirmed in the store (see NodeRoster). Above
#: etcd's own request timeout (5 s + 2 election timeouts: 7 s with etcd's defaults), which
#: a write in flight when the leader dies waits out before it fails and is tried again:
#: at 5 s, a node whose etcd lost its leader with the killed node took itself for the
#: one cut off (seen in tests/multinode: "etcdserver: request timed out" after 7 s).
CONFIRM_MIN = 10.0
#: How long a fence answer is reused for the other ranks of the node.
_FENCE_REUSE = 0.5


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
class _Watch:
    peer: Peer
    last_beat: float  # monotonic


@dataclass
class _Round:
    store: Any  # the round's (prefixed) store
    job_store: Any  # the job's store, across rounds
    rank: int
    nodes: int
    peers: dict[int, Peer]
    token: str
    key: str  # the job-wide round record
    prefix: str  # the roster's keys in the round's store


_Done = Callable[[Any, "BaseException | None"], None]


class _StoreCalls:
    """Store calls on a thread of their own, each with a deadline."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], _Done] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="steadfast-node-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                value = fn()
            except BaseException as exc:  # handed over inside the block: no cycle kept
                self._finish(done, None, exc)
            else:
                self._finish(done, value, None)

    @staticmethod
    def _finish(done: _Done, value: Any, exc: BaseException | None) -> None:
        try:
            done(value, exc)
        except Exception:  # a bug in a callback must not stop the store calls
            logger.exception("node roster: a store call's callback failed")

    def submit(
        self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        self._jobs.put((fn, done))

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()``'s value; raises its error, or TimeoutError after ``timeout``."""
        box: dict[str, Any] = {}
        finished = threading.Event()

        def done(value: Any, exc: BaseException | None) -> None:
            box["value"], box["exc"] = value, exc
            finished.set()

        self.submit(fn, done)
        if not finished.wait(timeout):
            raise TimeoutError(f"the store did not answer in {timeout:g} s")
        error, value = box.pop("exc"), box.pop("value")
        if error is not None:
            try:
                raise error
            finally:  # no frame -> error -> traceback -> frame cycle holding the store
                del error
        return value

    def close(self, wait: float = 0.0) -> None:
        """End the thread after the calls queued; wait up to ``wait`` seconds for it (a
        call stuck in the store keeps the daemon thread until the store gives up)."""
        self._jobs.put(None)
        if wait > 0:
            self._thread.join(wait)


def _keepalive(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class NodeRoster:
    """This launcher's view of the round's nodes (see the module's description)."""

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
        self._sel = selectors.DefaultSelector()
        self._listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=64)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        name = f"steadfast-fence-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.fence_address = "@" + name
        self._fence = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fence.bind("\0" + name)
        self._fence.listen(64)
        self._fence.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._fence, selectors.EVENT_READ, "fence")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._watchers: set[socket.socket] = set()  # those that watch this node
        self._watched: dict[socket.socket, _Watch] = {}
        self._to_close: list[socket.socket] = []  # closed by the loop thread
        self._round: _Round | None = None
        self._losses: dict[int, Loss] = {}
        self._pending: set[int] = set()  # node ranks seen gone, not yet confirmed
        self._isolated: str | None = None
        self._fence_ok_at = -1.0
        self._finished = False
        self._stopping = False
        self._calls = _StoreCalls()  # fence probes, round bookkeeping
        self._confirms = _StoreCalls()  # loss confirmations: never queued behind probes
        self._timers: list[threading.Timer] = []  # the deadlines of store calls (_deadline)
        self._probing: list[socket.socket] | None = None  # ranks waiting on a fence probe
        self._thread = threading.Thread(target=self._loop, name="steadfast-nodes", daemon=True)
        self._thread.start()

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
    ) -> list[Peer]:
        """Publish this node in the round that just formed, learn the others, start
        watching the next ones and (node rank 0) record the round job-wide, emitting
        ``node_joined`` for each node that the previous round did not have. Returns the
        round's nodes by node rank. ``generation``: the round's number, the same on every
        node, where the rendezvous hands out one store for every round (static)."""
        prefix = "steadfast/" if generation is None else f"steadfast/g{generation}/"
        me = Peer(rank, self.name, self.host, self.port, os.getpid(), rdzv)
        store.set(f"{prefix}node/{rank}", json.dumps(me.__dict__))
        peers: dict[int, Peer] = {}
        for r in range(nodes):
            raw = store.get(f"{prefix}node/{r}")
            peers[r] = Peer(**json.loads(raw))
        job_store = getattr(store, "underlying_store", store)
        key = f"steadfast/{run_id}/round"
        if rank == 0:
            token = uuid.uuid4().hex
            previous = None
            if job_store.check([key]):
                previous = json.loads(job_store.get(key))
            record = {"token": token, "nodes": [peers[r].host for r in range(nodes)]}
            job_store.set(key, json.dumps(record))
            store.set(f"{prefix}token", token)
            if previous is not None:
                self._joined(peers, previous.get("nodes", []))
        else:
            token = store.get(f"{prefix}token").decode()
        with self._lock:
            self._round = _Round(store, job_store, rank, nodes, peers, token, key, prefix)
            self._losses = {}
            self._pending = set()
            self._isolated = None
            self._fence_ok_at = -1.0
        for k in range(1, min(WATCHERS, nodes - 1) + 1):
            self._watch(peers[(rank + k) % nodes])
        return [peers[r] for r in range(nodes)]

    def leave_round(self, reason: str | None = None, cause: str = "unhealthy") -> None:
        """Stop watching; the fence is closed until the next round. ``reason``: this node
        leaves the job (``cause``: ``unhealthy``, or ``left`` when its launcher stops on
        a fault of its own), recorded for the launchers that see it go."""
        with self._lock:
            current = self._round
            self._round = None
            watched = list(self._watched)
            self._watched.clear()
        if current is not None and reason is not None:
            record = json.dumps({"cause": cause, "reason": reason})
            with contextlib.suppress(Exception):
                self._calls.call(
                    lambda: current.store.set(f"{current.prefix}left/{current.rank}", record),
                    self.timeout,
                )
        with self._lock:
            self._to_close.extend(watched)
            if current is not None and reason is not None:  # they see it go at once
                self._to_close.extend(self._watchers)
                self._watchers.clear()
        self._wake()

    def finish(self) -> None:
        """This node's workers finished the job: say goodbye to the launchers that watch
        it, so that its launcher exiting is not reported as a lost node."""
        with self._lock:
            self._finished = True
        self._wake()  # the loop sends the goodbye at once, then instead of beats

    def exit_barrier(self, timeout: float) -> list[str]:
        """Wait until every node of the round has finished its workers (or is lost), up
        to ``timeout`` seconds: torch's exit barrier, which keeps the store's host alive
        while other nodes may still need it, done so that it cannot hang a job.

        torch's barrier blocks in one ``store.wait`` of up to 300 s on the round's store
        *client*, which the rendezvous keep-alive and this roster's store threads share:
        a TCPStore client serves one call at a time, so the wait stalls every other call
        on it and any of them stalls the barrier's own ``add``. This one takes a
        connection of its own (``clone``), marks this node done under its node rank,
        polls (never a long blocking call), stops waiting for nodes found lost (by this
        launcher, or confirmed in the store by any other: this one watches only its ring
        neighbours), and names the nodes it waits for every 10 s. Returns the hosts it
        stopped waiting for."""
        with self._lock:
            current = self._round
        if current is None or current.nodes <= 1:
            return []
        try:
            store = current.store.clone()  # a connection of its own
        except (RuntimeError, NotImplementedError, AttributeError):
            store = current.store  # etcd's: each call is a request of its own already
        key = f"{current.prefix}exit/"
        store.set(f"{key}{current.rank}", b"1")
        if int(store.add(f"{key}count", 1)) >= current.nodes:
            store.set(f"{key}all", b"1")
        start = time.monotonic()
        deadline, report, pause = start + timeout, start + 10.0, 0.005
        confirmed: set[int] = set()  # losses other launchers recorded in the store
        while not store.check([f"{key}all"]):
            if int(store.add(f"{current.prefix}lost_count", 0)) > len(confirmed):
                confirmed |= {
                    r
                    for r in range(current.nodes)
                    if r != current.rank and store.check([f"{current.prefix}lost/{r}"])
                }
            with self._lock:
                lost = set(self._losses) | confirmed
            waiting = [
                r
                for r in range(current.nodes)
                if r not in lost and (lost or time.monotonic() > report)
                and not store.check([f"{key}{r}"])
            ]  # fmt: skip
            if lost and not waiting:  # every node left finished: the lost ones never will
                return sorted(current.peers[r].host for r in lost)
            now = time.monotonic()
            if now > report and waiting:
                logger.info(
                    "waiting for %s to finish their workers (%.0f s so far)",
                    ", ".join(current.peers[r].host for r in waiting),
                    now - start,
                )
                report = now + 10.0
            if now > deadline:
                logger.warning(
                    "exit barrier: %s did not finish within %.0f s; leaving without them",
                    ", ".join(current.peers[r].host for r in waiting) or "some nodes",
                    timeout,
                )
                return [current.peers[r].host for r in waiting]
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
        return []

    def losses(self) -> list[Loss]:
        """The round's confirmed losses so far."""
        with self._lock:
            return list(self._losses.values())

    def isolated(self) -> str | None:
        """Why this node is cut off from the job (None while it is not)."""
        with self._lock:
            return self._isolated

    def wait_for_loss(self, timeout: float) -> list[Loss]:
        """Wait up to ``timeout`` for a loss to be known (seen here, or recorded in the
        store by another launcher); returns the round's losses (empty: none known)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._losses or self._isolated:
                    return list(self._losses.values())
                current = self._round
            if current is None:
                return []
            self._learn_losses(current, max(0.05, deadline - time.monotonic()))
            with self._lock:
                if self._losses or self._isolated:
                    return list(self._losses.values())
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
            while self._pending and not self._isolated:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(0.1, left))
            return list(self._losses.values())

    def close(self) -> None:
        """Close every socket and stop the threads."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        if self._finished:  # the loop may have stopped before it said goodbye
            self._beat()
        with self._lock:
            timers, self._timers = self._timers, []
        for timer in timers:  # a deadline still waiting: the roster is gone
            timer.cancel()
            timer.join()
        self._calls.close()
        self._confirms.close(wait=1.0)
        with self._lock:
            socks = [*self._watched, *self._watchers, *self._to_close, *(self._probing or [])]
            self._watched.clear()
            self._watchers.clear()
            self._to_close = []
            self._probing = None
            self._round = None  # and the round's store connection with it
        for sock in [*socks, self._listener, self._fence, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()
        self._sel.close()

    # ------------------------------------------------------------------ the round
    def _joined(self, peers: dict[int, Peer], before: list[str]) -> None:
        hosts = [peers[r].host for r in sorted(peers)]
        replaced = sorted(set(before) - set(hosts))
        for rank, peer in sorted(peers.items()):
            if peer.host not in before:
                events.emit(
                    "node_joined",
                    cause="spare" if replaced else "scale_up",
                    node=peer.host,
                    node_rank=rank,
                    nodes=len(hosts),
                    replaced=replaced,
                )

    def _watch(self, peer: Peer) -> None:
        try:
            sock = socket.create_connection((peer.addr, peer.port), timeout=self.timeout)
        except OSError as exc:
            self._lost(peer, "connection_reset", f"its launcher did not answer ({exc})", 0.0)
            return
        _keepalive(sock)
        sock.setblocking(False)
        with self._lock:
            self._watched[sock] = _Watch(peer, time.monotonic())
        self._wake()

    def _learn_losses(self, current: _Round, timeout: float) -> None:
        """Losses recorded in the round's store by other launchers."""

        def read() -> list[tuple[int, str]]:
            found: list[tuple[int, str]] = []
            if int(current.store.add(f"{current.prefix}lost_count", 0)) == 0:
                return found
            for r in range(current.nodes):
                if current.store.check([f"{current.prefix}lost/{r}"]):
                    how = current.store.get(f"{current.prefix}lost_how/{r}").decode()
                    found.append((r, how))
            return found

        try:
            found = self._calls.call(read, timeout)
        except Exception:
            return
        with self._lock:
            if self._round is not current:
                return
            for r, how in found:
                cause, _, words = how.partition(":")
                if r == current.rank and self._isolated is None:  # the others lost this one
                    self._isolated = f"the other nodes found this node lost ({cause}: {words})"
                elif r != current.rank and r not in self._losses:
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

        def confirm() -> tuple[bool, str, str] | None:
            """(first to confirm, cause, how); None: the job went on without this node."""
            if json.loads(current.job_store.get(current.key))["token"] != current.token:
                return None  # a stale claim (a partition healed): this node was replaced
            p = current.prefix
            left = f"{p}left/{peer.rank}"
            real_cause, real_how = cause, how
            if current.store.check([left]):
                record = json.loads(current.store.get(left))
                real_cause = str(record["cause"])
                real_how = f"it left the job: {record['reason']}"
            # the description first: whoever reads lost/R finds lost_how/R
            if not current.store.check([f"{p}lost_how/{peer.rank}"]):
                current.store.set(f"{p}lost_how/{peer.rank}", f"{real_cause}:{real_how}")
            first = int(current.store.add(f"{p}lost/{peer.rank}", 1)) == 1
            if first:
                current.store.add(f"{p}lost_count", 1)
            return first, real_cause, real_how

        def done(value: Any, exc: BaseException | None) -> None:
            with self._lock:
                if self._round is current:
                    self._pending.discard(peer.rank)
                    self._lock.notify_all()
                if self._round is not current and exc is not None:
                    return  # this node has left that round since: nothing to say
                if exc is not None or value is None:
                    first_time = self._isolated is None
                    if value is None and exc is None:
                        cause, self._isolated = (
                            "replaced",
                            (
                                f"lost {peer.host} ({how}), and the job formed a newer round "
                                "without this node meanwhile"
                            ),
                        )
                    else:
                        cause, self._isolated = (
                            "partition",
                            (
                                f"lost {peer.host} ({how}) and cannot reach the rendezvous store "
                                f"({type(exc).__name__}: {exc})"
                            ),
                        )
                    self._lock.notify_all()
                    if first_time:
                        events.emit(
                            "node_isolated", cause=cause, how=self._isolated, nodes=current.nodes
                        )
                    return
                first, real_cause, real_how = value
                if self._round is current:
                    self._losses[peer.rank] = Loss(peer, real_cause, real_how, latency)
                    self._lock.notify_all()
            if first:  # reported even when confirmed after this node left the round
                events.emit(
                    "node_lost",
                    cause=real_cause,
                    node=peer.host,
                    node_rank=peer.rank,
                    how=real_how,
                    latency=latency,
                    nodes=current.nodes,
                )

        deadline = time.monotonic() + self.confirm_timeout

        def bounded() -> Any:
            while True:  # a store that fails for a moment (etcd electing a leader): again
                if self._stopping:
                    raise RuntimeError("the node roster closed")
                if time.monotonic() > deadline:
                    raise TimeoutError("the store did not answer in time")
                try:
                    return confirm()
                except Exception:
                    if time.monotonic() + 0.2 > deadline:
                        raise
                    time.sleep(0.2)

        # the deadline also covers a store call stuck in the store's own timeout
        timer = self._deadline(self.confirm_timeout, self._confirm_timeout, current, peer, how)

        def finished(value: Any, exc: BaseException | None) -> None:
            timer.cancel()
            done(value, exc)

        self._confirms.submit(bounded, finished)

    def _deadline(self, seconds: float, fn: Callable[..., None], *args: Any) -> threading.Timer:
        """``fn(*args)`` in ``seconds`` unless cancelled first; :meth:`close` cancels the
        timers still waiting, so none outlives the roster."""
        timer = threading.Timer(seconds, fn, args=args)
        timer.daemon = True
        with self._lock:
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()
        return timer

    def _confirm_timeout(self, current: _Round, peer: Peer, how: str) -> None:
        with self._lock:
            if self._round is not current or peer.rank in self._losses or self._isolated:
                return
            self._pending.discard(peer.rank)
            self._isolated = (
                f"lost {peer.host} ({how}) and the rendezvous store did not answer in "
                f"{self.confirm_timeout:g} s"
            )
            self._lock.notify_all()
            isolated = self._isolated
        events.emit("node_isolated", cause="partition", how=isolated, nodes=current.nodes)

    # ------------------------------------------------------------------ the fence
    def _answer_fence(self, client: socket.socket) -> None:
        """Answer a rank: ``ok`` while this node holds the job's current round. One live
        probe of the store answers every rank that asks while it runs (a save asks from
        every rank at once), and an ``ok`` is reused for ``_FENCE_REUSE`` seconds."""
        with self._lock:
            current = self._round
            isolated = self._isolated
            fresh = time.monotonic() - self._fence_ok_at < _FENCE_REUSE
            if current is not None and not isolated and not fresh:
                if self._probing is not None:  # a probe runs: its answer is this one's
                    self._probing.append(client)
                    return
                self._probing = [client]
        if current is None:
            self._reply(client, "fenced: this node is not in a running round of the job")
            return
        if isolated:
            self._reply(client, f"fenced: {isolated}")
            return
        if fresh:
            self._reply(client, "ok")
            return

        def probe() -> str:
            # a write: only a store that holds the job (etcd: a quorum) takes it
            current.job_store.add(current.key + "/fence", 1)
            if current.store.check([f"{current.prefix}lost/{current.rank}"]):
                return "lost"  # the others found this node lost: they go on without it
            return str(json.loads(current.job_store.get(current.key))["token"])

        def answer(text: str) -> None:
            with self._lock:
                waiting, self._probing = self._probing or [], None
                if text == "ok" and (self._round is not current or self._isolated):
                    text = "fenced: " + (self._isolated or "this node left the round")
                if text == "ok":
                    self._fence_ok_at = time.monotonic()
            for waiter in waiting:
                self._reply(waiter, text)

        def done(value: Any, exc: BaseException | None) -> None:
            timer.cancel()
            if exc is not None:
                answer(f"fenced: the rendezvous store did not answer ({exc})")
            elif value == "lost":
                answer("fenced: the other nodes found this node lost and went on without it")
            elif value != current.token:
                answer("fenced: the job formed a newer round without this node")
            else:
                answer("ok")

        deadline = time.monotonic() + self.timeout
        # the deadline also covers a store call stuck in the store's own timeout
        timer = self._deadline(
            self.timeout, answer, "fenced: the rendezvous store did not answer in time"
        )

        def bounded() -> str:
            if time.monotonic() > deadline:
                raise TimeoutError("the store did not answer in time")
            return probe()

        self._calls.submit(bounded, done)

    @staticmethod
    def _reply(client: socket.socket, answer: str) -> None:
        with contextlib.suppress(OSError):
            client.setblocking(True)
            client.settimeout(1.0)
            client.sendall(answer.encode() + b"\n")
        with contextlib.suppress(OSError):
            client.close()

    # ------------------------------------------------------------------ the loop
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _drop(self, sock: socket.socket) -> None:
        """Unregister and close (the loop thread only)."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        said_bye = False
        registered: set[socket.socket] = set()
        while not self._stopping:
            try:
                with self._lock:
                    watched = dict(self._watched)
                    closing, self._to_close = self._to_close, []
                for sock in closing:
                    registered.discard(sock)
                    self._drop(sock)
                for sock in watched:  # newly watched
                    if sock not in registered:
                        with contextlib.suppress(ValueError, KeyError, OSError):
                            self._sel.register(sock, selectors.EVENT_READ, "watched")
                            registered.add(sock)
                registered &= set(watched)
                now = time.monotonic()
                until = min(
                    [next_beat, now + 1.0] + [w.last_beat + self.timeout for w in watched.values()]
                )
                wait = max(0.0, until - now)
                try:
                    ready = self._sel.select(wait)
                except OSError:
                    ready = []
                now = time.monotonic()
                for key, _ in ready:
                    sock = key.fileobj  # type: ignore[assignment]
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            sock.recv(4096)
                    elif key.data == "accept":
                        self._accept()
                    elif key.data == "fence":
                        with contextlib.suppress(OSError):
                            client, _ = self._fence.accept()
                            client.setblocking(True)
                            client.settimeout(1.0)
                            with contextlib.suppress(OSError):
                                client.recv(16)
                            self._answer_fence(client)
                    elif key.data == "watcher":
                        self._read_watcher(sock)
                    elif key.data == "watched":
                        self._read_watched(sock, now)
                if now >= next_beat or (self._finished and not said_bye):
                    said_bye = self._finished
                    self._beat()
                    next_beat = now + self.interval
                with self._lock:
                    silent = [
                        (s, w) for s, w in self._watched.items() if now - w.last_beat > self.timeout
                    ]
                    for sock, _ in silent:
                        del self._watched[sock]
                for sock, watch in silent:
                    registered.discard(sock)
                    self._drop(sock)
                    self._lost(
                        watch.peer,
                        "silent",
                        f"no beat for {now - watch.last_beat:.1f} s: its link or its power went",
                        now - watch.last_beat,
                    )
            except Exception:  # the beats must go on: a dead loop reads as a lost node
                logger.exception("node roster: an error in the loop")
                time.sleep(0.1)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            _keepalive(conn)
            conn.setblocking(False)
            with self._lock:
                self._watchers.add(conn)
            self._sel.register(conn, selectors.EVENT_READ, "watcher")
            with contextlib.suppress(OSError):
                conn.send(_BYE if self._finished else _BEAT)

    def _read_watcher(self, sock: socket.socket) -> None:
        """A watcher never sends; readable means it closed (or reset)."""
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            with self._lock:
                self._watchers.discard(sock)
            self._drop(sock)

    def _read_watched(self, sock: socket.socket, now: float) -> None:
        with self._lock:
            watch = self._watched.get(sock)
        if watch is None:
            self._drop(sock)
            return
        try:
            data = sock.recv(4096)
            error = None
        except BlockingIOError:
            return
        except OSError as exc:
            data, error = b"", exc
        if data and _BYE not in data:
            watch.last_beat = now
            return
        with self._lock:
            self._watched.pop(sock, None)
        self._drop(sock)
        if data:  # its workers finished: it leaves, it is not lost
            logger.info("%s finished", watch.peer.host)
            return
        how = "its launcher's connection was " + ("reset" if error else "closed")
        self._lost(
            watch.peer,
            "connection_reset",
            f"{how}: the node or its launcher died",
            now - watch.last_beat,
        )

    def _beat(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
            beat = _BYE if self._finished else _BEAT
        for sock in watchers:
            try:
                sock.send(beat)
            except BlockingIOError:
                pass  # a slow watcher: its buffer is full of beats already
            except OSError:
                with self._lock:
                    self._watchers.discard(sock)
                self._drop(sock)


# ---------------------------------------------------------------------- health check
def health_check(ft: FaultToleranceConfig, gpus: int) -> tuple[str, str] | None:
    """This node's health before it joins a rendezvous: ``(check, reason)`` for the
    first check that failed, None when healthy. In order: ``node_health_check_dir``
    writable with ``node_min_free_gb`` free; each of ``gpus`` GPUs
    (:func:`~steadfast.health.check_gpu_health`, in a child process so that the launcher
    holds no CUDA context); the user's ``node_health_check`` command."""
    directory = ft.node_health_check_dir
    if directory is not None:
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".steadfast-health-") as f:
                f.write(b"x")
                f.flush()
                os.fsync(f.fileno())
            free = shutil.disk_usage(directory).free / 2**30
        except OSError as exc:
            return "checkpoint_dir", f"{directory} is not writable: {exc}"
        if free < ft.node_min_free_gb:
            return (
                "checkpoint_dir",
                f"{directory} has {free:.2f} GiB free, below node_min_free_gb="
                f"{ft.node_min_free_gb:g}",
            )
    if gpus > 0:
        done = _run(
            [sys.executable, "-m", "steadfast.cli", "health", "--all-devices", str(gpus)], 300
        )
        if done is not None:
            return "gpu", done
    if ft.node_health_check:
        done = _run(["sh", "-c", ft.node_health_check], 300)
        if done is not None:
            return "command", done
    return None


def _run(argv: list[str], timeout: float) -> str | None:
    """None when ``argv`` exits 0; else why, with the last line of its output."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"{argv[-1]!r} did not finish in {timeout:g} s"
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc}"
    if done.returncode == 0:
        return None
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    tail = lines[-1].strip() if lines else "no output"
    return f"exit {done.returncode}: {tail}"
