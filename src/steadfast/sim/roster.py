"""N real node rosters (``steadfast.launcher.nodes.NodeRoster``: the ring watch, the
confirmation of a loss in the store, the fence's socket) in one process, against one
real ``TCPStore``, each roster's store calls counted on a client of its own.

What it measures: the round's entry (each node publishes itself and reads the nodes it
watches; node rank 0 records the round), then one node killed (its sockets close
without a goodbye, as a launcher that died): how long its watchers take to see it, the
store operations and bytes the loss costs the whole job (the watchers confirm it; every
survivor then learns it, as each launcher does when its workers fail), and the ring's
own traffic per node (a protocol figure: one byte per watcher per beat)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .cluster import _median, clients
from .store import Tally

__all__ = ["RosterRun", "simulate_roster"]


@dataclass
class RosterRun:
    """One roster simulation's figures."""

    nodes: int
    enter_seconds: float  # every roster entered the round and watches its successors
    enter: Tally  # per node (median node)
    enter_max: Tally  # the node that moved most (node rank 0, which records the round)
    detect_seconds: float  # the kill -> the first watcher's confirmed loss
    loss_ops: int  # store operations of the whole job for the loss (confirm + learn)
    loss_bytes: int
    learn: Tally  # per survivor to learn the loss (median survivor)
    ring_bytes_per_node_second: float  # beacon payload each node sends


def simulate_roster(nodes: int, interval: float = 0.5, timeout: float = 5.0) -> RosterRun:
    """``nodes`` rosters enter one round, the last is killed, every survivor learns it.
    ``interval``/``timeout``: the ring's ``node_heartbeat_interval``/``_timeout``."""
    from ..config import FaultToleranceConfig
    from ..launcher.nodes import NodeRoster
    from ..launcher.nodes.ring import WATCHERS
    from ..rendezvous.handler import _Prefixed

    if nodes < 3:
        raise ValueError(f"nodes: {nodes} (a loss needs at least 3)")
    ft = FaultToleranceConfig(node_heartbeat_interval=interval, node_heartbeat_timeout=timeout)
    run_id = uuid.uuid4().hex[:8]
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    counters = clients(server.port, nodes)
    try:
        prefix = f"/sim/{run_id}/round0/"
        stores = [_Prefixed(prefix, counter) for counter in counters]
        previous = threading.stack_size(512 * 1024)
        try:
            made = [NodeRoster(ft, host="127.0.0.1", name=f"node{i}") for i in range(nodes)]
        finally:
            threading.stack_size(previous)
        try:
            start = time.monotonic()
            _all(lambda i: made[i].enter_round(stores[i], i, nodes, run_id, None), nodes)
            entered = time.monotonic() - start
            enters = [c.tally.copy() for c in counters]
            victim, survivors = made[-1], made[:-1]
            watchers = [made[(nodes - 1 - k) % nodes] for k in range(1, WATCHERS + 1)]
            killed = time.monotonic()
            victim.close()  # no goodbye: its watchers see the connections reset
            deadline = killed + timeout + 10.0
            while not any(w.losses() for w in watchers) and time.monotonic() < deadline:
                time.sleep(0.005)
            detected = time.monotonic() - killed
            for w in watchers:  # both watchers' confirmations are part of the loss's cost
                w.settle(timeout)
            confirmed = [c.tally.copy() for c in counters]
            _all(lambda i: survivors[i].wait_for_loss(timeout), len(survivors))
            learned = [c.tally.minus(b) for c, b in zip(counters[:-1], confirmed[:-1], strict=True)]
            cost = [c.tally.minus(e) for c, e in zip(counters, enters, strict=True)]
            lost_seen = [bool(s.losses()) for s in survivors]
            if not all(lost_seen):
                raise RuntimeError(f"{lost_seen.count(False)} survivors never learnt the loss")
        finally:
            for roster in made:
                roster.close()
    finally:
        counters.clear()  # the clients, then the server (the function's locals) go
    return RosterRun(
        nodes=nodes,
        enter_seconds=entered,
        enter=_median(enters),
        enter_max=max(enters, key=lambda t: t.bytes),
        detect_seconds=detected,
        loss_ops=sum(t.count for t in cost),
        loss_bytes=sum(t.bytes for t in cost),
        learn=_median(learned),
        ring_bytes_per_node_second=WATCHERS / interval,
    )


def _all(fn: Any, count: int) -> None:
    """``fn(i)`` for every i at once, each on a thread; the first error raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # reported below
            errors.append(exc.with_traceback(None))

    previous = threading.stack_size(512 * 1024)
    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(previous)
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {count} rosters failed: {errors[0]!r}")
