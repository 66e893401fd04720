"""The state one restart iteration runs with, and the exceptions of in-process restart.

Every rank computes the same :class:`State` for an iteration from the same inputs (the
iteration number and the set of terminated ranks frozen at the barrier), so rank
assignment needs no extra communication.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field

__all__ = [
    "BarrierTimeout",
    "FrozenState",
    "Mode",
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


class Mode(enum.Enum):
    """What a rank does in an iteration (NVRx's ``inprocess.state.Mode``)."""

    INITIALIZED = enum.auto()  #: state made, ranks not yet assigned
    ACTIVE = enum.auto()  #: calls the wrapped function
    INACTIVE = enum.auto()  #: waits as a spare
    TERMINATED = enum.auto()  #: left the job


@dataclass(frozen=True)
class State:
    """Where this rank stands in one restart iteration (frozen: hooks receive it and
    return it, or a changed copy, never change it in place; assigning to a field raises
    ``dataclasses.FrozenInstanceError``, as NVRx's ``FrozenState`` does).

    NVRx's fields, in NVRx's order (``State(rank, world_size)`` works as there):
    ``rank``/``world_size`` after rank assignment (-1: no rank); ``active_rank``/
    ``active_world_size`` for the ranks that call the function (``active_rank`` None for
    a spare); ``initial_rank``/``initial_world_size`` when the Wrapper started (this
    process's identity for the whole call; default: ``rank``/``world_size``);
    ``iteration``; ``mode``; ``fn_exception``. steadfast's own: ``assignment[r]``, the
    current rank of initial rank ``r`` (-1 once terminated), the same on every rank, and
    ``terminated``, the initial ranks terminated since the last assignment.
    """

    rank: int = -1
    world_size: int = 0
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int = -1
    initial_world_size: int = 0
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None
    assignment: tuple[int, ...] = ()
    terminated: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.initial_rank is None or self.initial_rank < 0:
            object.__setattr__(self, "initial_rank", self.rank)
        if not self.initial_world_size:
            object.__setattr__(self, "initial_world_size", self.world_size)

    @classmethod
    def first(cls, initial_rank: int, initial_world_size: int) -> State:
        """The state of iteration 0: every rank keeps its rank and is active."""
        return cls(
            rank=initial_rank,
            world_size=initial_world_size,
            active_rank=initial_rank,
            active_world_size=initial_world_size,
            initial_rank=initial_rank,
            initial_world_size=initial_world_size,
            mode=Mode.ACTIVE,
            assignment=tuple(range(initial_world_size)),
        )

    @classmethod
    def from_env(cls) -> State:
        """From ``RANK`` and ``WORLD_SIZE`` (0 and 1 when unset), as NVRx's."""
        return cls.first(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def active(self) -> bool:
        """Whether this rank calls the wrapped function in this iteration."""
        return self.active_rank is not None

    def replace(self, **changes: object) -> State:
        """A copy with ``changes`` applied (hooks return new states, never mutate)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def freeze(self) -> State:
        """This state (it is frozen already; NVRx's ``State.freeze()``)."""
        return self

    def set_distributed_vars(self) -> None:
        """``RANK`` and ``WORLD_SIZE`` for the wrapped function: the active ones."""
        os.environ["RANK"] = str(self.active_rank)
        os.environ["WORLD_SIZE"] = str(self.active_world_size)


#: NVRx's name of the state its hooks receive; steadfast's :class:`State` is frozen.
FrozenState = State
