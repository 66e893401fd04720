"""N real node rosters (``steadfast.launcher.nodes.NodeRoster``: the ring watch, the
confirmation of a loss in the store, the fence's socket) in one process, against one
real ``TCPStore``, each roster's store calls counted on a client of its own.

What it measures: the round's entry (each node publishes itself and reads the nodes it
watches; node rank 0 records the round), a fence probe (a rank asks its launcher
before a save), a goodbye (a node whose workers finished leaves: no loss, no store
call), then one node killed (its sockets close
without a goodbye, as a launcher that died): how long its watchers take to see it, the
store operations and bytes the loss costs the whole job (the watchers confirm it; every
survivor then learns it, as each launcher does when its workers fail), and the ring's
own traffic per node (a protocol figure: one byte per watcher per beat)."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .cluster import _median, clients
from .nodes import small_stacks, started
from .store import Tally

__all__ = ["RosterRun", "simulate_roster"]


@dataclass
class RosterRun:
    """One roster simulation's figures."""

    nodes: int
    enter_seconds: float  # every roster entered the round and watches its successors
    enter: Tally  # per node (median node)
    enter_max: Tally  # the node that moved most (node rank 0, which records the round)
    fence: Tally  # one fence probe (a rank asks its launcher before a save; median node)
    goodbye_ops: int  # store operations of the whole job when a node leaves at the end
    detect_seconds: float  # the kill -> the first watcher's confirmed loss
    loss_ops: int  # store operations of the whole job for the loss (confirm + learn)
    loss_bytes: int
    learn: Tally  # per survivor to learn the loss (median survivor)
    ring_bytes_per_node_second: float  # beacon payload each node sends


def simulate_roster(nodes: int, interval: float = 0.5, timeout: float = 5.0) -> RosterRun:
    """``nodes`` rosters enter one round, the last is killed, every survivor learns it.
    ``interval``/``timeout``: the ring's ``node_heartbeat_interval``/``_timeout``."""
    from steadfast.config import FaultToleranceConfig
    from steadfast.launcher.nodes import NodeRoster
    from steadfast.launcher.nodes.ring import WATCHERS

    if nodes < 5:
        raise ValueError(f"nodes: {nodes} (a goodbye and a loss apart need at least 5)")
    ft = FaultToleranceConfig(node_heartbeat_interval=interval, node_heartbeat_timeout=timeout)
    run_id = uuid.uuid4().hex[:8]
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)  # type: ignore[attr-defined]
    counters = clients(server.port, nodes)
    try:
        prefix = f"/sim/{run_id}/round0/"
        stores = [dist.PrefixStore(prefix, counter) for counter in counters]  # type: ignore[attr-defined]
        with small_stacks():  # each roster's ring and store-call threads
            made = [NodeRoster(ft, host="127.0.0.1", name=f"node{i}") for i in range(nodes)]
        try:
            start = time.monotonic()
            _all(lambda i: made[i].enter_round(stores[i], i, nodes, run_id, None), nodes)
            entered = time.monotonic() - start
            enters = [c.tally.copy() for c in counters]
            fences = [_fence_probe(made[r], counters[r], timeout) for r in range(min(nodes, 8))]
            # node 1's workers finished: it says goodbye and goes; not a loss, no store call
            before = [c.tally.copy() for c in counters]
            made[1].finish()
            time.sleep(interval)
            made[1].close()
            time.sleep(2 * interval)
            if any(r.losses() for r in made):
                raise RuntimeError("a node that said goodbye was taken for lost")
            goodbye = sum(c.tally.minus(b).count for c, b in zip(counters, before, strict=True))
            enters_after = [c.tally.copy() for c in counters]
            victim = made[-1]
            survivors = [r for i, r in enumerate(made[:-1]) if i != 1]
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
            kept = [i for i in range(nodes - 1) if i != 1]
            learned = [counters[i].tally.minus(confirmed[i]) for i in kept]
            cost = [c.tally.minus(e) for c, e in zip(counters, enters_after, strict=True)]
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
        fence=_median(fences),
        goodbye_ops=goodbye,
        detect_seconds=detected,
        loss_ops=sum(t.count for t in cost),
        loss_bytes=sum(t.bytes for t in cost),
        learn=_median(learned),
        ring_bytes_per_node_second=WATCHERS / interval,
    )


def _fence_probe(roster: Any, counter: Any, timeout: float) -> Tally:
    """A rank of ``roster``'s node asks its launcher's fence before a save (one live
    probe of the store): what that cost the node's store client."""
    from steadfast import fence

    before = counter.tally.copy()
    saved = {k: os.environ.get(k) for k in roster.env()}
    os.environ.update(roster.env())
    try:
        answer = fence.check(timeout)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if answer is not None:
        raise RuntimeError(f"the fence of a node in the round refused: {answer}")
    spent: Tally = counter.tally.minus(before)
    return spent


def _all(fn: Any, count: int) -> None:
    """``fn(i)`` for every i at once, each on a thread; the first error raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # reported below
            errors.append(exc.with_traceback(None))

    for t in started([(run, i) for i in range(count)]):
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {count} rosters failed: {errors[0]!r}")
