"""The fence checks of a save: a rank whose node no longer holds the job's rendezvous
(:mod:`steadfast.fence`) writes nothing. A save asks before its first file (every rank
learns the answer in the agreement that opens the save) and rank 0 asks again just
before ``latest`` moves."""

from __future__ import annotations

from pathlib import Path

from .. import events
from .layout import CheckpointError

__all__ = ["CheckpointFenced", "fence", "fenced"]


class CheckpointFenced(CheckpointError):
    """This rank may not write: its node no longer holds the job's rendezvous (cut off
    by a partition, or the job went on without it). Nothing was written, and ``latest``
    was not moved (:mod:`steadfast.fence`)."""


def fenced(path: Path) -> str | None:
    """Why this rank may not write ``path`` (after a ``checkpoint_fenced`` event): its
    node's launcher says the node no longer holds the job's rendezvous. None: it may."""
    from .. import fence

    reason = fence.check()
    if reason is not None:
        events.emit("checkpoint_fenced", cause="fence", path=str(path), reason=reason)
        return f"not writing {path}: {reason}"
    return None


def fence(path: Path) -> None:
    """Raise :class:`CheckpointFenced` where :func:`fenced` says so."""
    refused = fenced(path)
    if refused is not None:
        raise CheckpointFenced(refused)
