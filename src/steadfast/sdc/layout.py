"""The replica-check area of a heartbeat-table row: where a worker publishes the
fingerprints of its replicated state (:mod:`.probe`) and the launcher reads them
(:mod:`.board`).

Float64 slots in the row's progress page (:mod:`steadfast.progress.layout` owns the
page and keeps its own slots below :data:`BASE`). One writer per slot: the worker, but
for :data:`PROVEN`, the launcher's. A check's entry is written before the count that
publishes it, so a reader that reads the count, then the entries, then the count again
knows which entries it can trust (no lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BASE", "END", "Entry", "clear", "note_save", "publish", "read"]

BASE = 160
GROUP = BASE  # the replicas' group key (fingerprint.group_key); 0: this rank is not checked
CHECKS = BASE + 1  # entries published
TOTAL = BASE + 2  # bytes of the replicated state
CHUNKS = BASE + 3  # checks that cover it once
RING_AT = BASE + 4
RING = 16  # entries kept: 160 steps at the default period
WIDTH = 5  # an entry: COUNT, CHUNK, FP, STEP, SAVED
SAVES = RING_AT + RING * WIDTH  # checkpoints noted (steadfast's CheckpointManager's)
#: written by the launcher: 1 + the newest checkpoint step its checks proved clean (0:
#: none yet); the manager's retention keeps that checkpoint
PROVEN = SAVES + 1
END = PROVEN + 1
_COUNT, _CHUNK, _FP, _STEP, _SAVED = range(WIDTH)


@dataclass(frozen=True)
class Entry:
    """One check of one rank: after its ``count``-th optimizer step (counted since the
    process started: the same on every replica), chunk ``chunk``'s fingerprint ``fp``;
    ``step``: the script's own index of that step where it keeps one, else ``count``."""

    count: int
    chunk: int
    fp: int
    step: int
    #: the newest checkpoint step of steadfast's CheckpointManager whose state was
    #: captured at or before this check (-1: none): proven clean if the check agrees
    saved: int = -1

    @property
    def fingerprint(self) -> tuple[int, int]:
        """What two replicas' checks compare: the chunk and its fingerprint."""
        return self.chunk, self.fp


def publish(slots: Any, n: int, entry: Entry) -> None:
    """Write entry number ``n`` (1, 2, ...), then publish it."""
    at = RING_AT + (n % RING) * WIDTH
    slots[at + _COUNT] = float(entry.count)
    slots[at + _CHUNK] = float(entry.chunk)
    slots[at + _FP] = float(entry.fp)
    slots[at + _STEP] = float(entry.step)
    slots[at + _SAVED] = float(entry.saved)
    slots[CHECKS] = float(n)


def clear(slots: Any) -> None:
    """No checks in this row (a new worker's first act)."""
    slots[GROUP] = 0.0
    slots[CHECKS] = 0.0
    slots[SAVES] = 0.0
    slots[PROVEN] = 0.0


def note_save(slots: Any, n: int, saves: int, step: int) -> None:
    """The worker's ``saves``-th checkpoint captured the state entry ``n`` (the last
    published) was checked on (a save right after the check's optimizer step): its
    ``saved`` becomes ``step``."""
    if n > 0:
        slots[RING_AT + (n % RING) * WIDTH + _SAVED] = float(step)
    slots[SAVES] = float(saves)


def read(slots: Any) -> tuple[int, list[Entry]]:
    """The row's group key (0: not checked) and the entries still in its ring, oldest
    first; an entry overwritten while it was read is left out."""
    group = int(slots[GROUP])
    n = int(slots[CHECKS])
    if not group or n <= 0:
        return group, []
    entries = []
    for k in range(max(1, n - RING + 1), n + 1):
        at = RING_AT + (k % RING) * WIDTH
        e = Entry(*(int(slots[at + k]) for k in range(WIDTH)))
        entries.append((k, e))
    after = int(slots[CHECKS])
    # entry after+1 may be being written over the oldest slot
    return group, [e for k, e in entries if k > after + 1 - RING]
