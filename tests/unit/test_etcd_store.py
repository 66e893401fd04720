"""steadfast's rendezvous on etcd through its v3 JSON API (``steadfast.rendezvous.etcd``),
against real etcd members started here (Debian's etcd-server; `make test` installs it):
the c10d store's semantics, the rendezvous on one member, and a 3-member cluster that
loses a member (any member: no single point of failure) while nodes join."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from sfharness import join_rendezvous
from steadfast.rendezvous.etcd import EtcdV3Store
from steadfast.rendezvous.handler import Settings, SteadfastRendezvousHandler

pytestmark = pytest.mark.timeout(120)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: every socket stays bound until all are
    chosen (one closed before the next is bound may be handed out again: two members on
    one port, one of them dead before it answers)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class Cluster:
    """``size`` etcd members on this machine, each its own process, data directory and
    log (``root/NAME.log``). A cluster that does not start stops every member it started
    before it fails (a failed fixture gets no teardown: its members would outlive the
    test) and names the member, its exit status and its log's last lines."""

    def __init__(self, root: Path, size: int) -> None:
        if shutil.which("etcd") is None:
            if IN_CI:
                pytest.fail("etcd is not installed; CI must run the etcd tests")
            pytest.skip("etcd is not installed (`make test` installs etcd-server)")
        self.names = [f"m{i}" for i in range(size)]
        ports = _free_ports(2 * size)
        self.client = dict(zip(self.names, ports[:size], strict=True))
        peer = dict(zip(self.names, ports[size:], strict=True))
        initial = ",".join(f"{n}=http://127.0.0.1:{peer[n]}" for n in self.names)
        self.logs = {n: root / f"{n}.log" for n in self.names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for n in self.names:
                url = f"http://127.0.0.1:{self.client[n]}"
                with open(self.logs[n], "wb") as log:
                    self.procs[n] = subprocess.Popen(
                        ["etcd", "--name", n, "--data-dir", str(root / n),
                         "--listen-client-urls", url, "--advertise-client-urls", url,
                         "--listen-peer-urls", f"http://127.0.0.1:{peer[n]}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[n]}",
                         "--initial-cluster", initial, "--initial-cluster-state", "new",
                         "--heartbeat-interval", "50", "--election-timeout", "500"],
                        stdout=subprocess.DEVNULL, stderr=log,
                    )  # fmt: skip
            deadline = time.monotonic() + 60
            for n in self.names:
                while not self._healthy(n):
                    if self.procs[n].poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"etcd member {n} did not start: {self._why(n)}")
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    def _why(self, name: str) -> str:
        code = self.procs[name].poll()
        state = "still running, not healthy" if code is None else f"exited {code}"
        tail = self.logs[name].read_text(errors="replace").splitlines()[-5:]
        return f"{state}; its log ends:\n" + "\n".join(tail)

    def _healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.client[name]}/health", timeout=1
            ) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{self.client[n]}" for n in self.names]

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, 1)
    yield cluster
    cluster.close()


@pytest.fixture
def three(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, 3)
    yield cluster
    cluster.close()


def test_it_behaves_as_a_c10d_store(one: Cluster) -> None:
    store = EtcdV3Store(one.endpoints(), prefix="/t", timeout=datetime.timedelta(seconds=5))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    assert store.compare_set("a", "1", "2") == b"2"  # matched: written
    assert store.compare_set("a", "1", "3") == b"2"  # not: the value now
    assert store.compare_set("new", "", "x") == b"x"  # absent, expected empty: written
    assert store.compare_set("absent", "y", "z") == b"y"  # absent: the expected back
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.multi_get(["a", "n"]) == [b"2", b"2"]
    # more keys than etcd takes in one transaction (--max-txn-ops, 128 by default)
    many = [f"many/{i}" for i in range(300)]
    store.multi_set(many, [str(i) for i in range(300)])
    assert store.check(many) and not store.check([*many, "missing"])
    assert store.multi_get(many) == [str(i).encode() for i in range(300)]
    with pytest.raises(dist.DistStoreError, match="timeout"):  # type: ignore[attr-defined]
        store.wait(["later"], datetime.timedelta(seconds=0.3))
    threading.Timer(0.3, lambda: store.set("later", b"v")).start()
    assert store.get("later") == b"v"  # a blocking get, woken by the write
    prefixed = dist.PrefixStore("round/", store)  # type: ignore[attr-defined]
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and store.check(["round//k"])
    # concurrent adds from many threads: each counted once
    threads = [threading.Thread(target=lambda: store.add("c", 1)) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("c", 0) == 20
    store.close()


def nodes(endpoints: list[str], count: int, lo: int, run: str) -> list[SteadfastRendezvousHandler]:
    return [
        SteadfastRendezvousHandler(
            EtcdV3Store(endpoints, prefix="", timeout=datetime.timedelta(seconds=30)),
            Settings(
                run, lo, count, join_timeout=60, last_call_timeout=600, local_addr="127.0.0.1"
            ),
            node=f"n{i}",
        )
        for i in range(count)
    ]


def test_the_rendezvous_forms_and_reforms_after_a_loss_on_etcd(one: Cluster) -> None:
    handlers = nodes(one.endpoints(), 4, 3, "etcd1")
    first = join_rendezvous(*handlers)
    assert sorted(v[0] for v in first.values()) == [0, 1, 2, 3], first
    lost = next(name for name, v in first.items() if v[0] == 2)
    survivors = [h for h in handlers if h.node != lost]
    assert survivors[0].expire([[lost]]) == 1
    second = join_rendezvous(*survivors)  # formed without the 600 s last call
    assert sorted(v[0] for v in second.values()) == [0, 1, 2], second
    assert {v[1] for v in second.values()} == {3}
    for h in handlers:
        h.store.close()


def test_losing_any_etcd_member_costs_a_retry_not_the_job(three: Cluster) -> None:
    """A 3-member cluster; the member every client talks to first is killed between two
    rounds: the next round forms on the other two (a majority)."""
    handlers = nodes(three.endpoints(), 3, 2, "etcd3")
    first = join_rendezvous(*handlers)
    assert sorted(v[0] for v in first.values()) == [0, 1, 2], first
    three.kill(three.names[0])
    survivors = handlers[:2]
    assert survivors[0].expire([[handlers[2].node]]) == 1
    second = join_rendezvous(*survivors)
    assert sorted(v[0] for v in second.values()) == [0, 1], second
    for h in handlers:
        h.store.close()


def test_the_simulator_counts_the_same_per_node_figures_on_etcd(three: Cluster) -> None:
    """The simulator's nodes on a 3-member etcd cluster: the same few operations per
    node as on a TCPStore (the protocol's figures do not depend on the store)."""
    from sfsim import simulate_join

    endpoints = tuple(three.endpoints())
    run = simulate_join(8, "steadfast", keep_alive=1, window=1, processes=0, etcd=endpoints)
    tcp = simulate_join(8, "steadfast", keep_alive=1, window=1, processes=0)
    assert run.join.count == tcp.join.count <= 8, (run.join, tcp.join)


def test_a_cluster_that_does_not_start_names_the_member_and_leaves_none_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness itself: a member whose client port is taken exits, the cluster fails
    naming it and its log, and the members that did start are stopped (the no_leaks
    check around this test sees no child left)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = _free_ports(6)
    ports[1] = int(taken.getsockname()[1])  # m1's client port
    monkeypatch.setattr(f"{__name__}._free_ports", lambda count: ports[:count])
    try:
        with pytest.raises(AssertionError, match=r"etcd member m1 did not start: exited"):
            Cluster(tmp_path, 3)
    finally:
        taken.close()
