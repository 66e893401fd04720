"""N simulated nodes' rendezvous: a handler per node, each with its own
:class:`~sfsim.store.CountingStore` over its own real ``TCPStore`` client of one
``TCPStore`` server (in this process). The nodes live in ``processes`` worker processes
(a thread per node in each): one interpreter holding thousands of nodes' threads spends
more time handing its lock around than the protocol takes (a 2,048-node loss: 1.5-1.7 s
in one process, 2.7 s of CPU mostly in the kernel; 0.48 s over 8), so the nodes are
spread over processes, each
thread is started before the clock starts (a real node's agent exists before it joins),
and ``processes=0`` keeps them in this process (small runs, tests). Two designs side by
side:

- ``torch``: torch's dynamic rendezvous (``DynamicRendezvousHandler`` over the c10d
  backend), as ``steadfast launch --rdzv-backend c10d`` uses it;
- ``steadfast``: steadfast's own (``steadfast.rendezvous``, ``--rdzv-backend steadfast``);
- ``nvrx``: NVRx's barrier rendezvous (``ft_rendezvous_barrier``, the default of its
  newest launcher), from its source (``scripts/nvrx-env.sh`` makes an environment with
  it; the workers run that environment's interpreter, ``python=``). Node 0 is its store
  host (``is_store_host``), which closes each round. The harness runs NVRx's nodes on
  threads, so its handler's install of signal handlers (main thread only) is skipped, it
  is told that many launchers share this machine
  (``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE``), and it gets a stand-in worker group (one
  local rank) as its agent would set; nothing of its protocol is changed.

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
import time
from dataclasses import dataclass
from typing import Any

from .nodes import DESIGNS, Nodes, Setup, _client, _nofile
from .store import CountingStore, Tally

__all__ = ["DESIGNS", "Loss", "Run", "simulate_join", "simulate_loss"]


@dataclass
class Run:
    """One simulation's figures; per-node figures are medians over the nodes."""

    design: str
    nodes: int
    processes: int  # worker processes holding the nodes (0: this one)
    join_seconds: float
    join: Tally  # one median node's tally for the join (round 1)
    join_max: Tally  # the node that sent most
    keep_alive: Tally  # per node per keep-alive interval (median node; ops rounded)
    keep_alive_ops: float  # operations per node per keep-alive interval (median node)
    memory_per_node: float  # bytes of resident memory the harness grew by, per node
    overhead_per_op: float  # seconds of the counting proxy's own work per operation
    latency_per_op: float  # seconds of a bare get on this machine's loopback store


@dataclass
class Loss:
    """A node lost after the round formed: the survivors expire it and form the next
    round (detection itself is the node roster's: ``sfsim.roster``)."""

    design: str
    nodes: int
    last_call: float  # the rendezvous' last-call wait (torch's elastic rounds wait it)
    seconds: float  # expiry by one survivor -> every survivor in the next round
    expire: Tally  # the survivor that expired the lost node: that operation's tally
    round: Tally  # per survivor for the next round (median survivor)
    round_max: Tally
    world: int  # the next round's size


def _median(tallies: list[Tally]) -> Tally:
    ranked = sorted(tallies, key=lambda t: t.bytes)
    return ranked[len(ranked) // 2]


def default_processes(nodes: int) -> int:
    """Worker processes for ``nodes`` simulated nodes: about 256 nodes' threads each."""
    return 0 if nodes <= 64 else min(16, (nodes + 255) // 256)


def _processes(nodes: int, asked: int | None, python: str) -> int:
    """The worker processes for ``nodes`` nodes: as ``asked``, else the default; at
    least one when the nodes run in another interpreter (``python``)."""
    procs = default_processes(nodes) if asked is None else asked
    return max(procs, 1) if python else procs


def simulate_join(
    nodes: int,
    design: str = "steadfast",
    keep_alive: float = 5.0,
    window: float = 10.0,
    monitor_interval: float = 0.1,
    join_timeout: float = 120.0,
    processes: int | None = None,
    etcd: tuple[str, ...] = (),
    python: str = "",
) -> Run:
    """Join ``nodes`` simulated nodes through ``design``'s rendezvous on a real
    ``TCPStore``, then let the round run for ``window`` seconds: the handlers'
    keep-alives, and every node's agent asking ``num_nodes_waiting`` each
    ``monitor_interval``."""
    procs = _processes(nodes, processes, python)
    settings = Setup(design, nodes, nodes, 0.1, keep_alive, join_timeout, etcd=etcd,
                      python=python)  # fmt: skip
    with _Cluster(settings, procs) as cluster:
        joined, worlds, memory = cluster.join(range(nodes))
        if set(worlds) != {nodes}:
            raise RuntimeError(f"the round has {sorted(set(worlds))} nodes, not {nodes}")
        joins = cluster.tallies()
        cluster.monitor(window, monitor_interval)
        quiet = [t.minus(j) for t, j in zip(cluster.tallies(), joins, strict=True)]
        interval = max(1, round(keep_alive))
        per_interval = [
            Tally({k: round(v * interval / window) for k, v in q.ops.items()},
                  round(q.sent * interval / window), round(q.received * interval / window))
            for q in quiet
        ]  # fmt: skip
        latency, overhead = cluster.proxy_overhead()
    return Run(
        design=design,
        nodes=nodes,
        processes=procs,
        join_seconds=joined,
        join=_median(joins),
        join_max=max(joins, key=lambda t: t.bytes),
        keep_alive=_median(per_interval),
        keep_alive_ops=sorted(q.count for q in quiet)[len(quiet) // 2] * interval / window,
        memory_per_node=memory / nodes,
        overhead_per_op=overhead,
        latency_per_op=latency,
    )


def simulate_loss(
    nodes: int,
    design: str = "steadfast",
    last_call: float = 1.0,
    join_timeout: float = 120.0,
    processes: int | None = None,
    etcd: tuple[str, ...] = (),
    python: str = "",
) -> Loss:
    """``nodes`` nodes form a round and a spare waits (``--nnodes N`` with one launcher
    more; NVRx's: N active nodes and one hot spare), then an active node is lost: one
    survivor reports it as its launcher does when it sees the loss (steadfast's and
    torch's: expire it; NVRx's: open the next round), and every survivor and the spare
    join the next round: the time from the report to the last node in that round."""
    procs = _processes(nodes + 1, processes, python)
    top = nodes + 1 if design == "nvrx" else nodes  # NVRx counts its hot spares in max
    settings = Setup(design, nodes + 1, nodes, last_call, 5.0, join_timeout, etcd=etcd,
                      python=python, max_nodes=top)  # fmt: skip
    with _Cluster(settings, procs) as cluster:
        _, worlds, _ = cluster.join(range(nodes))
        if set(worlds) != {nodes}:
            raise RuntimeError(f"the first round has {sorted(set(worlds))} nodes, not {nodes}")
        spare, lost = nodes, nodes - 1
        cluster.park(spare)
        time.sleep(1.0)  # the spare waits in the rendezvous
        cluster.lose(lost)
        before = cluster.tallies()
        seconds, worlds, _ = cluster.join(range(nodes - 1), expire=(0, lost))
        after = cluster.tallies()
        joined = [*range(nodes - 1), spare]
        rounds = [after[i].minus(before[i]) for i in joined]
        expire = cluster.expire_tally
        rounds[0] = rounds[0].minus(expire)
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


def _with_sfsim_on_path() -> dict[str, str]:
    """The environment, with the folder that holds this package first on the path: the
    simulator is a bench tool, not part of the installed product."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


class _Worker:
    """A worker process (a plain subprocess: no multiprocessing helper process outlives
    it) and the two pipes to it, each carrying pickled messages."""

    def __init__(self, setup: Setup, indices: list[int]) -> None:
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self.proc = subprocess.Popen(
            [
                setup.python or sys.executable,
                "-m",
                "sfsim.worker",
                str(to_child),
                str(from_child),
            ],
            pass_fds=(to_child, from_child),
            env=_with_sfsim_on_path(),
        )
        os.close(to_child)
        os.close(from_child)
        self.send_conn = Connection(from_parent, readable=False)
        self.recv_conn = Connection(to_parent, writable=False)
        self.indices = indices
        self.send((setup, indices))

    def send(self, message: Any) -> None:
        self.send_conn.send(message)

    def recv(self) -> Any:
        return self.recv_conn.recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send(("stop", ()))
            self.recv()
        self.send_conn.close()
        self.recv_conn.close()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


class _Cluster:
    """One ``TCPStore`` server here and the nodes in ``processes`` workers (0: here),
    a context manager: on exit the workers stop and the store goes."""

    def __init__(self, setup: Setup, processes: int) -> None:
        from dataclasses import replace

        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        # a loopback client's address is looked up in DNS by c10d's logging: where DNS
        # does not answer, every lookup waits 5 s (the harness's, not the protocol's)
        os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        resource.setrlimit(resource.RLIMIT_NOFILE, _nofile(setup.nodes))
        self.server: Any = None
        if not setup.etcd:
            self.server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   use_libuv=True)  # fmt: skip
            setup = replace(setup, port=self.server.port)
        elif setup.design == "nvrx":
            raise ValueError("NVRx's rendezvous on etcd: not simulated (its launcher's is c10d)")
        self.setup = setup
        self.expire_tally = Tally()
        self._local: Nodes | None = None
        self._workers: list[_Worker] = []
        if processes <= 0:
            self._local = Nodes(self.setup, list(range(setup.nodes)))
            return
        self._workers = [
            _Worker(self.setup, list(range(p, setup.nodes, processes))) for p in range(processes)
        ]
        for worker in self._workers:
            if worker.recv() != "ready":
                raise RuntimeError("a simulator worker did not start")

    def _owner(self, i: int) -> _Worker:
        for worker in self._workers:
            if i in worker.indices:
                return worker
        raise KeyError(i)

    def _call(self, i: int | None, name: str, *args: Any) -> list[Any]:
        """``Nodes.name(*args)`` on node ``i``'s process, or on every process."""
        if self._local is not None:
            return [getattr(self._local, name)(*args)]
        workers = [self._owner(i)] if i is not None else self._workers
        for worker in workers:
            worker.send(("call", (name, *args)))
        return [worker.recv() for worker in workers]

    def join(
        self, which: range, expire: tuple[int, int] | None = None
    ) -> tuple[float, list[int], int]:
        """Nodes ``which`` join at once (node ``expire[0]`` first expiring node
        ``expire[1]``): the seconds from the start to the last node's round, the worlds,
        and the memory the nodes' processes grew by."""
        target = (
            None if expire is None else (expire[0], self._call(expire[1], "node_id", expire[1])[0])
        )
        if self._local is not None:
            go = self._local.prepare(list(which), target)
            time.sleep(0.05)  # every thread waiting
            start = time.monotonic()
            go.set()
            results, memory = self._local.finish()
            self.expire_tally = self._local.expire_tally or Tally()
            return max(r[2] for r in results) - start, [r[1] for r in results], memory
        for worker in self._workers:
            worker.send(("prepare", (list(which), target)))
        for worker in self._workers:
            worker.recv()
        start = time.monotonic()
        for worker in self._workers:
            worker.send("go")
        results, memory = [], 0
        for worker in self._workers:
            status, value, tally = worker.recv()
            if status != "ok":
                raise RuntimeError(value)
            results.extend(value[0])
            memory += value[1]
            if tally is not None:
                self.expire_tally = tally
        return max(r[2] for r in results) - start, [r[1] for r in results], memory

    def lose(self, i: int) -> None:
        self._call(i, "lose", i)

    def park(self, i: int) -> None:
        self._call(i, "park", i)

    def monitor(self, window: float, interval: float) -> None:
        self._call(None, "monitor", window, interval)

    def tallies(self) -> list[Tally]:
        merged: dict[int, Tally] = {}
        for part in self._call(None, "tallies"):
            merged.update(part)
        return [merged[i] for i in range(self.setup.nodes)]

    def proxy_overhead(self) -> tuple[float, float]:
        return _proxy_overhead(_client(self.setup))

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._local is not None:
            self._local.stop()
            self._local = None
        for worker in self._workers:
            worker.close()
        self._workers = []
        del self.server


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


def clients(port: int, count: int) -> list[Any]:
    """``count`` counted clients of the store at ``port`` (the roster simulation's)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    resource.setrlimit(resource.RLIMIT_NOFILE, _nofile(count))
    return [CountingStore(TCPStore("127.0.0.1", port, is_master=False)) for _ in range(count)]
