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
import logging
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .. import events
from ..checkpoint.memory import MEMORY_DIR_ENV, MemoryDir
from ..config import ConfigError
from ..dist import is_distributed
from . import monitor as mon
from . import transport
from .barriers import await_completion, last_call, restart_barrier
from .monitor_thread import MonitorThread
from .settings import CallSettings
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

__all__ = ["CallWrapper", "MonitorProcess"]

logger = logging.getLogger("steadfast.inprocess")


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

    def __init__(self, wrapper: CallSettings) -> None:
        self.wrapper = wrapper
        self._monitor_thread = MonitorThread(self._on_interrupt)
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
        with self._monitor_thread.atomic(self.state.iteration):
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
            self._monitor_thread.start(
                self.store_client, w.seconds["monitor_thread_interval"], lambda: self.iteration
            )
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
            self._shutdown(watchdog, monitor_pid, monitor_stop)
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
        if is_distributed():
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
                fault = InterruptedIteration() if self._monitor_thread.interrupting == it else exc
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
        self._monitor_thread.iteration_changed()

    def _run_fn(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], state: State
    ) -> Any:
        it = state.iteration
        try:
            self._monitor_thread.enter(it)
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave_fn()
        except BaseException:
            self._leave_fn()  # idempotent: the interruption may have landed in the finally
            raise

    def _leave_fn(self) -> None:
        """Stop being interruptible; cancel an interruption raised but not yet delivered."""
        with self._monitor_thread.lock:
            self._monitor_thread.leave()
            if self.shared is not None:
                _, _, phase, iteration = self.shared.read()
                if phase == mon.RUNNING:  # the manual ping stops with the function
                    self.shared.set_phase(mon.RUNNING, iteration)

    def _record_own_fault(self, iteration: int, exc: BaseException) -> None:
        """Record this rank's fault (not an interruption by another rank) in the store.

        An exception caught once another rank's record has ended the iteration is that
        record's consequence, not a fault of this rank: the faulty rank records first,
        then aborts its process group, and this rank's collective fails on the closed
        connection ("Connection closed by peer") before its monitor thread has delivered
        the interruption (the monitor thread usually wins that race, not always).
        """
        if isinstance(exc, InterruptedIteration) or self._monitor_thread.interrupting == iteration:
            return  # a consequence of another rank's interruption, not a fault of ours
        detail = f"{type(exc).__name__}: {exc}"
        if self.store_client.iteration_state(iteration) == INTERRUPTED:
            logger.info(
                "rank %d: iteration %d failed after another rank ended it (its consequence): %s",
                self.state.initial_rank, iteration, detail,
            )  # fmt: skip
            return
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
        """True once every active rank has returned: see :func:`~.barriers.await_completion`."""
        return await_completion(
            self.store_client, state, self.wrapper.seconds["completion_timeout"]
        )

    # -- interruption, from the monitor thread ----------------------------------------
    def _on_interrupt(self, first: bool) -> None:
        """The monitor thread raised the interruption in the main thread (under its lock):
        the first time, run the abort hook (it releases a blocked collective)."""
        if not first:
            return
        if self.shared is not None:  # before the hook, which may take a while
            self.shared.mark_aborted()
        abort = self.wrapper.abort
        if abort is not None:
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
        self._monitor_thread.mark_interrupting(it)
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
        terminated = restart_barrier(self.store_client, state, w.seconds["barrier_timeout"])
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

    # -- leaving ------------------------------------------------------------------------
    def _last_call(self, exc: BaseException) -> None:
        """This rank ends with ``exc``: see :func:`~.barriers.last_call`."""
        store = getattr(self, "store_client", None)
        if store is not None:
            last_call(store, self.state, exc, self.wrapper.seconds["last_call_wait"])

    def _shutdown(
        self,
        watchdog: mon.ProgressWatchdog,
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
        self._monitor_thread.stop()
        assert self.shared is not None
        self.shared.set_phase(mon.EXITED, it)
        watchdog.stop()
        self._monitor_thread.join()
        with contextlib.suppress(OSError):
            os.write(monitor_stop, b"x")
            os.close(monitor_stop)
        _reap(monitor_pid, self.wrapper.seconds["completion_timeout"] + 10)
        self.monitor_process = None
        self._pg_store = None
        self.store_client = None  # type: ignore[assignment]
        if is_distributed():
            import torch.distributed as dist

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
