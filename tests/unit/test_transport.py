"""steadfast.inprocess.transport: which connections an abort shuts down (real sockets).

A process group's connections are those accepted on a listener made after the baseline
that is not a store's; the abort shuts them down (the peer reads EOF at once) and leaves
every other socket of the process working.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from steadfast.inprocess import transport


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


@pytest.fixture
def baseline() -> Iterator[None]:
    yield
    transport.clear_baseline()


def test_tcp_sockets_lists_this_process_listeners_and_both_ends() -> None:
    with _listener() as lst:
        client, accepted = _pair(lst)
        with client, accepted:
            socks = {s.inode: s for s in transport.tcp_sockets()}
            port = lst.getsockname()[1]
            assert any(s.listening and s.local == ("127.0.0.1", port) for s in socks.values())
            mine = [s for s in socks.values() if s.remote == client.getsockname()]
            assert [s.local for s in mine] == [("127.0.0.1", port)]
            assert mine[0].fd == accepted.fileno()


def test_abort_shuts_a_groups_connections_and_keeps_stores_and_older_listeners(
    baseline: None,
) -> None:
    older = _listener()  # open before the Wrapper ran: a user's server, say
    store = _listener()  # a store's (its port is named)
    transport.mark_baseline(protected_ports=[])
    group = _listener()  # a process group's, made inside the function
    with older, store, group:
        old_c, old_a = _pair(older)
        store_c, store_a = _pair(store)
        peer, ours = _pair(group)  # the peer connected to our group listener
        sockets = (old_c, old_a, store_c, store_a, peer, ours)
        try:
            closed = transport.close_collective_connections([store.getsockname()[1]])
            assert closed == 1
            peer.settimeout(5)
            assert peer.recv(1) == b""  # the peer sees the connection closed at once
            for a, b in ((old_c, old_a), (store_c, store_a)):  # the others still talk
                a.sendall(b"x")
                b.settimeout(5)
                assert b.recv(1) == b"x"
        finally:
            for s in sockets:
                s.close()


def test_protected_ports_given_at_the_baseline_are_kept(baseline: None) -> None:
    with _listener() as lst:
        transport.mark_baseline()  # lst is in the baseline
        with _listener() as restart_store:
            transport.mark_baseline(protected_ports=[restart_store.getsockname()[1]])
            c, a = _pair(restart_store)
            with c, a:
                assert transport.close_collective_connections() == 0
        assert lst.fileno() >= 0
