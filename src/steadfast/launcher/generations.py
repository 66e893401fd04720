"""This node's generations as the event log tells them: ``workers_started`` (with the
launcher's side of the start: how long the health check, the rendezvous and the spawn
took) and ``workers_exited`` (how and when each worker ended), once per generation.

The worker's side of the start (imports, ``init_process_group``, checkpoint load,
compile, first batch, first step) is its own (steadfast.progress.phases), written by the
reporter as ``first_step``; ``steadfast report`` joins the two with the fault before
them into a restart's phases (steadfast.report.restarts).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from .. import events
from .failures import worker_exits

__all__ = ["Generations", "wall_times"]


def wall_times(times: Mapping[int, float]) -> dict[int, float]:
    """``time.monotonic()`` values (the watcher's) as epoch seconds."""
    now_wall, now_mono = time.time(), time.monotonic()
    return {k: now_wall - (now_mono - t) for k, t in times.items()}


class Generations:
    """The running generation (its start, its workers' pids by local rank, its group)
    and the launcher's timings of the next one's start."""

    def __init__(self) -> None:
        self.current: tuple[float, dict[int, int], WorkerGroup] | None = None
        #: the pids of the last generation that ended (whose GPU memory a restart
        #: waits to see freed)
        self.last_pids: list[int] = []
        self._health = 0.0
        self._rendezvous: list[float] = []
        self._spawn: float | None = None

    @property
    def running(self) -> bool:
        return self.current is not None

    def pids(self) -> dict[int, int]:
        return dict(self.current[1]) if self.current is not None else {}

    def group(self) -> WorkerGroup | None:
        return self.current[2] if self.current is not None else None

    # ------------------------------------------------------------------ the start's timings
    @contextlib.contextmanager
    def health_check(self) -> Iterator[None]:
        began = time.time()
        try:
            yield
        finally:
            self._health = time.time() - began

    @contextlib.contextmanager
    def rendezvous(self) -> Iterator[None]:
        """The rendezvous (every try of it: the last one's end is the round's)."""
        began = time.time()
        yield
        self._rendezvous = [round(began, 6), round(time.time(), 6)]

    def spawning(self) -> None:
        """The workers are about to be started."""
        self._spawn = time.time()

    # ------------------------------------------------------------------ the events
    def started(
        self,
        worker_group: WorkerGroup,
        pids: Mapping[int, int],
        generation: int,
        restart_count: int,
    ) -> None:
        """``workers_started``: what this node runs in this round, for any script."""
        self.current = (time.time(), dict(pids), worker_group)
        workers = sorted(worker_group.workers, key=lambda w: int(w.local_rank))
        events.emit(
            "workers_started",
            generation=generation,
            restart_count=restart_count,
            node_rank=int(worker_group.group_rank or 0),
            nodes=int(worker_group.group_world_size or 1),
            world_size=int(workers[0].world_size) if workers else 0,
            ranks=[int(w.global_rank) for w in workers],
            pids=[pids.get(int(w.local_rank)) for w in workers],
            health_check=round(self._health, 6),
            rendezvous=self._rendezvous or None,
            spawn=round(self._spawn, 6) if self._spawn is not None else None,
        )
        self._health, self._rendezvous, self._spawn = 0.0, [], None

    def exited(
        self,
        cause: str,
        generation: int,
        exit_times: Mapping[int, float],
        failures: Mapping[int, Any] | None = None,
    ) -> None:
        """``workers_exited``: how and when each of the running generation's workers
        ended (``exit_times``: the watcher's, monotonic, by local rank); once."""
        if self.current is None:
            return
        started, pids, worker_group = self.current
        self.current = None
        self.last_pids = sorted(pids.values())
        now_wall = time.time()
        exits_at = wall_times(exit_times)
        stopped_at = now_wall if cause == "stopped" else None  # no longer watched
        exits = worker_exits(worker_group, pids, failures or {}, exits_at, stopped_at)
        last = max((float(t) for t in exits_at.values()), default=now_wall)
        events.emit(
            "workers_exited",
            cause=cause,
            generation=generation,
            exits=exits,
            seconds=round(last - started, 6),
        )
