"""The Slurm job this process runs in, read from the environment Slurm sets.

Parity with ``kempnerforge.resilience`` (seed 000): :class:`SLURMInfo`,
:func:`get_slurm_info`, :func:`is_slurm_job`, :func:`is_slurm_requeue`,
:func:`log_job_info`. Facts from real Slurm that shape this module (checked against a
real single-node Slurm in ``tests/slurm/``):

- ``SLURM_RESTART_COUNT`` is *unset* until the first requeue, so unset means 0.
- ``SLURM_NTASKS_PER_NODE`` is only set when ``--ntasks-per-node`` was given; otherwise the
  per-node task count is in ``SLURM_TASKS_PER_NODE`` in Slurm's compressed form
  (``"4(x2),3"``), of which the first node's count is used.
- ``SLURM_JOB_NUM_NODES`` is the newer name of ``SLURM_NNODES``; both are read.

A variable that is set but malformed raises :class:`~steadfast.config.ConfigError`
naming it, instead of a bare ``int()`` traceback.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from ..config import ConfigError

__all__ = ["SLURMInfo", "get_slurm_info", "is_slurm_job", "is_slurm_requeue", "log_job_info"]

logger = logging.getLogger(__name__)


@dataclass
class SLURMInfo:
    """Information about the current SLURM job."""

    job_id: str
    job_name: str
    node_list: str
    num_nodes: int
    ntasks_per_node: int
    restart_count: int
    partition: str
    array_task_id: str | None

    @property
    def is_requeued(self) -> bool:
        """Whether this job has been requeued (restart_count > 0)."""
        return self.restart_count > 0


def _int_var(names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        text = raw.strip()
        if name == "SLURM_TASKS_PER_NODE":  # compressed form: "4(x2),3" -> 4
            match = re.match(r"^(\d+)", text)
            text = match.group(1) if match else text
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
        if value < 0:
            raise ConfigError(f"environment variable {name}={raw!r} must not be negative")
        return value
    return default


def get_slurm_info() -> SLURMInfo | None:
    """Read SLURM job information from environment variables.

    Returns:
        SLURMInfo if running under SLURM, None otherwise.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return SLURMInfo(
        job_id=job_id,
        job_name=os.environ.get("SLURM_JOB_NAME", ""),
        node_list=os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "")),
        num_nodes=_int_var(("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), 1),
        ntasks_per_node=_int_var(("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), 1),
        restart_count=_int_var(("SLURM_RESTART_COUNT",), 0),
        partition=os.environ.get("SLURM_JOB_PARTITION", ""),
        array_task_id=os.environ.get("SLURM_ARRAY_TASK_ID") or None,
    )


def is_slurm_job() -> bool:
    """Check if we are running under SLURM (``SLURM_JOB_ID`` is set)."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def is_slurm_requeue() -> bool:
    """Check if this is a requeued SLURM job.

    Uses ``SLURM_RESTART_COUNT`` (set by SLURM on requeue; unset before the first one).
    """
    return _int_var(("SLURM_RESTART_COUNT",), 0) > 0


def log_job_info() -> None:
    """Log SLURM job information (if running under SLURM)."""
    info = get_slurm_info()
    if info is None:
        logger.info("Not running under SLURM")
        return
    logger.info(
        "SLURM job: id=%s, name=%s, nodes=%d, tasks/node=%d, partition=%s, restart_count=%d%s",
        info.job_id,
        info.job_name,
        info.num_nodes,
        info.ntasks_per_node,
        info.partition,
        info.restart_count,
        f", array_task_id={info.array_task_id}" if info.array_task_id else "",
    )
    if info.is_requeued:
        logger.info("Job was requeued (restart #%d) - will auto-resume", info.restart_count)
