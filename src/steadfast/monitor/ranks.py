"""A rank's life as its node's launcher sees it: one state, its transitions written down,
each end owned by one module.

The watcher (:mod:`.watcher`) keeps a :class:`Rank` per local rank of the generation it
watches, in :class:`Ranks`; nothing else holds a rank's state. ::

    STARTING ─> RUNNING ─┬─> HUNG ───────────────────────────> ENDED
        │                ├─> FINISHED ─┬─> TEARING_DOWN ──────> ENDED
        │                │             └──────────────────────> ENDED
        │                ├─> FAILED ──────────────────────────> ENDED
        │                └─> TEARING_DOWN (hung once every other rank finished)
        └──> HUNG, TEARING_DOWN (it never showed a sign of life), FINISHED, FAILED,
             ENDED (a script quicker than the first read)

- ``STARTING``: started; its row shows no sign of it yet (no heartbeat, no hooks).
- ``RUNNING``: its script runs; watched for hangs (a confirmed one is a fault). While
  it waits for a hang's culprit to go (``held``) or for one still within its own bound
  (``deferred``), it is not judged.
- ``FINISHED``: its training is over: the worker marked ``COLLECTIVES_DONE`` (its
  ``destroy_process_group()`` returned) or ``FINISHED`` (its ``__main__`` returned, or
  ``sys.exit(0)``) in its row (:mod:`steadfast.launcher.worker_end`). Never restarted;
  its end is teardown (:mod:`.teardown`).
- ``FAILED``: its script raised or exited non-zero (the worker's ``ENDED`` mark): a
  failure, on its way out; no hang is looked for, and it is killed past
  ``workers_stop_timeout``.
- ``HUNG``: a hang confirmed while it ran: the fault's ``rank_hung`` written, being
  ended (:mod:`.ending`: stacks, termination signal, SIGKILL).
- ``TEARING_DOWN``: a finished rank that hung (past ``teardown_timeout``, or a look
  found it stuck), or a running rank that hung once every other rank of the job had
  finished: ``worker_teardown`` written, killed, and its exit is 0 for torch's agent.
- ``ENDED``: its process exited (its pidfd said so); the code the agent sees is read
  through :meth:`steadfast.monitor.teardown.Teardown.exit_code`.

Who moves it: the row's marks, read here (:meth:`Ranks.observe`); ``HUNG`` the
watcher's judgment (:mod:`.watcher`); ``TEARING_DOWN`` :mod:`.teardown`; ``ENDED`` the
exit seen. A transition not drawn above is a bug: refused, and logged as an error (the
watcher's thread goes on watching the other ranks).
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..progress.layout import COLLECTIVES_DONE, ENDED, FINISHED

__all__ = ["Rank", "RankState", "Ranks"]

logger = logging.getLogger(__name__)


class RankState(str, enum.Enum):
    """See the module docstring for each state and its transitions."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    HUNG = "hung"
    TEARING_DOWN = "tearing_down"
    ENDED = "ended"

    def __str__(self) -> str:
        return str(self.value)


_S = RankState
_ALLOWED: dict[RankState, frozenset[RankState]] = {
    _S.STARTING: frozenset(
        {_S.RUNNING, _S.HUNG, _S.FINISHED, _S.FAILED, _S.TEARING_DOWN, _S.ENDED}
    ),
    _S.RUNNING: frozenset({_S.HUNG, _S.FINISHED, _S.FAILED, _S.TEARING_DOWN, _S.ENDED}),
    _S.FINISHED: frozenset({_S.TEARING_DOWN, _S.ENDED}),
    _S.FAILED: frozenset({_S.ENDED}),
    _S.HUNG: frozenset({_S.ENDED}),
    _S.TEARING_DOWN: frozenset({_S.ENDED}),
    _S.ENDED: frozenset(),
}


@dataclass
class Rank:
    """One local rank of the watched generation."""

    local: int
    pid: int
    state: RankState = RankState.STARTING
    since: float = 0.0  # monotonic: when it entered ``state``
    #: set as it became HUNG (and kept once ENDED): what timed out and the epoch time
    #: of its last sign of life
    hang: tuple[str, float] | None = None
    #: RUNNING: the pid of the culprit it waits for, and until when (inf: it runs)
    held: tuple[int, float] | None = None
    #: RUNNING: not judged again before this (it waits for a culprit within its bound)
    deferred: float = 0.0

    @property
    def watched(self) -> bool:
        """Whether its hangs are looked for (a hang would be a fault)."""
        return self.state in (RankState.STARTING, RankState.RUNNING)


class Ranks:
    """The ranks of the watched generation (``local -> Rank``) and their transitions;
    ``slots``: each local rank's progress slots (the row's end marks), where known."""

    def __init__(self, slots: Mapping[int, Any] | None = None) -> None:
        self._slots = dict(slots or {})
        self._lock = threading.Lock()
        self._ranks: dict[int, Rank] = {}

    def new_generation(self, pids: Mapping[int, int]) -> None:
        """A new generation: every rank ``STARTING``."""
        now = time.monotonic()
        with self._lock:
            self._ranks = {local: Rank(local, pid, since=now) for local, pid in pids.items()}

    def get(self, local: int) -> Rank | None:
        return self._ranks.get(local)

    def __iter__(self) -> Iterator[Rank]:
        return iter(list(self._ranks.values()))

    def to(self, local: int, pid: int, state: RankState, **fields: Any) -> Rank | None:
        """Move ``local`` (of process ``pid``: a rank of a generation since replaced is
        left alone, None) to ``state``, setting ``fields``; the same state again only
        sets them. A transition not drawn in the module docstring is refused (None), and
        logged as the bug it is."""
        with self._lock:
            rank = self._ranks.get(local)
            if rank is None or rank.pid != pid:
                return None
            if state != rank.state:
                if state not in _ALLOWED[rank.state]:
                    logger.error(
                        "local rank %d: %s -> %s is no transition", local, rank.state, state
                    )
                    return None
                rank.state, rank.since = state, time.monotonic()
            for name, value in fields.items():
                setattr(rank, name, value)
            return rank

    def set(self, local: int, pid: int, **fields: Any) -> Rank | None:
        """Set ``fields`` of ``local`` (of process ``pid``), its state kept."""
        rank = self._ranks.get(local)
        return None if rank is None else self.to(local, pid, rank.state, **fields)

    # ------------------------------------------------------------------ the row's marks
    def marks(self, local: int) -> tuple[float | None, float | None, float | None]:
        """``(collectives done, finished, failed)``: the monotonic times the worker
        marked in its row, None where it did not."""
        slots = self._slots.get(local)
        if slots is None:
            return None, None, None
        return tuple(  # type: ignore[return-value]
            float(slots[s]) if slots[s] > 0 and math.isfinite(slots[s]) else None
            for s in (COLLECTIVES_DONE, FINISHED, ENDED)
        )

    def over(self, local: int) -> float | None:
        """When ``local``'s training was over (its first mark of it), None before."""
        done, finished, _ = self.marks(local)
        times = [t for t in (done, finished) if t is not None]
        return min(times) if times else None

    def observe(self, local: int, pid: int, alive: bool) -> Rank | None:
        """Move ``local`` on from what its row says: ``FINISHED`` or ``FAILED`` from its
        marks, ``RUNNING`` once it shows a sign of life (``alive``)."""
        rank = self._ranks.get(local)
        if rank is None or rank.pid != pid:
            return None
        if rank.state in (RankState.STARTING, RankState.RUNNING):
            _, _, failed = self.marks(local)
            if failed is not None:
                return self.to(local, pid, RankState.FAILED)
            if self.over(local) is not None:
                return self.to(local, pid, RankState.FINISHED)
            if alive and rank.state == RankState.STARTING:
                return self.to(local, pid, RankState.RUNNING)
        return rank

    def others_finished(self, local: int) -> bool:
        """Whether every other rank of the generation has finished its training (marked
        it, or exited after marking it): a hang of ``local`` then comes after the job's
        last collective."""
        others = [r for r in self._ranks.values() if r.local != local]
        return bool(others) and all(self.over(r.local) is not None for r in others)
