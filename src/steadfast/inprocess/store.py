"""The store the ranks use to coordinate restarts (interruptions, terminations, barriers).

One TCPStore per Wrapper call, served by the monitor process of initial rank 0 (so it
outlives a crashed rank 0) on ``MASTER_PORT + 1`` unless ``store_kwargs`` say otherwise.
Every key of an iteration carries the iteration number, so a late write from an old
iteration can never be mistaken for a new one. Keys:

``hb/{r}``                 heartbeat counter of rank r's monitor process
``terminated``             "r," appended for every rank that left the job for good
``left``                   "r," appended by every rank that left the Wrapper cleanly
``iter/{i}/n``             number of interruption records of iteration i
``iter/{i}/why``           one JSON line per interruption record (who, cause, when)
``iter/{i}/state``         b"interrupted" or b"completed": what ended iteration i (the
                           monitor threads block on this key)
``iter/{i}/completed``     "r," for every active rank whose function returned
``iter/{i}/arrived``       "r," for every rank that reached the restart barrier
``iter/{i}/frozen``        the terminated set the barrier settled on (first writer wins)
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

__all__ = ["StoreMixin", "TCPStore", "default_address", "make_store", "own_connection"]

INTERRUPTED = b"interrupted"
COMPLETED = b"completed"


def _parse_ranks(raw: bytes) -> frozenset[int]:
    return frozenset(int(x) for x in raw.decode().split(",") if x)


class StoreMixin:
    """The restart protocol over a torch ``Store``: ``self.store`` where the object
    holds one (steadfast's :class:`TCPStore`), else the object itself (NVRx's stores
    derive from a torch Store and this mixin: ``class S(torch.distributed.TCPStore,
    StoreMixin)``)."""

    @property
    def kv(self) -> Any:
        """The torch Store the protocol's keys live in."""
        return self.__dict__.get("store", self)

    # -- plumbing -------------------------------------------------------------------
    def _get_opt(self, key: str) -> bytes | None:
        return self.kv.get(key) if self.kv.check([key]) else None

    def _ranks(self, key: str) -> frozenset[int]:
        raw = self._get_opt(key)
        return _parse_ranks(raw) if raw else frozenset()

    # -- liveness -------------------------------------------------------------------
    def heartbeat(self, rank: int) -> None:
        """One heartbeat of rank ``rank``'s monitor process."""
        self.kv.add(f"hb/{rank}", 1)

    def heartbeats(self, ranks: list[int]) -> dict[int, int]:
        """Heartbeat counters of those of ``ranks`` that have registered one."""
        present = [r for r in ranks if self.kv.check([f"hb/{r}"])]
        if not present:
            return {}
        values = self.kv.multi_get([f"hb/{r}" for r in present])
        return {r: int(v) for r, v in zip(present, values, strict=True)}

    def record_terminated(self, rank: int) -> None:
        """Rank ``rank`` left the job for good (dead, killed, unhealthy or aborted)."""
        self.kv.append("terminated", f"{rank},")

    def terminated(self) -> frozenset[int]:
        return self._ranks("terminated")

    def record_left(self, rank: int) -> None:
        """Rank ``rank`` left the Wrapper (success or its final error)."""
        self.kv.append("left", f"{rank},")

    def left(self) -> frozenset[int]:
        return self._ranks("left")

    # -- interruptions --------------------------------------------------------------
    def record_interruption(self, iteration: int, rank: int, cause: str, detail: str) -> bool:
        """Record why ``iteration`` must end; True for the first record of the iteration.

        The record goes in before the state flips, so a rank woken by the flip always
        finds at least one cause.
        """
        record = {"rank": rank, "cause": cause, "detail": detail[:2000], "time": time.time()}
        self.kv.append(f"iter/{iteration}/why", json.dumps(record) + "\n")
        first = int(self.kv.add(f"iter/{iteration}/n", 1)) == 1
        self.kv.compare_set(f"iter/{iteration}/state", "", INTERRUPTED)
        return first

    def interruptions(self, iteration: int) -> list[dict[str, Any]]:
        raw = self._get_opt(f"iter/{iteration}/why")
        if not raw:
            return []
        return [json.loads(line) for line in raw.decode().splitlines() if line]

    def iteration_state(self, iteration: int) -> bytes | None:
        """``INTERRUPTED``, ``COMPLETED`` or None while iteration ``iteration`` runs."""
        return self._get_opt(f"iter/{iteration}/state")

    def wait_iteration_end(self, iteration: int, timeout: timedelta) -> bytes:
        """Block until iteration ``iteration`` is interrupted or completed (raises the
        store's timeout error otherwise)."""
        key = f"iter/{iteration}/state"
        self.kv.wait([key], timeout)
        return self.kv.get(key)  # type: ignore[no-any-return]

    # -- completion -----------------------------------------------------------------
    def record_completed(self, iteration: int, rank: int) -> None:
        self.kv.append(f"iter/{iteration}/completed", f"{rank},")

    def completed(self, iteration: int) -> frozenset[int]:
        return self._ranks(f"iter/{iteration}/completed")

    def mark_completed(self, iteration: int) -> bytes:
        """Flip iteration ``iteration`` to completed unless it was interrupted first;
        returns the state that won."""
        return self.kv.compare_set(f"iter/{iteration}/state", "", COMPLETED)  # type: ignore[no-any-return]

    # -- restart barrier ------------------------------------------------------------
    def arrive(self, iteration: int, rank: int) -> None:
        self.kv.append(f"iter/{iteration}/arrived", f"{rank},")

    def arrived(self, iteration: int) -> frozenset[int]:
        return self._ranks(f"iter/{iteration}/arrived")

    def freeze(self, iteration: int, terminated: frozenset[int]) -> frozenset[int]:
        """Settle the terminated set of the barrier after ``iteration``: the first rank to
        see the barrier complete writes it, every rank reads the same value back."""
        value = ",".join(str(r) for r in sorted(terminated)) + ","
        return _parse_ranks(self.kv.compare_set(f"iter/{iteration}/frozen", "", value))


class TCPStore(StoreMixin):
    """The default store: a ``torch.distributed.TCPStore`` (libuv) client or server.

    ``TCPStore(host_name=None, port=None, is_master=False, timeout=...)``: the host is
    ``MASTER_ADDR`` and the port ``MASTER_PORT + 1`` unless given (the process group may
    use ``MASTER_PORT`` itself with ``env://``). The Wrapper makes the server in initial
    rank 0's monitor process (so it outlives rank 0) and one client per thread that
    needs one (a TCPStore client serialises its operations).
    """

    store: Any  #: the torch.distributed.TCPStore

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=120),
        **kwargs: Any,
    ) -> None:
        import torch.distributed as dist

        self.host_name, self.port = default_address(host_name, port)
        self.store = dist.TCPStore(  # type: ignore[attr-defined]
            self.host_name,
            self.port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=timeout,
            use_libuv=True,
            **kwargs,
        )

    def clone(self) -> TCPStore:
        """Another client connection to the same server."""
        other = object.__new__(TCPStore)
        other.host_name, other.port = self.host_name, self.port
        other.store = self.store.clone()
        return other


class _Connection(StoreMixin):
    """The restart protocol over a plain torch Store: another client of a user's store."""

    def __init__(self, store: Any) -> None:
        self.store = store


def own_connection(client: Any) -> Any:
    """A connection of its own to the restart store, with the protocol's methods.

    A TCPStore client serialises its operations, so a thread that blocks on the store
    (the monitor thread waits for an iteration to end) needs its own. Steadfast's
    :class:`TCPStore` clones itself; an NVRx-shaped store (a torch Store deriving from
    :class:`StoreMixin`) clones only its torch part, which is wrapped so that the clone
    still speaks the protocol; a store that cannot clone is shared.
    """
    clone = getattr(client, "clone", None)
    if clone is None:
        return client
    other = clone()
    return other if isinstance(other, StoreMixin) else _Connection(other)


def default_address(host_name: str | None, port: int | None) -> tuple[str, int]:
    """The restart store's address: the given values, else ``MASTER_ADDR`` and
    ``MASTER_PORT + 1``; a missing variable is a ConfigError naming it."""
    from ..config import ConfigError

    if host_name is None:
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                "Wrapper: environment variable MASTER_ADDR not set and store_kwargs has no "
                "'host_name' for the restart store"
            )
        host_name = os.environ["MASTER_ADDR"]
    if port is None:
        if "MASTER_PORT" not in os.environ:
            raise ConfigError(
                "Wrapper: environment variable MASTER_PORT not set and store_kwargs has no "
                "'port' for the restart store"
            )
        port = int(os.environ["MASTER_PORT"]) + 1
    return host_name, int(port)


def make_store(factory: Any, kwargs: dict[str, Any], is_master: bool) -> Any:
    """A store from ``factory``: steadfast's :class:`TCPStore` (or a subclass) is told
    whether to serve; any other factory gets the user's ``store_kwargs`` only, as NVRx
    calls it, and decides its role itself."""
    if isinstance(factory, type) and issubclass(factory, TCPStore):
        return factory(**kwargs, is_master=is_master)
    return factory(**kwargs)
