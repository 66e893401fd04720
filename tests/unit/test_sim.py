"""The control-plane simulator (``steadfast.sim``): its counting store client against a
real ``TCPStore``, and torch's dynamic rendezvous simulated with a few nodes, whose
keep-alive cost per node grows with the number of nodes (each keep-alive writes the
whole state, which holds every node's heartbeat): the figure issue 28 must flatten."""

from __future__ import annotations

import pytest
from torch.distributed import TCPStore

from steadfast.sim import CountingStore, simulate_join, simulate_loss


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
def test_a_lost_node_is_expired_and_the_survivors_form_the_next_round() -> None:
    loss = simulate_loss(4, "torch", last_call=0.5)
    assert loss.world == 3  # the lost node is not in the next round
    assert loss.expire.ops.get("compare_set") == 1  # one write marks it expired
    assert loss.round.ops.get("compare_set", 0) >= 1  # each survivor rejoined
