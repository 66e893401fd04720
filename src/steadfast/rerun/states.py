"""The re-run state machine's states and their transitions, as torch's ``WorkerState``
documents its own; :func:`check` refuses a transition the table does not draw.

- ``NOT_RUNNING_YET``: between steps. The next step begins here.
- ``INITIAL_RUN``: the step's first forward-backward; its results are validated.
- ``RERUNNING_IN_PLACE``: the same step again on the same hardware (RNG states and
  micro-batches restored), its results compared with the first run's.
- ``WILL_RERUN_FROM_CHECKPOINT``: the result reproduced in place; a checkpoint is
  saved and the job exits 16 to re-run the step on other hardware. A checkpoint holds
  the machine in this state (or between steps), never in another.
- ``RERUNNING_FROM_CHECKPOINT``: after the restart, on other hardware, the step runs a
  third time; its results decide between a persistent fault and a correct result.

Transitions (each at a call of ``should_run_forward_backward``)::

    NOT_RUNNING_YET            -> INITIAL_RUN                 a step begins
    INITIAL_RUN                -> NOT_RUNNING_YET             accepted (or mode disabled)
    INITIAL_RUN                -> RERUNNING_IN_PLACE          a rank rejected a result
                                                              (or report_stats)
    RERUNNING_IN_PLACE         -> NOT_RUNNING_YET             not reproduced: transient
                                                              (or report_stats' figures kept)
    RERUNNING_IN_PLACE         -> WILL_RERUN_FROM_CHECKPOINT  reproduced: checkpoint, exit 16
    WILL_RERUN_FROM_CHECKPOINT -> RERUNNING_FROM_CHECKPOINT   restored on other hardware
    WILL_RERUN_FROM_CHECKPOINT -> WILL_RERUN_FROM_CHECKPOINT  restored on the same: exit 16
    RERUNNING_FROM_CHECKPOINT  -> NOT_RUNNING_YET             persistent, or correct
"""

from __future__ import annotations

from enum import Enum

__all__ = ["TRANSITIONS", "RerunState", "check"]


class RerunState(Enum):
    """Where the machine is in the attribution of a step (see the module docstring)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4


_S = RerunState
#: every transition the module docstring draws
TRANSITIONS: frozenset[tuple[RerunState, RerunState]] = frozenset(
    {
        (_S.NOT_RUNNING_YET, _S.INITIAL_RUN),
        (_S.INITIAL_RUN, _S.NOT_RUNNING_YET),
        (_S.INITIAL_RUN, _S.RERUNNING_IN_PLACE),
        (_S.RERUNNING_IN_PLACE, _S.NOT_RUNNING_YET),
        (_S.RERUNNING_IN_PLACE, _S.WILL_RERUN_FROM_CHECKPOINT),
        (_S.WILL_RERUN_FROM_CHECKPOINT, _S.RERUNNING_FROM_CHECKPOINT),
        (_S.WILL_RERUN_FROM_CHECKPOINT, _S.WILL_RERUN_FROM_CHECKPOINT),
        (_S.RERUNNING_FROM_CHECKPOINT, _S.NOT_RUNNING_YET),
    }
)


def check(old: RerunState, new: RerunState) -> RerunState:
    """``new``, where the table draws ``old -> new``; else an ``AssertionError`` (a bug of
    the machine, never the user's)."""
    if (old, new) not in TRANSITIONS:
        raise AssertionError(f"re-run state machine: no transition {old.name} -> {new.name}")
    return new
