"""steadfast for PyTorch Lightning: callbacks and a checkpoint plugin that give a
``Trainer.fit`` run under ``steadfast launch`` what ``examples/train.py`` has by hand
(``pip install steadfast[lightning]``)::

    trainer = L.Trainer(callbacks=[FaultToleranceCallback(exp_dir=ckpt_dir),
                                   ModelCheckpoint(ckpt_dir, save_last=True)])
    trainer.fit(model, ckpt_path="last")  # resumes after an in-job restart

- :mod:`.callbacks`: :class:`FaultToleranceCallback` (heartbeats, sections, calculated
  timeouts, events), :class:`GracefulShutdownCallback`, :class:`NaNCallback` and
  :class:`StragglerDetectionCallback`;
- :mod:`.checkpoint_io`: :class:`SteadfastCheckpointIO`, every checkpoint Lightning
  writes through :class:`~steadfast.CheckpointManager`;
- :mod:`.data`: :func:`resumable`, a train dataloader that Lightning resumes mid-epoch.

Nothing here imports anything from Lightning's internals.
"""

from __future__ import annotations

from .._common import NaNRollback
from .callbacks import (
    FaultToleranceCallback,
    GracefulShutdownCallback,
    NaNCallback,
    StragglerDetectionCallback,
)
from .checkpoint_io import SteadfastCheckpointIO
from .data import resumable

__all__ = [
    "FaultToleranceCallback",
    "SteadfastCheckpointIO",
    "resumable",
    "GracefulShutdownCallback",
    "NaNCallback",
    "NaNRollback",
    "StragglerDetectionCallback",
]
