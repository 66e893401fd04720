"""Ranks whose training is over: their end is bounded, and never a fault.

A rank's training is over once its worker marked it (:mod:`steadfast.monitor.ranks`,
state ``FINISHED``): its ``destroy_process_group()`` returned (``COLLECTIVES_DONE``), or
its ``__main__`` returned or it called ``sys.exit(0)`` (``FINISHED``). What follows is
the script's tail (a final save after the group is gone) and the interpreter's own exit
(non-daemon threads joined, ``atexit`` handlers, module teardown), where torch's
teardown races (gloo's threads at ``~ProcessGroupGloo``, "terminate called without an
active exception") can hang a worker or kill it with a signal. The training is done: such
a worker is not restarted, and its end is not a fault.

- A rank whose ``__main__`` has returned and that still runs ``teardown_timeout``
  seconds later is torn down (state ``TEARING_DOWN``): ``worker_teardown`` (cause
  ``hung``, with its stack, or its native stacks where its Python cannot say), SIGKILL
  to its process group; the agent sees it exit 0.
- A rank whose group is destroyed but whose script still runs is looked at
  ``teardown_timeout`` after the destroy: one that moves (a final save writing, a
  computation) is left alone and looked at again every :data:`RECHECK` seconds, up to
  ``progress_cap``; one that does not is torn down as above.
- A running rank found hung once every other rank of the job has finished is torn down
  too (the watcher decides, :meth:`Teardown.tear_down`): the job's last collective is
  behind it, and a restart would train a finished job again.
- A rank whose training was over and that exits with a signal or a non-zero code:
  ``worker_teardown`` (cause ``signal`` or ``exit_code``), and the agent sees it exit 0.
  SIGTERM and SIGKILL, the launcher's own stop signals (another rank failed), are not
  told of.

The report shows these as warnings. A worker that dies before its training was over is
a fault as before. One whose script raised or exited non-zero (``FAILED``) is on its way
out, a failure for the agent; no hang is looked for in it while the interpreter
finalizes (the peers of a culprit, ending on the error of their collective, took over a
second to exit under load and were judged hung a second time); past
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
from ..progress.native import native_stack
from ..progress.proc import running, sample, signal_group
from .ranks import Rank, Ranks, RankState

__all__ = ["RECHECK", "Teardown"]

logger = logging.getLogger(__name__)

#: The signals the launcher stops a group's workers with (SIGTERM, SIGKILL after the
#: grace): a finished worker that dies of one was stopped, and is not told of.
_STOPS = (int(signal.SIGTERM), int(signal.SIGKILL))

#: Seconds between two looks at a rank whose group is destroyed and whose script moves.
RECHECK = 2.0


class Teardown:
    """The ends of the node's ranks whose training is over, or whose script failed.

    Args:
        ranks: The watched generation's ranks (their states, their rows' marks).
        timeout: ``teardown_timeout``: seconds a finished worker may take to exit.
        global_rank: Maps a local rank to its global rank (for events).
        describe: Where a running worker is (``local_rank, pid -> text``: its stack
            where its progress thread answers, else its state); None: its state alone.
        failed_timeout: ``workers_stop_timeout``: the bound of a worker whose script
            failed (at most ``timeout``).
        moving: Whether a worker moves (``local_rank, pid -> bool``: a look through a
            window, :mod:`steadfast.progress.judge`); None: it cannot be told.
        cap: ``progress_cap``: the longest a rank whose group is destroyed may go on.
    """

    def __init__(
        self,
        ranks: Ranks,
        timeout: float,
        global_rank: Callable[[int], int] = lambda local: local,
        describe: Callable[[int, int], str] | None = None,
        failed_timeout: float = 15.0,
        moving: Callable[[int, int], bool] | None = None,
        cap: float = 600.0,
    ) -> None:
        self.ranks = ranks
        self.timeout = timeout
        #: a worker whose script failed gets what a stopped one gets: workers_stop_timeout
        self.failed_timeout = min(timeout, failed_timeout)
        self.global_rank = global_rank
        self.describe = describe
        self.moving = moving
        self.cap = max(cap, timeout)
        self._lock = threading.Lock()
        self._told: set[int] = set()  # pids whose teardown was written

    def due(self, rank: Rank, now: float) -> float | None:
        """For the watcher: None while ``rank`` is watched for hangs (or being ended as
        hung); else when to look at it again (``inf``: nothing more to do until it
        exits). A bound passed is acted on here: a finished rank torn down, one that
        failed killed (its exit, a failure as before, is the agent's to see)."""
        if rank.watched or rank.state == RankState.HUNG:
            return None
        if rank.state in (RankState.TEARING_DOWN, RankState.ENDED):
            return float("inf")
        if not running(rank.pid):  # it exited: exit_code() tells how, once reaped
            return float("inf")
        done, finished, failed = self.ranks.marks(rank.local)
        if rank.state == RankState.FAILED:
            assert failed is not None
            if now < failed + self.failed_timeout:
                return failed + self.failed_timeout
            logger.warning(
                "rank %d failed and has not exited: killed", self.global_rank(rank.local)
            )
            signal_group(rank.pid, signal.SIGKILL)
            return float("inf")
        if finished is not None:  # only the interpreter's exit is left
            if now < finished + self.timeout:
                return finished + self.timeout
            self.tear_down(rank, now - finished)
            return float("inf")
        assert done is not None  # its group is destroyed; its script's tail runs
        if now < done + self.timeout:
            return done + self.timeout
        if now < done + self.cap and (self.moving is None or self.moving(rank.local, rank.pid)):
            return min(now + RECHECK, done + self.cap)
        self.tear_down(rank, now - done)
        return float("inf")

    def tear_down(self, rank: Rank, after: float, why: str = "") -> None:
        """End ``rank`` as teardown: ``TEARING_DOWN``, ``worker_teardown`` (cause
        ``hung``: where it is), SIGKILL to its process group; its exit is 0 for the
        agent (:meth:`exit_code`). ``why``: what made it teardown, for the log."""
        if self.ranks.to(rank.local, rank.pid, RankState.TEARING_DOWN) is None:
            return
        if self._tell(rank.pid):
            where = self._where(rank.local, rank.pid)
            native = native_stack(rank.pid) if not where or "no answer" in where else ""
            self._emit(
                rank.local,
                rank.pid,
                "hung",
                after,
                str(RankState.TEARING_DOWN),
                where=where,
                native=native.splitlines(),
            )
            logger.warning(
                "rank %d's training was over %.1f s ago%s and it has not exited "
                "(teardown_timeout=%g s): ended, not restarted (%s)",
                self.global_rank(rank.local),
                after,
                why,
                self.timeout,
                (where or native).splitlines()[0] if (where or native) else "?",
            )
        signal_group(rank.pid, signal.SIGKILL)

    def exit_code(self, local: int, pid: int, code: int) -> int:
        """The code the agent is to see for worker ``pid`` (``local``) that exited with
        ``code``: 0 for a rank whose training was over, or that was torn down (its
        teardown written once), else ``code``."""
        rank = self.ranks.get(local)
        torn = rank is not None and rank.pid == pid and rank.state == RankState.TEARING_DOWN
        over = self.ranks.over(local) is not None and not self.ranks.marks(local)[2]
        state = str(rank.state) if rank is not None and rank.pid == pid else None
        self.ranks.to(local, pid, RankState.ENDED)
        if code == 0 or not (over or torn):
            return code
        if -code in _STOPS:  # the launcher's own stop (another rank failed), or ours
            return 0
        after = time.monotonic() - (self.ranks.over(local) or time.monotonic())
        if self._tell(pid):
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
                self._emit(local, pid, "signal", after, state, signal=name)
            else:
                self._emit(local, pid, "exit_code", after, state, exit_code=code)
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

    def _emit(
        self, local: int, pid: int, cause: str, after: float, state: str | None, **fields: Any
    ) -> None:
        events.emit(
            "worker_teardown",
            cause=cause,
            state=state,
            rank=self.global_rank(local),
            local_rank=local,
            worker_pid=pid,
            after=round(after, 3),
            timeout=self.timeout,
            **fields,
        )
