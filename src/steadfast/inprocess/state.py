"""The state one restart iteration runs with, and the exceptions of in-process restart.

Every rank computes the same :class:`State` for an iteration from the same inputs (the
iteration number and the set of terminated ranks frozen at the barrier), so rank
assignment needs no extra communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = [
    "BarrierTimeout",
    "HealthCheckError",
    "InterruptedIteration",
    "RestartAbort",
    "RestartError",
    "State",
]


class RestartError(RuntimeError):
    """Base class of the errors the in-process restart machinery raises."""


class RestartAbort(RestartError):
    """Stop restarting: raised by a hook (e.g. :class:`RetryController`) to end the run.

    Raised on every rank that reaches the same decision; the Wrapper re-raises it to the
    caller with the causes of the last interruption in the message.
    """


class HealthCheckError(RestartError):
    """This rank is unhealthy: it leaves the job and the others restart without it."""


class BarrierTimeout(RestartError):
    """Ranks did not meet at a restart barrier within ``barrier_timeout``."""


class InterruptedIteration(BaseException):
    """Raised asynchronously in the main thread when another rank interrupts the iteration.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that a training loop's
    ``except Exception`` does not swallow it. The Wrapper catches it; user code never
    needs to.
    """


@dataclass
class State:
    """Where this rank stands in one restart iteration.

    ``initial_rank`` is the rank this process had when the Wrapper started (its identity
    for the whole call); ``rank``/``world_size`` are the ranks after rank assignment;
    ``active_rank`` is ``None`` for a rank that the rank filter keeps out of this
    iteration, and ``active_world_size`` counts the ranks that call the function.
    ``assignment[r]`` is the current rank of initial rank ``r`` (-1 once terminated), the
    same on every rank.
    """

    initial_rank: int
    initial_world_size: int
    iteration: int = 0
    rank: int = -1
    world_size: int = 0
    active_rank: int | None = None
    active_world_size: int = 0
    assignment: tuple[int, ...] = ()
    terminated: frozenset[int] = field(default_factory=frozenset)
    fn_exception: BaseException | None = None

    @classmethod
    def first(cls, initial_rank: int, initial_world_size: int) -> State:
        """The state of iteration 0: every rank keeps its rank and is active."""
        return cls(
            initial_rank=initial_rank,
            initial_world_size=initial_world_size,
            rank=initial_rank,
            world_size=initial_world_size,
            active_rank=initial_rank,
            active_world_size=initial_world_size,
            assignment=tuple(range(initial_world_size)),
        )

    @property
    def active(self) -> bool:
        """Whether this rank calls the wrapped function in this iteration."""
        return self.active_rank is not None

    def replace(self, **changes: object) -> State:
        """A copy with ``changes`` applied (hooks return new states, never mutate)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
