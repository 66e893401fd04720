"""A worker's side of progress watching: hooks that see the script's progress without a
line of it, and a thread that samples the main thread's stack when the launcher asks.

Installed by the launcher in every worker before the script runs (:func:`install`: the
worker template calls it in each forked worker, :mod:`.boot` in a worker started as a
plain process). Everything goes into the worker's row of the node's heartbeat table
(:mod:`.layout`): plain memory stores, no system call, no lock, no host-device sync.

- **Iterations**, from torch's global optimizer step hooks (every ``torch.optim``
  optimizer: Lightning's, the HF Trainer's, FSDP2 loops'). A step call inside another
  one (a container optimizer whose ``step`` steps its members, a subclass calling
  ``super().step()``) is one call: only the outermost counts. An iteration is counted
  when an optimizer steps that already stepped since the last count (several
  optimizers, one per parameter in the backward: each steps once per iteration). A
  step that GradScaler skips calls nothing. Inside ``torch.compile`` the hooks do
  nothing (``torch.compiler.is_compiling()``: they are not traced); a process whose
  optimizer steps only in compiled code counts its top module's training forwards.
- **The top module**: the first module called with a trainable parameter (a loss or a
  preprocessing module before it has none), found by global forward hooks that are
  removed the moment it is found, before its forward runs (so before ``torch.compile``
  of that module traces anything); then hooked alone. Under DDP, the module inside (its
  forward without DDP's buffer broadcast). Its forward time: ``perf_counter`` on CPU;
  on CUDA two events, read once complete (``query()``, never a sync).
- **Marks**: each iteration's end and each top-module forward's start and end is a sign
  of progress; the longest interval between marks after the first iteration is kept
  for the launcher's learned bound.
- **The stack thread** waits in a ``read`` of the row's ask channel (a FIFO) and answers
  each request with the main thread's stack, which it can read while the main thread
  waits in C with the GIL released (a collective, a sleep, a queue); a main thread that
  holds the GIL and never releases it leaves the request unanswered, which the launcher
  takes for stuck.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from .layout import (
    ANSWER,
    ANSWER_AT,
    ASK,
    FIRST_STEP,
    FLAG_CUDA,
    FLAG_DDP,
    FLAG_FORWARD_STEPS,
    FLAG_OWN_STEPS,
    FLAG_OWN_STRAGGLERS,
    FLAG_TOP,
    FLAGS,
    FORWARDS,
    FWD_RING,
    INTERVALS,
    LAST_STEP,
    LONGEST,
    MARK,
    PID,
    RING,
    STEP_BASE,
    STEP_RING,
    STEPS,
    TEXT_BYTES,
    TEXT_LEN,
    TEXT_OFFSET,
)

__all__ = ["PROGRESS_ENV", "Probe", "format_stack", "install", "note_own_stragglers"]

logger = logging.getLogger(__name__)

#: Set to ``1`` by the launcher when progress is watched (``watch_progress``).
PROGRESS_ENV = "STEADFAST_WATCH_PROGRESS"
#: Module calls with no trainable parameter after which the search for a top module
#: stops (an inference script): its global hooks must not stay on every call.
_SEARCH_CALLS = 10_000
_MAX_FRAMES = 48

_installed: Probe | None = None
#: frames from here outwards are steadfast's (the template, the boot), not the script's
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def install(table: Any, row: int, began: float | None = None) -> Probe | None:
    """Install the hooks and the stack thread in this worker, once, in row ``row`` of
    ``table`` (the node's heartbeat table, attached by the launcher's worker side:
    :func:`steadfast.launcher.boot.worker_hooks`); never raises: a worker runs its
    script whatever happens here. ``began``: the monotonic time the process began, where
    that was before this call (a plain process imports torch first: imports, in its
    phases)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from .layout import ask_path

        probe = Probe(table, row, str(ask_path(table.path, row)))
        probe.start(began)
    except Exception as exc:  # no torch: nothing to watch
        logger.debug("progress hooks not installed: %s", exc)
        return None
    _installed = probe
    return probe


def note_own_stragglers() -> None:
    """This worker runs steadfast's straggler ``Detector``: the launcher leaves the
    straggler reports to it (they would otherwise be written twice)."""
    if _installed is not None:
        _installed.note(FLAG_OWN_STRAGGLERS)


def format_stack(frame: Any) -> str:
    """``file:line qualname`` per frame, outermost first, from the script's own module
    inwards (at most the innermost ``_MAX_FRAMES``)."""
    lines: deque[str] = deque(maxlen=_MAX_FRAMES)
    inner = []
    while frame is not None:
        code = frame.f_code
        place = code.co_filename
        inner.append(
            (place, f"{place}:{frame.f_lineno} {getattr(code, 'co_qualname', code.co_name)}")
        )
        frame = frame.f_back
    outer = list(reversed(inner))
    while outer and (outer[0][0].startswith(_OURS) or "runpy" in outer[0][0]):
        outer.pop(0)  # the worker template's or the boot's frames: not the script's
    lines.extend(line for _, line in outer)
    return "\n".join(lines)


class Probe:
    """The hooks and the stack thread of one worker (see the module docstring)."""

    def __init__(self, table: Any, row: int, ask: str) -> None:
        self.table = table  # kept: the slots are a view of its mapping
        self.slots, self.area = table.progress_area(row)
        self.ask = ask
        self.pid = os.getpid()
        self.active = True
        self._depth = 0  # optimizer step calls in progress (nested ones are one)
        self._stepped: set[int] = set()  # optimizers stepped in this iteration
        self._optimizer_seen = False
        self._steps = 0
        self._forwards = 0
        self._flags = 0
        self._last_mark = 0.0
        self._searching = 0
        self._opt_handles: list[Any] = []
        self._search_handles: list[Any] = []
        self._top_handles: list[Any] = []
        self._thread: threading.Thread | None = None
        self._started: float | None = None  # perf_counter at the top forward's start
        self._cuda_current: tuple[Any, Any] | None = None  # the forward in flight
        self._cuda_pending: deque[tuple[Any, Any]] = deque()
        self._cuda_free: list[tuple[Any, Any]] = []
        self._main = threading.main_thread().ident or 0
        self._is_compiling: Any = None
        self._grad_enabled: Any = None
        self.phases: Any = None  # the PhaseClock of this worker's start
        self.replicas: Any = None  # the DDP model's replica checks (steadfast.sdc.probe)

    # ------------------------------------------------------------------ set-up
    def start(self, began: float | None = None) -> None:
        from .phases import PhaseClock

        self.phases = PhaseClock(self.slots)
        with contextlib.suppress(Exception):  # the phases are a report, never in the way
            self.phases.start(began)
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        from ..events import writer
        from ..sdc import layout as replica_layout

        self._is_compiling = torch.compiler.is_compiling
        self._grad_enabled = torch.is_grad_enabled
        replica_layout.clear(self.slots)  # a restarted worker's row holds none yet
        self.slots[PID] = float(self.pid)
        self._opt_handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._search_handles = [register_module_forward_pre_hook(self._search)]
        writer.step_listeners.append(self._own_step)
        os.register_at_fork(after_in_child=self._forked)
        self._thread = threading.Thread(target=self._serve, name="steadfast-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Remove the hooks and end the thread (a worker never needs to: they end with
        it; tests do)."""
        from ..events import writer

        self.active = False
        if self.phases is not None:
            self.phases.finish()
        for handle in (*self._opt_handles, *self._search_handles, *self._top_handles):
            handle.remove()
        self._opt_handles, self._search_handles, self._top_handles = [], [], []
        if self._own_step in writer.step_listeners:
            writer.step_listeners.remove(self._own_step)
        if self._thread is not None:
            with contextlib.suppress(OSError):
                fd = os.open(self.ask, os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(fd, b"q")
                finally:
                    os.close(fd)
            self._thread.join(5)
            self._thread = None

    def _forked(self) -> None:
        """A process forked from the worker (a DataLoader worker) is not the rank: it
        writes nothing into the rank's row."""
        self.active = False
        if self.phases is not None:
            self.phases.done = True  # its timers write nothing either

    def _own_step(self, record: dict[str, Any]) -> None:
        self.note(FLAG_OWN_STEPS)

    def note(self, flag: int) -> None:
        """Set ``flag`` in the row (the script does that part itself)."""
        if self.active and not self._flags & flag:
            self._flags |= flag
            self.slots[FLAGS] = float(self._flags)

    # ------------------------------------------------------------------ marks
    def _mark(self, now: float) -> None:
        s = self.slots
        last = self._last_mark
        if self._steps >= 1 and last > 0 and last >= s[FIRST_STEP]:
            interval = now - last
            if interval > s[LONGEST]:
                s[LONGEST] = interval
            s[INTERVALS] += 1
        self._last_mark = now
        s[MARK] = now

    def _iteration(self, now: float) -> None:
        n = self._steps + 1
        s = self.slots
        s[STEP_RING + n % RING] = now
        if n == 1:
            s[FIRST_STEP] = now
            if self.phases is not None:
                self.phases.finish()
        s[LAST_STEP] = now
        self._steps = n
        s[STEPS] = float(n)  # published after its ring entry

    # ------------------------------------------------------------------ optimizer hooks
    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling() or not self.active:
            return
        self._depth += 1

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling() or not self.active:
            return
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return  # inside another optimizer's step: the outer one counts
        now = time.monotonic()
        key = id(optimizer)
        if not self._optimizer_seen:
            self._optimizer_seen = True
            self._stepped = {key}
            if self._flags & FLAG_FORWARD_STEPS:  # this iteration's forward counted it
                self._flags &= ~FLAG_FORWARD_STEPS
                self.slots[FLAGS] = float(self._flags)
            else:
                self._iteration(now)
            self._note_base(optimizer)
        elif key in self._stepped:  # it stepped before in this iteration: a new one
            self._stepped = {key}
            self._iteration(now)
        else:
            self._stepped.add(key)
        self._mark(now)
        if self.replicas is not None:
            self._check_replicas(optimizer)

    def _check_replicas(self, optimizer: Any) -> None:
        """The replica check's turn after an optimizer step; an error of its own turns it
        off, never the script's step."""
        base = self.slots[STEP_BASE]
        try:
            self.replicas.after_step(optimizer, int(base) - 1 if base > 0 else None)
        except Exception as exc:
            logger.warning("replica check off in this rank: %s: %s", type(exc).__name__, exc)
            self.replicas = None

    def _note_base(self, optimizer: Any) -> None:
        """The script's own index of the iteration just counted, where the optimizer
        keeps one on the CPU (Adam's ``step``; reading a CUDA one would sync)."""
        with contextlib.suppress(Exception):
            param = optimizer.param_groups[0]["params"][0]
            step = optimizer.state[param]["step"]
            if hasattr(step, "device"):
                if step.device.type != "cpu":
                    return
                step = float(step)
            self.slots[STEP_BASE] = float(step) - (self._steps - 1)  # 1 + index of iter 1

    # ------------------------------------------------------------------ the top module
    def _search(self, module: Any, args: Any) -> None:
        """Global forward pre-hook until the top module is found."""
        if self._is_compiling() or not self.active:
            return
        self._searching += 1
        trainable = any(p.requires_grad for p in module.parameters())
        if not trainable:
            if self._searching >= _SEARCH_CALLS:
                self._stop_search()
            return
        self._stop_search()
        from torch.nn.parallel import DistributedDataParallel

        from .. import seam

        target = module
        inner = seam.compiled_original(module)  # a DDP model compiled whole: DDP inside
        if isinstance(module, DistributedDataParallel):
            target = module.module
            self._flags |= FLAG_DDP
        if isinstance(inner, DistributedDataParallel):
            self._start_replicas(inner)
        param = next(target.parameters(), None)
        if param is not None and param.device.type == "cuda":
            self._flags |= FLAG_CUDA
        self._flags |= FLAG_TOP
        self.slots[FLAGS] = float(self._flags)
        self._top_handles = [
            target.register_forward_pre_hook(self._fwd_pre),
            target.register_forward_hook(self._fwd_post, always_call=True),
        ]
        if target is module:  # its pre-hooks of this call were taken before ours existed
            self._fwd_pre(module, args)

    def _start_replicas(self, ddp: Any) -> None:
        try:
            from ..sdc.probe import start

            self.replicas = start(self.slots, ddp)
        except Exception as exc:  # never in the script's way
            logger.warning("replica check not started: %s: %s", type(exc).__name__, exc)

    def _stop_search(self) -> None:
        for handle in self._search_handles:
            handle.remove()
        self._search_handles = []

    def _fwd_pre(self, module: Any, args: Any) -> None:
        if self._is_compiling() or not self.active:
            return
        now = time.monotonic()
        self._mark(now)
        if self._forwards == 0 and self.phases is not None:
            self.phases.first_forward(now)
        if self._flags & FLAG_CUDA:
            self._collect_cuda()
            pair = self._cuda_free.pop() if self._cuda_free else self._cuda_pair()
            pair[0].record()
            self._cuda_current = pair
        else:
            self._started = time.perf_counter()

    def _fwd_post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling() or not self.active:
            return
        now = time.monotonic()
        if self._cuda_current is not None:
            self._cuda_current[1].record()
            self._cuda_pending.append(self._cuda_current)
            self._cuda_current = None
        elif self._started is not None:
            self._publish_forward(time.perf_counter() - self._started)
            self._started = None
        if not self._optimizer_seen and module.training and self._grad_enabled():
            # a training forward while no optimizer step was seen: the count's fallback
            if not self._flags & FLAG_FORWARD_STEPS:
                self._flags |= FLAG_FORWARD_STEPS
                self.slots[FLAGS] = float(self._flags)
            self._iteration(now)
        self._mark(now)

    def _publish_forward(self, seconds: float) -> None:
        n = self._forwards + 1
        self.slots[FWD_RING + n % RING] = seconds
        self._forwards = n
        self.slots[FORWARDS] = float(n)

    def _cuda_pair(self) -> tuple[Any, Any]:
        import torch

        event: Any = torch.cuda.Event
        return event(enable_timing=True), event(enable_timing=True)

    def _collect_cuda(self) -> None:
        """Publish the forwards whose end event completed (``query``: never a sync)."""
        while self._cuda_pending:
            start, end = self._cuda_pending[0]
            if not end.query():
                break
            self._cuda_pending.popleft()
            self._publish_forward(start.elapsed_time(end) / 1000.0)
            self._cuda_free.append((start, end))
        while len(self._cuda_pending) > 8:  # a device far behind: drop the oldest
            self._cuda_pending.popleft()

    # ------------------------------------------------------------------ the stack thread
    def _serve(self) -> None:
        try:
            fd = os.open(self.ask, os.O_RDWR | os.O_CLOEXEC)  # RDWR: never end-of-file
        except OSError:
            return
        if not self.active:  # closed before this thread had the pipe open: close()'s
            os.close(fd)  # wake-up found no reader and was dropped; nothing will come
            return
        from .. import seam

        try:
            while True:
                if not os.read(fd, 64) or not self.active:
                    return
                asked = self.slots[ASK]
                frame = seam.thread_frame(self._main)
                text = format_stack(frame).encode()[-TEXT_BYTES:]
                del frame
                self.area[TEXT_OFFSET : TEXT_OFFSET + len(text)] = text
                self.slots[TEXT_LEN] = float(len(text))
                self.slots[ANSWER_AT] = time.monotonic()
                self.slots[ANSWER] = asked
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
