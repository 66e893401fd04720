"""When each worker exited, as its pidfd tells: the watcher thread holds a pidfd of each
worker of the running generation in its poll set, and takes in those found readable.

The agent learns that a worker ended from another source (the template's report, or
``Popen.poll``), often before the watcher thread has run: on a busy machine the thread
can be a scheduler slice or more behind. :meth:`ExitClock.times` therefore waits, for
a bounded time, until every worker that is no longer running has its exit taken in, so
a ``workers_exited`` event or a culprit claim never lacks an exit time the kernel could
give (seen under load: a ``succeeded`` generation whose last exit had no time).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Iterable, Mapping

from ..progress.proc import running

__all__ = ["ExitClock", "SETTLE"]

#: How long :meth:`ExitClock.times` waits for the watcher thread to take in exits that
#: have happened (it does within a millisecond on an idle machine).
SETTLE = 2.0


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), None where the kernel has none or
    the process is already gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


class ExitClock:
    """The exit time (``time.monotonic()``) of each worker of the current generation,
    by local rank. The agent's side: :meth:`new_generation` and :meth:`times`; the
    watcher thread's: :meth:`follow`, :meth:`take` and :meth:`close`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self._exits: dict[int, float] = {}
        # what the thread follows: its generation, and local rank -> pid of each worker
        # it holds a pidfd of (an exit it will take in)
        self._followed = -1
        self._watched: dict[int, int] = {}
        self._fds: dict[int, tuple[int, int]] = {}  # pidfd -> (local rank, generation)

    # ---------------------------------------------------------------- the agent's
    def new_generation(self, generation: int, keep: bool = False) -> None:
        """Workers of ``generation`` (or none) are now the ones whose exits count;
        ``keep``: the exits taken in so far stay readable (workers being stopped)."""
        with self._cond:
            self._generation = generation
            if not keep:
                self._exits = {}

    def times(self, settle: float = SETTLE) -> dict[int, float]:
        """The exits taken in so far, once every followed worker that no longer runs is
        among them (or ``settle`` seconds passed); empty where the kernel has no
        pidfds."""
        deadline = time.monotonic() + settle
        with self._cond:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or self._complete():
                    return dict(self._exits)
                self._cond.wait(min(left, 0.05))

    def _complete(self) -> bool:
        if self._followed != self._generation:  # the thread has not followed them yet
            return False
        return all(local in self._exits or running(pid) for local, pid in self._watched.items())

    # ------------------------------------------------------------ the thread's
    def follow(self, poll: select.poll, pids: Mapping[int, int], generation: int) -> None:
        """Hold a pidfd of each of ``pids`` (``local rank -> pid``) in ``poll``, closing
        the previous generation's; a worker already gone exits now."""
        self.close(poll)
        gone, watched = [], {}
        for local, pid in pids.items():
            fd = _pidfd(pid)
            if fd is None:
                if not running(pid):  # already gone before we looked
                    gone.append(local)
                continue
            self._fds[fd] = (local, generation)
            watched[local] = pid
            poll.register(fd, select.POLLIN)
        with self._cond:
            self._followed, self._watched = generation, watched
        self._record(gone, generation, time.monotonic())

    def take(self, poll: select.poll, ready: Iterable[int], when: float) -> None:
        """Take in the exits of the pidfds among ``ready`` (seen readable at ``when``):
        one time for all the exits of one wake-up, whose order cannot be told."""
        exited: dict[int, list[int]] = {}
        for fd in ready:
            if fd in self._fds:
                local, generation = self._fds.pop(fd)
                exited.setdefault(generation, []).append(local)
                poll.unregister(fd)
                os.close(fd)
        for generation, locals_ in exited.items():
            self._record(locals_, generation, when)

    def close(self, poll: select.poll | None) -> None:
        """Close every pidfd held (a new generation, or the watcher stopping)."""
        for fd in self._fds:
            if poll is not None:
                with contextlib.suppress(KeyError, ValueError):
                    poll.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def _record(self, locals_: list[int], generation: int, when: float) -> None:
        with self._cond:
            if generation != self._generation:  # a worker of a generation gone already
                return
            for local in locals_:
                self._exits.setdefault(local, when)
            self._cond.notify_all()
