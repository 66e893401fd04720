"""Deleting checkpoints: ``keep_last_n`` applied once a save is published, and the
removal of a framework's named checkpoint. A checkpoint is first hidden by a rename
(atomic: a crash never leaves one half deleted under its name), then unlinked; after a
sync save the unlinking runs on a thread of its own, so that training does not wait for
it."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from .. import events
from ..sdc.probe import checking, proven_step
from .layout import LATEST, discard, remove_all, step_dirs

__all__ = ["Retention", "remove"]

logger = logging.getLogger(__name__)


class Retention:
    """``keep_last_n`` over the ``step_N`` checkpoints of ``folder`` (<= 0 keeps all);
    ``latest``'s target and the steps named at :meth:`apply` are never deleted, nor,
    while the replica checks run (steadfast.sdc), the newest checkpoint they proved clean
    (the state a roll-back after a silent corruption goes back to) and every newer one
    (the next to be proven is among them: a proof comes a second or so after a save)."""

    def __init__(self, folder: Path, keep_last_n: int) -> None:
        self.folder = folder
        self.keep_last_n = keep_last_n
        self._reaper: threading.Thread | None = None

    def apply(self, keep_step: int, in_flight: int | None, background: bool) -> None:
        """Once checkpoint ``keep_step`` is published (rank 0): hide the checkpoints
        beyond ``keep_last_n`` and remove them, on the reaper thread when
        ``background``. A failure is logged: it must not fail a published checkpoint."""
        try:
            trash = self._hide_old(keep_step, in_flight)
        except Exception as exc:
            logger.warning("retention after checkpoint step %d failed: %s", keep_step, exc)
            trash = []
        if trash and background:
            self._reaper = threading.Thread(
                target=remove_all, args=(trash,), name="steadfast-checkpoint-reaper"
            )
            self._reaper.start()
        else:
            remove_all(trash)

    def _hide_old(self, keep_step: int, in_flight: int | None) -> list[Path]:
        """Hide checkpoints beyond ``keep_last_n`` (rename, atomic); returns the hidden
        paths for the caller to remove."""
        if self.keep_last_n <= 0:
            return []
        existing = step_dirs(self.folder)
        latest_target: Path | None = None
        with contextlib.suppress(OSError, RuntimeError):
            latest_target = (self.folder / LATEST).resolve()
        protected = {keep_step, in_flight}
        if checking():  # the replica checks' proof of a checkpoint comes a while after it
            proven = proven_step()
            newest = max((n for n, _ in existing if proven is not None and n <= proven),
                         default=-1)  # fmt: skip
            # the roll-back's state, and every newer one: one of them is the next proven
            protected.update(n for n, _ in existing if n >= newest)
        trash = []
        for n, path in existing[: max(0, len(existing) - self.keep_last_n)]:
            if n in protected or path.resolve() == latest_target:
                continue
            try:
                trash.append(discard(path))
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s: %s", path, exc)
                continue
            events.emit("checkpoint_deleted", step=n, path=str(path))
        return trash

    def wait(self) -> None:
        """Wait for the old checkpoints being removed."""
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None


def remove(target: Path, announce: bool) -> None:
    """Delete the checkpoint directory (or link) ``target``, hidden by a rename first;
    ``announce``: emit ``checkpoint_deleted`` (rank 0)."""
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink():
        remove_all([discard(target)])
    else:
        target.unlink()
    if announce:
        events.emit("checkpoint_deleted", path=str(target))
