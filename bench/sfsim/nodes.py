"""The simulated nodes' side (``cluster.py`` drives them): a process's share of the
nodes (:class:`Nodes`: a counted store client and a rendezvous handler each, of one of
the designs), and the loop of a worker process that holds them (:func:`serve`, run by
``python -m sfsim.worker``)."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .store import CountingStore, Tally

__all__ = ["DESIGNS", "Nodes", "Setup", "serve"]

DESIGNS = ("torch", "steadfast", "nvrx")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _nofile(nodes: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * nodes + 256))
    return want, hard


@dataclass(frozen=True)
class Setup:
    """What every worker needs to build its nodes."""

    design: str
    nodes: int
    min_nodes: int
    last_call: float
    keep_alive: float
    join_timeout: float
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    port: int = 0
    etcd: tuple[str, ...] = ()  # an etcd cluster's client endpoints instead of a TCPStore
    python: str = ""  # the workers' interpreter (NVRx's environment), else this one
    max_nodes: int = 0  # the rendezvous' max_nodes (0: every node)

    @property
    def top(self) -> int:
        return self.max_nodes or self.nodes


class Nodes:
    """Some of the simulated nodes (``indices``), in one process: a counted client and
    a handler each."""

    def __init__(self, setup: Setup, indices: list[int]) -> None:

        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher
        resource.setrlimit(resource.RLIMIT_NOFILE, _nofile(len(indices)))
        self.setup, self.indices = setup, indices
        self.rss0 = _rss()
        self.counters = {i: CountingStore(_client(setup)) for i in indices}
        self.handlers = {i: self._handler(i) for i in indices}
        self._threads: list[threading.Thread] = []  # prepared joins
        self._parked: list[threading.Thread] = []  # a spare's join, started already
        self._results: list[tuple[int, int, float]] = []  # (node, world, when done)
        self._errors: list[BaseException] = []
        #: what expiring a lost node cost the node that did it (the last prepared one)
        self.expire_tally: Tally | None = None

    def _handler(self, i: int) -> Any:
        s, counter = self.setup, self.counters[i]
        if s.design == "steadfast":
            from steadfast.rendezvous.handler import Settings, SteadfastRendezvousHandler

            settings = Settings(s.run_id, s.min_nodes, s.top, join_timeout=s.join_timeout,
                                last_call_timeout=s.last_call, keep_alive_interval=s.keep_alive,
                                local_addr="127.0.0.1")  # fmt: skip
            return SteadfastRendezvousHandler(counter, settings, node=f"node{i}")
        if s.design == "nvrx":
            return _nvrx_handler(s, i, counter)
        if s.design != "torch":
            raise ValueError(f"design: {s.design!r} (expected one of {', '.join(DESIGNS)})")
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        timeout = RendezvousTimeout(
            join=timedelta(seconds=s.join_timeout),
            last_call=timedelta(seconds=s.last_call),
            close=timedelta(seconds=5),
            heartbeat=timedelta(seconds=max(5.0, 3 * s.keep_alive)),
        )
        if s.etcd:  # torch's etcd-v2 backend (python-etcd) and its EtcdStore
            from torch.distributed.elastic.rendezvous.api import RendezvousParameters
            from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
                create_backend,
            )

            from .store import CountingBackend

            params = RendezvousParameters(
                backend="etcd-v2", endpoint=s.etcd[i % len(s.etcd)], run_id=s.run_id,
                min_nodes=s.min_nodes, max_nodes=s.top,
            )  # fmt: skip
            backend, etcd_store = create_backend(params)
            counter.store = etcd_store
            return DynamicRendezvousHandler.from_backend(
                s.run_id, counter, CountingBackend(backend, counter),  # type: ignore[arg-type]
                min_nodes=s.min_nodes, max_nodes=s.top, local_addr=f"node{i}",
                timeout=timeout, keep_alive_interval=max(1, round(s.keep_alive)),
            )  # fmt: skip
        return DynamicRendezvousHandler.from_backend(
            s.run_id, counter.store, C10dRendezvousBackend(counter, s.run_id),
            min_nodes=s.min_nodes, max_nodes=s.top, local_addr=f"node{i}",
            timeout=timeout, keep_alive_interval=max(1, round(s.keep_alive)),
        )  # fmt: skip

    def _join_one(self, i: int) -> None:
        """Node ``i`` joins; its result (or its error) is kept for :meth:`finish`."""
        try:
            world = int(self.handlers[i].next_rendezvous().world_size)
            self._results.append((i, world, time.monotonic()))
        except BaseException as exc:  # every failure is reported
            self._errors.append(exc.with_traceback(None))

    def prepare(self, which: list[int], expire: tuple[int, Any] | None) -> threading.Event:
        """A thread per node of ``which`` (here), started and waiting for the returned
        event: each then joins (the first expiring ``expire``'s node first, if here)."""
        go = threading.Event()

        def run(i: int) -> None:
            go.wait()
            if expire is not None and i == expire[0]:
                before = self.counters[i].tally.copy()
                self._expire(i, expire[1])
                self.expire_tally = self.counters[i].tally.minus(before)
            self._join_one(i)

        self._threads.extend(started([(run, i) for i in which if i in self.handlers]))
        return go

    def park(self, i: int) -> None:
        """Node ``i`` joins now, on a thread of its own that the next :meth:`finish`
        waits for too (a spare: it waits in the rendezvous until a round takes it)."""
        self._parked.extend(started([(self._join_one, i)]))

    def finish(self) -> tuple[list[tuple[int, int, float]], int]:
        """Wait for the prepared joins (and a parked spare's): ``(node, world, when
        done)`` each, and the resident memory grown since these nodes were made."""
        for t in self._threads:
            t.join()
        for t in self._parked:
            t.join(self.setup.join_timeout)
        results, errors = self._results, self._errors
        self._threads, self._parked, self._results, self._errors = [], [], [], []
        if errors:
            raise RuntimeError(f"{len(errors)} nodes failed to join: {errors[0]!r}")
        return results, _rss() - self.rss0

    def _expire(self, i: int, node_id: Any) -> None:
        from steadfast import seam

        handler = self.handlers[i]
        if self.setup.design == "steadfast":
            handler.expire([node_id])
        elif self.setup.design == "torch":
            seam.expire_rendezvous_nodes(handler, [node_id])
        else:  # NVRx: no expiry; the launcher that sees a failure opens the next round
            handler._barrier_state.open_rendezvous()  # (its launcher's own call)

    def node_id(self, i: int) -> Any:
        """Node ``i`` in its rendezvous (for the node that expires it)."""
        from steadfast import seam

        handler = self.handlers[i]
        if self.setup.design == "nvrx":
            return [f"node{i}"]
        return handler.node_id() if self.setup.design == "steadfast" else (
            seam.rendezvous_node_id(handler)
        )  # fmt: skip

    def lose(self, i: int) -> Any:
        """Node ``i`` is lost: its keep-alives stop; returns its id."""
        from steadfast import seam

        seam.stop_rendezvous_heartbeats(self.handlers[i])
        return self.node_id(i)

    def monitor(self, window: float, interval: float) -> None:
        """Each node's agent loop for ``window`` seconds: ``num_nodes_waiting`` every
        ``interval`` (torch's ``_invoke_run`` while the workers are healthy; NVRx's
        agent: ``is_next_round_open``)."""
        end = time.monotonic() + window
        # NVRx's agent asks whether a peer opened the next round instead
        ask = "is_next_round_open" if self.setup.design == "nvrx" else "num_nodes_waiting"
        while (now := time.monotonic()) < end:
            for handler in self.handlers.values():
                getattr(handler, ask)()
            time.sleep(max(0.0, min(interval - (time.monotonic() - now), end - time.monotonic())))

    def tallies(self) -> dict[int, Tally]:
        return {i: c.tally.copy() for i, c in self.counters.items()}

    def stop(self) -> None:
        from steadfast import seam

        for handler in self.handlers.values():
            with contextlib.suppress(Exception):
                seam.stop_rendezvous_heartbeats(handler)  # torch's: a timer thread
        self.handlers, self.counters = {}, {}


@contextlib.contextmanager
def small_stacks() -> Iterator[None]:
    """Threads started within get 512 KB stacks: a thousand nodes' threads in one
    process."""
    previous = threading.stack_size(512 * 1024)
    try:
        yield
    finally:
        threading.stack_size(previous)


def started(jobs: list[tuple[Any, int]]) -> list[threading.Thread]:
    """A started daemon thread per ``(function, node)``, each calling ``function(node)``."""
    with small_stacks():
        threads = [threading.Thread(target=fn, args=(i,), daemon=True) for fn, i in jobs]
        for t in threads:
            t.start()
    return threads


def serve(inp: Any, out: Any) -> None:
    """A worker process's loop (``python -m sfsim.worker``): its nodes, built
    from the first message on ``inp``, then driven by the parent's commands; answers on
    ``out``."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    setup, indices = inp.recv()
    nodes = Nodes(setup, indices)
    out.send("ready")
    while True:
        cmd, args = inp.recv()
        if cmd == "prepare":
            go = nodes.prepare(*args)
            out.send("ready")
            inp.recv()
            go.set()
            try:
                out.send(("ok", nodes.finish(), nodes.expire_tally))
            except RuntimeError as exc:
                out.send(("error", str(exc), None))
        elif cmd == "call":
            out.send(getattr(nodes, args[0])(*args[1:]))
        elif cmd == "stop":
            nodes.stop()
            out.send("bye")
            return


def _nvrx_handler(s: Setup, i: int, counter: Any) -> Any:
    """NVRx's barrier rendezvous handler for node ``i`` (its ``create_handler``, as its
    launcher calls it), on the counted store."""
    import types

    import nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier as barrier  # type: ignore[import-not-found]
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    os.environ["NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE"] = "1"  # N nodes on one machine
    barrier._install_rdzv_signal_handlers = lambda: {}  # main thread only; nodes are threads
    barrier._restore_rdzv_signal_handlers = lambda previous: None
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{s.port}", run_id=s.run_id,
        min_nodes=s.min_nodes, max_nodes=s.top, local_addr="127.0.0.1",
        is_store_host=i == 0, join_timeout=str(int(s.join_timeout)),
        last_call_timeout=str(round(s.last_call)),  # whole seconds: its parser
    )  # fmt: skip
    handler = barrier.create_handler(counter, None, params)
    spec = types.SimpleNamespace(local_world_size=1)
    handler.set_worker_group(types.SimpleNamespace(spec=spec))  # as its agent does
    return handler


def _client(setup: Setup) -> Any:
    """A node's store client: of the TCPStore here, or of the etcd cluster (torch's
    design replaces it by its etcd-v2 backend's own store)."""
    if setup.etcd:
        from steadfast.rendezvous.etcd import EtcdV3Store

        return EtcdV3Store(list(setup.etcd), prefix="", timeout=timedelta(seconds=120))
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", setup.port, is_master=False)
