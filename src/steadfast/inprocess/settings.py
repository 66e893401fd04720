"""What one call of a wrapped function reads of its :class:`~.wrapper.Wrapper`: the
hooks and the timeouts, as a protocol. The call (:mod:`.call_wrapper`) takes its Wrapper
by this shape, so the two modules do not import each other: the Wrapper makes calls,
the call only reads settings."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from .hooks import Abort, Completion, Finalize, HealthCheck, Initialize, Terminate
from .rank_assignment import RankAssignment
from .store import StoreMixin

__all__ = ["CallSettings"]


class CallSettings(Protocol):
    """The Wrapper's settings a call reads (the Wrapper's constructor validates them)."""

    store_factory: Callable[..., StoreMixin]
    store_kwargs: dict[str, Any]
    initialize: Initialize | None
    abort: Abort | None
    finalize: Finalize | None
    health_check: HealthCheck | None
    rank_assignment: RankAssignment
    rank_filter: RankAssignment
    progress_watchdog_interval: timedelta
    barrier_timeout: timedelta
    monitor_process_logfile: str | None
    completion: Completion | None
    terminate: Terminate | None
    #: every timeout and interval, in seconds, by its parameter's name
    seconds: dict[str, float]
