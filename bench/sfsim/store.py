"""A store client that counts: every operation a simulated node sends and the bytes it
moves, both ways, as the wire would carry them (keys and values; the protocol's few
framing bytes per message are not counted). The figures depend only on the protocol,
not on the machine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["CountingBackend", "CountingStore", "Tally"]


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


class CountingStore(dist.Store):  # type: ignore[misc,name-defined]
    """A c10d ``Store`` in front of a store client (``TCPStore``, ``EtcdV3Store``, any
    object with the store's methods) that tallies each call: the operation, the bytes
    of its arguments and of its answer. One per simulated node. Being a ``Store``, it
    goes under torch's ``PrefixStore`` (every rendezvous wraps its store in one), whose
    calls reach it with the prefixed keys: counted as the wire carries them."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store = store
        self.tally = Tally()
        self._lock = threading.Lock()

    def _count(self, op: str, args: tuple[Any, ...], answer: Any) -> None:
        with self._lock:
            self.tally.ops[op] = self.tally.ops.get(op, 0) + 1
            self.tally.sent += _size(args)
            self.tally.received += _size(answer)

    def _call(self, op: str, *args: Any) -> Any:
        answer = getattr(self.store, op)(*args)
        self._count(op, args, answer)
        return answer

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._call("compare_set", key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self._call("wait", list(keys))
        else:
            self._call("wait", list(keys), timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self._call("multi_get", list(keys))]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", list(keys), list(values))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def __getattr__(self, name: str) -> Any:  # the client's own attributes (port, ...)
        if name == "store":  # not set yet
            raise AttributeError(name)
        return getattr(self.store, name)


class CountingBackend:
    """A proxy of a torch rendezvous backend (``get_state``/``set_state``: torch's
    etcd-v2 backend, whose client is python-etcd, not a c10d store) that tallies each
    call into ``tally`` (the node's :class:`CountingStore`'s): the pickled state's bytes
    both ways, as for the c10d backend's ``compare_set``/``get``."""

    def __init__(self, backend: Any, counter: CountingStore) -> None:
        self.backend, self.counter = backend, counter

    @property
    def name(self) -> str:
        return str(self.backend.name)

    def get_state(self) -> Any:
        answer = self.backend.get_state()
        self.counter._count("get_state", (), answer[0] if answer else None)
        return answer

    def set_state(self, state: bytes, token: Any = None) -> Any:
        answer = self.backend.set_state(state, token)
        self.counter._count("set_state", (state,), answer[0] if answer else None)
        return answer
