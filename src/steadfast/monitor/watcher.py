"""The launcher's watcher: reads the heartbeat table and terminates hung ranks.

Instead of polling every ``workload_check_interval`` (the original's 5 s, so a hang is
seen up to 5 s late), the watcher computes each rank's nearest deadline from its row and
sleeps until then (at most ``workload_check_interval``), then re-reads the row: a rank
that made progress meanwhile moved its deadline; one that did not is hung. Detection
lags the timeout only by the thread's wake-up latency.

On a hang: a ``rank_hung`` event (rank, what timed out, elapsed, timeout), the rank's
Python stacks (:data:`~steadfast.monitor.client.STACK_DUMP_SIGNAL`, registered by the
client with faulthandler), then ``rank_termination_signal`` to the rank's process group.
The elastic agent sees the worker die and restarts the group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import events
from ..config import FaultToleranceConfig
from .client import STACK_DUMP_SIGNAL
from .table import HeartbeatTable, RowSnapshot

__all__ = ["Hang", "Watcher", "next_deadline"]

logger = logging.getLogger(__name__)

#: How long a hung rank gets to write its stacks before it is terminated.
STACK_DUMP_GRACE = 0.1


@dataclass(frozen=True)
class Hang:
    """What timed out on a rank: ``what`` is ``initial_heartbeat``, ``heartbeat``,
    ``section:<name>`` or ``out_of_section``."""

    local_rank: int
    what: str
    elapsed: float
    timeout: float


def next_deadline(
    snap: RowSnapshot, started: float, warmup_iterations: int
) -> tuple[float, str, float, float]:
    """The row's nearest deadline: ``(deadline, what, since, timeout)``; the deadline is
    ``inf`` when nothing can time out. ``started`` is when the worker was started."""
    best = (math.inf, "", 0.0, math.inf)

    def consider(since: float, timeout: float, what: str) -> None:
        nonlocal best
        if math.isfinite(timeout) and since + timeout < best[0]:
            best = (since + timeout, what, since, timeout)

    if snap.last_heartbeat == 0:
        consider(started, snap.initial_heartbeat_timeout, "initial_heartbeat")
    else:
        consider(snap.last_heartbeat, snap.heartbeat_timeout, "heartbeat")
    if snap.section is not None:
        timeout = snap.section_timeouts.get(snap.section, math.inf)
        warmup = snap.section_timeouts.get("warmup")
        if snap.section == "step" and warmup is not None and snap.steps < warmup_iterations:
            timeout = warmup
        consider(snap.section_start, timeout, f"section:{snap.section}")
    elif snap.out_of_section_start > 0:  # not before the first step section
        consider(snap.out_of_section_start, snap.out_of_section_timeout, "out_of_section")
    return best


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the worker's process group (its own: grandchildren too), else to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            os.kill(pid, sig)


class Watcher:
    """Watches the rows of ``table`` for the workers the agent started.

    Args:
        table: The node's heartbeat table.
        cfg: Timeouts, termination signal, check interval and warm-up iterations.
        global_rank: Maps a local rank to its global rank (for events).
        on_hang: Called after a hang was handled (tests, the launcher's bookkeeping).
    """

    def __init__(
        self,
        table: HeartbeatTable,
        cfg: FaultToleranceConfig,
        global_rank: Callable[[int], int] = lambda local: local,
        on_hang: Callable[[Hang], None] | None = None,
    ) -> None:
        self.table = table
        self.cfg = cfg
        self.global_rank = global_rank
        self.on_hang = on_hang
        self._pids: dict[int, int] = {}
        self._started = 0.0
        self._handled: set[int] = set()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.hangs: list[Hang] = []

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the watcher thread."""
        self._thread = threading.Thread(target=self._run, name="steadfast-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the watcher thread and wait for it."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def watch(self, pids: Mapping[int, int]) -> None:
        """Start watching a new generation of workers (``local_rank -> pid``); their rows
        must have been reset."""
        with self._wake:
            self._pids = dict(pids)
            self._started = time.monotonic()
            self._handled = set()
            self._wake.notify_all()

    def unwatch(self) -> None:
        """Stop watching (the workers are being stopped)."""
        with self._wake:
            self._pids = {}
            self._wake.notify_all()

    def progress(self) -> int:
        """Progress of the current generation: ``step`` sections completed, or for a
        rank that only sends heartbeats, heartbeats after its first (max over ranks)."""
        best = 0
        for r in range(self.table.rows):
            snap = self.table.snapshot(r)
            best = max(best, snap.steps, snap.heartbeats - 1)
        return best

    def attached(self) -> bool:
        """Whether any rank of the current generation uses the client."""
        return any(self.table.snapshot(r).pid for r in range(self.table.rows))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stop:
                    return
                pids, started, handled = dict(self._pids), self._started, set(self._handled)
            now = time.monotonic()
            soonest = now + self.cfg.workload_check_interval
            for local, pid in pids.items():
                if local in handled or local >= self.table.rows:
                    continue
                snap = self.table.snapshot(local)
                if snap.closed:
                    continue
                deadline, what, since, timeout = next_deadline(
                    snap, started, self.cfg.num_warmup_iterations
                )
                if deadline <= now:
                    self._handle(Hang(local, what, now - since, timeout), pid, snap.pid == pid)
                else:
                    soonest = min(soonest, deadline)
            with self._wake:
                if self._stop:
                    return
                if self._pids == pids:  # no new generation meanwhile: sleep to the deadline
                    self._wake.wait(max(0.0, soonest - time.monotonic()) + 0.001)

    def _handle(self, hang: Hang, pid: int, dumps_stacks: bool) -> None:
        with self._wake:
            if self._pids.get(hang.local_rank) != pid:
                return  # that generation is gone already
            self._handled.add(hang.local_rank)
        if not _running(pid):  # it exited (the agent will see it): not a hang to act on
            return
        rank = self.global_rank(hang.local_rank)
        logger.error(
            "rank %d (local %d, pid %d) hung: %s for %.2fs (timeout %.2fs); terminating it",
            rank,
            hang.local_rank,
            pid,
            hang.what,
            hang.elapsed,
            hang.timeout,
        )
        events.emit(
            "rank_hung",
            cause=hang.what,
            rank=rank,
            local_rank=hang.local_rank,
            section=hang.what.removeprefix("section:"),
            elapsed=round(hang.elapsed, 4),
            timeout=hang.timeout,
            worker_pid=pid,
        )
        if dumps_stacks:  # only a rank whose client registered the handler: else it kills
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, STACK_DUMP_SIGNAL)
                os.kill(pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) must run to dump
                time.sleep(STACK_DUMP_GRACE)
        sig = self.cfg.rank_termination_signal
        _signal_group(pid, sig)
        if sig != signal.SIGKILL:  # a rank stuck in C may never run its handler
            deadline = time.monotonic() + self.cfg.workers_stop_timeout
            while _running(pid) and time.monotonic() < deadline:
                with self._wake:
                    if self._stop or self._pids.get(hang.local_rank) != pid:
                        break
                    self._wake.wait(0.05)
            if _running(pid):
                logger.error("rank %d ignored %s; sending SIGKILL", rank, sig.name)
                _signal_group(pid, signal.SIGKILL)
        self.hangs.append(hang)
        if self.on_hang is not None:
            self.on_hang(hang)
