"""steadfast's own rendezvous (``--rdzv-backend steadfast``), with several nodes' handlers
in one process, each on its own thread and its own real ``TCPStore`` client of one
server: the join, a lost node, a spare, a late node, a node dying during the join, the
end of the job, a store gone, and torch's registry. (The launcher's multi-node tests in
``tests/multinode`` run on it; this file checks the protocol itself.)"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from sfharness import join_rendezvous
from sfsim import CountingStore
from steadfast.rendezvous import register
from steadfast.rendezvous.handler import Settings, SteadfastRendezvousHandler, Verdict
from steadfast.rendezvous.keys import Keys, encode_members, rank_of

pytestmark = pytest.mark.timeout(120)


def serve() -> TCPStore:
    """The store's server, a local of the test (a fixture's value would outlive the
    test's leak check)."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def node(
    server: TCPStore, name: str, lo: int, hi: int, run: str = "job", **settings: Any
) -> SteadfastRendezvousHandler:
    """A node of an ``lo``..``hi`` job, on a counted client of its own."""
    settings.setdefault("join_timeout", 30.0)
    settings.setdefault("last_call_timeout", 600.0)  # a test that waits for it times out
    client = CountingStore(TCPStore("127.0.0.1", server.port, is_master=False))
    return SteadfastRendezvousHandler(
        client, Settings(run, lo, hi, local_addr="127.0.0.1", **settings), node=name
    )


def ranks(result: dict[str, Any]) -> dict[str, int]:
    assert all(isinstance(v, tuple) for v in result.values()), result
    return {k: v[0] for k, v in result.items()}


def test_members_are_encoded_as_runs_and_ranked_by_position() -> None:
    assert encode_members([1, 2, 3, 7, 5, 6]) == "1-3,7,5-6"
    assert encode_members(list(range(1, 2049))) == "1-2048"  # a whole round: one run
    assert [rank_of("1-3,7,5-6", t) for t in (1, 3, 7, 5, 6, 4)] == [0, 2, 3, 4, 5, None]


def test_a_verdict_keeps_the_members_seats_and_gives_vacant_ones_to_newcomers() -> None:
    # the round before had 4 seats; seat 1's node was lost; newcomer ticket 9 fills it
    verdict = Verdict(world=4, previous=4, vacant="1", newcomers="9")
    assert [verdict.rank(t, seat) for t, seat in ((1, 0), (2, 2), (3, 3))] == [0, 2, 3]
    assert verdict.rank(9, -1) == 1  # the spare takes the lost node's rank
    assert verdict.rank(8, -1) is None  # a newcomer not admitted
    # no newcomer: the seats after the vacant one close up
    shrunk = Verdict(world=3, previous=4, vacant="1", newcomers="")
    assert [shrunk.rank(t, seat) for t, seat in ((1, 0), (2, 2), (3, 3))] == [0, 1, 2]
    assert shrunk.rank(5, 1) is None  # the node judged lost, arriving late
    # more newcomers than vacant seats: the rest get new seats after the old ones
    grown = Verdict(world=5, previous=3, vacant="2", newcomers="4-5")
    assert [grown.rank(4, -1), grown.rank(5, -1), grown.rank(1, 0)] == [2, 3, 0]


def test_nodes_join_with_a_few_operations_each_whatever_their_number() -> None:
    """The join's operations and bytes per node do not grow with the nodes: each takes
    a ticket and waits for one verdict; only the node that completes the round reads
    the holders (two multi_gets)."""
    server = serve()
    figures = {}
    for n in (4, 16):
        # no keep-alive within the join: a node that waits longer than one beats, and
        # the decider reads such a holder's beat (a loaded machine's slow join is not
        # the join's cost; the beat's is tested below)
        handlers = [
            node(server, f"n{i}", n, n, run=f"grow{n}", keep_alive_interval=60.0) for i in range(n)
        ]
        result = join_rendezvous(*handlers)
        assert sorted(ranks(result).values()) == list(range(n))
        assert {v[1] for v in result.values()} == {n}
        tallies = [h.store.tally for h in handlers]
        assert sum("multi_get" in t.ops for t in tallies) == 1  # one node decided
        counts = [t.count for t in tallies]
        usual = max(set(counts), key=counts.count)  # a node that neither decided nor ranked 0
        typical = next(t for t in tallies if t.count == usual)
        figures[n] = (usual, max(counts), typical.bytes)
        del handlers, tallies, typical, result
    assert figures[16][:2] == figures[4][:2], figures  # the same operations per node
    assert abs(figures[16][2] - figures[4][2]) <= 16, figures  # and bytes, but key names


def test_a_lost_node_is_expired_and_the_next_round_forms_without_a_last_call() -> None:
    """An elastic 3..4 job loses a node: one survivor expires it (as the launcher does
    when its ring confirms the loss) and the survivors form the next round the moment
    the last arrives: with a 600 s last call, waiting for it would time the test out.
    The survivors keep their ranks, closed up."""
    server = serve()
    handlers = [node(server, f"n{i}", 3, 4) for i in range(4)]
    first = ranks(join_rendezvous(*handlers))
    lost = next(name for name, rank in first.items() if rank == 1)
    survivors = [h for h in handlers if h.node != lost]
    assert survivors[0].expire([[lost]]) == 1
    assert survivors[1].expire([[lost]]) == 0  # counted once job-wide
    second = ranks(join_rendezvous(*survivors))
    order = sorted(second, key=lambda k: second[k])
    assert order == sorted(second, key=lambda k: first[k])  # the same order, closed up
    assert sorted(second.values()) == [0, 1, 2]


def test_a_spare_takes_the_lost_nodes_rank() -> None:
    """Two nodes and a spare (max 2): the spare waits; a node is lost; the spare takes
    its rank, the survivor keeps its own."""
    server = serve()
    a, b, spare = (node(server, name, 2, 2) for name in ("a", "b", "spare"))
    first = ranks(join_rendezvous(a, b))
    results: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: results.update(join_rendezvous(spare)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not server.check([spare.keys.delta(0)]) and time.monotonic() < deadline:
        time.sleep(0.02)  # the spare counted itself in for the next round
    assert a.expire([["b"]]) == 1
    results.update(join_rendezvous(a))
    waiter.join()
    second = ranks(results)
    assert second == {"a": first["a"], "spare": first["b"]}


def test_a_late_node_makes_the_members_restart_for_it() -> None:
    """An elastic 1..2 job formed with one node (last call 0.2 s); a second node comes:
    the member's num_nodes_waiting says so (read at most once per keep-alive interval),
    the member joins again and the round has both."""
    server = serve()
    a = node(server, "a", 1, 2, last_call_timeout=0.2, keep_alive_interval=0.2)
    late = node(server, "late", 1, 2, last_call_timeout=0.2, keep_alive_interval=0.2)
    assert join_rendezvous(a) == {"a": (0, 1)}
    results: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: results.update(join_rendezvous(late)))
    waiter.start()
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.num_nodes_waiting() == 1
    results.update(join_rendezvous(a))
    waiter.join()
    assert ranks(results) == {"a": 0, "late": 1}


def test_a_node_dying_during_the_join_is_left_out() -> None:
    """A ticket holder whose heartbeat stopped (older than keep_alive_interval x
    keep_alive_max_attempt) is not a member: the two live nodes of a 2..3 job form the
    round after the last call."""
    server = serve()
    keys = Keys("job")
    server.add(keys.ticket(0), 1)
    # its key: a newcomer that took its ticket 100 s ago and never beat since
    server.set(keys.holder(0, 1), json.dumps(["dead", -1, time.time() - 100, "127.0.0.1", 1]))
    a, b = (node(server, n, 2, 3, last_call_timeout=0.3) for n in ("a", "b"))
    result = join_rendezvous(a, b)
    assert sorted(ranks(result).values()) == [0, 1]
    assert {v[1] for v in result.values()} == {2}


def test_the_end_of_the_job_lets_a_spare_go_and_refuses_new_joins() -> None:
    server = serve()
    a, spare = node(server, "a", 1, 1), node(server, "spare", 1, 1)
    assert join_rendezvous(a) == {"a": (0, 1)}
    results: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: results.update(join_rendezvous(spare)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not server.check([a.keys.delta(0)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.shutdown() is True
    waiter.join()
    assert isinstance(results["spare"], RendezvousGracefulExitError)
    assert a.is_closed()
    assert isinstance(join_rendezvous(node(server, "new", 1, 1))["new"], RendezvousClosedError)


def test_too_few_nodes_time_out_naming_the_minimum() -> None:
    server = serve()
    alone = node(server, "alone", 2, 2, join_timeout=0.5)
    result = join_rendezvous(alone)["alone"]
    assert isinstance(result, RendezvousTimeoutError) and "min_nodes=2" in str(result)


def test_a_store_gone_is_a_connection_error() -> None:
    server = serve()
    h = node(server, "a", 1, 1)
    del server
    time.sleep(0.1)
    with pytest.raises(RendezvousConnectionError):
        h.next_rendezvous()


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="min_nodes=3 and max_nodes=2"):
        Settings("job", 3, 2)
    with pytest.raises(ValueError, match="last_call_timeout"):
        Settings("job", 1, 1, last_call_timeout=0)


def test_torchs_registry_creates_it_from_torchrun_flags() -> None:
    server = serve()
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    register()
    register()  # idempotent
    params = RendezvousParameters(
        backend="steadfast", endpoint=f"127.0.0.1:{server.port}", run_id="reg",
        min_nodes=1, max_nodes=1, is_host="false", last_call_timeout="0.5",
    )  # fmt: skip
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, SteadfastRendezvousHandler)
    assert handler.get_backend() == "steadfast"
    assert handler.settings.last_call_timeout == 0.5
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info is not None and info.bootstrap_store_info.master_port > 0
    bad = RendezvousParameters(
        backend="steadfast", endpoint=f"127.0.0.1:{server.port}", run_id="reg",
        min_nodes=1, max_nodes=1, is_host="false", join_timeout="soon",
    )  # fmt: skip
    with pytest.raises(ValueError, match="join_timeout: 'soon'"):
        get_rendezvous_handler(bad)


def test_the_store_host_takes_rank_0_in_the_first_round() -> None:
    """The node that hosts the store (the endpoint's host: the batch host under Slurm)
    is node rank 0 of the first round, whatever its ticket; the others follow theirs."""
    server = serve()
    others = [node(server, f"n{i}", 4, 4, run="host") for i in range(3)]
    host = node(server, "host", 4, 4, run="host")
    host.settings = Settings("host", 4, 4, join_timeout=30, last_call_timeout=600,
                             local_addr="127.0.0.1", first=True)  # fmt: skip
    results: dict[str, Any] = {}
    early = threading.Thread(target=lambda: results.update(join_rendezvous(*others)))
    early.start()  # the others take tickets 1-3 first
    deadline = time.monotonic() + 10
    while int(server.add(host.keys.ticket(0), 0)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    results.update(join_rendezvous(host))
    early.join()
    assert ranks(results)["host"] == 0
    assert sorted(ranks(results).values()) == [0, 1, 2, 3]
