"""``CallWrapper``: one call of a wrapped function, run as restart iterations.

One call of the wrapped function runs *iterations*. A fault on any rank (an exception,
a rank that died, a soft timeout) ends the iteration on every rank: the rank that saw it
records it in the store; every other rank's monitor thread, blocked on that store key,
raises :class:`InterruptedIteration` in its main thread and runs the ``abort`` hook (which
releases the main thread from a blocked collective). Then each healthy rank runs
``abort``, ``finalize`` and ``health_check``, meets the others at a barrier that settles
who is gone, computes its new rank (``rank_assignment``, ``rank_filter``) and calls the
function again with ``iteration + 1``. No process starts, no ``import torch``, no data
loader start: the fastest recovery there is. The configuration is the
:class:`~steadfast.inprocess.wrapper.Wrapper`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import events
from ..checkpoint.memory import MEMORY_DIR_ENV, MemoryDir
from ..config import ConfigError
from . import monitor as mon
from . import transport
from .state import (
    BarrierTimeout,
    HealthCheckError,
    InterruptedIteration,
    RestartAbort,
    RestartError,
    State,
)
from .store import (
    COMPLETED,
    INTERRUPTED,
    StoreMixin,
    TCPStore,
    default_address,
    make_store,
    own_connection,
)

if TYPE_CHECKING:
    from .wrapper import Wrapper

__all__ = ["CallWrapper", "MonitorProcess"]

logger = logging.getLogger("steadfast.inprocess")

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int


class _AlreadyInitialized(RestartError, ValueError):
    """torch.distributed was initialised before the Wrapper was called (a ValueError,
    as NVRx raises)."""


class CallWrapper:
    """The restart state of one call of a wrapped function (created by the Wrapper).

    Passed to the function as the value of any parameter annotated ``CallWrapper`` or
    ``Optional[CallWrapper]``: ``iteration`` is the restart iteration (0 first),
    ``ping()`` reports progress, ``atomic()`` keeps the interruption out of a block,
    ``state`` holds the ranks of this iteration and ``store`` is a fresh store prefix per
    iteration for ``init_process_group``; ``monitor_process`` is this rank's monitor
    process (NVRx's shape: ``monitor_process.process_monitor_proc.pid``).
    """

    def __init__(self, wrapper: Wrapper) -> None:
        self.wrapper = wrapper
        self._lock = threading.RLock()  # shared by atomic() and the interruption
        self._in_fn = -1  # iteration whose function the main thread is executing
        self._interrupting = -1  # iteration whose interruption is under way
        self._aborted = -1  # iteration already aborted
        self._main_tid = threading.get_ident()
        self._cond = threading.Condition()
        self._stopping = False
        self.state: State = State.first(0, 1)
        self._pg_store: Any = None
        self.shared: mon.SharedProgress | None = None
        self.monitor_process: MonitorProcess | None = None

    # -- the public surface -----------------------------------------------------------
    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (0 for the first run)."""
        return self.state.iteration

    @property
    def store(self) -> Any:
        """A ``torch.distributed.PrefixStore`` unique to this iteration, for
        ``init_process_group(store=...)``: keys of an aborted group never leak into the
        next one."""
        import torch.distributed as dist

        base = getattr(self._pg_store, "kv", self._pg_store)
        return dist.PrefixStore(f"pg/{self.state.iteration}/", base)  # type: ignore[attr-defined]

    def ping(self) -> None:
        """Report forward progress. The first ping of an iteration turns on the manual
        progress timeout: from then on this rank must ping within ``soft_timeout`` (else
        the iteration is interrupted) and ``hard_timeout`` (else it is terminated)."""
        if self.shared is not None:
            self.shared.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block the interruption never lands in.

        A reentrant lock shared with the interruption: the monitor thread does not
        interrupt (nor abort) while the main thread is inside, and the main thread does
        not enter once an interruption of this iteration is under way (it is interrupted
        right there instead).
        """
        with self._lock:
            if self._interrupting == self.state.iteration:
                raise InterruptedIteration()
            yield

    # -- the restart loop -------------------------------------------------------------
    def __call__(
        self,
        fn: Callable[..., Any],
        params: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        w = self.wrapper
        self._check_environment()
        initial_rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", MEMORY_DIR_ENV)}
        self.state = State.first(initial_rank, world)
        logger.debug("rank %d: Wrapper call of %s (world size %d)", initial_rank, fn, world)
        store_kwargs = self._store_kwargs()
        self.shared = mon.SharedProgress()
        cfg = mon.MonitorProcessConfig(
            initial_rank=initial_rank,
            world_size=world,
            rank_pid=os.getpid(),
            store_factory=w.store_factory,
            store_kwargs=store_kwargs,
            serve_store=(
                isinstance(w.store_factory, type)
                and issubclass(w.store_factory, TCPStore)
                and "host_name" not in w.store_kwargs
                and initial_rank == 0
            ),
            coordinate=initial_rank == 0,
            interval=w.seconds["monitor_process_interval"],
            heartbeat_interval=w.seconds["heartbeat_interval"],
            thread_interval=w.seconds["monitor_thread_interval"],
            soft_timeout=w.seconds["soft_timeout"],
            hard_timeout=w.seconds["hard_timeout"],
            heartbeat_timeout=w.seconds["heartbeat_timeout"],
            termination_grace_time=w.seconds["termination_grace_time"],
            linger=w.seconds["completion_timeout"] + w.seconds["barrier_timeout"],
            logfile=w.monitor_process_logfile,
        )
        monitor_pid, monitor_stop = mon.start_monitor_process(cfg, self.shared)
        self.monitor_process = MonitorProcess(monitor_pid)
        watchdog = mon.ProgressWatchdog(self.shared, w.progress_watchdog_interval)
        monitor_thread: threading.Thread | None = None
        # the memory tier's snapshots live as long as this call: they survive the
        # restarts, not the run (a launcher above already owns a directory)
        memory_dir = None if os.environ.get(MEMORY_DIR_ENV) else MemoryDir()
        if memory_dir is not None:
            os.environ[MEMORY_DIR_ENV] = str(memory_dir.path)
        try:
            transport.mark_baseline(_known_store_ports(store_kwargs))
            self.store_client: StoreMixin = make_store(w.store_factory, store_kwargs, False)
            self._pg_store = own_connection(self.store_client)  # a connection of its own
            watchdog.start()
            monitor_thread = threading.Thread(
                target=self._monitor_thread, name="steadfast-inprocess-monitor", daemon=True
            )
            monitor_thread.start()
            result = self._loop(fn, args, {**kwargs, **dict.fromkeys(params, self)})
        except BaseException as exc:
            self._last_call(exc)
            if w.terminate is not None:  # this rank ends with an error (NVRx's terminate)
                try:
                    w.terminate(self.state)
                except Exception as terminate_error:
                    raise terminate_error from exc
            raise
        else:
            if w.completion is not None:  # every active rank completed (NVRx's completion)
                try:
                    w.completion(self.state)
                except Exception as completion_error:
                    logger.error("completion hook failed: %s", completion_error)
            logger.debug("rank %d: returning (iteration %d)", initial_rank, self.iteration)
            return result
        finally:
            self._shutdown(watchdog, monitor_thread, monitor_pid, monitor_stop)
            transport.clear_baseline()
            if memory_dir is not None:
                memory_dir.remove()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _check_environment(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RestartError("the Wrapper must be called from the main thread")
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise ConfigError(
                f"Wrapper: environment variable(s) {', '.join(missing)} not set (run under "
                "steadfast launch, torchrun or srun)"
            )
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise _AlreadyInitialized(
                "torch.distributed is already initialised; the Wrapper needs "
                "not torch.distributed.is_initialized(): the wrapped function must "
                "initialise it itself (the Wrapper restarts it on every iteration)"
            )
        if not logging.getLogger(logger.name).hasHandlers():  # as NVRx warns
            warnings.warn(
                "logging not initialized, logs are disabled: only the in-process restart's "
                "warnings and errors reach stderr (configure logging to see its log)",
                UserWarning,
                stacklevel=4,
            )

    def _store_kwargs(self) -> dict[str, Any]:
        """The kwargs every process makes the restart store with: for steadfast's
        :class:`TCPStore`, ``store_kwargs`` with the address resolved here (``host_name``
        / ``port``, else ``MASTER_ADDR`` / ``MASTER_PORT + 1``) and the barrier timeout;
        for any other factory, ``store_kwargs`` as given (NVRx's convention)."""
        factory = self.wrapper.store_factory
        kwargs = dict(self.wrapper.store_kwargs)
        if isinstance(factory, type) and issubclass(factory, TCPStore):
            kwargs["host_name"], kwargs["port"] = default_address(
                kwargs.get("host_name"), kwargs.get("port")
            )
            kwargs.setdefault("timeout", self.wrapper.barrier_timeout)
        return kwargs

    def _loop(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run iterations until one completes on every active rank."""
        w = self.wrapper
        state = w.rank_filter(self.state)
        while True:
            self._begin_iteration(state)
            it = state.iteration
            try:
                if w.initialize is not None:
                    w.initialize(state)
                if state.active:
                    result = self._run_fn(fn, args, kwargs, state)
                    if self._await_completion(state):
                        return result
                elif self._await_completion(state):
                    return None
            except _TERMINAL:
                raise
            except BaseException as exc:
                fault = InterruptedIteration() if self._interrupting == it else exc
                self.state = state = state.replace(fn_exception=fault)
                self._record_own_fault(it, fault)
                del fault  # its traceback holds the failed iteration's frames
            state = self._restart(state)

    def _begin_iteration(self, state: State) -> None:
        self.state = state
        if state.active:
            os.environ["RANK"] = str(state.active_rank)
            os.environ["WORLD_SIZE"] = str(state.active_world_size)
        assert self.shared is not None
        self.shared.set_phase(mon.RUNNING if state.active else mon.SPARE, state.iteration)
        with self._cond:
            self._cond.notify_all()

    def _run_fn(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], state: State
    ) -> Any:
        it = state.iteration
        try:
            with self._lock:
                if self._interrupting == it:
                    raise InterruptedIteration()
                self._in_fn = it
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave_fn()
        except BaseException:
            self._leave_fn()  # idempotent: the interruption may have landed in the finally
            raise

    def _leave_fn(self) -> None:
        """Stop being interruptible; cancel an interruption raised but not yet delivered."""
        with self._lock:
            self._in_fn = -1
            _set_async_exc(self._main_tid, ctypes.py_object())  # NULL: clear a pending one
            if self.shared is not None:
                _, _, phase, iteration = self.shared.read()
                if phase == mon.RUNNING:  # the manual ping stops with the function
                    self.shared.set_phase(mon.RUNNING, iteration)

    def _record_own_fault(self, iteration: int, exc: BaseException) -> None:
        """Record this rank's fault (not an interruption by another rank) in the store."""
        if isinstance(exc, InterruptedIteration) or self._interrupting == iteration:
            return  # a consequence of another rank's interruption, not a fault of ours
        detail = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "rank %d: iteration %d failed: %s", self.state.initial_rank, iteration, detail
        )
        first = self.store_client.record_interruption(
            iteration, self.state.initial_rank, "exception", detail
        )
        events.emit(
            "inprocess_interrupted",
            cause="exception",
            rank=self.state.initial_rank,
            iteration=iteration,
            fault_rank=self.state.initial_rank,
            detail=detail,
            first=first,
        )

    def _await_completion(self, state: State) -> bool:
        """After the function returned (or on a spare): True once every active rank has
        returned, False if the iteration was interrupted first."""
        it = state.iteration
        store = self.store_client
        if state.active:
            store.record_completed(it, state.initial_rank)
        active_world = state.active_world_size or 0
        actives = {r for r, cur in enumerate(state.assignment) if 0 <= cur < active_world}
        deadline = time.monotonic() + (
            self.wrapper.seconds["completion_timeout"] if state.active else float("inf")
        )
        delay = 0.002
        while True:
            status = store.iteration_state(it)
            if status == INTERRUPTED:
                return False
            if status == COMPLETED or actives <= store.completed(it):
                return store.mark_completed(it) == COMPLETED
            if time.monotonic() > deadline:
                raise BarrierTimeout(
                    f"iteration {it}: ranks {sorted(actives - store.completed(it))} did not "
                    f"return within completion_timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    # -- interruption, from the monitor thread ----------------------------------------
    def _monitor_thread(self) -> None:
        store = own_connection(self.store_client)
        interval = self.wrapper.seconds["monitor_thread_interval"]
        watched = -1
        while True:
            with self._cond:
                while not self._stopping and self.state.iteration == watched:
                    self._cond.wait()
                if self._stopping:
                    return
                watched = self.state.iteration
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
                    if self._stopping or self.state.iteration != watched:
                        break
                if not self._interrupt(watched, first=False):
                    break

    def _interrupt(self, iteration: int, first: bool) -> bool:
        """Interrupt the main thread's function for ``iteration``; False if it is not in it."""
        with self._lock:
            if self._in_fn != iteration:
                self._interrupting = iteration
                return False
            self._interrupting = iteration
            _set_async_exc(self._main_tid, ctypes.py_object(InterruptedIteration))
            if first:
                self._run_abort(iteration)
            if self.shared is not None:
                self.shared.mark_aborting(first)
            return True

    def _run_abort(self, iteration: int) -> None:
        abort = self.wrapper.abort
        if abort is None:
            return
        try:
            abort(self.state)
        except Exception as exc:
            logger.error("abort hook failed: %s", exc)

    # -- between iterations -------------------------------------------------------------
    def _restart(self, state: State) -> State:
        w = self.wrapper
        it = state.iteration
        assert self.shared is not None
        self.shared.set_phase(mon.RESTARTING, it)
        with self._lock:
            self._interrupting = it
        if w.abort is not None:
            w.abort(state)
        if w.finalize is not None:
            w.finalize(state)
        if w.health_check is not None:
            try:
                w.health_check(state)
            except Exception as exc:
                raise HealthCheckError(f"rank {state.initial_rank} unhealthy: {exc}") from exc
        if state.fn_exception is not None and state.fn_exception.__traceback__ is not None:
            # Logged already; drop the frames' locals (tensors, the aborted group and its
            # sockets) so that nothing of the failed iteration outlives it.
            traceback.clear_frames(state.fn_exception.__traceback__)
        self.state = state = state.replace(fn_exception=None)
        terminated = self._barrier(it)
        causes = self.store_client.interruptions(it)
        if state.initial_rank in terminated:
            raise RestartError(
                f"rank {state.initial_rank} was declared terminated during iteration {it}"
            )
        following = state.replace(iteration=it + 1, terminated=terminated)
        new_state: State = w.rank_filter(w.rank_assignment(following))
        self.state = new_state
        first_time = min((c["time"] for c in causes), default=time.time())
        events.emit(
            "inprocess_restart",
            cause=causes[0]["cause"] if causes else None,
            rank=state.initial_rank,
            iteration=it + 1,
            world_size=new_state.world_size,
            active_world_size=new_state.active_world_size,
            terminated=sorted(terminated),
            causes=[{k: c[k] for k in ("rank", "cause", "detail")} for c in causes],
            seconds=round(time.time() - first_time, 6),
        )
        if new_state.rank != state.rank:
            events.emit(
                "inprocess_rank_reassigned",
                rank=state.initial_rank,
                iteration=it + 1,
                from_rank=state.rank,
                to_rank=new_state.rank,
                world_size=new_state.world_size,
            )
        return new_state

    def _barrier(self, iteration: int) -> frozenset[int]:
        """Meet every rank that is not terminated; return the terminated set they agree on."""
        store = self.store_client
        rank = self.state.initial_rank
        everyone = frozenset(range(self.state.initial_world_size))
        store.arrive(iteration, rank)
        deadline = time.monotonic() + self.wrapper.seconds["barrier_timeout"]
        delay = 0.001
        while True:
            terminated = store.terminated()
            if everyone <= store.arrived(iteration) | terminated:
                return store.freeze(iteration, terminated)
            if time.monotonic() > deadline:
                missing = sorted(everyone - store.arrived(iteration) - terminated)
                raise BarrierTimeout(
                    f"restart barrier after iteration {iteration}: ranks {missing} did not "
                    f"arrive within barrier_timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    # -- leaving ------------------------------------------------------------------------
    def _last_call(self, exc: BaseException) -> None:
        """This rank ends with ``exc``: tell the others (they restart without it), then
        wait up to ``last_call_wait`` for concurrent terminal failures of other ranks and
        name them in ``exc``'s notes, so every rank's error tells the whole story."""
        store = getattr(self, "store_client", None)
        if store is None:
            return
        rank, it = self.state.initial_rank, self.state.iteration
        everyone = frozenset(range(self.state.initial_world_size))
        try:
            store.record_terminated(rank)
            store.record_interruption(it, rank, "left", f"{type(exc).__name__}: {exc}")
            deadline = time.monotonic() + self.wrapper.seconds["last_call_wait"]
            while time.monotonic() < deadline and not everyone <= store.terminated():
                time.sleep(0.01)
            others = [c for c in store.interruptions(it) if c["rank"] != rank]
        except Exception:
            return
        add_note = getattr(exc, "add_note", None)  # Python 3.11+
        if others and add_note is not None:
            add_note(
                f"other ranks in iteration {it}: "
                + "; ".join(f"rank {c['rank']}: {c['detail']}" for c in others)
            )

    def _shutdown(
        self,
        watchdog: mon.ProgressWatchdog,
        monitor_thread: threading.Thread | None,
        monitor_pid: int,
        monitor_stop: int,
    ) -> None:
        """Leave the job: tell the others (if this is not a clean completion, it is an
        interruption for them), stop the threads, the monitor process and the stores."""
        rank = self.state.initial_rank
        it = self.state.iteration
        store = getattr(self, "store_client", None)
        if store is not None:
            with contextlib.suppress(Exception):
                ended = store.iteration_state(it) == COMPLETED or rank in store.terminated()
                if not ended:  # (a terminal error was recorded by _last_call already)
                    store.record_terminated(rank)
                    store.record_interruption(it, rank, "left", "the rank left the Wrapper")
                store.record_left(rank)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        assert self.shared is not None
        self.shared.set_phase(mon.EXITED, it)
        watchdog.stop()
        if monitor_thread is not None:
            monitor_thread.join()
        with contextlib.suppress(OSError):
            os.write(monitor_stop, b"x")
            os.close(monitor_stop)
        _reap(monitor_pid, self.wrapper.seconds["completion_timeout"] + 10)
        self.monitor_process = None
        self._pg_store = None
        self.store_client = None  # type: ignore[assignment]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.shared.close()
        self.shared = None


class MonitorProcess:
    """This rank's monitor process, in NVRx's shape (``CallWrapper.monitor_process``):
    ``process_monitor_proc`` is a ``psutil.Process`` where psutil is installed, else an
    object with its ``pid``; ``pid`` is there either way."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.process_monitor_proc: Any
        try:
            import psutil  # type: ignore[import-untyped]

            self.process_monitor_proc = psutil.Process(pid)
        except Exception:  # psutil missing (it is no dependency of steadfast's)
            self.process_monitor_proc = _Pid(pid)

    def __repr__(self) -> str:
        return f"MonitorProcess(pid={self.pid})"


class _Pid:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __repr__(self) -> str:
        return f"Process(pid={self.pid})"


_TERMINAL = (RestartAbort, HealthCheckError, BarrierTimeout, KeyboardInterrupt, SystemExit)


def _known_store_ports(store_kwargs: dict[str, Any]) -> set[int]:
    """Ports of the stores known before the function runs: the restart store's and the
    launcher's (``MASTER_PORT``); the abort never closes their connections."""
    ports = set()
    for value in (store_kwargs.get("port"), os.environ.get("MASTER_PORT")):
        with contextlib.suppress(TypeError, ValueError):
            ports.add(int(value))  # type: ignore[arg-type]
    return ports


def _reap(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)
