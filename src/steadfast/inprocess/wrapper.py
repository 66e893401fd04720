"""``Wrapper``: NVRx's in-process restart decorator, its parameters and their checks.

Usage (seed 004)::

    @steadfast.inprocess.Wrapper(soft_timeout=timedelta(seconds=30), ...)
    def train(cfg, call_wrapper: Optional[CallWrapper] = None):
        dist.init_process_group("nccl", store=call_wrapper.store, ...)  # RANK, WORLD_SIZE
        ...                                                            # set per iteration

Each call of the decorated function runs under a new
:class:`~steadfast.inprocess.call_wrapper.CallWrapper`, which restarts the function on
every healthy rank inside the same processes (see :mod:`steadfast.inprocess.call_wrapper`).
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from ..config import ConfigError
from .call_wrapper import CallWrapper, MonitorProcess
from .hooks import (
    Abort,
    AbortTorchDistributed,
    Completion,
    Finalize,
    HealthCheck,
    Initialize,
    Terminate,
)
from .rank_assignment import ActivateAllRanks, RankAssignment, RankFilter, ShiftRanks
from .store import StoreMixin, TCPStore

__all__ = ["CallWrapper", "MonitorProcess", "Wrapper"]

F = TypeVar("F", bound=Callable[..., Any])


def _td(name: str, value: Any) -> float:
    if not isinstance(value, timedelta):
        raise ConfigError(f"Wrapper: {name} must be a datetime.timedelta, got {value!r}")
    seconds = value.total_seconds()
    if seconds <= 0:
        raise ConfigError(f"Wrapper: {name} must be positive, got {seconds:g}s")
    return seconds


def _hook(name: str, value: Any, cls: type) -> None:
    if value is not None and not callable(value):
        raise ConfigError(f"Wrapper: {name} must be a {cls.__name__} (callable), got {value!r}")


class Wrapper:
    """Adds in-process restart to a distributed PyTorch training function (a decorator).

    Upon a fault the wrapped function is restarted on all healthy ranks, inside the same
    operating-system processes; terminated, missing or unhealthy ranks are left out and
    the others get new ranks (``rank_assignment``). The call returns the function's value
    once every active rank has returned; inactive (spare) ranks return ``None``.

    Timeouts (``datetime.timedelta``): ``soft_timeout`` (no progress: the iteration is
    interrupted and the rank restarts if healthy) < ``hard_timeout`` (the rank is
    terminated: SIGTERM, then SIGKILL after ``termination_grace_time``) <
    ``barrier_timeout`` (ranks meeting between iterations). ``heartbeat_timeout``: a rank
    whose monitor process stops beating is declared lost. ``completion_timeout``: how
    long ranks that returned wait for the others. ``last_call_wait``: how long a rank
    that ends the run with an error waits for concurrent terminal failures of other
    ranks, so that its error names them all. Intervals: the monitor thread re-raises an
    unacknowledged interruption every ``monitor_thread_interval``; the monitor process
    checks every ``monitor_process_interval``; the progress watchdog ticks every
    ``progress_watchdog_interval``.

    Requires ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
    ``steadfast launch``, torchrun and the usual srun wrappers); the store listens on
    ``MASTER_PORT + 1`` unless ``store_kwargs`` give ``host_name``/``port``.
    ``torch.distributed`` must not be initialised when the function is called: the
    function initialises it itself, every iteration, from ``RANK``/``WORLD_SIZE``
    (``call_wrapper.store`` is a fresh store prefix for it each iteration).
    """

    def __init__(
        self,
        *,
        store_factory: Callable[..., StoreMixin] = TCPStore,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Initialize | None = None,
        abort: Abort | None = AbortTorchDistributed(),  # noqa: B008 - stateless, as the seed
        finalize: Finalize | None = None,
        health_check: HealthCheck | None = None,
        rank_assignment: RankAssignment = ShiftRanks(),  # noqa: B008 - stateless
        rank_filter: RankFilter | None = None,
        monitor_thread_interval: timedelta = timedelta(seconds=1),
        monitor_process_interval: timedelta = timedelta(seconds=1),
        progress_watchdog_interval: timedelta = timedelta(seconds=1),
        soft_timeout: timedelta = timedelta(seconds=60),
        hard_timeout: timedelta = timedelta(seconds=90),
        heartbeat_timeout: timedelta = timedelta(seconds=30),
        barrier_timeout: timedelta = timedelta(seconds=120),
        completion_timeout: timedelta = timedelta(seconds=120),
        last_call_wait: timedelta = timedelta(seconds=1),
        termination_grace_time: timedelta = timedelta(seconds=5),
        monitor_process_logfile: str | None = None,
        enabled: bool = True,
        completion: Completion | None = None,
        terminate: Terminate | None = None,
        heartbeat_interval: timedelta = timedelta(seconds=1),
    ) -> None:
        if not callable(store_factory):
            raise ConfigError(f"Wrapper: store_factory must be callable, got {store_factory!r}")
        if store_kwargs is not None and not isinstance(store_kwargs, dict):
            raise ConfigError(f"Wrapper: store_kwargs must be a dict, got {store_kwargs!r}")
        for name, value, cls in (
            ("initialize", initialize, Initialize),
            ("abort", abort, Abort),
            ("finalize", finalize, Finalize),
            ("health_check", health_check, HealthCheck),
            ("rank_filter", rank_filter, RankFilter),
            ("completion", completion, Completion),
            ("terminate", terminate, Terminate),
        ):
            _hook(name, value, cls)
        if not callable(rank_assignment):
            raise ConfigError(
                f"Wrapper: rank_assignment must be a RankAssignment, got {rank_assignment!r}"
            )
        t = {
            name: _td(name, value)
            for name, value in (
                ("monitor_thread_interval", monitor_thread_interval),
                ("monitor_process_interval", monitor_process_interval),
                ("heartbeat_interval", heartbeat_interval),
                ("progress_watchdog_interval", progress_watchdog_interval),
                ("soft_timeout", soft_timeout),
                ("hard_timeout", hard_timeout),
                ("heartbeat_timeout", heartbeat_timeout),
                ("barrier_timeout", barrier_timeout),
                ("completion_timeout", completion_timeout),
                ("last_call_wait", last_call_wait),
                ("termination_grace_time", termination_grace_time),
            )
        }
        if not t["soft_timeout"] < t["hard_timeout"] < t["barrier_timeout"]:
            raise ConfigError(
                "Wrapper: need soft_timeout < hard_timeout < barrier_timeout, got "
                f"{t['soft_timeout']:g}s, {t['hard_timeout']:g}s, {t['barrier_timeout']:g}s"
            )
        for interval in (
            "monitor_thread_interval",
            "monitor_process_interval",
            "progress_watchdog_interval",
        ):
            if not t[interval] < t["soft_timeout"]:
                raise ConfigError(
                    f"Wrapper: {interval} ({t[interval]:g}s) must be shorter than "
                    f"soft_timeout ({t['soft_timeout']:g}s)"
                )
        for interval in ("monitor_process_interval", "heartbeat_interval"):
            if not t[interval] < t["heartbeat_timeout"]:
                raise ConfigError(
                    f"Wrapper: {interval} ({t[interval]:g}s) must be shorter than "
                    f"heartbeat_timeout ({t['heartbeat_timeout']:g}s)"
                )
        if monitor_process_logfile is not None and not os.path.isabs(monitor_process_logfile):
            raise ConfigError(
                "Wrapper: monitor_process_logfile must be an absolute path, got "
                f"{monitor_process_logfile!r}"
            )
        self.store_factory = store_factory
        self.store_kwargs = dict(store_kwargs or {})
        self.initialize = initialize
        self.abort = abort
        self.finalize = finalize
        self.health_check = health_check
        self.rank_assignment = rank_assignment
        self.rank_filter: RankAssignment = rank_filter or ActivateAllRanks()
        self.monitor_thread_interval = monitor_thread_interval
        self.monitor_process_interval = monitor_process_interval
        self.progress_watchdog_interval = progress_watchdog_interval
        self.soft_timeout = soft_timeout
        self.hard_timeout = hard_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.barrier_timeout = barrier_timeout
        self.completion_timeout = completion_timeout
        self.last_call_wait = last_call_wait
        self.termination_grace_time = termination_grace_time
        self.monitor_process_logfile = monitor_process_logfile
        self.completion = completion
        self.terminate = terminate
        self.heartbeat_interval = heartbeat_interval
        self.enabled = enabled
        self.seconds = t

    def __call__(self, fn: F) -> F:
        """Decorate ``fn``: each call of the result runs ``fn`` under a new CallWrapper."""
        if not self.enabled:
            return fn
        params = _call_wrapper_params(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            call = CallWrapper(self)
            return call(fn, params, args, kwargs)

        return typing.cast(F, wrapped)


def _call_wrapper_params(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters annotated ``CallWrapper`` or ``Optional[CallWrapper]``."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    names = []
    for name, param in inspect.signature(fn).parameters.items():
        hint = hints.get(name, param.annotation)
        if (
            hint is CallWrapper
            or CallWrapper in typing.get_args(hint)
            or (isinstance(hint, str) and "CallWrapper" in hint)
        ):
            names.append(name)
    return names
