"""What the launcher does once a job cannot go on in place: requeue it under Slurm while
job retries remain (the launcher of ``SLURM_PROCID`` 0 asks), kept away from the nodes
it must leave, or exit with the code that says why (:mod:`.exit_codes`)."""

from __future__ import annotations

import logging
import os

from ..config import FaultToleranceConfig
from .exit_codes import (
    EXIT_NODE_LOST,
    EXIT_REQUEUED,
    EXIT_RESTART_ELSEWHERE,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_RESULT_VALIDATION_FAILED,
)

__all__ = ["job_retry", "node_lost_exit", "rerun_exit"]

logger = logging.getLogger("steadfast.launcher")


def node_lost_exit(ft: FaultToleranceConfig, hosts: list[str] | None = None) -> int:
    """Exit 75, or a requeue (78) while job retries remain under Slurm, away from the
    lost ``hosts``."""
    return job_retry(ft, cause="node_lost", otherwise=EXIT_NODE_LOST, exclude=hosts or [])


def rerun_exit(code: int, ft: FaultToleranceConfig) -> int:
    """The launcher's answer to the re-run state machine's exit codes (see above)."""
    if code == EXIT_RESULT_VALIDATION_FAILED:
        logger.error(
            "steadfast launch: a worker failed result validation (exit 17); not restarting"
        )
        return EXIT_RESULT_VALIDATION_FAILED
    logger.error(
        "steadfast launch: a worker asked to resume on other hardware (exit 16); not "
        "restarting on this hardware"
    )
    from ..slurm import doubted_hosts, get_slurm_info

    # the nodes whose ranks must move: a requeue that may put them back on the same
    # node would exit 16 again, spending retries for nothing
    info = get_slurm_info()
    doubted = doubted_hosts(info.job_id, info.restart_count) if info is not None else []
    return job_retry(
        ft, cause="restart_elsewhere", otherwise=EXIT_RESTART_ELSEWHERE, exclude=doubted
    )


def job_retry(
    ft: FaultToleranceConfig,
    cause: str = "restarts_exhausted",
    otherwise: int = EXIT_RESTARTS_EXHAUSTED,
    exclude: list[str] | None = None,
) -> int:
    """Requeue the Slurm job when job retries remain (the launcher of SLURM_PROCID 0),
    kept away from the ``exclude`` hosts and from the job's nodes the node ledger now
    keeps out (``node_ledger_max_faults``); ``otherwise`` is the exit code when it is
    not requeued. ``ft.num_job_retries_on_failure``: the job's retries.

    The retries spent are the job's earlier failure requeues in the event log
    (:func:`~steadfast.slurm.failure_requeues`): a preemption or an operator's requeue
    does not spend one. Without a readable log, ``SLURM_RESTART_COUNT`` (every requeue)
    is used, which can only retry less, never more."""
    from ..slurm import failure_requeues, get_slurm_info, requeue_job

    retries = ft.num_job_retries_on_failure
    info = get_slurm_info()
    if info is None or retries <= 0:
        return otherwise
    spent = failure_requeues(info.job_id, info.restart_count)
    counted = "failure requeues in the event log"
    if spent is None:
        spent, counted = info.restart_count, "SLURM_RESTART_COUNT"
    if spent >= retries:
        logger.error(
            "job retries spent (%d %s, num_job_retries_on_failure=%d)", spent, counted, retries
        )
        return otherwise
    if os.environ.get("SLURM_PROCID", "0") != "0":
        return EXIT_REQUEUED  # the launcher of SLURM_PROCID 0 asks Slurm
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        requeued = requeue_job(
            info.job_id, cause=cause, exclude=exclude or [], kept_out=_ledger_kept_out(ft)
        )
        return EXIT_REQUEUED if requeued else otherwise
    except SignalException:  # Slurm's SIGTERM of the requeued job, held until the event
        return EXIT_REQUEUED


def _ledger_kept_out(ft: FaultToleranceConfig) -> list[str]:
    """The nodes the node ledger keeps out now (none without one, or when it cannot be
    read: said, and the requeue goes on)."""
    if not (ft.node_ledger and ft.node_ledger_max_faults):
        return []
    from ..ledger import LedgerError, excluded_nodes

    try:
        return excluded_nodes(ft.node_ledger, ft.node_ledger_max_faults, ft.node_ledger_window_days)
    except LedgerError as exc:
        logger.warning("requeue: cannot read the node ledger: %s", exc)
        return []
