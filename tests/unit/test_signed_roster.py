"""The node roster's records bound to the job's secret whatever rendezvous formed the
round: under torch's own c10d rendezvous (which binds nothing itself), the roster's
node records, token, losses, claims and exit marks are sealed and kept under the job's
prefix in the round's store, its round record in the job's; a forged record, or one
replayed from an earlier round, is refused and never acted on. Under steadfast's
rendezvous the round's store is the signed store's own child, which can ``clone`` (the
exit barrier and the culprit's agreement wait on a connection of their own). Real
TCPStores, real torch c10d rendezvous handlers, real rosters."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sfharness import enter_round as enter
from sfharness import read_events
from steadfast import seam
from steadfast.config import FaultToleranceConfig
from steadfast.launcher.nodes import NodeRoster
from steadfast.launcher.nodes.round import Peer, RoundKeys
from steadfast.records import Refusals
from steadfast.rendezvous.signed import RecordRefused, SignedStore, bind_roster, round_view
from steadfast.secret import SECRET_ENV

pytestmark = pytest.mark.timeout(120)

FT = FaultToleranceConfig(node_heartbeat_interval=0.05, node_heartbeat_timeout=2.0)
SECRET = "s" * 32


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


def serve() -> Any:
    """The c10d backend's store, hosted by the test (as on the rendezvous host)."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True
    )


def client(port: int) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


def c10d_round(port: int, count: int) -> Iterator[tuple[Any, Any]]:
    """``count`` torch c10d rendezvous handlers forming one round: (handler, info) each."""
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters(
                backend="c10d",
                endpoint=f"127.0.0.1:{port}",
                run_id="job",
                min_nodes=count,
                max_nodes=count,
                local_addr="127.0.0.1",
                is_host=False,
            )
        )
        for _ in range(count)
    ]
    infos: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda i=i, h=h: infos.__setitem__(i, h.next_rendezvous()))
        for i, h in enumerate(handlers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(infos) == count, "torch's c10d rendezvous did not form"
    try:
        yield from ((h, infos[i]) for i, h in enumerate(handlers))
    finally:
        for h in handlers:
            h.shutdown()


def test_under_torchs_c10d_the_rosters_records_are_sealed_and_forgeries_refused(
    secret, event_log: Path
) -> None:
    server = serve()
    rounds = list(c10d_round(server.port, 2))
    handler = rounds[0][0]
    number = seam.rendezvous_round(handler)
    assert number is not None and {seam.rendezvous_round(h) for h, _ in rounds} == {number}
    # torch's round store: a PrefixStore on its TCPStore, as the agent's worker group holds
    bound = [bind_roster(info.store, "job", number) for _, info in rounds]
    assert all(isinstance(b, SignedStore) for b in bound)
    made = [NodeRoster(FT, host=f"127.0.0.{i + 1}", name=f"node{i + 1}") for i in range(2)]
    try:
        enter(made, bound)
        tokens = {r._round.token for r in made if r._round is not None}
        assert len(tokens) == 1, "both nodes hold the round's one token"
        keys = RoundKeys("job")
        torch_prefix = f"torch.rendezvous.job.{number}/"
        # what the store holds: nothing at the names a peer without the secret could
        # compute, the node record sealed under the round's own prefix
        assert not server.check([torch_prefix + keys.node(0), keys.record])
        raw = server.get(torch_prefix + bound[0].prefix + keys.node(0))
        assert json.loads(bound[0].open(keys.node(0), raw))["host"] == "node1"
        assert raw[-33:-32] == b"\x1f"  # the seal: a separator and the MAC
        assert json.loads(bound[1].get(keys.node(0)))["host"] == "node1"
        job = bound[0].underlying_store
        assert json.loads(job.get(keys.record)) == {"token": tokens.pop()}
        assert server.check([job.prefix + keys.record])
        # a connection of its own reads the same records
        assert bound[0].clone().get(keys.token) == bound[1].get(keys.token)

        # a forged node record at the sealed key (a peer that read the prefix off the
        # store): refused; the roster's read gives a stand-in, never watched; said once
        forged = json.dumps({"rank": 1, "host": "intruder", "addr": "10.9.9.9", "port": 1})
        server.set(torch_prefix + bound[0].prefix + keys.node(1), forged)
        with pytest.raises(RecordRefused, match="node/1"):
            bound[0].get(keys.node(1))
        peer = Peer.read(bound[0], keys.node(1), 1, Refusals())
        assert peer == Peer.stand_in(1) and not peer.reachable
        # a record sealed for this round, replayed into the next round's key
        following = client(server.port)
        later = bind_roster(
            dist.PrefixStore(f"torch.rendezvous.job.{number + 1}", following),  # type: ignore[attr-defined]
            "job",
            number + 1,
        )
        server.set(
            torch_prefix.replace(f".{number}/", f".{number + 1}/") + later.prefix + keys.token, raw
        )
        with pytest.raises(RecordRefused, match="token"):
            later.get(keys.token)
    finally:
        for r in made:
            r.close()
    found = [e for e in read_events(event_log) if e["kind"] == "record_refused"]
    assert {(e["key"], e["cause"]) for e in found} == {
        (keys.node(1), "unsigned"),
        (keys.token, "bad_signature"),
    }, found
    assert sum(e["key"] == keys.node(1) for e in found) == 1  # said once, read twice


def test_without_a_secret_the_rosters_store_is_torchs_own(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    server = serve()
    store = dist.PrefixStore("torch.rendezvous.job.0", client(server.port))  # type: ignore[attr-defined]
    assert bind_roster(store, "job", 0) is store


def test_under_steadfasts_rendezvous_the_rounds_store_clones(secret) -> None:
    """The round's store of a signed job is the signed store's child: the same keys as a
    PrefixStore on it, and a clone over a connection of its own (a Python store under
    torch's C++ PrefixStore cannot clone)."""
    server = serve()
    signed = SignedStore(client(server.port), SECRET.encode(), "job")
    child = round_view(signed, "3/s/")
    assert child.underlying_store is signed and bind_roster(child, "job", None) is child
    child.set("k", "v")
    assert dist.PrefixStore("3/s/", signed).get("k") == b"v"  # type: ignore[attr-defined]
    twin = child.clone()
    assert twin.store is not child.store and twin.get("k") == b"v"
    assert server.check([signed.prefix + "3/s//k"])  # the keys a PrefixStore gives
    # the wait on the clone does not hold the first connection: it still answers
    waiter = threading.Thread(
        target=lambda: twin.wait(["later"], datetime.timedelta(seconds=10)), daemon=True
    )
    waiter.start()
    assert child.get("k") == b"v"
    child.set("later", "1")
    waiter.join(10)
    assert not waiter.is_alive()
