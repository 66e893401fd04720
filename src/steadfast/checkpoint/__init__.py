"""Checkpoints: finding the one to resume from (and, in later issues, writing them).

:func:`resolve_resume_path` follows seed 000's rules: a ``{dir}/latest`` symlink that
resolves to an existing checkpoint wins; otherwise the highest ``step_N`` directory by
number (not by name: ``step_10`` is newer than ``step_9``); a broken ``latest`` falls back
to the scan. A missing directory means "nothing to resume" (the first run); a path that
exists but is not a directory is a configuration error, not a silent fresh start.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..config import ConfigError

__all__ = [
    "LATEST",
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointManager",
    "DataPosition",
    "RNGState",
    "ResumableSampler",
    "Stateful",
    "resolve_resume_path",
    "step_dirs",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dirs(checkpoint_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N`` directory in ``checkpoint_dir``, oldest first."""
    base = Path(checkpoint_dir)
    found: list[tuple[int, Path]] = []
    for entry in base.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    found.sort(key=lambda item: item[0])
    return found


def resolve_resume_path(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """Find the latest checkpoint for auto-resume.

    Checks:
      1. ``{checkpoint_dir}/latest`` symlink (used when it resolves to a directory)
      2. Most recent ``step_N`` directory by step number

    Args:
        checkpoint_dir: Base checkpoint directory.

    Returns:
        Path to the latest checkpoint, or None if none found (or the directory does not
        exist yet).

    Raises:
        ConfigError: ``checkpoint_dir`` exists but is not a directory.
    """
    base = Path(checkpoint_dir)
    if not base.exists():
        return None
    if not base.is_dir():
        raise ConfigError(f"checkpoint_dir {str(base)!r} exists but is not a directory")
    latest = base / LATEST
    if latest.is_symlink() or latest.exists():
        try:
            resolved: Path | None = latest.resolve()
        except (OSError, RuntimeError):  # a symlink loop, or an unreadable link
            resolved = None
        if resolved is not None and resolved.is_dir():
            logger.info("Auto-resume: found latest checkpoint at %s", resolved)
            return resolved
        logger.warning(
            "Auto-resume: %s does not resolve to a checkpoint directory; scanning step_N", latest
        )
    candidates = step_dirs(base)
    if candidates:
        path = candidates[-1][1]
        logger.info("Auto-resume: found checkpoint at %s", path)
        return path
    return None


from .manager import (  # noqa: E402  (needs LATEST)
    CheckpointError,
    CheckpointFenced,
    CheckpointManager,
    verify,
    write_manifest,
)
from .state import DataPosition, ResumableSampler, RNGState, Stateful  # noqa: E402
