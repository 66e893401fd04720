"""Checkpoints: writing them so that no fault can lose one, and finding the one to resume
from. :class:`CheckpointManager` is the front; each submodule owns one part (see
:mod:`steadfast.checkpoint.manager`), and :func:`resolve_resume_path` lives with the
on-disk layout (:mod:`steadfast.checkpoint.layout`)."""

from __future__ import annotations

from .layout import LATEST, resolve_resume_path, step_dirs
from .manager import (
    CheckpointError,
    CheckpointFenced,
    CheckpointManager,
    verify,
    write_manifest,
)
from .state import DataPosition, ResumableSampler, RNGState, ShardedTrainState, Stateful

__all__ = [
    "LATEST",
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointManager",
    "DataPosition",
    "RNGState",
    "ResumableSampler",
    "ShardedTrainState",
    "Stateful",
    "resolve_resume_path",
    "step_dirs",
    "verify",
    "write_manifest",
]
