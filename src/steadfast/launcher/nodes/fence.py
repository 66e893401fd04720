"""The fence's launcher side: a local (abstract Unix) socket on which the roster answers
its ranks whether this node is still in the job's current round. :mod:`steadfast.fence`
is the ranks' side.

An answer is a live round trip to the rendezvous store: a write (only a store that holds
the job takes it, etcd: a quorum), then the round's token must still be the job's and no
other node may have recorded this one lost. One probe answers every rank that asks while
it runs (a save asks from every rank at once), and an ``ok`` is reused for
:data:`_FENCE_REUSE` seconds. A probe that overruns ``timeout`` (a store call stuck in
the store's own timeout) is answered as fenced.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .round import Round
from .store_calls import Deadlines, StoreCalls

__all__ = ["Fence", "View"]

#: How long a fence answer is reused for the other ranks of the node.
_FENCE_REUSE = 0.5

#: ``view()``: the round this node is in (None: none) and why it is cut off (None: it is
#: not); called with the roster's lock held
View = Callable[[], "tuple[Round | None, str | None]"]


class Fence:
    """The fence's socket and its answers (see the module's description)."""

    def __init__(
        self,
        lock: threading.Condition,
        view: View,
        calls: StoreCalls,
        deadlines: Deadlines,
        timeout: float,
    ) -> None:
        """``lock``: the roster's, which guards what ``view`` reads; ``calls`` runs the
        probes, ``deadlines`` bounds them to ``timeout`` seconds."""
        self._lock = lock
        self._view = view
        self._calls = calls
        self._deadlines = deadlines
        self.timeout = timeout
        name = f"steadfast-fence-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: what the ranks connect to (:data:`steadfast.fence.FENCE_ENV`)
        self.address = "@" + name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + name)
        self.sock.listen(64)
        self.sock.setblocking(False)
        self._ok_at = -1.0
        self._probing: list[socket.socket] | None = None  # ranks waiting on a probe

    def forget(self) -> None:
        """Reuse no ``ok`` given before (a new round; the caller holds the lock)."""
        self._ok_at = -1.0

    def accept(self) -> None:
        """Take a rank's question and answer it (the socket is readable)."""
        with contextlib.suppress(OSError):
            client, _ = self.sock.accept()
            client.setblocking(True)
            client.settimeout(1.0)
            with contextlib.suppress(OSError):
                client.recv(16)
            self._answer(client)

    def close(self) -> None:
        """Close the socket and the connections of the ranks still waiting."""
        with self._lock:
            waiting, self._probing = self._probing or [], None
        for sock in [*waiting, self.sock]:
            with contextlib.suppress(OSError):
                sock.close()

    def _answer(self, client: socket.socket) -> None:
        """Answer a rank: ``ok`` while this node holds the job's current round."""
        with self._lock:
            current, isolated = self._view()
            fresh = time.monotonic() - self._ok_at < _FENCE_REUSE
            if current is not None and not isolated and not fresh:
                if self._probing is not None:  # a probe runs: its answer is this one's
                    self._probing.append(client)
                    return
                self._probing = [client]
        if current is None:
            _reply(client, "fenced: this node is not in a running round of the job")
            return
        if isolated:
            _reply(client, f"fenced: {isolated}")
            return
        if fresh:
            _reply(client, "ok")
            return
        self._probe(current)

    def _probe(self, current: Round) -> None:
        """Ask the store; the answer goes to every rank waiting then."""

        def probe() -> str:
            # a write: only a store that holds the job (etcd: a quorum) takes it
            current.job_store.add(current.keys.fence, 1)
            if current.store.check([current.keys.lost(current.rank)]):
                return "lost"  # the others found this node lost: they go on without it
            return current.job_token()

        def answer(text: str) -> None:
            with self._lock:
                waiting, self._probing = self._probing or [], None
                now, isolated = self._view()
                if text == "ok" and (now is not current or isolated):
                    text = "fenced: " + (isolated or "this node left the round")
                if text == "ok":
                    self._ok_at = time.monotonic()
            for waiter in waiting:
                _reply(waiter, text)

        def done(value: Any, exc: BaseException | None) -> None:
            timer.cancel()
            if exc is not None:
                answer(f"fenced: the rendezvous store did not answer ({exc})")
            elif value == "lost":
                answer("fenced: the other nodes found this node lost and went on without it")
            elif value != current.token:
                answer("fenced: the job formed a newer round without this node")
            else:
                answer("ok")

        deadline = time.monotonic() + self.timeout
        # the deadline also covers a store call stuck in the store's own timeout
        timer = self._deadlines.start(
            self.timeout, answer, "fenced: the rendezvous store did not answer in time"
        )

        def bounded() -> str:
            if time.monotonic() > deadline:
                raise TimeoutError("the store did not answer in time")
            return probe()

        self._calls.submit(bounded, done)


def _reply(client: socket.socket, answer: str) -> None:
    with contextlib.suppress(OSError):
        client.setblocking(True)
        client.settimeout(1.0)
        client.sendall(answer.encode() + b"\n")
    with contextlib.suppress(OSError):
        client.close()
