"""Nested restarter hooks: the in-process restarter's state as log lines (NVRx 0.4.1's
``inprocess.nested_restarter``).

When in-process restart runs inside a launcher's in-job restart, tools that follow the
job read one log line per state change of the in-process restarter::

    [NestedRestarter] name=[InProcess] state=<state>[ stage=<stage>]

written by one rank (``special_rank``). Pass the hooks to the Wrapper where NVRx's users
pass them: ``initialize=NestedRestarterHandlingCompleted()`` (``state=initialize`` on
the first call, then ``state=handling stage=completed`` after every restart),
``abort=Compose(NestedRestarterHandlingStarting(), AbortTorchDistributed())``
(``state=handling stage=starting``), ``completion=NestedRestarterFinalized()``,
``terminate=NestedRestarterAborted()``. Each returns the state it got, so they compose
with other hooks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .hooks import Abort, Completion, Initialize, Terminate
from .state import State

__all__ = [
    "NestedRestarterAborted",
    "NestedRestarterCallback",
    "NestedRestarterFinalized",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
    "NestedRestarterLogger",
]


class NestedRestarterLogger:
    """Where the nested restarter's lines go: ``restarter_logger``
    (``steadfast.inprocess.restarter``, INFO), each line prefixed with the rank that
    wrote it once :meth:`set_connected_rank` named it."""

    def __init__(self, name: str = "InprocessRestarter") -> None:
        self.name = name
        self.restarter_logger = logging.getLogger("steadfast.inprocess.restarter")
        self.connected_rank: int | None = None

    def set_connected_rank(self, rank: int | None) -> None:
        """The rank whose lines these are."""
        self.connected_rank = rank

    def log_for_restarter(self, message: str) -> None:
        """One line for the tools that follow the restarter."""
        prefix = "" if self.connected_rank is None else f"[rank {self.connected_rank}] "
        self.restarter_logger.info("%s%s", prefix, message)


_SHARED_LOGGER = NestedRestarterLogger()


@dataclass
class NestedRestarterCallback:
    """Logs ``state=<restarter_state>`` (and ``stage=<restarter_stage>``) on
    ``special_rank``; returns the state it got."""

    restarter_state: str
    restarter_stage: str | None = None
    logger: NestedRestarterLogger = field(default=_SHARED_LOGGER)
    special_rank: int = 0

    def __call__(self, state: State) -> State:
        if state.initial_rank == self.special_rank:
            self.logger.set_connected_rank(state.initial_rank)
            message = f"[NestedRestarter] name=[InProcess] state={self.restarter_state}"
            if self.restarter_stage is not None:
                message += f" stage={self.restarter_stage}"
            self.logger.log_for_restarter(message)
        return state


class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """An ``initialize`` hook: ``state=initialize`` on the first iteration, then
    ``state=handling stage=completed`` at the start of every restarted one."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "initialize", None, _SHARED_LOGGER, special_rank)
        self._called = False

    def __call__(self, state: State) -> State:
        state = NestedRestarterCallback.__call__(self, state)
        if not self._called:
            self._called = True
            self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """An ``abort`` hook: ``state=handling stage=starting`` when a restart begins."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "handling", "starting", _SHARED_LOGGER, special_rank)

    def __call__(self, state: State) -> State:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterFinalized(Completion, NestedRestarterCallback):
    """A ``completion`` hook: ``state=finalized`` when the call completed."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "finalized", None, _SHARED_LOGGER, special_rank)

    def __call__(self, state: State) -> State:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterAborted(Terminate, NestedRestarterCallback):
    """A ``terminate`` hook: ``state=aborted`` when this rank's call ends with an error."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "aborted", None, _SHARED_LOGGER, special_rank)

    def __call__(self, state: State) -> State:
        return NestedRestarterCallback.__call__(self, state)
