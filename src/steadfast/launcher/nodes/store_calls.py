"""Store calls of the node roster, off its loop's thread: :class:`StoreCalls` runs them
on a thread of its own, since a call can block for as long as the store's own timeout,
and :class:`Deadlines` answers a call that overruns its deadline as failed while the
thread goes on with it in the background."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Deadlines", "StoreCalls"]

logger = logging.getLogger(__name__)

_Done = Callable[[Any, "BaseException | None"], None]


class StoreCalls:
    """Store calls on a thread of their own, each with a deadline."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], _Done] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="steadfast-node-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                value = fn()
            except BaseException as exc:  # handed over inside the block: no cycle kept
                self._finish(done, None, exc)
            else:
                self._finish(done, value, None)

    @staticmethod
    def _finish(done: _Done, value: Any, exc: BaseException | None) -> None:
        try:
            done(value, exc)
        except Exception:  # a bug in a callback must not stop the store calls
            logger.exception("node roster: a store call's callback failed")

    def submit(
        self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Run ``fn`` on the thread, then ``done(value, error)`` there with its outcome."""
        self._jobs.put((fn, done))

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()``'s value; raises its error, or TimeoutError after ``timeout``."""
        box: dict[str, Any] = {}
        finished = threading.Event()

        def done(value: Any, exc: BaseException | None) -> None:
            box["value"], box["exc"] = value, exc
            finished.set()

        self.submit(fn, done)
        if not finished.wait(timeout):
            raise TimeoutError(f"the store did not answer in {timeout:g} s")
        error, value = box.pop("exc"), box.pop("value")
        if error is not None:
            try:
                raise error
            finally:  # no frame -> error -> traceback -> frame cycle holding the store
                del error
        return value

    def close(self, wait: float = 0.0) -> None:
        """End the thread after the calls queued; wait up to ``wait`` seconds for it (a
        call stuck in the store keeps the daemon thread until the store gives up)."""
        self._jobs.put(None)
        if wait > 0:
            self._thread.join(wait)


class Deadlines:
    """The deadlines of store calls under way, as timers that :meth:`close` cancels, so
    that none outlives the roster."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._closed = False

    def start(self, seconds: float, fn: Callable[..., None], *args: Any) -> threading.Timer:
        """``fn(*args)`` in ``seconds`` unless cancelled first. Once closed, the timer
        returned never runs (a deadline of a call the roster no longer waits for)."""
        timer = threading.Timer(seconds, fn, args=args)
        timer.daemon = True
        with self._lock:  # started under the lock: close never meets one not yet started
            if self._closed:
                timer.cancel()
                return timer
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
            timer.start()
        return timer

    def close(self) -> None:
        """Cancel the timers still waiting (and wait for any running its ``fn``, unless
        that is the caller: a deadline's ``fn`` may end in closing the roster)."""
        with self._lock:
            timers, self._timers, self._closed = self._timers, [], True
        for timer in timers:  # a deadline still waiting: the roster is gone
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join()
