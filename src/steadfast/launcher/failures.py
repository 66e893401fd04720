"""How a generation of workers ended, read from torch's failures: the rank(s) that
failed first (the others went down after them), the re-run state machine's exit codes,
a group the launcher stopped itself; and how the event log records it (``rank_failed``,
``rank_stopped``, the ``exits`` of ``workers_exited``)."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from .. import events
from ..events import Kind
from ..rerun.machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
)
from ..signals import signal_name
from .nodes.culprit import Claim, Verdict, exit_cause

__all__ = [
    "describe",
    "emit_agreed",
    "emit_failures",
    "failure_fields",
    "first_failures",
    "rerun_exit_code",
    "stopped_failures",
    "worker_exits",
]


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


def failure_fields(failure: Any) -> dict[str, Any]:
    """The worker fields of a ``rank_failed`` / ``rank_stopped`` for torch's failure."""
    code = int(failure.exitcode)
    return dict(
        exit_code=code,
        signal=signal_name(-code) if code < 0 else None,
        local_rank=int(failure.local_rank),
        worker_pid=int(failure.pid),
    )


def describe(culprit: Claim) -> str:
    """The culprit in words, for the causes of the stops that followed it."""
    if culprit.rank is None:
        return f"the loss of {culprit.node} ({culprit.cause})"
    verb = "hung" if culprit.what == "rank hung" else "failed"
    return f"rank {culprit.rank} on {culprit.node} {verb} ({culprit.cause})"


def emit_agreed(
    stops: Mapping[int, dict[str, Any]], verdict: Verdict, node: str, generation: int
) -> None:
    """Report a round's fault as agreed job-wide: ``rank_failed`` for the culprit where
    it is one of this node's ranks, ``rank_stopped`` pointing to it for every other rank
    of ``stops`` (this node's ranks that went down, by global rank, with their worker
    fields), then ``fault_culprit``: so each node's own log names the one culprit."""
    c = verdict.culprit
    own = c.rank if c.node == node and c.rank is not None and c.rank in stops else None
    after = describe(c)
    stopped = []
    for rank, fields in sorted(stops.items()):
        if rank == own:
            events.emit(
                Kind.RANK_FAILED,
                cause=c.cause,
                rank=int(rank),
                fault_id=verdict.fault_id,
                **fields,
            )
            continue
        stopped.append(int(rank))
        events.emit(
            Kind.RANK_STOPPED,
            cause=f"after {after}",
            rank=int(rank),
            first_failed_rank=c.rank,
            culprit_node=c.node,
            fault_id=verdict.fault_id,
            **fields,
        )
    events.emit(
        Kind.FAULT_CULPRIT,
        cause=c.cause,
        fault_id=verdict.fault_id,
        what=c.what,
        node=c.node,
        node_rank=c.node_rank,
        culprit_rank=c.rank,
        fault_time=round(c.time, 6),
        detected=round(c.detected, 6),
        claims=verdict.claims,
        stopped=stopped,
        generation=generation,
    )


def emit_failures(
    failures: Mapping[int, Any], exits: Mapping[int, float], loss: str | None = None
) -> None:
    """``rank_failed`` for the rank(s) of ``failures`` that failed first (see
    :func:`first_failures`; ``exits`` are the watcher's exit times), ``rank_stopped`` for
    the ranks that went down after them; with ``loss`` (a node lost, this node cut off),
    every rank went down for that: ``rank_stopped`` with ``loss`` as its cause."""
    first = first_failures(failures, exits) if loss is None else set()
    culprit = min(first) if first else None
    for rank, failure in sorted(failures.items()):
        fields = failure_fields(failure)
        if loss is not None:
            events.emit("rank_stopped", cause=loss, rank=int(rank), **fields)
        elif rank in first:
            cause = exit_cause(int(failure.exitcode))
            events.emit("rank_failed", cause=cause, rank=int(rank), **fields)
        else:
            events.emit(
                "rank_stopped",
                cause=f"after rank {culprit} failed",
                rank=int(rank),
                first_failed_rank=culprit,
                **fields,
            )


def worker_exits(
    worker_group: WorkerGroup,
    pids: Mapping[int, int],
    failures: Mapping[int, Any],
    exits_at: Mapping[int, float],
    stopped_at: float | None = None,
) -> list[dict[str, Any]]:
    """The ``exits`` of a ``workers_exited`` event: each worker's rank, pid (``pids`` by
    local rank), exit code and signal (from ``failures``: none is exit 0) and exit time
    (wall clock: ``exits_at`` by local rank, else ``stopped_at`` for a group the
    launcher stopped, else None)."""
    by_local = {int(f.local_rank): f for f in failures.values()}
    exits: list[dict[str, Any]] = []
    for w in sorted(worker_group.workers, key=lambda w: int(w.local_rank)):
        local = int(w.local_rank)
        failure = by_local.get(local)
        code = int(failure.exitcode) if failure is not None else 0
        exits.append(
            {
                "rank": int(w.global_rank),
                "local_rank": local,
                "pid": pids.get(local),
                "exit_code": code,
                "signal": signal_name(-code) if code < 0 else None,
                "time": round(exits_at.get(local, stopped_at or 0), 6) or None,
            }
        )
    return exits
