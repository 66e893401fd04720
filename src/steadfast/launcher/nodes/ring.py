"""The ring watch over sockets: this node's beacon, and its watch over the next
:data:`WATCHERS` nodes of the round.

- the **beacon**: a TCP socket that the launchers watching this node connect to; it
  sends them one byte every ``node_heartbeat_interval``. A launcher whose workers
  finished says goodbye (another byte) instead, so that its leaving at the end of the
  job is not taken for a loss;
- the **watch**: after each rendezvous the roster connects to the beacons of the next
  nodes of the round (by node rank, wrapping), so each node is watched by
  :data:`WATCHERS` others and each launcher holds that many connections whatever the
  job's size. A node killed outright (power loss, kernel panic, OOM killer taking the
  launcher) resets them at once; one that goes silent (a NIC, a partition) is lost after
  ``node_heartbeat_timeout`` without a beat. A loss goes to the ``on_lost`` callback.

One thread runs a selector over the beacon, the watched and the watching connections
and whatever else the roster has it serve (the fence's socket).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .round import Peer

__all__ = ["WATCHERS", "OnFinished", "OnLost", "Ring"]

logger = logging.getLogger(__name__)

_BEAT = b"\x01"
_BYE = b"\x02"  # instead of beats once this node's workers finished
#: Successors each node watches (each node is watched by as many predecessors).
WATCHERS = 2

#: ``on_lost(peer, cause, how, latency)``: a watched node is gone
OnLost = Callable[[Peer, str, str, "float | None"], None]
#: ``on_finished(peer)``: a watched node said goodbye (its workers finished)
OnFinished = Callable[[Peer], None]


@dataclass
class _Watch:
    peer: Peer
    last_beat: float  # monotonic


def _keepalive(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Ring:
    """This node's beacon and its watch over the nodes it follows (see the module's
    description)."""

    def __init__(
        self,
        interval: float,
        timeout: float,
        on_lost: OnLost,
        on_finished: OnFinished | None = None,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self._on_lost = on_lost
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=64)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._watchers: set[socket.socket] = set()  # those that watch this node
        self._watched: dict[socket.socket, _Watch] = {}
        self._to_close: list[socket.socket] = []  # closed by the loop thread
        self._finished = False
        self._gone = False  # left the job (release with watchers) until admit()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="steadfast-nodes", daemon=True)

    def serve(self, sock: socket.socket, handler: Callable[[], None]) -> None:
        """Call ``handler`` on the loop's thread whenever ``sock`` is readable (before
        :meth:`start`)."""
        self._sel.register(sock, selectors.EVENT_READ, handler)

    def start(self) -> None:
        """Start the loop's thread: beats, watches and the served sockets."""
        self._thread.start()

    def watch(self, peer: Peer) -> None:
        """Connect to ``peer``'s beacon and watch it."""
        try:
            sock = socket.create_connection((peer.addr, peer.port), timeout=self.timeout)
        except OSError as exc:
            self._on_lost(peer, "connection_reset", f"its launcher did not answer ({exc})", 0.0)
            return
        _keepalive(sock)
        sock.setblocking(False)
        with self._lock:
            self._watched[sock] = _Watch(peer, time.monotonic())
        self._wake()

    def unwatch(self) -> list[socket.socket]:
        """Stop watching the nodes watched now; their connections, returned, are closed
        by :meth:`release`."""
        with self._lock:
            watched = list(self._watched)
            self._watched.clear()
        return watched

    def release(self, socks: list[socket.socket], watchers: bool = False) -> None:
        """Close ``socks`` (from :meth:`unwatch`) on the loop's thread; with
        ``watchers``, the connections of the nodes watching this one too: they see it go
        at once, and so does a watcher whose connection is still waiting to be accepted
        (it is closed as soon as it is: this node has left, until :meth:`admit`)."""
        with self._lock:
            self._to_close.extend(socks)
            if watchers:
                self._to_close.extend(self._watchers)
                self._watchers.clear()
                self._gone = True
        self._wake()

    def admit(self) -> None:
        """This node is in a round again: the nodes that connect now watch it."""
        with self._lock:
            self._gone = False

    def finish(self) -> None:
        """Say goodbye at once, then instead of beats."""
        with self._lock:
            self._finished = True
        self._wake()

    def stop(self) -> None:
        """Stop the loop (saying goodbye if it had not yet)."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        if self._finished:  # the loop may have stopped before it said goodbye
            self._beat()

    def close(self) -> None:
        """Close every socket (after :meth:`stop`)."""
        with self._lock:
            socks = [*self._watched, *self._watchers, *self._to_close]
            self._watched.clear()
            self._watchers.clear()
            self._to_close = []
        for sock in [*socks, self._listener, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()
        self._sel.close()

    # ------------------------------------------------------------------ the loop
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _drop(self, sock: socket.socket) -> None:
        """Unregister and close (the loop thread only)."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        said_bye = False
        registered: set[socket.socket] = set()
        while not self._stopping:
            try:
                with self._lock:
                    watched = dict(self._watched)
                    closing, self._to_close = self._to_close, []
                for sock in closing:
                    registered.discard(sock)
                    self._drop(sock)
                for sock in watched:  # newly watched
                    if sock not in registered:
                        with contextlib.suppress(ValueError, KeyError, OSError):
                            self._sel.register(sock, selectors.EVENT_READ, "watched")
                            registered.add(sock)
                registered &= set(watched)
                now = time.monotonic()
                until = min(
                    [next_beat, now + 1.0] + [w.last_beat + self.timeout for w in watched.values()]
                )
                wait = max(0.0, until - now)
                try:
                    ready = self._sel.select(wait)
                except OSError:
                    ready = []
                now = time.monotonic()
                for key, _ in ready:
                    sock = key.fileobj  # type: ignore[assignment]
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            sock.recv(4096)
                    elif key.data == "accept":
                        self._accept()
                    elif key.data == "watcher":
                        self._read_watcher(sock)
                    elif key.data == "watched":
                        self._read_watched(sock, now)
                    else:  # a socket served for the roster (serve)
                        key.data()
                if now >= next_beat or (self._finished and not said_bye):
                    said_bye = self._finished
                    self._beat()
                    next_beat = now + self.interval
                with self._lock:
                    silent = [
                        (s, w) for s, w in self._watched.items() if now - w.last_beat > self.timeout
                    ]
                    for sock, _ in silent:
                        del self._watched[sock]
                for sock, watch in silent:
                    registered.discard(sock)
                    self._drop(sock)
                    self._on_lost(
                        watch.peer,
                        "silent",
                        f"no beat for {now - watch.last_beat:.1f} s: its link or its power went",
                        now - watch.last_beat,
                    )
            except Exception:  # the beats must go on: a dead loop reads as a lost node
                logger.exception("node roster: an error in the loop")
                time.sleep(0.1)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            with self._lock:
                gone = self._gone
            if gone:  # this node left the job: the watcher sees it go
                conn.close()
                return
            _keepalive(conn)
            conn.setblocking(False)
            with self._lock:
                self._watchers.add(conn)
            self._sel.register(conn, selectors.EVENT_READ, "watcher")
            with contextlib.suppress(OSError):
                conn.send(_BYE if self._finished else _BEAT)

    def _read_watcher(self, sock: socket.socket) -> None:
        """A watcher never sends; readable means it closed (or reset)."""
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            with self._lock:
                self._watchers.discard(sock)
            self._drop(sock)

    def _read_watched(self, sock: socket.socket, now: float) -> None:
        with self._lock:
            watch = self._watched.get(sock)
        if watch is None:
            self._drop(sock)
            return
        try:
            data = sock.recv(4096)
            error = None
        except BlockingIOError:
            return
        except OSError as exc:
            data, error = b"", exc
        if data and _BYE not in data:
            watch.last_beat = now
            return
        with self._lock:
            self._watched.pop(sock, None)
        self._drop(sock)
        if data:  # its workers finished: it leaves, it is not lost
            logger.info("%s finished", watch.peer.host)
            if self._on_finished is not None:
                self._on_finished(watch.peer)
            return
        how = "its launcher's connection was " + ("reset" if error else "closed")
        self._on_lost(
            watch.peer,
            "connection_reset",
            f"{how}: the node or its launcher died",
            now - watch.last_beat,
        )

    def _beat(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
            beat = _BYE if self._finished else _BEAT
        for sock in watchers:
            try:
                sock.send(beat)
            except BlockingIOError:
                pass  # a slow watcher: its buffer is full of beats already
            except OSError:
                with self._lock:
                    self._watchers.discard(sock)
                self._drop(sock)
