"""The launcher's reading of its ranks' progress: the job's steps into the event log, and
stragglers from the forward times, for a script that reports neither.

- **Steps, counted once.** The node's lowest rank's iterations (their end times, from its
  row's ring) go into one ``steps_seen`` event every :data:`FLUSH` seconds and when a
  generation ends: 8 ranks at 10 ms steps would otherwise write 800 lines a second. A
  rank whose script emits its own ``step_done`` is left to it (and the report prefers
  ``step_done`` where both exist).
- **Stragglers.** Every :data:`PERIOD` each rank's median forward time over its newest
  forwards (at least :data:`SAMPLES` of them, and :data:`WINDOW_SECONDS` of forward
  time: a sub-millisecond forward's median is then over hundreds, which a descheduled
  burst on a busy machine does not move) is scored against the fastest rank's of the node (NVRx's
  relative score: the reference over the rank's median); a rank below
  :data:`THRESHOLD` (Megatron Bridge's 0.7) is a straggler, written as
  ``straggler_detected`` when the set of stragglers changes. A rank slowed 2x at a pace
  p is seen after its second slow forward: ~2 x 2p after the slowdown (1.4 s at the
  demo's 0.34 s). A script that runs steadfast's own straggler ``Detector`` keeps its
  reports (none from here). The ranks compared are one node's: across nodes each node compares
  its own (a job of one rank per node has no straggler report from here).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import events
from . import phases
from .layout import FLAG_OWN_STEPS, FLAG_OWN_STRAGGLERS, forward_times, read, step_times

__all__ = ["Reporter"]

PERIOD = 0.25
FLUSH = 10.0
SAMPLES = 3
THRESHOLD = 0.7
#: A straggler's median forward is at least this much (seconds) over the fastest's: below
#: it, a sub-millisecond forward's scheduling noise would make stragglers of healthy ranks.
MIN_EXCESS = 0.005
WINDOW_SECONDS = 0.25
_KEEP = 1024  # forward times kept per rank (a window of fast forwards holds many)
_MAX_ENDS = 2000  # a steps_seen event stays well under the log's line limit


def _window(seen: deque[float]) -> list[float]:
    """The newest forwards that make at least SAMPLES and WINDOW_SECONDS of forward time
    (as the in-loop detector's window: a burst of short hiccups is not a straggler), or
    none when too few were seen."""
    out: list[float] = []
    total = 0.0
    for seconds in reversed(seen):
        out.append(seconds)
        total += seconds
        if len(out) >= SAMPLES and total >= WINDOW_SECONDS:
            return out
    return []


class Reporter:
    """Steps and stragglers of a node's ranks (``slots``: local rank -> progress slots),
    on a thread of its own while a generation runs."""

    def __init__(self, slots: dict[int, Any], global_rank: Callable[[int], int]) -> None:
        self.slots = slots
        self.global_rank = global_rank
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pids: dict[int, int] = {}
        self._generation = 0
        self._steps_read = 0
        self._ends: list[float] = []
        self._first = 0
        self._base: int | None = None
        self._flushed = time.monotonic()
        self._fwd_read: dict[int, int] = {}
        self._fwd: dict[int, deque[float]] = {}
        self._stragglers: frozenset[int] = frozenset()
        self._phases_written = False
        #: called (on this thread) once a generation's first_step is written: its
        #: compilations are done (the launcher shares its compile cache then)
        self.on_first_step: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="steadfast-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def watch(self, pids: dict[int, int]) -> None:
        """A new generation's workers."""
        self.flush()
        with self._lock:
            self._pids = dict(pids)
            self._generation += 1
            self._steps_read, self._ends, self._first, self._base = 0, [], 0, None
            self._fwd_read = dict.fromkeys(pids, 0)
            self._fwd = {local: deque(maxlen=_KEEP) for local in pids}
            self._stragglers = frozenset()
            self._phases_written = False

    def unwatch(self) -> None:
        """The generation ends: what it did is written now."""
        self.flush()
        with self._lock:
            self._pids = {}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
            self._tick()
            self._wake.wait(PERIOD)
            self._wake.clear()

    def _tick(self) -> None:
        with self._lock:
            if not self._pids:
                return
            self._read_steps()
            self._first_step()
            scores = self._scores()
        if time.monotonic() - self._flushed >= FLUSH:
            self.flush()
        if scores is not None:
            self._report(scores)

    def _lowest(self) -> int | None:
        pids = self._pids.items()
        attached = [local for local, pid in pids if read(self.slots[local]).pid == pid]
        return min(attached, key=self.global_rank) if attached else None

    def _read_steps(self) -> None:
        local = self._lowest()
        if local is None:
            return
        slots = self.slots[local]
        g = read(slots)
        if g.flags & FLAG_OWN_STEPS or g.steps <= self._steps_read:
            return
        offset = time.time() - time.monotonic()
        for n, end in step_times(slots, self._steps_read, g.steps):
            if not self._ends:
                self._first = n
            self._ends.append(round(end + offset, 4))
        self._steps_read = g.steps
        self._base = g.step_base
        if len(self._ends) >= _MAX_ENDS:
            self._flush_locked()

    def flush(self) -> None:
        """Write the steps read and not yet written."""
        with self._lock:
            self._read_steps()
            self._first_step()
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._flushed = time.monotonic()
        if not self._ends:
            return
        local = self._lowest()
        events.emit(
            "steps_seen",
            rank=self.global_rank(local) if local is not None else None,
            local_rank=local,
            worker_pid=self._pids.get(local) if local is not None else None,
            generation=self._generation,
            first=self._first,
            ends=self._ends,
            base=self._base,
        )
        self._ends = []

    def _first_step(self) -> None:
        """``first_step`` once per generation: the lowest rank's phases, once final."""
        if self._phases_written or not self._pids:
            return
        local = self._lowest()
        found = phases.read(self.slots[local]) if local is not None else None
        if local is None or found is None:
            return
        self._phases_written = True
        events.emit(
            "first_step",
            rank=self.global_rank(local),
            local_rank=local,
            worker_pid=self._pids.get(local),
            generation=self._generation,
            **found,
        )
        if self.on_first_step is not None:
            self.on_first_step()

    # ------------------------------------------------------------------ stragglers
    def _scores(self) -> dict[int, float] | None:
        medians = {}
        for local, pid in self._pids.items():
            g = read(self.slots[local])
            if g.pid != pid:
                continue
            if g.flags & FLAG_OWN_STRAGGLERS:  # the script's own Detector reports them
                return None
            seen = self._fwd[local]
            seen.extend(forward_times(self.slots[local], self._fwd_read[local], g.forwards))
            self._fwd_read[local] = g.forwards
            window = _window(seen)
            if window:
                medians[local] = statistics.median(window)
        if len(medians) < 2 or min(medians.values()) <= 0:
            return None
        reference = min(medians.values())
        return {
            local: reference / median if median - reference >= MIN_EXCESS else 1.0
            for local, median in medians.items()
        }

    def _report(self, scores: dict[int, float]) -> None:
        slow = frozenset(local for local, score in scores.items() if score < THRESHOLD)
        if slow == self._stragglers:
            return
        self._stragglers = slow
        if not slow:
            return
        ranks = sorted(self.global_rank(local) for local in slow)
        events.emit(
            "straggler_detected",
            ranks=ranks,
            relative=ranks,
            individual=[],
            scores={str(self.global_rank(k)): round(v, 3) for k, v in sorted(scores.items())},
        )
