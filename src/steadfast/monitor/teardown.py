"""Workers whose script has finished: their interpreter's teardown is bounded, and never a
fault.

A worker's script has *finished* once its ``__main__`` returned or it called
``sys.exit(0)``: the worker says so in its row of the heartbeat table
(:func:`steadfast.launcher.as_main.mark_finished`; the worker template's children and
workers booted with the progress hooks). What follows is the interpreter's own exit
(non-daemon threads joined, ``atexit`` handlers, module teardown), where torch's
teardown races (gloo's threads at ``~ProcessGroupGloo``, "terminate called without an
active exception") can hang a worker or kill it with a signal. The training is done:
such a worker is not restarted, and its end is not a fault.

- A finished worker still running ``teardown_timeout`` seconds after it finished is
  looked at once (its stack, or where it is stuck), ``worker_teardown`` (cause
  ``hung``) is written, and it is killed (SIGKILL to its process group): the agent sees
  it exit 0.
- A finished worker that exits with a signal or a non-zero code: ``worker_teardown``
  (cause ``signal`` or ``exit_code``, with it), and the agent sees it exit 0. SIGTERM
  and SIGKILL, the launcher's own stop signals (another rank failed), are not told of.

The report shows these as warnings. A worker that dies before its script finished is a
fault as before. One whose script raised or exited non-zero says so too (``ENDED``): it
is on its way out, a failure for the agent, and no hang is looked for in it while the
interpreter finalizes (the peers of a culprit, ending on the error of their collective,
took over a second to exit under load and were judged hung a second time); past
``workers_stop_timeout`` (at most ``teardown_timeout``) it is killed.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import events
from ..progress.layout import ENDED, FINISHED
from ..progress.proc import running, sample, signal_group
from .table import HeartbeatTable

__all__ = ["Teardown"]

logger = logging.getLogger(__name__)

#: The signals the launcher stops a group's workers with (SIGTERM, SIGKILL after the
#: grace): a finished worker that dies of one was stopped, and is not told of.
_STOPS = (int(signal.SIGTERM), int(signal.SIGKILL))


class Teardown:
    """The finished workers of the node's heartbeat table.

    Args:
        table: The node's heartbeat table (a row per local rank).
        timeout: ``teardown_timeout``: seconds a finished worker may take to exit.
        global_rank: Maps a local rank to its global rank (for events).
        describe: Where a running worker is (``local_rank, pid -> text``: its stack
            where its progress thread answers, else its state); None: its state alone.
        failed_timeout: ``workers_stop_timeout``: the bound of a worker whose script
            failed (at most ``timeout``).
    """

    def __init__(
        self,
        table: HeartbeatTable,
        timeout: float,
        global_rank: Callable[[int], int] = lambda local: local,
        describe: Callable[[int, int], str] | None = None,
        failed_timeout: float = 15.0,
    ) -> None:
        self.timeout = timeout
        #: a worker whose script failed gets what a stopped one gets: workers_stop_timeout
        self.failed_timeout = min(timeout, failed_timeout)
        self.global_rank = global_rank
        self.describe = describe
        self._slots = {r: table.progress_area(r)[0] for r in range(table.rows)}
        self._lock = threading.Lock()
        self._told: set[int] = set()  # pids whose teardown was written

    def finished(self, local: int) -> float | None:
        """The monotonic time ``local``'s script finished, None while it runs."""
        slots = self._slots.get(local)
        when = float(slots[FINISHED]) if slots is not None else 0.0
        return when if when > 0 else None

    def ended(self, local: int) -> float | None:
        """The monotonic time ``local``'s script ended, finished or not (it raised, or
        exited non-zero), None while it runs."""
        slots = self._slots.get(local)
        when = max(float(slots[FINISHED]), float(slots[ENDED])) if slots is not None else 0.0
        return when if when > 0 else None

    def due(self, local: int, pid: int, now: float) -> float | None:
        """For the watcher: None while ``local``'s script runs (watch it as before);
        else when its teardown's bound passes. Once passed, the worker is ended here: a
        finished one told of (``worker_teardown``), one that failed as it would be (its
        exit, a failure as before, is the agent's to see)."""
        ended = self.ended(local)
        if ended is None:
            return None
        finished = self.finished(local)
        deadline = ended + (self.timeout if finished is not None else self.failed_timeout)
        if now < deadline:
            return deadline
        if not running(pid):  # it exited: exit_code() tells how, once reaped
            return float("inf")
        if finished is None:  # it failed, and hangs on its way out
            logger.warning("rank %d failed and has not exited: killed", self.global_rank(local))
            signal_group(pid, signal.SIGKILL)
            return float("inf")
        if self._tell(pid):
            where = self._where(local, pid)
            self._emit(local, pid, "hung", now - finished, where=where)
            logger.warning(
                "rank %d finished its script %.1f s ago and has not exited "
                "(teardown_timeout=%g s): ended, not restarted (%s)",
                self.global_rank(local),
                now - finished,
                self.timeout,
                where.splitlines()[0] if where else "?",
            )
            signal_group(pid, signal.SIGKILL)
        return float("inf")  # nothing more to do for it: its exit wakes the watcher

    def exit_code(self, local: int, pid: int, code: int) -> int:
        """The code the agent is to see for worker ``pid`` (``local``) that exited with
        ``code``: 0 for a finished worker (its teardown written once), else ``code``."""
        finished = self.finished(local)
        if code == 0 or finished is None:
            return code
        if -code in _STOPS:  # the launcher's own stop (another rank failed): no fault
            return 0
        if self._tell(pid):
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
                self._emit(local, pid, "signal", time.monotonic() - finished, signal=name)
            else:
                self._emit(local, pid, "exit_code", time.monotonic() - finished, exit_code=code)
        return 0

    def _tell(self, pid: int) -> bool:
        with self._lock:
            if pid in self._told:
                return False
            self._told.add(pid)
            return True

    def _where(self, local: int, pid: int) -> str:
        if self.describe is not None:
            with contextlib.suppress(Exception):
                return self.describe(local, pid)
        proc = sample(pid)
        return f"state {proc.state}" + (f" ({proc.wchan})" if proc.wchan else "")

    def _emit(self, local: int, pid: int, cause: str, after: float, **fields: Any) -> None:
        events.emit(
            "worker_teardown",
            cause=cause,
            rank=self.global_rank(local),
            local_rank=local,
            worker_pid=pid,
            after=round(after, 3),
            timeout=self.timeout,
            **fields,
        )
