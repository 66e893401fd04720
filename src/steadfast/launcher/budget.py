"""The progress guard: a job whose worker generations keep failing without a step stops
(exit 76) instead of restarting for ever, and its count goes on across the job's Slurm
requeues, so that a requeued job continues its budget instead of getting a new one
(kubeflow/trainer#3779; Megatron-LM#5281 crash-looped 44 times).

What carries over and what does not:

- **the no-progress count** (``max_no_progress_restarts``): consecutive failed
  generations that completed no step, the job's whole life long. Each launcher writes
  its count in its ``launcher_end`` event (``no_progress``); a requeued incarnation's
  launchers start from the highest count of the incarnation before (the run's event
  log, as the job retries are counted: :func:`steadfast.slurm.failure_requeues`). A
  generation that made a step sets it back to 0; a generation stopped by a signal (a
  preemption) neither adds to it nor clears it;
- **the job retries** (``num_job_retries_on_failure``): the job's failure requeues,
  from the event log (a preemption's requeue spends none);
- **``--max-restarts``** keeps torchrun's meaning: in-job restarts per incarnation, so
  that a job requeued onto good nodes does not start with none left.
"""

from __future__ import annotations

import logging
import os

from .. import events
from .errors import NoProgressError

__all__ = ["ProgressGuard", "carried_no_progress"]

logger = logging.getLogger(__name__)


class ProgressGuard:
    """The count of consecutive failed generations with no step (``streak``), from
    ``carried`` (the job's earlier incarnations') on; over ``limit`` (0: never) the job
    stops."""

    def __init__(self, limit: int, carried: int = 0) -> None:
        self.limit = limit
        self.carried = carried
        self.streak = carried
        # steps are only seen from ranks that report them: once any generation did
        # (an earlier incarnation's count says one did), one with no step counts
        self._steps_visible = carried > 0

    def generation_failed(self, reporting: bool, steps: int) -> None:
        """A generation failed; ``reporting``: its ranks report steps; ``steps``: how
        many it made. Raises :class:`NoProgressError` once the count is over the limit."""
        self._steps_visible = self._steps_visible or reporting
        self.streak = self.streak + 1 if self._steps_visible and steps == 0 else 0
        if self.limit and self.streak > self.limit:
            earlier = (
                f", {self.carried} of them in the job's earlier incarnations (requeues)"
                if self.carried
                else ""
            )
            raise NoProgressError(
                f"{self.streak} consecutive worker generations completed no step"
                f"{earlier} (max_no_progress_restarts={self.limit})"
            )


def carried_no_progress(job_id: str | None, restart_count: int) -> int:
    """The no-progress count the job's previous incarnation ended with: the highest
    ``no_progress`` of its launchers' ``launcher_end`` events in the run's event log
    (0: the first incarnation, not a Slurm job, or no log to tell)."""
    path = events.current_path()
    if not job_id or restart_count <= 0 or path is None or not os.path.exists(path):
        return 0
    ends: dict[int, int] = {}
    try:
        for ev in events.read_events(path):
            incarnation = int(ev.get("slurm_restart") or 0)
            if (
                ev.kind == events.Kind.LAUNCHER_END
                and str(ev.get("slurm_job_id")) == job_id
                and incarnation < restart_count
                and isinstance(ev.get("no_progress"), int)
            ):
                ends[incarnation] = max(ends.get(incarnation, 0), int(ev.get("no_progress")))
    except (OSError, events.EventLogError) as exc:
        logger.warning("cannot read the job's no-progress count from %s: %s", path, exc)
        return 0
    if not ends:
        return 0
    latest = max(ends)
    if ends[latest]:
        logger.warning(
            "job %s's incarnation %d ended %d consecutive generations without a step: "
            "this one goes on from that count",
            job_id,
            latest,
            ends[latest],
        )
    return ends[latest]
