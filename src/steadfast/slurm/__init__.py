"""Slurm: the job's information, its requeues (job retries, node exclusion) and the batch
script of ``steadfast slurm``.

Parity with ``kempnerforge.resilience`` (seed 000): :class:`SLURMInfo`,
:func:`get_slurm_info`, :func:`is_slurm_job`, :func:`is_slurm_requeue`,
:func:`log_job_info` (:mod:`.info`, read from the environment Slurm sets). On top of it:
:func:`requeue_job`, :func:`failure_requeues`, :func:`doubted_hosts` and
:func:`exclusion_plan` (:mod:`.requeue`: the launcher's job retries through
``scontrol``, away from lost or doubted nodes), and :class:`SbatchSpec` /
:func:`render_sbatch` (:mod:`.sbatch`: the batch script that runs ``steadfast launch``
on every node). Each module says which facts of real Slurm shape it.
"""

from __future__ import annotations

from .info import SLURMInfo, get_slurm_info, is_slurm_job, is_slurm_requeue, log_job_info
from .requeue import (
    FAILURE_REQUEUE_CAUSES,
    ExclusionPlan,
    doubted_hosts,
    exclusion_plan,
    failure_requeues,
    requeue_job,
)
from .sbatch import PREEMPT_SIGNALS, RDZV_BACKENDS, SbatchSpec, parse_time_limit, render_sbatch

__all__ = [
    "FAILURE_REQUEUE_CAUSES",
    "PREEMPT_SIGNALS",
    "RDZV_BACKENDS",
    "SLURMInfo",
    "ExclusionPlan",
    "SbatchSpec",
    "doubted_hosts",
    "exclusion_plan",
    "failure_requeues",
    "get_slurm_info",
    "is_slurm_job",
    "is_slurm_requeue",
    "log_job_info",
    "parse_time_limit",
    "render_sbatch",
    "requeue_job",
]
