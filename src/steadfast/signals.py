"""Cooperative shutdown on SIGTERM / SIGUSR1, with a forced-exit timeout.

Parity with ``kempnerforge.resilience.signal_handler`` (seed 001): :class:`ShutdownHandler`
handles SIGTERM (Slurm preemption, graceful shutdown) and SIGUSR1 (Slurm requeue) by
setting a flag that the training loop checks after each step; the loop then saves an
emergency checkpoint and exits. If the graceful shutdown takes longer than
``timeout_sec`` (stuck in a collective, say), the process is ended with ``os._exit(1)``.

Beyond the original:

- ``agree=True`` makes every rank stop after the *same* step: ``should_shutdown()`` starts
  one small all-reduce and reads the one it started at the step before, so a signal
  delivered to one rank (Slurm often signals one task, or one node first) stops them all
  together, one step later, and no step waits for the agreement. When the loop's NaN check
  runs over the same ranks between two calls, its all-reduce carries the flag
  (:mod:`steadfast.riders`) and the agreement makes no collective of its own.
- Before a forced exit, the Python stacks of all threads are written to stderr (where the
  process was stuck is the first thing one asks) and a ``shutdown_forced`` event is logged.
- Events ``shutdown_requested``, ``shutdown_agreed``, ``shutdown_forced``, ``shutdown_complete``.

:class:`DistributedSignalHandler` is Megatron Bridge's context manager: it records one
chosen signal (default SIGTERM) and ``signals_received()`` gathers one flag per rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from . import events
from .config import parse_signal, require_number
from .dist import PendingCount, cpu_group, gather_flags, group_rank, is_distributed
from .riders import Rider

__all__ = [
    "FORCED_EXIT_CODE",
    "PREEMPTION_EXIT_CODE",
    "PREEMPT_SIGNAL_ENV",
    "DistributedSignalHandler",
    "PreemptionConfig",
    "PreemptionHandler",
    "ShutdownHandler",
    "job_preemption_signal",
    "sbatch_signal_option",
    "signal_name",
]

logger = logging.getLogger(__name__)

#: Exit code of a process ended by the forced-exit timer.
FORCED_EXIT_CODE = 1

_SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what} must be called from the main thread: Python delivers signals only to "
            f"the main thread (called from thread {threading.current_thread().name!r})"
        )


class ShutdownHandler:
    """Cooperative shutdown handler for long-running training jobs.

    Register this handler before the training loop. The training loop checks
    :meth:`should_shutdown` after each step and takes appropriate action (save
    checkpoint, clean up, exit). If the graceful shutdown exceeds ``timeout_sec``, a forced
    exit is triggered via ``os._exit`` to avoid hanging on stuck collectives.

    Usage::

        handler = ShutdownHandler(timeout_sec=120)
        handler.register()
        for step in range(max_steps):
            train_step()
            if handler.should_shutdown():
                save_checkpoint()
                handler.finish()
                break

    Args:
        timeout_sec: Maximum seconds allowed for graceful shutdown before forced exit.
            Set to 0 to disable the timeout.
        agree: When True, :meth:`should_shutdown` is a collective (every rank must call it
            at each step) and returns the same answer on every rank: True at the step
            after the one at which any rank had received a signal. Its all-reduce runs on
            CPU (``group`` itself when it has gloo, else a gloo group over its ranks) in
            the background from one step to the next, so no step waits for it.
        group: The process group to agree over (default: the world).
    """

    def __init__(self, timeout_sec: float = 600.0, *, agree: bool = False, group: Any = None):
        self._timeout_sec = float(
            require_number("ShutdownHandler.timeout_sec", timeout_sec, minimum=0)
        )
        self._agree = bool(agree)
        self._group = group
        self._shutdown_requested = False
        self._agreed = False
        self._pending: PendingCount | None = None  # the count started at the last step
        self._rider: Rider | None = None  # the flag the NaN checks' all-reduces carry
        self._cpu_group: Any = None  # where that count runs (dist.cpu_group), made once
        self._cpu_group_made = False  # (None is a made group too: the default one)
        self._signal_received: signal.Signals | None = None
        self._timer: threading.Timer | None = None
        self._original_handlers: dict[signal.Signals, _Handler] = {}
        self._lock = threading.RLock()  # the handler (main thread) and the watcher share it
        self._watcher: _WakeupWatcher | None = None

    @property
    def shutdown_requested(self) -> bool:
        """Whether a shutdown signal has been received (or, with ``agree``, agreed on)."""
        return self._shutdown_requested

    @property
    def signal_received(self) -> signal.Signals | None:
        """The signal that triggered shutdown on this rank, or None."""
        return self._signal_received

    @property
    def timeout_sec(self) -> float:
        """Seconds from the signal to the forced exit (0: never forced)."""
        return self._timeout_sec

    def should_shutdown(self, step: int | None = None) -> bool:
        """Check if the training loop should exit. Call this after each training step.

        With ``agree=True`` this is a collective: every rank must call it after each step,
        and all of them get True at the same step. Each call starts counting the ranks
        that have a signal and reads the count the call before started (at once, as it
        ran in the background during the step): a signal stops the ranks one step after
        the step it reached them in. When a :class:`~steadfast.NaNDetector` check over
        the same group ran since the call before (``check_loss`` in the same loop), its
        all-reduce carried the flag instead: nothing is started, and a signal that came
        before that check stops the ranks after this very step. ``step`` is only used
        for the event.
        """
        if not self._agree or self._agreed:
            return self._shutdown_requested
        if not is_distributed():
            signalled = int(self._shutdown_requested)  # one rank agrees with itself at once
        else:
            pending, self._pending = self._pending, None
            signalled = pending.read() if pending is not None else 0
            if self._rider is None:
                self._rider = Rider(lambda: self._shutdown_requested, self._group)
            carried = self._rider.take()  # the NaN checks since the last call counted it
            if carried is not None:
                signalled = max(signalled, carried)
            elif signalled == 0:
                if not self._cpu_group_made:
                    self._cpu_group, self._cpu_group_made = cpu_group(self._group), True
                self._pending = PendingCount(self._shutdown_requested, self._cpu_group)
        if signalled == 0:
            return False
        self._agreed = True
        self._leave()
        if not self._shutdown_requested:
            self._shutdown_requested = True
            logger.warning("another rank received a shutdown signal; stopping after this step")
            self._start_timer()
        if group_rank(self._group) == 0:
            events.emit(
                "shutdown_agreed",
                step=step,
                cause=self._signal_received.name if self._signal_received else "peer",
                ranks_signalled=signalled,
            )
        return True

    def register(self) -> None:
        """Register signal handlers for SIGTERM and SIGUSR1.

        Must be called from the main thread (Python only delivers signals there); calling
        it again is harmless. Besides the Python handler, a small watcher thread reads
        Python's signal wakeup fd: Python runs a handler only between bytecodes, so a
        main thread blocked in a C call (a collective that never completes) would never
        start the forced-exit countdown; the watcher starts it anyway.
        """
        _require_main_thread("ShutdownHandler.register()")
        for sig in _SHUTDOWN_SIGNALS:
            if sig not in self._original_handlers:
                self._original_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle_signal)
        if self._watcher is None:
            self._watcher = _WakeupWatcher(self._on_wakeup)
        logger.info("Shutdown handler registered (SIGTERM, SIGUSR1)")

    def unregister(self) -> None:
        """Restore original signal handlers (and cancel a pending forced exit)."""
        if self._original_handlers or self._watcher is not None:
            _require_main_thread("ShutdownHandler.unregister()")
        for sig, handler in self._original_handlers.items():
            _restore_handler(sig, handler)
        self._original_handlers.clear()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._cancel_timer()
        self._leave()
        pending, self._pending = self._pending, None
        if pending is not None:  # every rank started it: it ends, and leaves nothing behind
            try:
                pending.read()
            except Exception as exc:  # its group destroyed first: the count is not needed
                logger.debug("the last shutdown count was not read: %s", exc)

    def finish(self) -> None:
        """Call after graceful shutdown is complete.

        Cancels the forced-exit timer and restores signal handlers.
        """
        self._cancel_timer()
        self.unregister()
        if self._shutdown_requested:
            events.emit(
                "shutdown_complete",
                cause=self._signal_received.name if self._signal_received else None,
            )
        logger.info("Graceful shutdown complete")

    # ------------------------------------------------------------------ internals
    def _leave(self) -> None:
        if self._rider is not None:
            self._rider.close()
            self._rider = None

    def _handle_signal(self, signum: int, frame: FrameType | None) -> None:
        self._request(signal.Signals(signum))

    def _on_wakeup(self, signum: int) -> None:
        if signum in _SHUTDOWN_SIGNALS:
            self._request(signal.Signals(signum))

    def _request(self, sig: signal.Signals) -> None:
        """Record a shutdown request once; called by the Python handler and the watcher,
        whichever sees the signal first."""
        with self._lock:
            if self._signal_received is not None:
                return
            self._shutdown_requested = True
            self._signal_received = sig
            logger.warning("Received %s - requesting graceful shutdown", sig.name)
            events.emit("shutdown_requested", cause=sig.name, signal=int(sig))
            self._start_timer()

    def _start_timer(self) -> None:
        with self._lock:
            if self._timeout_sec <= 0 or self._timer is not None:
                return
            timer = threading.Timer(self._timeout_sec, self._force_exit)
            timer.name = "steadfast-forced-exit"
            timer.daemon = True
            timer.start()
            self._timer = timer
        logger.info("Forced exit in %.1fs if shutdown is not complete", self._timeout_sec)

    def _force_exit(self) -> None:
        msg = (
            f"steadfast: graceful shutdown timed out after {self._timeout_sec}s - "
            f"forcing exit (code {FORCED_EXIT_CODE}); stacks of all threads follow\n"
        )
        try:
            os.write(sys.stderr.fileno(), msg.encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass
        try:
            events.emit(
                "shutdown_forced",
                cause="timeout",
                timeout_sec=self._timeout_sec,
                exit_code=FORCED_EXIT_CODE,
            )
        finally:
            os._exit(FORCED_EXIT_CODE)

    def _cancel_timer(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join(timeout=1.0)


def _restore_handler(sig: signal.Signals, handler: _Handler) -> None:
    """Put back a handler saved by ``getsignal``. ``None`` means it was installed from C
    and cannot be reinstalled from Python: fall back to the default action."""
    if handler is None:
        logger.warning("original %s handler was set from C; restoring SIG_DFL", sig.name)
        handler = signal.SIG_DFL
    signal.signal(sig, handler)


class _WakeupWatcher:
    """Reads Python's signal wakeup fd in a daemon thread and reports each signal number.

    CPython's C-level handler writes the signal number to the wakeup fd as soon as the
    signal arrives, even while the main thread is blocked in C code. A previously set
    wakeup fd (asyncio's, say) is chained: every byte is forwarded to it, and it is put
    back on :meth:`stop`. Create and stop from the main thread.
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        for fd in (self._read_fd, self._write_fd):
            os.set_inheritable(fd, False)
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(
            target=self._run, name="steadfast-signal-watcher", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:  # write end closed by stop()
                return
            if self._previous >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._previous, data)
            for signum in data:
                try:
                    self._on_signal(signum)
                except Exception:  # never let the watcher die on a logging/event error
                    logger.exception("shutdown watcher failed to handle signal %d", signum)

    def stop(self) -> None:
        current = signal.set_wakeup_fd(self._previous, warn_on_full_buffer=False)
        if current != self._write_fd:  # someone replaced ours after us: keep theirs
            signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        os.close(self._write_fd)
        self._thread.join(timeout=5.0)
        os.close(self._read_fd)


class DistributedSignalHandler:
    """Records one signal in a ``with`` block and tells which ranks received it.

    Megatron Bridge's handler: on entry it installs a handler for ``sig`` (default
    SIGTERM) that only sets a flag; :meth:`signals_received` all-gathers one flag per rank
    (a list of bools in rank order, the same on every rank); on exit, or on
    :meth:`release`, the original handler is restored (release is idempotent and returns
    whether it did anything). Signal handlers can only be installed from the main thread:
    entered from another thread it installs nothing, logs a warning, and reports no signal
    for this rank.
    """

    def __init__(self, sig: signal.Signals | int = signal.SIGTERM, group: Any = None):
        self.sig = signal.Signals(sig)
        self._group = group
        self._signal_received = False
        self.released = True
        self.installed = False
        self.original_handler: _Handler = None

    def signals_received(self) -> list[bool]:
        """One flag per rank of the group: whether that rank received the signal."""
        return gather_flags(self._signal_received, self._group)

    @property
    def signal_received(self) -> bool:
        """Whether this rank received the signal since the block was entered."""
        return self._signal_received

    def __enter__(self) -> DistributedSignalHandler:
        self._signal_received = False
        self.released = False
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "DistributedSignalHandler entered outside the main thread: %s not handled",
                self.sig.name,
            )
            self.installed = False
            return self
        self.original_handler = signal.getsignal(self.sig)
        signal.signal(self.sig, self._handle)
        self.installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> bool:
        """Restore the original handler. Returns False when already released."""
        if self.released:
            return False
        if self.installed:
            _restore_handler(self.sig, self.original_handler)
            self.installed = False
        self.released = True
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._signal_received:
            events.emit("shutdown_requested", cause=self.sig.name, signal=int(self.sig))
        self._signal_received = True


# ---------------------------------------------------------------------------------------
# Preemption (Megatron Bridge, seed 003)
# ---------------------------------------------------------------------------------------
#: Exit code after a preemption stop: the checkpoint is saved and the stop was asked
#: for, so it is a success to the launcher, which must not restart the workers in place.
PREEMPTION_EXIT_CODE = 0

#: The signal that preempts this job (``USR1``, ``SIGTERM`` or a number), as the batch
#: script of ``steadfast slurm`` declares it (its ``--preempt-signal``).
PREEMPT_SIGNAL_ENV = "STEADFAST_PREEMPT_SIGNAL"


def job_preemption_signal() -> signal.Signals | None:
    """The signal this job's scheduler preempts it with, from ``$STEADFAST_PREEMPT_SIGNAL``
    (None when unset); a value that names no signal is a ConfigError naming the
    variable."""
    value = os.environ.get(PREEMPT_SIGNAL_ENV, "").strip()
    if not value:
        return None
    return parse_signal(value, PREEMPT_SIGNAL_ENV)


@dataclass
class PreemptionConfig:
    """Megatron Bridge's preemption settings (same names and defaults)."""

    exit_signal_handler: bool = False
    exit_signal: signal.Signals = signal.SIGTERM
    exit_signal_handler_for_dataloader: bool = False

    def __post_init__(self) -> None:
        self.exit_signal = parse_signal(self.exit_signal, "exit_signal")


def signal_name(number: int) -> str:
    """The name of signal ``number`` (``SIGTERM``), or ``SIG<number>`` for one that has
    none (a real-time signal): how events and messages name a signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def sbatch_signal_option(
    preempt_time: int = 60, sig: signal.Signals | int | str = signal.SIGTERM
) -> str:
    """The sbatch option that makes Slurm send ``sig`` (a signal, its number or its name)
    to the batch script ``preempt_time`` seconds before the time limit
    (``--signal=B:TERM@60``)."""
    require_number("preempt_time", preempt_time, minimum=1, integer=True)
    return f"--signal=B:{parse_signal(sig, 'sig').name.removeprefix('SIG')}@{preempt_time}"


class PreemptionHandler:
    """Graceful stop on a preemption signal, agreed by every rank at the end of a step.

    ``with PreemptionHandler(cfg) as pre:`` installs a :class:`DistributedSignalHandler`
    for ``exit_signal`` (when ``exit_signal_handler``); ``pre.should_exit(step)`` at the
    end of each step is one small all-gather that tells every rank whether any rank got
    the signal, so all save a checkpoint and call :meth:`exit` after the same step.
    """

    def __init__(self, config: PreemptionConfig, group: Any = None) -> None:
        self.config = config
        self._group = group
        self._handler: DistributedSignalHandler | None = None
        # the job's own preemption signal, when it is not exit_signal, and its old handler
        self._also: tuple[signal.Signals, _Handler] | None = None
        self._received = config.exit_signal  # the signal that arrived (for the logs)

    def __enter__(self) -> PreemptionHandler:
        if self.config.exit_signal_handler:
            self._handler = DistributedSignalHandler(self.config.exit_signal, self._group)
            self._handler.__enter__()
            original = self._handler._handle

            def handle(signum: int, frame: FrameType | None) -> None:
                logger.warning("Received signal %d, initiating graceful stop", signum)
                if not self._handler or not self._handler.signal_received:
                    self._received = signal.Signals(signum)
                    events.emit(
                        "preemption_signal", cause=signal.Signals(signum).name, signal=signum
                    )
                original(signum, frame)

            if self._handler.installed:
                signal.signal(self.config.exit_signal, handle)
                logger.info("Signal handler installed for %d", int(self.config.exit_signal))
                also = job_preemption_signal()
                if also is not None and also != self.config.exit_signal:
                    # under steadfast slurm the job is preempted with --preempt-signal
                    # (SIGUSR1 by default): unhandled, it would end the rank before its save
                    self._also = (also, signal.getsignal(also))
                    signal.signal(also, handle)
                    logger.info(
                        "Signal handler also installed for %s, the job's preemption signal "
                        "($%s)", also.name, PREEMPT_SIGNAL_ENV,
                    )  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        if self._also is not None:
            _restore_handler(*self._also)
            self._also = None
        if self._handler is not None:
            self._handler.release()
            self._handler = None

    def should_exit(self, step: int | None = None) -> bool:
        """End of step, every rank: whether any rank received the signal (collective)."""
        if self._handler is None:
            return False
        ranks = self._handler.signals_received()
        if not any(ranks):
            return False
        if group_rank(self._group) == 0:
            events.emit(
                "preemption_exit",
                step=step,
                cause=self._received.name,
                ranks_signalled=[r for r, got in enumerate(ranks) if got],
            )
        return True

    def exit(self, code: int = PREEMPTION_EXIT_CODE) -> None:
        """Log the reason, restore the signal handler and exit (after the save)."""
        logger.warning("exiting program after receiving %s.", self._received.name)
        self.__exit__()
        sys.exit(code)

    def dataloader_worker_init(self, worker_id: int) -> None:
        """``worker_init_fn`` for DataLoader workers: they must not die of the signal
        mid-batch (the main process would hang or fail on a dead worker). With
        ``exit_signal_handler_for_dataloader`` they handle it (note it and go on; the
        main process leads the stop), otherwise they ignore it."""
        also = job_preemption_signal()
        for sig in {self.config.exit_signal, *([also] if also is not None else [])}:
            if self.config.exit_signal_handler_for_dataloader:
                signal.signal(
                    sig,
                    lambda signum, frame: logger.info(
                        "dataloader worker %d: signal %d noted; the trainer leads the stop",
                        worker_id,
                        signum,
                    ),
                )
            else:
                signal.signal(sig, signal.SIG_IGN)
