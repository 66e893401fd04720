"""The control-plane simulator (``sfsim``): its counting store client against a
real ``TCPStore``, and torch's dynamic rendezvous simulated with a few nodes, whose
keep-alive cost per node grows with the number of nodes (each keep-alive writes the
whole state, which holds every node's heartbeat): the figure issue 28 must flatten."""

from __future__ import annotations

import pytest
from torch.distributed import TCPStore

from sfsim import CountingStore, simulate_join, simulate_loss
from sfsim.roster import simulate_roster


def test_the_counting_client_tallies_operations_and_bytes_both_ways() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = CountingStore(TCPStore("127.0.0.1", server.port, is_master=False))
    client.set("key", b"v" * 100)  # 3 + 100 sent
    assert client.get("key") == b"v" * 100  # 3 sent, 100 received
    assert client.compare_set("key", b"v" * 100, b"w") == b"w"  # 3 + 100 + 1, 1 back
    assert client.add("n", 5) == 5  # 1 + 8 sent, 8 back
    tally = client.tally
    assert tally.ops == {"set": 1, "get": 1, "compare_set": 1, "add": 1}
    assert (tally.sent, tally.received) == (103 + 3 + 104 + 9, 100 + 1 + 8)
    before = tally.copy()
    client.get("key")
    assert client.tally.minus(before).ops == {"get": 1}


@pytest.mark.timeout(120)
def test_torchs_keep_alive_cost_per_node_grows_with_the_nodes() -> None:
    small = simulate_join(4, "torch", keep_alive=1, window=2)
    large = simulate_join(16, "torch", keep_alive=1, window=2)
    for run in (small, large):
        assert run.join.ops.get("compare_set", 0) >= 1  # each node wrote the state
        assert run.keep_alive.ops.get("compare_set", 0) >= 1  # and writes it to beat
    # each node added makes every node's keep-alive longer by its entries in the state
    # (written and read back: ~290 bytes here), so the store's traffic grows as N^2
    added = (large.keep_alive.bytes - small.keep_alive.bytes) / (16 - 4)
    assert added > 100, (small.keep_alive, large.keep_alive)


@pytest.mark.timeout(120)
def test_a_lost_node_is_expired_and_the_survivors_and_the_spare_form_the_next_round() -> None:
    loss = simulate_loss(4, "torch", last_call=0.5)
    assert loss.world == 4  # the spare took the lost node's place
    assert loss.expire.ops.get("compare_set") == 1  # one write marks it expired
    assert loss.round.ops.get("compare_set", 0) >= 1  # each survivor rejoined


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steadfasts_per_node_store_figures_stay_flat_from_16_to_128_nodes() -> None:
    """The issue's scale test: steadfast's rendezvous with 16 and 128 simulated nodes
    (the 128 in a worker process), each on its own real store client (2,048: the
    bench, bench/bench_control_plane.py). Per node, the
    join, the round running and the next round after a loss cost the same operations,
    and bytes that differ only by the digits of longer numbers; only the node that
    decides a round reads every holder (O(N) bytes, once per round)."""
    small = simulate_join(16, "steadfast", keep_alive=1, window=3, processes=0)
    large = simulate_join(128, "steadfast", keep_alive=1, window=3, processes=1)
    assert large.join.count == small.join.count <= 8, (small.join, large.join)
    assert large.join.bytes - small.join.bytes <= 16, (small.join, large.join)
    assert large.keep_alive_ops == small.keep_alive_ops <= 1  # one counter read
    assert large.keep_alive.bytes - small.keep_alive.bytes <= 4
    assert large.join_max.bytes > 4 * small.join_max.bytes  # the decider's one read
    small_loss = simulate_loss(16, "steadfast", processes=0)
    large_loss = simulate_loss(128, "steadfast", processes=1)
    assert (small_loss.world, large_loss.world) == (16, 128)  # the spare took its place
    assert large_loss.round.count == small_loss.round.count <= 6
    assert large_loss.round.bytes - small_loss.round.bytes <= 16
    assert large_loss.expire.count == small_loss.expire.count  # marking a loss: O(1)


@pytest.mark.timeout(120)
def test_the_node_rosters_round_and_loss_cost_each_node_the_same_at_any_size() -> None:
    """Real node rosters (ring watch, confirmation in the store, the fence): entering a
    round reads the nodes a roster watches, not every node; a fence probe costs the same
    at any size; a goodbye is no loss; a killed node is seen by its watchers and every
    survivor learns it with the same few reads."""
    small, large = simulate_roster(8), simulate_roster(48)
    assert small.enter.count == large.enter.count <= 5, (small.enter, large.enter)
    assert small.learn.count == large.learn.count <= 6, (small.learn, large.learn)
    assert small.detect_seconds < 5 and large.detect_seconds < 5  # a reset, not a silence
    assert small.fence.count == large.fence.count <= 3  # a probe: a few small operations
    assert large.fence.bytes - small.fence.bytes <= 8, (small.fence, large.fence)
    assert small.goodbye_ops == large.goodbye_ops == 0  # a goodbye is not a loss
