"""How a generation of workers ended, read from torch's failures: the rank(s) that
failed first (the others went down after them), the re-run state machine's exit codes,
and a group the launcher stopped itself."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ..rerun.machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
)

__all__ = ["first_failures", "rerun_exit_code", "stopped_failures"]


def first_failures(failures: Mapping[int, Any], exits: Mapping[int, float]) -> set[int]:
    """The global ranks of ``failures`` (torch's ``ProcessFailure`` by global rank) that
    failed first: the earliest exit in ``exits`` (local rank -> monotonic time), else the
    earliest of torch's timestamps (1 s resolution).

    Exits the watcher saw in one wake-up share one time: among such a tie, a rank killed
    by a signal (SIGKILL, SIGSEGV, SIGABRT: the fault itself) is taken over one that
    exited with a code (which is how a rank ends when a collective lost its peer); a tie
    that this cannot break counts every tied rank as failed."""
    timed = {r: exits[int(f.local_rank)] for r, f in failures.items() if int(f.local_rank) in exits}
    if timed:
        earliest = min(timed.values())
        tied = {r for r, t in timed.items() if t == earliest}
    elif failures:
        stamp = min(int(f.timestamp) for f in failures.values())
        tied = {r for r, f in failures.items() if int(f.timestamp) == stamp}
    else:
        return set()
    killed = {r for r in tied if 0 > int(failures[r].exitcode) != -signal.SIGTERM}
    return killed if killed and killed != tied else tied


def rerun_exit_code(exit_codes: set[int]) -> int | None:
    """17 if any worker failed result validation, else 16 if any asked to resume on
    other hardware, else None (an ordinary failure)."""
    for code in (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE):
        if code in exit_codes:
            return code
    return None


def stopped_failures(worker_group: WorkerGroup) -> dict[int, ProcessFailure]:
    """Every worker of the group as stopped by the launcher (SIGTERM), by global rank."""
    return {
        int(w.global_rank): ProcessFailure(
            local_rank=int(w.local_rank),
            pid=int(w.id or 0),
            exitcode=-int(signal.SIGTERM),
            error_file="",
        )
        for w in worker_group.workers
    }
