"""The errors that end a launcher's run, each answered by the launcher with its own exit
code (``steadfast.launcher``): no progress (76), a re-run state machine code (17; 16, or a
requeue away from the node), a lost node (75, or a requeue away from it), an unhealthy
node (74), workers that outlived the job's end (79), silent data corruption (80)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "JobEndHangError",
    "NoProgressError",
    "NodeLostError",
    "NodeUnhealthyError",
    "RerunExit",
    "SilentCorruptionError",
]


class NoProgressError(RuntimeError):
    """Consecutive restarts made no step progress: restarting again would loop."""


class RerunExit(RuntimeError):
    """A worker exited with a re-run state machine code: restarting it here is useless
    (16: the result must be re-checked on other hardware) or wrong (17: the result
    failed validation). ``code`` is that exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"a worker exited {code}")
        self.code = code


class NodeLostError(RuntimeError):
    """A node of the job was lost (or this node was cut off from the job) and no round
    could form again within ``node_lost_timeout``. ``hosts``: the lost nodes' host
    names, which a requeue keeps the job away from."""

    def __init__(self, message: str, hosts: list[str] | None = None) -> None:
        super().__init__(message)
        self.hosts = list(hosts or [])


class NodeUnhealthyError(RuntimeError):
    """This node failed its health check before a rendezvous: it leaves the job."""

    def __init__(self, check: str, reason: str) -> None:
        super().__init__(f"node health check {check!r} failed: {reason}")
        self.check, self.reason = check, reason


class JobEndHangError(RuntimeError):
    """Another node of the round finished its workers, and this node's were still
    running ``job_end_timeout`` later: taken for hung at the job's end and stopped.
    Restarting would find no round (the others are gone), so the launcher ends.
    ``ranks``: the global ranks that were still running."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class SilentCorruptionError(RuntimeError):
    """Replicas that must agree disagreed (:class:`steadfast.sdc.Verdict`): the workers
    were stopped before more of the corrupted state was saved; a restart here would go
    on from it."""

    def __init__(self, verdict: Any, why: str = "") -> None:
        super().__init__(verdict.describe() + (f": {why}" if why else ""))
        self.verdict = verdict
