"""Watching a rank from inside (progress watchdog) and from outside (monitor process).

- :class:`SharedProgress`: a page of memory shared (``MAP_SHARED``, inherited by the fork)
  between a rank and its monitor process: the rank's phase and iteration, when the phase
  began and the last manual ping (``time.monotonic``, the same clock in both processes),
  and the automatic progress counter.
- :class:`ProgressWatchdog`: a thread that, every ``progress_watchdog_interval``, queues a
  *pending call* (``Py_AddPendingCall``) that the main thread's interpreter runs between
  two bytecodes: libc's ``sem_post`` on a shared semaphore. The count therefore moves
  only while the main thread is executing Python: a rank stuck in a C call (a hung
  collective, a deadlock holding the GIL, SIGSTOP) stops it. ``CallWrapper.ping()``
  writes the second, manual timestamp.
- :func:`start_monitor_process`: forks the monitor process. It outlives its rank: it
  heartbeats into the store, interrupts the iteration on the soft timeout, terminates
  the rank on the hard timeout (SIGTERM, SIGKILL after ``termination_grace_time``),
  reports the rank's death at once (a pidfd), and, for initial rank 0, serves the store
  and declares ranks whose heartbeats stop (``heartbeat_timeout``) terminated.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import events
from .store import StoreMixin, make_store

__all__ = [
    "EXITED",
    "IDLE",
    "RESTARTING",
    "RUNNING",
    "SPARE",
    "MonitorProcessConfig",
    "ProgressWatchdog",
    "SharedProgress",
    "start_monitor_process",
]

logger = logging.getLogger("steadfast.inprocess")

IDLE, RUNNING, RESTARTING, SPARE, EXITED = 0, 1, 2, 3, 4
_LAYOUT = struct.Struct("<ddqqd")  # since, manual, phase, iteration, aborted
_SEM_OFFSET = 64  # a process-shared POSIX semaphore: the progress counter

_libc = ctypes.CDLL(None, use_errno=True)
_PendingCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# The pending call is libc's sem_post itself: C code that returns 0 and runs no Python,
# so the interruption (an async exception) can never land inside it.
_SEM_POST = ctypes.cast(_libc.sem_post, _PendingCall)
_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = [_PendingCall, ctypes.c_void_p]
_add_pending_call.restype = ctypes.c_int
_make_pending_calls = ctypes.pythonapi.Py_MakePendingCalls
_make_pending_calls.restype = ctypes.c_int


class SharedProgress:
    """The rank's phase, iteration and progress, shared with its monitor process.

    Automatic progress is a process-shared semaphore that the main thread's interpreter
    posts (a pending call); the monitor reads its value and notes when it last moved.
    """

    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous + MAP_SHARED: no /dev/shm file
        _LAYOUT.pack_into(self._mem, 0, time.monotonic(), 0.0, IDLE, 0, 0.0)
        self._sem = ctypes.c_char.from_buffer(self._mem, _SEM_OFFSET)
        self.sem_address = ctypes.addressof(self._sem)
        if _libc.sem_init(ctypes.c_void_p(self.sem_address), 1, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def read(self) -> tuple[float, float, int, int]:
        """``(phase_since, manual_ping, phase, iteration)``."""
        since, manual, phase, iteration, _ = _LAYOUT.unpack_from(self._mem, 0)
        return since, manual, phase, iteration

    def aborted_at(self) -> float:
        """When the monitor thread began to interrupt and abort this phase (0.0: not)."""
        return _LAYOUT.unpack_from(self._mem, 0)[4]  # type: ignore[no-any-return]

    def mark_aborted(self) -> None:
        """The monitor thread interrupts the main thread and runs the abort hook: the
        main thread may be blocked in a call that only the abort, or a peer's end,
        releases."""
        struct.pack_into("<d", self._mem, 32, time.monotonic())

    def ticks(self) -> int:
        """How many times the main thread's interpreter ran the progress pending call."""
        value = ctypes.c_int(0)
        _libc.sem_getvalue(ctypes.c_void_p(self.sem_address), ctypes.byref(value))
        return value.value

    def set_phase(self, phase: int, iteration: int) -> None:
        """Enter ``phase``; progress restarts from now and the manual ping is off."""
        _LAYOUT.pack_into(self._mem, 0, time.monotonic(), 0.0, phase, iteration, 0.0)

    def ping(self) -> None:
        struct.pack_into("<d", self._mem, 8, time.monotonic())

    def close(self) -> None:
        """Unmap (after running any progress call still queued for the main thread)."""
        _make_pending_calls()
        _libc.sem_destroy(ctypes.c_void_p(self.sem_address))
        del self._sem
        self._mem.close()


class ProgressWatchdog:
    """Queues the progress pending call every ``interval`` (a thread)."""

    def __init__(self, shared: SharedProgress, interval: timedelta) -> None:
        self.shared = shared
        self.interval = interval.total_seconds()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="steadfast-progress-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            _add_pending_call(_SEM_POST, self.shared.sem_address)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@dataclass
class MonitorProcessConfig:
    """What the monitor process of one rank needs to know."""

    initial_rank: int
    world_size: int
    rank_pid: int
    store_factory: Callable[..., StoreMixin]
    store_kwargs: dict[str, Any]
    serve_store: bool  #: make the restart store's server (steadfast's store, rank 0)
    #: initial rank 0's monitor: checks the others' heartbeats and stays until every
    #: rank left, whoever hosts the store (a user's NVRx-shaped store may be hosted by
    #: this very process, having been built here first)
    coordinate: bool
    interval: float
    thread_interval: float
    soft_timeout: float
    hard_timeout: float
    heartbeat_timeout: float
    termination_grace_time: float
    linger: float
    logfile: str | None
    heartbeat_interval: float = 1.0  #: how often it beats into the store


def hard_age(cfg: MonitorProcessConfig, now: float, progress: float, aborted: float) -> float:
    """How long the rank has gone without progress, as its hard timeout counts it.

    Interrupted and aborted by its monitor thread, the main thread may wait in a call the
    abort does not release: a gloo collective with a frozen peer, released only when that
    peer is terminated, a hard timeout and a termination grace after the peer's last
    progress. The aborted rank's hard timeout therefore counts from its abort plus the
    grace: it outlasts the peer's, whose soft timeout came no later than the abort.

    Once judged by whether the monitor thread still marked itself alive (a frozen process
    stops marking), a survivor was terminated 4-20 ms before its frozen peer, whose end
    would have released it, twice with the window at 0.3 s and at 1 s, on a machine that
    left the thread unscheduled. Without it, a process that freezes after its abort is
    terminated a hard timeout and a grace after the abort instead: later, never not."""
    if aborted:
        return now - max(progress, aborted + cfg.termination_grace_time)
    return now - progress


def _set_process_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def start_monitor_process(cfg: MonitorProcessConfig, shared: SharedProgress) -> tuple[int, int]:
    """Fork the monitor process; return ``(pid, stop_fd)``.

    Writing ``b"x"`` to ``stop_fd`` tells the monitor that its rank is leaving cleanly;
    the pipe closing without it (the rank died) is reported like the rank's death.
    Returns once the monitor is up (and its store is serving).
    Forked, not spawned: a spawned Python would import torch again (seconds); the fork
    happens before the Wrapper starts any thread and before torch.distributed exists.
    """
    stop_r, stop_w = os.pipe()
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child; covered by the dist tests
        code = 1
        try:
            gc.freeze()  # the rank's objects: no collection here walks (and copies) them
            os.close(stop_w)
            os.close(ready_r)
            code = _Monitor(cfg, shared, stop_r, ready_w).run()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(stop_r)
    os.close(ready_w)
    try:
        ok = os.read(ready_r, 1)
        failure = b"".join(iter(lambda: os.read(ready_r, 65536), b"")) if ok != b"1" else b""
    finally:
        os.close(ready_r)
    if ok != b"1":
        os.close(stop_w)
        os.waitpid(pid, 0)
        error = _unpickled_exception(failure)
        if error is not None:  # what store_factory raised, unchanged, as in NVRx
            note = getattr(error, "add_note", None)  # Python 3.11+
            if note is not None:
                note(
                    f"raised in the in-process restart monitor of rank {cfg.initial_rank} "
                    f"(store_factory({cfg.store_kwargs}))"
                )
            raise error
        raise RuntimeError(
            f"the in-process restart monitor of rank {cfg.initial_rank} failed to start "
            f"(store {cfg.store_kwargs.get('host_name')}:{cfg.store_kwargs.get('port')})"
        )
    return pid, stop_w


def _unpickled_exception(data: bytes) -> BaseException | None:
    """The exception the monitor process sent back (None if it sent none, or one that
    does not unpickle here)."""
    if not data:
        return None
    try:
        error = pickle.loads(data)
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


class _Monitor:
    """The monitor process's loop (see the module docstring)."""

    def __init__(
        self, cfg: MonitorProcessConfig, shared: SharedProgress, stop_fd: int, ready_fd: int
    ) -> None:
        self.cfg = cfg
        self.shared = shared
        self.stop_fd = stop_fd
        self.ready_fd = ready_fd
        self.rank = cfg.initial_rank
        self.log = logging.getLogger("steadfast.inprocess.monitor")

    def _setup(self) -> None:
        _set_process_name(f"sf-monitor-{self.rank}")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is for the ranks, we report them
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if self.cfg.logfile:
            path = self.cfg.logfile.replace("{rank}", str(self.rank))
            handler = logging.FileHandler(path)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            self.log.addHandler(handler)
            self.log.setLevel(logging.INFO)
            self.log.propagate = False

    def run(self) -> int:
        self._setup()
        cfg = self.cfg
        server = None
        try:
            if cfg.serve_store:
                server = make_store(cfg.store_factory, cfg.store_kwargs, is_master=True)
            store = make_store(cfg.store_factory, cfg.store_kwargs, is_master=False)
            store.heartbeat(self.rank)
            pidfd = os.pidfd_open(cfg.rank_pid)
        except Exception as exc:
            self.log.error("monitor of rank %d cannot start: %s", self.rank, exc)
            try:
                data = pickle.dumps(exc)
            except Exception:  # an exception that does not pickle: described instead
                data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
            os.write(self.ready_fd, b"0")
            with contextlib.suppress(OSError):
                view = memoryview(data)
                while view:
                    view = view[os.write(self.ready_fd, view) :]
            os.close(self.ready_fd)
            return 1
        os.write(self.ready_fd, b"1")
        os.close(self.ready_fd)
        self.log.info("monitor_process of rank %d started: target_pid=%d", self.rank, cfg.rank_pid)
        self.store = store
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._lost: set[int] = set()
        soft_done = -1
        ticks, ticked_at = self.shared.ticks(), time.monotonic()
        beat_at = ticked_at  # the heartbeat at the start was just sent
        while True:
            wait = min(cfg.interval, cfg.heartbeat_interval)
            ready, _, _ = select.select([pidfd, self.stop_fd], [], [], wait)
            since, manual, phase, iteration = self.shared.read()
            if self.stop_fd in ready and (os.read(self.stop_fd, 1) == b"x" or phase == EXITED):
                break  # the rank leaves cleanly (a dying rank closes the pipe: EOF, not "x")
            if pidfd in ready or self.stop_fd in ready:
                if phase != EXITED:
                    self._rank_gone(iteration, "rank_died", "the rank process died", None)
                break
            now = time.monotonic()
            if now - beat_at >= cfg.heartbeat_interval:
                store.heartbeat(self.rank)
                beat_at = now
            if (count := self.shared.ticks()) != ticks:
                ticks, ticked_at = count, now
            if phase in (RUNNING, RESTARTING, SPARE):
                auto = max(since, ticked_at)
                progress = min(auto, manual) if phase == RUNNING and manual > 0 else auto
                age = now - progress
                if phase == RUNNING and age > cfg.soft_timeout and soft_done != iteration:
                    soft_done = iteration
                    # Where the main thread is now: its interpreter has stopped if the
                    # count has not moved for half the timeout. (Not "did it tick after
                    # its last ping": a rank pings, runs Python up to its collective and
                    # blocks there, so a tick after the ping says nothing about now.)
                    where = (
                        "the interpreter runs but ping() stopped"
                        if now - ticked_at < cfg.soft_timeout / 2
                        else "the main thread is stuck outside Python"
                    )
                    detail = (
                        f"no progress for {age:.2f}s (soft_timeout {cfg.soft_timeout:g}s): {where}"
                    )
                    self._report(iteration, self.rank, "soft_timeout", detail)
                aborted = self.shared.aborted_at()
                age = hard_age(cfg, now, progress, aborted)
                if age > cfg.hard_timeout:
                    detail = f"no progress for {age:.2f}s (hard_timeout {cfg.hard_timeout:g}s)"
                    if aborted:
                        detail += f", counted from its abort {now - aborted:.2f}s ago"
                    self._rank_gone(iteration, "hard_timeout", detail, pidfd)
                    break
            if cfg.coordinate:
                self._check_heartbeats(iteration)
        os.close(pidfd)
        if cfg.coordinate:
            self._stay_until_all_left()
        del server  # a server made here closes only now, once every rank has left
        return 0

    def _report(
        self, iteration: int, rank: int, cause: str, detail: str, terminated: bool = False
    ) -> None:
        """Record an interruption of ``iteration`` caused by ``rank`` (and, if
        ``terminated``, that ``rank`` left for good) in the store and the event log."""
        self.log.warning("rank %d: %s", rank, detail)
        if terminated:
            self.store.record_terminated(rank)
        first = self.store.record_interruption(iteration, rank, cause, detail)
        events.emit(
            "inprocess_interrupted",
            cause=cause,
            rank=self.rank,
            iteration=iteration,
            fault_rank=rank,
            detail=detail,
            first=first,
        )

    def _rank_gone(self, iteration: int, cause: str, detail: str, pidfd: int | None) -> None:
        """Declare this rank terminated (and terminate it if it still runs)."""
        self._report(iteration, self.rank, cause, detail, terminated=True)
        sent = None
        if pidfd is not None:
            sent = self._terminate(pidfd)
        events.emit(
            "inprocess_terminated",
            cause=cause,
            rank=self.rank,
            iteration=iteration,
            terminated_rank=self.rank,
            signal=sent,
        )

    def _terminate(self, pidfd: int) -> str | None:
        """SIGTERM the rank, SIGKILL it after the grace time; the last signal sent."""
        sent = None
        for sig, wait in (
            (signal.SIGTERM, self.cfg.termination_grace_time),
            (signal.SIGKILL, 10.0),
        ):
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                break
            sent = sig.name
            self.log.warning("rank %d: sent %s", self.rank, sig.name)
            if select.select([pidfd], [], [], wait)[0]:
                break
        return sent

    def _check_heartbeats(self, iteration: int) -> None:
        """Initial rank 0's monitor: declare ranks whose monitor stopped beating lost."""
        now = time.monotonic()
        others = [r for r in range(self.cfg.world_size) if r != self.rank and r not in self._lost]
        if not others:
            return
        beats = self.store.heartbeats(others)
        gone = self.store.terminated() | self.store.left()
        for r, count in beats.items():
            seen = self._hb_seen.get(r)
            if seen is None or seen[0] != count:
                self._hb_seen[r] = (count, now)
            elif now - seen[1] > self.cfg.heartbeat_timeout and r not in gone:
                self._lost.add(r)
                detail = f"no heartbeat from rank {r}'s monitor for {now - seen[1]:.1f}s"
                self._report(iteration, r, "heartbeat_lost", detail, terminated=True)

    def _stay_until_all_left(self) -> None:
        """The coordinator stays until every other rank has left or is gone, still
        checking heartbeats: a store it hosts must outlive every rank that uses it."""
        deadline = time.monotonic() + self.cfg.linger
        everyone = frozenset(range(self.cfg.world_size))
        while time.monotonic() < deadline:
            _, _, _, iteration = self.shared.read()
            if everyone <= self.store.left() | self.store.terminated() | self._lost:
                return
            self._check_heartbeats(iteration)
            time.sleep(min(0.05, self.cfg.interval))
        self.log.warning("store host: ranks still present after %.0fs; closing", self.cfg.linger)
