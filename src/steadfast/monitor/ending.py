"""A hung rank's way out, once the watcher (:mod:`.watcher`) found it hung: its Python
stacks asked for (:data:`~steadfast.monitor.client.STACK_DUMP_SIGNAL`, where its client
registered the handler) and :data:`STACK_DUMP_GRACE` to write them, then the
termination signal (``rank_termination_signal``) to its process group, then SIGKILL
after ``workers_stop_timeout`` if it still runs (a rank stuck in C may never run its
handler). Each step is taken by the watcher's thread when it is due, never by waiting:
the other ranks' checks go on meanwhile."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ..config import FaultToleranceConfig
from ..progress.proc import running, signal_group
from .client import STACK_DUMP_SIGNAL

__all__ = ["STACK_DUMP_GRACE", "Hang", "Endings"]

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
    since: float  # time.monotonic() of the silence's start (its elapsed is from then)
    learned: bool = False  # the timeout was learned (monitor/learned.py), not configured


@dataclass
class _Ending:
    """A hung rank on its way out: its stacks asked for (``stage`` ``dump``), then the
    termination signal sent (``term``), SIGKILL once ``due`` passes if it still runs."""

    hang: Hang
    pid: int
    rank: int
    stage: str
    due: float


class Endings:
    """The hung ranks being ended. ``on_hang`` is called as each gets its termination
    signal (the launcher's bookkeeping, tests)."""

    def __init__(
        self, cfg: FaultToleranceConfig, on_hang: Callable[[Hang], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.on_hang = on_hang
        self._ending: list[_Ending] = []

    def begin(self, hang: Hang, pid: int, rank: int, dumps_stacks: bool, now: float) -> None:
        """Start ending the hung rank ``pid`` (global ``rank``): its stacks asked for
        where ``dumps_stacks`` (its client registered the handler), else it is
        terminated at the next :meth:`advance`."""
        if dumps_stacks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, STACK_DUMP_SIGNAL)
                os.kill(pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) must run to dump
            self._ending.append(_Ending(hang, pid, rank, "dump", now + STACK_DUMP_GRACE))
        else:
            self._ending.append(_Ending(hang, pid, rank, "dump", now))

    def advance(self, now: float, current: Callable[[int, int], bool]) -> float:
        """Move each termination on (the termination signal once its stacks had their
        grace, SIGKILL after ``workers_stop_timeout`` if it ignored it); ``current``:
        whether ``(local_rank, pid)`` is of the generation watched (one the agent is
        stopping is ended now, not later). Returns when the next step is due (``inf``:
        none)."""
        soonest = float("inf")
        for ending in list(self._ending):
            if not running(ending.pid):  # it is gone: nothing more to do
                self._ending.remove(ending)
                continue
            if ending.due > now and current(ending.hang.local_rank, ending.pid):
                soonest = min(soonest, ending.due)
                continue
            if ending.stage == "dump":
                sig = self.cfg.rank_termination_signal
                signal_group(ending.pid, sig)
                if self.on_hang is not None:
                    self.on_hang(ending.hang)
                if sig == signal.SIGKILL:
                    self._ending.remove(ending)
                    continue
                ending.stage, ending.due = "term", now + self.cfg.workers_stop_timeout
                soonest = min(soonest, ending.due)
            else:  # a rank stuck in C may never run its handler
                name = signal.Signals(self.cfg.rank_termination_signal).name
                logger.error("rank %d ignored %s; sending SIGKILL", ending.rank, name)
                signal_group(ending.pid, signal.SIGKILL)
                self._ending.remove(ending)
        return soonest

    def kill(self) -> None:
        """SIGKILL every rank still on its way out (the watcher stops)."""
        for ending in self._ending:
            if running(ending.pid):
                signal_group(ending.pid, signal.SIGKILL)
        self._ending = []
