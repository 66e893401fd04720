"""One culprit per fault, agreed through a real TCPStore by nodes that claim at once
(threads, each with a client of its own, as launchers on separate nodes have)."""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from steadfast.launcher.nodes.culprit import Claim, agree, node_claim
from steadfast.launcher.nodes.round import PeerBook, Round, RoundKeys, own_connection


class _Server:
    """A TCPStore server and the rounds (clients) made on it, all closed afterwards."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
        self.rounds: list[Round] = []

    def round(self, rank: int, nodes: int, wrap=lambda client: client) -> Round:
        client = wrap(
            dist.TCPStore(
                "127.0.0.1", self.store.port, is_master=False, timeout=timedelta(seconds=10)
            )
        )
        keys = RoundKeys("job")
        peers = PeerBook(client, keys, {})
        made = Round(client, client, rank, nodes, peers, "tok", keys, own_connection(client))
        self.rounds.append(made)
        return made


class _NoNewConnection:
    """A round's store that fails a new connection once the round has formed."""

    def __init__(self, client) -> None:
        self.client = client
        self.formed = False

    def clone(self):
        assert not self.formed, "a new connection to the store at fault time"
        return self.client.clone()

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def server():
    made = _Server()
    yield made
    made.rounds.clear()
    del made.store
    gc.collect()


def _round(server: _Server, rank: int, nodes: int) -> Round:
    return server.round(rank, nodes)


def _claim(node: str, rank: int | None, t: float, weight: int) -> Claim:
    what = "node lost" if rank is None else "rank failed"
    return Claim(what, node, 0, rank, "exit 1" if weight == 0 else "signal SIGKILL", t, t, weight)


def _run_all(rounds, claims, window=5.0):
    out = [None] * len(rounds)

    def one(i):
        out[i] = agree(rounds[i], claims[i], len(rounds), window)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_killed_rank_beats_the_earlier_exits_of_its_peers_on_every_node(server):
    """node2's rank 3 was killed (signal); node1's and node3's ranks exited with a code
    when their collective lost it, node1's even stamped earlier (clock skew): every node
    gets node2's rank 3, the same fault id and the count of claims."""
    t0 = 1000.0
    rounds = [_round(server, r, 3) for r in range(3)]
    claims = [
        _claim("node1", 0, t0 - 0.002, 0),
        _claim("node2", 3, t0, 1),
        _claim("node3", 4, t0 + 0.01, 0),
    ]
    verdicts = _run_all(rounds, claims)
    assert all(v is not None for v in verdicts)
    assert {(v.culprit.node, v.culprit.rank) for v in verdicts} == {("node2", 3)}
    assert {v.fault_id for v in verdicts} == {"steadfast/job/round/tok"}
    assert {v.claims for v in verdicts} == {3}


def test_among_claims_of_one_weight_the_earliest_fault_wins(server):
    rounds = [_round(server, r, 4) for r in range(4)]
    claims = [_claim(f"node{r + 1}", 2 * r, 50.0 - r * 0.1, 0) for r in range(4)]
    verdicts = _run_all(rounds, claims)
    assert {(v.culprit.node, v.culprit.rank) for v in verdicts} == {("node4", 6)}


def test_the_agreement_opens_no_connection_at_fault_time(server):
    """The connection an agreement blocks on was made when the round formed: a new one
    costs a reverse DNS lookup on the store's one server thread, which a slow resolver
    makes 5 s for every node's request (seen as node4's claim missing the others'
    window, and the verdict sealed without it)."""
    stores: list[_NoNewConnection] = []

    def wrap(client):
        stores.append(_NoNewConnection(client))
        return stores[-1]

    rounds = [server.round(r, 3, wrap) for r in range(3)]
    for store in stores:
        store.formed = True
    claims = [_claim(f"node{r + 1}", r, 50.0 - r * 0.1, 0) for r in range(3)]
    verdicts = _run_all(rounds, claims)
    assert {(v.culprit.node, v.culprit.rank) for v in verdicts} == {("node3", 2)}


def test_a_lost_node_beats_the_ranks_it_took_down(server):
    rounds = [_round(server, r, 2) for r in range(2)]
    lost = node_claim("node3", 2, "connection_reset", 0.5)
    claims = [lost, _claim("node2", 2, lost.time - 1.0, 1)]
    verdicts = _run_all(rounds, claims)
    assert {(v.culprit.node, v.culprit.rank, v.culprit.what) for v in verdicts} == {
        ("node3", None, "node lost")
    }


def test_a_node_that_never_counts_holds_the_verdict_up_only_for_the_window(server):
    """3 nodes, one of which never takes part (its workers went on running): the
    claimant seals after the window; a node that asks later gets the same verdict,
    whatever its own claim, and takes no window to get it."""
    rounds = [_round(server, r, 3) for r in range(3)]
    first = agree(rounds[0], _claim("node1", 1, 10.0, 1), 3, window=0.3)
    assert first is not None and first.culprit.rank == 1
    began = time.monotonic()
    late = agree(rounds[1], _claim("node2", 2, 5.0, 1), 3, window=30.0)
    assert time.monotonic() - began < 10.0  # the verdict was sealed: no 30 s window
    assert late is not None and (late.culprit.node, late.culprit.rank) == ("node1", 1)
    passer = agree(rounds[2], None, 3, window=30.0)
    assert passer is not None and passer.culprit == first.culprit and passer.claims == 1


def test_no_claim_no_verdict(server):
    rounds = [_round(server, r, 1) for r in range(1)]
    assert agree(rounds[0], None, 1, window=0.1) is None


def test_a_fault_no_node_claims_ends_every_nodes_wait_with_no_verdict(server):
    """No node has a claim (or the one there is not a node's): the node that completes
    the count seals a verdict naming no culprit, so the others stop waiting for one
    instead of sitting out the window (60 s here)."""
    rounds = [_round(server, r, 3) for r in range(3)]
    server.store.set(rounds[0].keys.fault_claim, b"not a claim")  # a peer's, refused
    out: list[object] = ["unset"] * 3
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, agree(rounds[i], None, 3, 60.0)))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a node waited out the window"
    assert out == [None, None, None]


def test_claims_round_trip_through_the_store_format():
    c = _claim("node2", 0, 12.5, 1)
    assert Claim.loads(c.dumps()) == c
    assert c.beats(_claim("node2", 1, 12.5, 1))  # a fixed order when all else is equal


def test_a_rank_aborted_for_a_lost_peer_weighs_as_an_exit_code():
    """NCCL's watchdog ends a rank whose collective lost its peer with SIGABRT: that is
    no sign of being the culprit (a SIGKILL or a SIGSEGV is); an exception's exit that
    came first then wins over it."""
    from types import SimpleNamespace

    from steadfast.launcher.nodes.culprit import rank_claim

    def claim(code: int, t: float, node: str) -> Claim:
        failures = {0: SimpleNamespace(local_rank=0, exitcode=code)}
        made = rank_claim(node, 0, failures, {0: t}, {}, {0})
        assert made is not None
        return made

    aborted, raised = claim(-6, 10.2, "node1"), claim(1, 10.0, "node2")
    assert aborted.weight == raised.weight == 0 and raised.beats(aborted)
    assert claim(-9, 10.3, "node3").beats(raised)  # a rank killed outright
    assert claim(-11, 10.3, "node3").weight == 1 and claim(-15, 9.0, "node3").weight == 0
