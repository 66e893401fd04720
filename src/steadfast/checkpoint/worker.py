"""A background thread that runs its owner's jobs one at a time, kept between jobs so
that no thread is started on the training step's path.

Starting a thread per job costs the caller more than the job's hand-off:
``Thread.start()`` returns only once the new thread has been scheduled and has run, which
on a busy node is most of a memory snapshot's stall (profiled: 65 % of it, 2 ranks on 2
cores). A job handed to a thread that already waits costs a lock and a notify.

The thread is made at the first job and ends:

- at :meth:`Worker.close` (its owner's close), once the jobs handed to it have run;
- at :meth:`Worker.retire`, without waiting: the owner was abandoned (an in-process
  restart drops the tier of the loop that raised; the next tier for the same folder
  retires it) and its last jobs still run;
- after :data:`IDLE` seconds without a job: an owner dropped without ``close()`` leaves
  no thread for longer; the next job starts a new one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["IDLE", "Worker"]

logger = logging.getLogger(__name__)

#: seconds a worker's thread waits for a job before it ends
IDLE = 10.0


class Worker:
    """Runs jobs (callables of no argument) in the order handed over, on one daemon
    thread named ``name``. A job's exception is logged; the owner's jobs report their
    own errors (they catch them)."""

    def __init__(self, name: str, idle: float = IDLE) -> None:
        self.name = name
        self._idle = idle
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._pending = 0  # handed over and not yet finished
        self._retired = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Hand ``job`` over; returns at once (a thread is started only when none waits)."""
        with self._cond:
            self._jobs.append(job)
            self._pending += 1
            self._retired = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()

    def wait(self) -> None:
        """Return once every job handed over so far has run."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def retire(self) -> None:
        """Let the thread end once its jobs have run, without waiting for them."""
        with self._cond:
            self._retired = True
            self._cond.notify_all()

    def close(self) -> None:
        """Run the jobs handed over, then end the thread and join it."""
        self.retire()
        with self._cond:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._jobs:
                    if self._retired or (not self._cond.wait(self._idle) and not self._jobs):
                        if self._thread is me:
                            self._thread = None
                        return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException:  # the thread serves the next job all the same
                logger.exception("%s: a background job failed", self.name)
            finally:
                del job  # its references (the owner's state) go with it
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
