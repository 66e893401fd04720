"""N simulated nodes' rendezvous in one process: a handler per node, each on a thread,
each with its own :class:`~steadfast.sim.store.CountingStore` over its own real
``TCPStore`` client of one ``TCPStore`` server. Two designs side by side:

- ``torch``: torch's dynamic rendezvous (``DynamicRendezvousHandler`` over the c10d
  backend), as ``steadfast launch --rdzv-backend c10d`` uses it;
- ``steadfast``: steadfast's own (``steadfast.rendezvous``, ``--rdzv-backend steadfast``).

What it measures: the join of N nodes (its time, and each node's store operations and
bytes), then a quiet window in which the round runs: each node's keep-alive and the
agent's own polling (torch's agent asks ``num_nodes_waiting`` every
``monitor_interval``, 0.1 s by default), per node per keep-alive interval; the memory per
simulated node; and a node lost after the round formed: one survivor expires it, every
survivor joins the next round."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .store import CountingStore, Tally

__all__ = ["DESIGNS", "Loss", "Run", "simulate_join", "simulate_loss"]

DESIGNS = ("torch", "steadfast")


@dataclass
class Run:
    """One simulation's figures; per-node figures are medians over the nodes."""

    design: str
    nodes: int
    join_seconds: float
    join: Tally  # one median node's tally for the join (round 1)
    join_max: Tally  # the node that sent most
    keep_alive: Tally  # per node per keep-alive interval (median node)
    intervals: float
    memory_per_node: float  # bytes of resident memory the harness grew by, per node
    overhead_per_op: float  # seconds of the counting proxy's own work per operation
    latency_per_op: float  # seconds of a bare get on this machine's loopback store
    notes: list[str] = field(default_factory=list)


def _median(tallies: list[Tally]) -> Tally:
    ranked = sorted(tallies, key=lambda t: t.bytes)
    return ranked[len(ranked) // 2]


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def simulate_join(
    nodes: int,
    design: str = "steadfast",
    keep_alive: float = 5.0,
    window: float = 10.0,
    monitor_interval: float = 0.1,
    join_timeout: float = 120.0,
) -> Run:
    """Join ``nodes`` simulated nodes through ``design``'s rendezvous on a real
    ``TCPStore``, then let the round run for ``window`` seconds: the handlers'
    keep-alives, and every node's agent asking ``num_nodes_waiting`` each
    ``monitor_interval`` (one thread asks for all nodes in turn)."""
    with _Cluster(nodes) as cluster:
        rss0 = _rss()
        handlers = cluster.handlers(design, nodes, last_call=0.1, keep_alive=keep_alive,
                                    join_timeout=join_timeout)  # fmt: skip
        start = time.monotonic()
        _join_all(handlers)
        joined = time.monotonic() - start
        memory = (_rss() - rss0) / nodes
        counters = cluster.counters
        joins = [c.tally.copy() for c in counters]
        _monitor(handlers, window, monitor_interval)
        quiet = [c.tally.minus(j) for c, j in zip(counters, joins, strict=True)]
        interval = max(1, round(keep_alive))
        per_interval = [
            Tally({k: round(v * interval / window) for k, v in q.ops.items()},
                  round(q.sent * interval / window), round(q.received * interval / window))
            for q in quiet
        ]  # fmt: skip
        cluster.stop()
        latency, overhead = _proxy_overhead(cluster.clients[0])
    return Run(
        design=design,
        nodes=nodes,
        join_seconds=joined,
        join=_median(joins),
        join_max=max(joins, key=lambda t: t.bytes),
        keep_alive=_median(per_interval),
        intervals=window / interval,
        memory_per_node=memory,
        overhead_per_op=overhead,
        latency_per_op=latency,
    )


def _monitor(handlers: list[Any], window: float, interval: float) -> None:
    """Each node's agent loop, for ``window`` seconds: ``num_nodes_waiting`` every
    ``interval`` (torch's ``_invoke_run`` while the workers are healthy)."""
    end = time.monotonic() + window
    while (now := time.monotonic()) < end:
        for handler in handlers:
            handler.num_nodes_waiting()
        time.sleep(max(0.0, min(interval - (time.monotonic() - now), end - time.monotonic())))


class _Cluster:
    """One ``TCPStore`` server and a client per simulated node, each counted (a context
    manager: on exit every handler's keep-alive stops and the store goes)."""

    def __init__(self, nodes: int) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher
        resource.setrlimit(resource.RLIMIT_NOFILE, _nofile(nodes))
        self.server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               use_libuv=True)  # fmt: skip
        # a client per node, as each node has: the rendezvous' own blocking get (the
        # master address, set by rank 0) must not hold a client another node needs
        self.clients = [
            TCPStore("127.0.0.1", self.server.port, is_master=False) for _ in range(nodes)
        ]
        self.counters = [CountingStore(c) for c in self.clients]
        self.run_id = uuid.uuid4().hex[:8]
        self._handlers: list[Any] = []

    def handlers(
        self, design: str, min_nodes: int, last_call: float, keep_alive: float = 5.0,
        join_timeout: float = 120.0,
    ) -> list[Any]:  # fmt: skip
        """A handler of ``design`` per node (elastic ``min_nodes`` .. all), its store
        calls through that node's counted client."""
        if design == "steadfast":
            from ..rendezvous.handler import Settings, SteadfastRendezvousHandler

            self._handlers = [
                SteadfastRendezvousHandler(
                    counter,
                    Settings(self.run_id, min_nodes, len(self.clients), join_timeout=join_timeout,
                             last_call_timeout=last_call, keep_alive_interval=keep_alive,
                             local_addr="127.0.0.1"),
                    node=f"node{i}",
                )
                for i, counter in enumerate(self.counters)
            ]  # fmt: skip
            return self._handlers
        if design != "torch":
            raise ValueError(f"design: {design!r} (expected one of {', '.join(DESIGNS)})")
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        timeout = RendezvousTimeout(
            join=timedelta(seconds=join_timeout),
            last_call=timedelta(seconds=last_call),
            close=timedelta(seconds=5),
            heartbeat=timedelta(seconds=max(5.0, 3 * keep_alive)),
        )
        self._handlers = [
            DynamicRendezvousHandler.from_backend(
                self.run_id, client, C10dRendezvousBackend(counter, self.run_id),  # type: ignore[arg-type]
                min_nodes=min_nodes, max_nodes=len(self.clients), local_addr=f"node{i}",
                timeout=timeout, keep_alive_interval=max(1, round(keep_alive)),
            )
            for i, (client, counter) in enumerate(zip(self.clients, self.counters, strict=True))
        ]  # fmt: skip
        return self._handlers

    def stop(self) -> None:
        """Every handler's keep-alive stopped (what a lost node does, and the clean-up)."""
        from .. import seam

        for handler in self._handlers:
            with contextlib.suppress(Exception):
                seam.stop_rendezvous_heartbeats(handler)  # torch's: a timer thread

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._handlers, self.counters, self.clients = [], [], []
        del self.server


def _nofile(nodes: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * nodes + 256))
    return want, hard


def _proxy_overhead(client: Any, calls: int = 2000) -> tuple[float, float]:
    """Seconds per bare ``get`` on this store, and what the counting proxy adds to each
    (the harness's own overhead; noisy on a shared machine)."""
    proxy = CountingStore(client)
    client.set("sim/overhead", b"x")
    start = time.perf_counter()
    for _ in range(calls):
        client.get("sim/overhead")
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        proxy.get("sim/overhead")
    return bare / calls, max(0.0, (time.perf_counter() - start - bare) / calls)


@dataclass
class Loss:
    """A node lost after the round formed: the survivors expire it and form the next
    round (detection itself is the node roster's: ``steadfast.sim.roster``)."""

    design: str
    nodes: int
    last_call: float  # the rendezvous' last-call wait (torch's elastic rounds wait it)
    seconds: float  # expiry by one survivor -> every survivor in the next round
    expire: Tally  # the survivor that expired the lost node: that operation's tally
    round: Tally  # per survivor for the next round (median survivor)
    round_max: Tally
    world: int  # the next round's size


def simulate_loss(
    nodes: int, design: str = "steadfast", last_call: float = 1.0, join_timeout: float = 120.0
) -> Loss:
    """``nodes`` nodes join (an elastic range ``nodes - 1 .. nodes``), then the last one
    is lost (torch's: its keep-alives stop): one survivor expires it in the rendezvous,
    as the launcher does when its ring reports a loss, and every survivor joins the next
    round."""
    from .. import seam

    with _Cluster(nodes) as cluster:
        handlers = cluster.handlers(design, max(1, nodes - 1), last_call,
                                    join_timeout=join_timeout)  # fmt: skip
        worlds = _join_all(handlers)
        if set(worlds) != {nodes}:
            raise RuntimeError(f"the first round has {sorted(set(worlds))} nodes, not {nodes}")
        counters = cluster.counters[:-1]
        lost, survivors = handlers[-1], handlers[:-1]
        seam.stop_rendezvous_heartbeats(lost)
        before = [c.tally.copy() for c in counters]
        start = time.monotonic()
        if design == "steadfast":
            survivors[0].expire([lost.node_id()])
        else:
            node_id = seam.rendezvous_node_id(lost)
            assert node_id is not None
            seam.expire_rendezvous_nodes(survivors[0], [node_id])
        expire = counters[0].tally.minus(before[0])
        after_expire = counters[0].tally.copy()
        worlds = _join_all(survivors)
        seconds = time.monotonic() - start
        rounds = [c.tally.minus(b) for c, b in zip(counters, before, strict=True)]
        rounds[0] = counters[0].tally.minus(after_expire)
    return Loss(
        design=design,
        nodes=nodes,
        last_call=last_call,
        seconds=seconds,
        expire=expire,
        round=_median(rounds),
        round_max=max(rounds, key=lambda t: t.bytes),
        world=worlds[0] if len(set(worlds)) == 1 else -1,
    )


def _join_all(handlers: list[Any]) -> list[int]:
    """Every handler's ``next_rendezvous`` at once, each on a thread (small stacks: a
    thousand nodes' threads): the world sizes."""
    worlds: list[int] = []
    errors: list[BaseException] = []

    def join(handler: Any) -> None:
        try:
            worlds.append(int(handler.next_rendezvous().world_size))
        except BaseException as exc:  # every failure is reported below
            errors.append(exc.with_traceback(None))

    previous = threading.stack_size(512 * 1024)
    try:
        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(previous)
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(handlers)} nodes failed to join: {errors[0]!r}")
    return worlds
