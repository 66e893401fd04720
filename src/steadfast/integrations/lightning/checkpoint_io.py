"""Lightning's checkpoint writer and reader through steadfast's checkpoints.

:class:`SteadfastCheckpointIO` (``Trainer(plugins=[SteadfastCheckpointIO()])``): every
checkpoint Lightning writes (``ModelCheckpoint``, a shutdown, ``trainer.save_checkpoint``)
goes through :class:`~steadfast.CheckpointManager` instead of one ``torch.save``: each
``.ckpt`` is a directory with the state and a manifest of sizes and CRC-32s, published by
an atomic rename (a crash mid-save leaves the previous ``last.ckpt`` whole), optionally
written in the background after a host snapshot (``async_save``); loading verifies it
and, if it is corrupt, goes on with the newest valid older checkpoint in its folder
(``checkpoint_corrupt``, then ``checkpoint_loaded`` with the one used), on every rank
alike. Plain ``.ckpt`` files written before the plugin still load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from ...checkpoint.manager import CheckpointError, CheckpointManager
from ...dist import all_gather_object

__all__ = ["SteadfastCheckpointIO"]


class SteadfastCheckpointIO(CheckpointIO):
    """Lightning's checkpoint writer and reader, through :class:`~steadfast.CheckpointManager`
    (see the module's description).

    Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only
    (DDP state is the same on every rank) and ``load_checkpoint`` on every rank, so each
    folder gets a single-writer manager (``collective=False``, no RNG: Lightning keeps
    its own state). ``async_save``: return after a host snapshot and write in a
    background thread (at most one in flight; a failed write is raised at the next save,
    load or at ``teardown``, which Lightning calls when ``fit`` ends). ``storage_options``
    is not supported (as with Lightning's default writer). Loads are to the CPU (the
    strategy moves the state to its device).

    Each ``.ckpt`` is a folder: read one outside the Trainer with
    ``SteadfastCheckpointIO().load_checkpoint(path)`` (``LightningModule.load_from_checkpoint``
    and loggers that upload checkpoints expect a file). Strategies that write sharded
    checkpoints themselves (FSDP's sharded state dict, DeepSpeed, ModelParallel) do not
    call the plugin; use it with DDP and single-device strategies.
    """

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = bool(async_save)
        self._managers: dict[Path, CheckpointManager] = {}
        #: the checkpoint the last load read (after any fall-back)
        self.loaded_path: Path | None = None

    def _manager(self, folder: Path) -> CheckpointManager:
        key = folder.absolute()
        manager = self._managers.get(key)
        if manager is None:
            manager = CheckpointManager(
                folder, keep_last_n=0, async_save=self.async_save, rng=False, collective=False
            )
            self._managers[key] = manager
        return manager

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save Lightning's ``checkpoint`` dict as the checkpoint directory ``path``
        (step: its ``global_step``)."""
        if storage_options is not None:
            raise TypeError(
                "SteadfastCheckpointIO.save_checkpoint: storage_options is not supported "
                f"(got {storage_options!r})"
            )
        target = Path(path)
        step = int(checkpoint.get("global_step", 0))
        self._manager(target.parent).save(step, checkpoint, name=target.name)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint at ``path``, verified; if it is corrupt (or a ``last.ckpt``
        link whose target a crash kept from landing), the newest valid full checkpoint
        in its folder that is not newer. A plain file (Lightning's own format) is read
        by Lightning's reader. Under ``torch.distributed`` every rank must call it (as
        Lightning does): the ranks then check that they all read the same checkpoint,
        and a rank that failed makes every rank raise (none is left waiting)."""
        source = Path(path)
        state: dict[str, Any] | None = None
        used: str | None = None
        failure: BaseException | None = None
        try:
            if source.is_file():
                state = TorchCheckpointIO().load_checkpoint(source, map_location, weights_only)
                used = str(source)
            elif not source.exists() and not source.is_symlink():
                raise FileNotFoundError(f"checkpoint {source} not found")
            else:
                manager = self._manager(source.parent)
                loaded = manager.load(
                    source,
                    fallback=True,
                    weights_only=weights_only is not False,
                    require_keys=_FULL_CHECKPOINT,
                )
                if loaded is None:  # pragma: no cover - a path was given: a candidate
                    raise CheckpointError(f"no checkpoint at {source}")
                state, used = loaded[1], str(manager.loaded_path)
        except Exception as exc:
            failure = exc
        _same_on_every_rank(used, failure, source)
        assert state is not None and used is not None
        self.loaded_path = Path(used)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint ``path`` (``ModelCheckpoint`` rotating its top-k):
        hidden by a rename first, after the save in flight."""
        target = Path(path)
        self._manager(target.parent).remove(target)

    def wait(self) -> None:
        """Wait for the background save in flight (if any); raise its error."""
        for manager in self._managers.values():
            manager.wait()

    def teardown(self) -> None:
        """Finish the saves in flight and release the staging buffers."""
        managers, self._managers = list(self._managers.values()), {}
        for manager in managers:
            manager.close()


#: what a checkpoint needs to resume ``fit`` from (the model, the loops, the optimizers):
#: a fall-back never lands on a weights-only one
_FULL_CHECKPOINT = ("state_dict", "loops", "optimizer_states")


def _same_on_every_rank(used: str | None, failure: BaseException | None, path: Path) -> None:
    """Every rank verifies on its own: if one failed, or fell back to another file than
    the others (a file readable on some nodes only), they must not train from different
    states, nor wait for each other: every rank raises the same way."""
    mine = (used, None if failure is None else f"{type(failure).__name__}: {failure}")
    everyone = all_gather_object(mine)
    if failure is not None:
        raise failure
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(everyone) if err]
    if errors:
        raise CheckpointError(f"loading {path} failed on other ranks: " + "; ".join(errors))
    if len({u for u, _ in everyone}) > 1:
        raise CheckpointError(
            f"ranks read different checkpoints for {path} ({[u for u, _ in everyone]}): a "
            "file is readable on some nodes only"
        )
