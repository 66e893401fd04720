"""The monitor thread: it carries an interruption of the iteration into the main thread.

Each rank's monitor thread blocks on the store key that ends the iteration it watches
(``iter/{i}/state``). When the iteration is interrupted (by any rank), it raises
:class:`InterruptedIteration` in the main thread (``PyThreadState_SetAsyncExc``), runs the
``abort`` hook, which releases the main thread from a blocked collective, and raises
again every ``monitor_thread_interval`` until the main thread has left the function.

The main thread and the monitor thread share one reentrant lock: the interruption lands
only while the main thread is inside the function of the iteration it is for (between
:meth:`MonitorThread.enter` and :meth:`MonitorThread.leave`), never inside
:meth:`MonitorThread.atomic`; and the main thread does not enter either once an
interruption of its iteration is under way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .state import InterruptedIteration
from .store import INTERRUPTED, own_connection

__all__ = ["MonitorThread"]

logger = logging.getLogger("steadfast.inprocess")

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int


class MonitorThread:
    """The interruption of one Wrapper call's main thread and the thread that delivers it.

    Made in the main thread (the one it interrupts). ``on_interrupt(first)`` runs, under
    the lock, each time the interruption is raised in the main thread: ``first`` the
    first time for an iteration (the abort hook runs then).
    """

    def __init__(self, on_interrupt: Callable[[bool], None]) -> None:
        self.lock = threading.RLock()  # shared by atomic() and the interruption
        self.in_fn = -1  # iteration whose function the main thread is executing
        self.interrupting = -1  # iteration whose interruption is under way
        self._on_interrupt = on_interrupt
        self._main_tid = threading.get_ident()
        self._exception = ctypes.py_object(InterruptedIteration)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the main thread's side ---------------------------------------------------------
    def start(self, store_client: Any, interval: float, iteration: Callable[[], int]) -> None:
        """Start watching the iterations (``iteration()``: the current one) in the store.

        The thread's own connection is made here, in the calling thread: made in the
        thread, a connection whose first try failed (a busy store's "Broken pipe") went
        on retrying there while the function ran unwatched, and past the job's end,
        when the store had closed: the call's exit joined the thread for the store's
        whole timeout."""
        store = own_connection(store_client)
        self._thread = threading.Thread(
            target=self._run,
            args=(store, interval, iteration),
            name="steadfast-inprocess-monitor",
            daemon=True,
        )
        self._thread.start()

    def iteration_changed(self) -> None:
        """Wake the thread: it watches the new iteration from now on."""
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        """Tell the thread to stop (:meth:`join` waits for it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def atomic(self, iteration: int) -> Iterator[None]:
        """A block the interruption of ``iteration`` never lands in."""
        with self.lock:
            if self.interrupting == iteration:
                raise InterruptedIteration()
            yield

    def enter(self, iteration: int) -> None:
        """The main thread enters the function of ``iteration``: interruptible from now."""
        with self.lock:
            if self.interrupting == iteration:
                raise InterruptedIteration()
            self.in_fn = iteration

    def leave(self) -> None:
        """Stop being interruptible; cancel an interruption raised but not yet delivered."""
        with self.lock:
            self.in_fn = -1
            _set_async_exc(self._main_tid, ctypes.py_object())  # NULL: clear a pending one

    def mark_interrupting(self, iteration: int) -> None:
        """``iteration`` is interrupted: its function is entered no more."""
        with self.lock:
            self.interrupting = iteration

    # -- the monitor thread -------------------------------------------------------------
    def _run(self, store: Any, interval: float, iteration: Callable[[], int]) -> None:
        watched = -1
        while True:
            with self._cond:
                while not self._stopping and iteration() == watched:
                    self._cond.wait()
                if self._stopping:
                    return
                watched = iteration()
            try:
                outcome = store.wait_iteration_end(watched, timedelta(days=1))
            except Exception as exc:
                if not self._stopping:
                    logger.error("in-process restart store lost: %s", exc)
                return
            if outcome != INTERRUPTED or not self._interrupt(watched, first=True):
                continue
            while True:
                # Re-raise while the main thread has not acknowledged (e.g. it was in a
                # C call that swallowed the first one on its way out).
                with self._cond:
                    self._cond.wait(interval)
                    if self._stopping or iteration() != watched:
                        break
                if not self._interrupt(watched, first=False):
                    break

    def _interrupt(self, iteration: int, first: bool) -> bool:
        """Interrupt the main thread's function for ``iteration``; False if it is not in it."""
        with self.lock:
            if self.in_fn != iteration:
                self.interrupting = iteration
                return False
            self.interrupting = iteration
            deadline = time.monotonic() + _STARTING_WAIT
            while not _raise_in(self._main_tid, self._exception):
                if time.monotonic() > deadline:  # not seen: a thread stuck before it ran
                    logger.warning("a thread has not started for %.0fs", _STARTING_WAIT)
                    _set_async_exc(self._main_tid, self._exception)
                    break
                time.sleep(0.0005)  # the starting thread gets the GIL and binds its id
            self._on_interrupt(first)
            return True


#: the longest the interruption waits for threads being started to start
_STARTING_WAIT = 5.0


def _raise_in(tid: int, exception: Any) -> bool:
    """Set ``exception`` pending in thread ``tid``, unless a thread is being started
    (False: try again).

    Why: CPython 3.11 gives a thread state made for a new thread its *creator's* id until
    the new thread runs, and ``PyThreadState_SetAsyncExc`` sets the exception in the
    first thread state with the id, the newest. An interruption raised while the main
    thread starts a thread (a memory snapshot's writer) landed in the new thread, which
    died before it had started, and the main thread waited in ``Thread.start()`` until
    the hard timeout ended it. ``threading._limbo`` holds every thread from before its
    state is made until after it has its own id. No bytecode between the test and the
    call checks for a thread switch (a forward jump, then a C call that keeps the GIL), so
    no thread can be started in between. Threads started with ``_thread`` directly are
    not seen."""
    limbo = threading._limbo  # type: ignore[attr-defined]
    set_exc = _set_async_exc
    if limbo:
        return False
    set_exc(tid, exception)
    return True
