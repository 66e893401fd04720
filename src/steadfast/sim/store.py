"""A store client that counts: every operation a simulated node sends and the bytes it
moves, both ways, as the wire would carry them (keys and values; the protocol's few
framing bytes per message are not counted). The figures depend only on the protocol,
not on the machine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CountingStore", "Tally"]


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    if isinstance(value, int):
        return 8
    return 0


@dataclass
class Tally:
    """Operations (by name) and bytes sent and received by one node."""

    ops: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    received: int = 0

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    @property
    def bytes(self) -> int:
        return self.sent + self.received

    def minus(self, before: Tally) -> Tally:
        """What was counted since ``before`` (a :meth:`copy` taken earlier)."""
        ops = {k: v - before.ops.get(k, 0) for k, v in self.ops.items()}
        return Tally({k: v for k, v in ops.items() if v}, self.sent - before.sent,
                     self.received - before.received)  # fmt: skip

    def copy(self) -> Tally:
        return Tally(dict(self.ops), self.sent, self.received)


class CountingStore:
    """A proxy of a store client (``TCPStore``, or any object with the c10d store's
    methods) that tallies each call: the operation, the bytes of its arguments and of
    its answer. One per simulated node; the clients under them may be shared."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.tally = Tally()
        self._lock = threading.Lock()

    def _count(self, op: str, args: tuple[Any, ...], answer: Any) -> None:
        with self._lock:
            self.tally.ops[op] = self.tally.ops.get(op, 0) + 1
            self.tally.sent += _size(args)
            self.tally.received += _size(answer)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if not callable(method):
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            answer = method(*args, **kwargs)
            self._count(name, args + tuple(kwargs.values()), answer)
            return answer

        return counted
