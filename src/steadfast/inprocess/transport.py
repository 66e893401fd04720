"""Closing the TCP connections of aborted process groups (gloo has no working abort).

Why this exists: ``ProcessGroupGloo.abort()`` and ``shutdown()`` (torch 2.13) return at
once and close nothing. A gloo group's connections close only when the group object is
destroyed, i.e. when its *last reference* goes. With steadfast's own tests nobody else
held the group, so clearing c10d's registry destroyed it and the peers blocked in a
collective with this rank failed at once ("connection closed by peer"). In the shape
NVRx documents, the user's code holds the group: ``DistributedDataParallel`` keeps it in
its reducer, a ``new_group`` handle sits in a local or a global, the failed iteration's
frames hold both. Then no connection closes, and every peer blocked in ``all_reduce``,
``barrier`` or ``recv`` waits out the group's timeout (60 s in NVRx's examples).

What closes them here: each gloo group has a listening socket of its own (one per
``ProcessGroupGloo``, ``new_group`` included) and every pair of ranks shares one TCP
connection, accepted on one side's listener and connected on the other's. This module
finds this process's listeners that belong to no store (the ports of the stores in
c10d's registry, and those given by the caller, are left alone; so are listeners that
existed before :func:`mark_baseline`), and ``shutdown()``\\ s every connection accepted
on them. Each rank that aborts closes the pairs it accepted; since every live rank
aborts on an interruption (the faulting one from its main thread, the others from their
monitor threads) and a killed rank's kernel closes its side, every pair of the job is
closed and every blocked collective fails at once, on its own rank (a local shutdown
wakes the local reader) and on the peer's. ``shutdown`` acts on the socket, not the file
descriptor: gloo's own close later is harmless, and nothing else in the process can be
handed a reused descriptor number (each socket is checked by inode first).

The sockets are read from ``/proc/self/fd`` and ``/proc/self/net/tcp{,6}`` (the
process's network namespace), Linux only; elsewhere nothing is closed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "TcpSocket",
    "clear_baseline",
    "close_collective_connections",
    "mark_baseline",
    "store_ports",
    "tcp_sockets",
]

_LISTEN = "0A"
_ESTABLISHED_LIKE = {"01", "02", "03", "04", "05", "06", "08"}  # not CLOSE/LISTEN/TIME_WAIT
_baseline: frozenset[int] | None = None
_protected: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process: its descriptor, inode and both ends."""

    fd: int
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str

    @property
    def listening(self) -> bool:
        return self.state == _LISTEN


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc prints IPv6 as four host-order 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:"):
            ip = ip[len("::ffff:") :]
    return ip, int(port, 16)


def _socket_inodes() -> dict[int, int]:
    """inode -> descriptor of every socket this process has open."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                found[int(target[8:-1])] = int(name)
    return found


def tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets (IPv4 and IPv6), from ``/proc``; empty elsewhere."""
    inodes = _socket_inodes()
    result = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            inode = int(fields[9])
            if inode in inodes:
                result.append(
                    TcpSocket(
                        fd=inodes[inode],
                        inode=inode,
                        local=_address(fields[1]),
                        remote=_address(fields[2]),
                        state=fields[3],
                    )
                )
    return result


def mark_baseline(protected_ports: Iterable[int] = ()) -> None:
    """Remember the listeners open now, and ports that are stores' (the restart store):
    neither belongs to a process group made later, and
    :func:`close_collective_connections` leaves their connections alone (the Wrapper
    calls this before the wrapped function first runs)."""
    global _baseline, _protected
    _baseline = frozenset(s.inode for s in tcp_sockets() if s.listening)
    _protected = frozenset(protected_ports)


def clear_baseline() -> None:
    """Forget the baseline (the Wrapper's call ended)."""
    global _baseline, _protected
    _baseline = None
    _protected = frozenset()


def store_ports(stores: Iterable[object]) -> set[int]:
    """The ports of the TCP stores under ``stores`` (a ``PrefixStore`` is unwrapped)."""
    ports = set()
    for store in stores:
        base = store
        for _ in range(16):  # PrefixStore over PrefixStore over ... a TCPStore
            inner = getattr(base, "underlying_store", None)
            if inner is None:
                break
            base = inner
        port = getattr(base, "port", None)
        if isinstance(port, int):
            ports.add(port)
    return ports


def _shutdown(sock: TcpSocket) -> bool:
    try:
        fd = os.dup(sock.fd)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != sock.inode:
            return False  # the descriptor was closed and its number reused meanwhile
        s = socket.socket(fileno=fd)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            s.detach()
        return True
    finally:
        os.close(fd)


def close_collective_connections(keep_ports: Iterable[int] = ()) -> int:
    """Shut down every connection accepted on a process group's listener in this process.

    A listener counts as a process group's when it is not a store's (``keep_ports``)
    and was not open at :func:`mark_baseline`. Returns how many connections were shut
    down. Safe from any thread, at any time: a group whose connections are gone fails
    its collectives at once; nothing is freed under a running collective.
    """
    skip = set(keep_ports) | _protected
    socks = tcp_sockets()
    listeners = {
        s.local
        for s in socks
        if s.listening
        and s.local[1] not in skip
        and (_baseline is None or s.inode not in _baseline)
    }
    if not listeners:
        return 0
    ports_any = {port for host, port in listeners if host in ("0.0.0.0", "::")}
    closed = 0
    for s in socks:
        if s.state not in _ESTABLISHED_LIKE:
            continue
        if (s.local in listeners or s.local[1] in ports_any) and _shutdown(s):
            closed += 1
    return closed
