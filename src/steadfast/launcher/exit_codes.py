"""The launcher's exit codes (the table is in :mod:`steadfast.launcher`) and the reason
each gives in its ``launcher_end`` event."""

from __future__ import annotations

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_JOB_END_HANG",
    "EXIT_LAUNCHER_ERROR",
    "EXIT_NODE_LOST",
    "EXIT_NODE_UNHEALTHY",
    "EXIT_NO_PROGRESS",
    "EXIT_OK",
    "EXIT_REASONS",
    "EXIT_REQUEUED",
    "EXIT_RESTARTS_EXHAUSTED",
    "EXIT_RESTART_ELSEWHERE",
    "EXIT_RESULT_VALIDATION_FAILED",
    "EXIT_SILENT_CORRUPTION",
]

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
EXIT_NO_PROGRESS = 76
EXIT_RESTARTS_EXHAUSTED = 77
EXIT_REQUEUED = 78
EXIT_RESTART_ELSEWHERE = 16  # = rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_RESULT_VALIDATION_FAILED = 17  # = rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
EXIT_NODE_UNHEALTHY = 74
EXIT_NODE_LOST = 75
EXIT_JOB_END_HANG = 79
EXIT_SILENT_CORRUPTION = 80
EXIT_LAUNCHER_ERROR = 1  # the launcher itself raised (a bug, or torch's own error)
EXIT_REASONS = {
    EXIT_OK: "the workers finished successfully",
    EXIT_BAD_CONFIG: "bad flags or FT config",
    EXIT_NO_PROGRESS: "no progress: consecutive restarts completed no step",
    EXIT_RESTARTS_EXHAUSTED: "the workers failed and the in-job restarts are spent",
    EXIT_REQUEUED: "the workers failed; the Slurm job was requeued",
    EXIT_RESTART_ELSEWHERE: "restart elsewhere: a worker exited 16",
    EXIT_RESULT_VALIDATION_FAILED: "a worker exited 17: failed result validation",
    EXIT_NODE_UNHEALTHY: "this node is unhealthy and left the job",
    EXIT_NODE_LOST: "a node was lost and no round formed again",
    EXIT_JOB_END_HANG: "this node's workers outlived the job's end by job_end_timeout",
    EXIT_SILENT_CORRUPTION: "the replicas of a DDP model disagreed (sdc_verdict)",
}
