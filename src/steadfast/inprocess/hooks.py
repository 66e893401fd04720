"""The Wrapper's rank-local hooks: abort, initialize, finalize and health checks.

Each hook is a small class with ``__call__(state) -> state``: it gets this iteration's
state (frozen) and returns it, as NVRx's hooks do, so hooks of any kind compose with
:class:`~steadfast.inprocess.Compose` (``Compose(a, b)(s) == a(b(s))``), or with ``a | b``
(``a`` then ``b``). Where they run:

- ``initialize(state)``: at the start of every iteration, before the function. Raising
  :class:`RestartAbort` (e.g. from :class:`RetryController`) ends the run on every rank.
- ``abort(state)``: as soon as an iteration is interrupted, from the monitor thread while
  the main thread may still be blocked in a collective, and again from the main thread
  before the restart. Must be idempotent and thread-safe.
- ``finalize(state)``: after the abort, before the health check.
- ``health_check(state)``: last before the restart barrier; raising means "this rank is
  unhealthy": it leaves the job and the others restart without it.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

from ..dist import is_distributed
from . import transport
from .state import HealthCheckError, InterruptedIteration, RestartAbort, State

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "Completion",
    "CudaHealthCheck",
    "FaultCounter",
    "Finalize",
    "HealthCheck",
    "Initialize",
    "RetryController",
    "Terminate",
]

logger = logging.getLogger("steadfast.inprocess")


class _Hook:
    """``__call__(state) -> state``; ``a | b`` runs ``a`` then ``b``."""

    def __call__(self, state: State) -> State:
        raise NotImplementedError

    def __or__(self, other: _Hook) -> _Hook:
        from .compose import Compose

        chained: _Hook = Compose(other, self)  # type: ignore[assignment]  # right to left
        return chained


class Abort(_Hook):
    """Asynchronously stops what the main thread is doing (communicators, streams)."""


class Initialize(_Hook):
    """Runs at the start of every restart iteration."""


class Finalize(_Hook):
    """Rank-local clean-up after an interrupted iteration, before the health check."""


class Completion(_Hook):
    """Runs once on a rank after the call completed on every active rank (NVRx 0.4.1's
    ``completion``); an error in it is logged, not raised."""


class Terminate(_Hook):
    """Runs on a rank whose call ends with an error, before the error reaches the caller
    (NVRx 0.4.1's ``terminate``); an error in it is raised, chained to the first."""


class HealthCheck(_Hook):
    """Raises (any exception) when this rank must not take part in the next iteration."""


class AbortTorchDistributed(Abort):
    """Abort every torch.distributed process group of this process, then destroy them.

    Aborting NCCL communicators releases kernels blocked in a collective. gloo's
    ``abort()`` closes nothing (its connections close only when the group object is
    destroyed, and the user's code, DDP's reducer or a ``new_group`` handle, usually
    still holds it), so when any group runs on gloo, the connections accepted on this
    process's group listeners are shut down after the abort
    (:mod:`steadfast.inprocess.transport`): every collective blocked on them, on this
    rank and on its peers, fails at once instead of waiting out the group's timeout
    (after, not before: NCCL's own sockets are never cut under a live communicator).
    Since every healthy rank aborts on an interruption, and a killed rank's kernel
    closes its side, every pair of the job is closed. The destroy runs
    only on the main thread (the monitor thread aborts, the main thread destroys before
    the restart), so no group is torn down under a running collective.
    """

    def __call__(self, state: State) -> State:
        if not is_distributed():
            return state
        from .. import seam

        # what the gloo groups' connections are found by, before the abort forgets them
        keep, gloo = self._gloo_transport(seam)
        if threading.current_thread() is threading.main_thread():
            # Abort every group (NCCL ones inside one group start/end) and clear the
            # registry, so the next iteration can init_process_group again.
            try:
                seam.abort_all_process_groups()
            except Exception as exc:
                logger.debug("abort of the process groups failed: %s", exc)
        else:
            # Monitor thread: abort only (newest group first); the registry stays for
            # the main thread, which may still be inside a collective.
            for group in reversed(seam.process_groups()):
                try:
                    group.abort()
                except Exception as exc:
                    logger.debug("abort of %s failed: %s", group, exc)
        if gloo:  # after the abort: NCCL's own sockets are never cut under a live comm
            try:
                transport.close_collective_connections(keep)
            except Exception as exc:
                logger.debug("closing the process groups' connections failed: %s", exc)
        return state

    @staticmethod
    def _gloo_transport(seam: Any) -> tuple[set[int], bool]:
        """The stores' ports (their connections are kept) and whether any live group
        runs on gloo.

        Read from ``dist.get_backend_config`` (``gloo``, ``cpu:gloo,cuda:nccl``), not
        ``get_backend``: a group made without a backend, as NVRx's examples make it, runs
        torch's default ``cpu:gloo,cuda:nccl`` and its ``get_backend`` is ``undefined``.
        One group that cannot be read does not hide the others."""
        import torch.distributed as dist

        try:
            keep = transport.store_ports(seam.process_group_stores())
            groups = seam.process_groups()
        except Exception as exc:
            logger.debug("could not read the process groups: %s", exc)
            return set(), False
        gloo = False
        for group in groups:
            try:
                gloo = gloo or "gloo" in str(dist.get_backend_config(group))
            except Exception as exc:
                logger.debug("could not read a process group's backend: %s", exc)
        return keep, gloo


class RetryController(Initialize):
    """End the run with :class:`RestartAbort` once restarting is no longer worth it.

    ``max_iterations``: how many iterations may run in all (``None``: no limit), as in
    NVRx: iteration ``max_iterations`` is refused, so ``max_iterations=3`` runs the
    function at most three times (the first call and two restarts);
    ``min_world_size`` / ``min_active_world_size``: the fewest ranks / active ranks to
    carry on with. Every rank sees the same state, so every rank raises the same error at
    the same iteration.
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        if max_iterations is not None and max_iterations < 0:
            raise ValueError(f"max_iterations must be >= 0, got {max_iterations}")
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: State) -> State:
        reasons = []
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            reasons.append("retry limit reached")
        if state.world_size < self.min_world_size:
            reasons.append("world size fell below min_world_size")
        active = state.world_size if state.active_world_size is None else state.active_world_size
        if active < self.min_active_world_size:
            reasons.append("active world size fell below min_active_world_size")
        if reasons:
            raise RestartAbort(
                f"{'; '.join(reasons)}: iteration={state.iteration} "
                f"max_iterations={self.max_iterations} world_size={state.world_size} "
                f"min_world_size={self.min_world_size} "
                f"active_world_size={state.active_world_size} "
                f"min_active_world_size={self.min_active_world_size}"
            )
        return state


class FaultCounter(HealthCheck):
    """Declare this rank unhealthy after more than ``max_rank_faults`` faults of its own.

    A fault counts when this rank's function raised (not when it was merely interrupted
    by another rank). ``None`` never trips.
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        self.max_rank_faults = max_rank_faults
        self.faults = 0

    def __call__(self, state: State) -> State:
        exc = state.fn_exception
        if exc is not None and not isinstance(exc, InterruptedIteration):
            self.faults += 1
        if self.max_rank_faults is not None and self.faults > self.max_rank_faults:
            raise HealthCheckError(
                f"rank {state.initial_rank} faulted {self.faults} times "
                f"(max_rank_faults={self.max_rank_faults})"
            )
        return state


class CudaHealthCheck(HealthCheck):
    """Synchronise this rank's CUDA device within ``timeout``; a device that does not
    answer (or raises, e.g. after an XID error) makes the rank unhealthy. A no-op where
    CUDA is not initialised."""

    def __init__(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        self.timeout = timeout

    def __call__(self, state: State) -> State:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return state
        error: list[BaseException] = []

        def sync() -> None:
            try:
                torch.cuda.synchronize()
            except BaseException as exc:
                error.append(exc)

        worker = threading.Thread(target=sync, name="steadfast-cuda-health", daemon=True)
        worker.start()
        worker.join(self.timeout.total_seconds())
        if worker.is_alive():
            raise HealthCheckError(
                f"CUDA device did not synchronise within {self.timeout.total_seconds():g}s"
            )
        if error:
            raise HealthCheckError(f"CUDA device unhealthy: {error[0]}") from error[0]
        return state
