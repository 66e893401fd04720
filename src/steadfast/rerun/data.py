"""Replaying a step's micro-batches: :class:`RerunDataIterator` keeps the batches of the
step being run, so the re-run state machine can re-run it on the same data, in place or
after a restart (the kept batches are in its state)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RerunDataIterator"]


class RerunDataIterator:
    """Wraps a data iterator so a step's micro-batches can be replayed.

    Batches fetched since the last :meth:`advance` are kept; :meth:`rewind` replays them
    in order. :meth:`state_dict` holds the kept batches, so a re-run after a restart
    (exit 16) replays the very same data.
    """

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable: Iterator[Any] = iter(iterable)
        self.saved: list[Any] = []
        self.replay_pos: int | None = None

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self.replay_pos is not None and self.replay_pos < len(self.saved):
            batch = self.saved[self.replay_pos]
            self.replay_pos += 1
            return batch
        self.replay_pos = None
        batch = next(self.iterable)
        self.saved.append(batch)
        return batch

    def rewind(self) -> None:
        """Replay the batches fetched since the last advance."""
        self.replay_pos = 0

    def advance(self) -> None:
        """The step is done: forget its batches."""
        self.saved = []
        self.replay_pos = None

    def state_dict(self) -> dict[str, Any]:
        """The kept batches (needed when the step is re-run after a restart)."""
        return {"saved": list(self.saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore kept batches; they are replayed first."""
        self.saved = list(state.get("saved", []))
        self.replay_pos = 0 if self.saved else None
