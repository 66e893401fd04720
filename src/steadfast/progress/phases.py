"""Where a worker's start goes, from its first instruction to its first iteration, seen
without a line of the script: the worker's half of a restart's phases (the launcher
times the rest: detection, the stop, the rendezvous, the spawn).

:class:`PhaseClock` (one per worker, installed with the progress hooks) times, on the
main thread and until the first iteration ends:

- **imports**: the outermost ``import`` statements (``builtins.__import__``; a module
  imported with ``importlib.import_module`` is not seen and falls into the setup);
- **init_process_group**: every call of ``torch.distributed.init_process_group``;
- **checkpoint load**: ``torch.load``, ``torch.distributed.checkpoint.load`` and
  steadfast's own loads (:func:`loading`, which ``CheckpointManager`` uses);
- **compile**: torch.compile's compilations (its own start and end callbacks, through
  :func:`steadfast.seam.on_compile`);
- **the first batch**: ``DataLoader.__iter__`` and the iterators' ``__next__``;
- **the first forward's start** of the top module (steadfast.progress.probe), and the
  totals above at that moment, so that what came before the first forward (the setup)
  is told apart from the first step itself.

A span inside another counts once, for the outer one (a module imported while a
checkpoint is unpickled is load time; dynamo's imports while compiling are compile
time), so the phases never overlap and add up. The first iteration's end puts every
function back as it was (nothing stays on the hot path) and marks the phases final.

The launcher reads them with :func:`read` and writes them in its ``first_step`` event.
Everything is plain stores into the worker's row (:mod:`.layout`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .layout import (
    FIRST_STEP,
    PH_BATCH,
    PH_BATCH_AT,
    PH_COMPILE,
    PH_COMPILE_AT,
    PH_DONE,
    PH_FIRST_FORWARD,
    PH_IMPORTS,
    PH_LOAD,
    PH_LOAD_AT,
    PH_PG,
    PH_STARTED,
    PH_WALL,
)

__all__ = ["PhaseClock", "loading", "read"]

_clock: PhaseClock | None = None


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Count what runs inside as checkpoint load in this worker's phases (a no-op where
    no clock runs, or after the first iteration)."""
    clock = _clock
    if clock is None:
        yield
        return
    with clock.span(PH_LOAD):
        yield


class PhaseClock:
    """The phase timers of one worker (see the module docstring)."""

    def __init__(self, slots: Any) -> None:
        self.slots = slots
        self._main = threading.main_thread().ident
        self._open: int | None = None  # the slot of the span in progress
        self._undo: list[Callable[[], None]] = []
        self._compile_watched = False
        self._dcp = False
        self._compile_started = 0.0
        self.done = False

    # ------------------------------------------------------------------ set-up
    def start(self, began: float | None = None) -> None:
        """Start the timers; ``began``: the monotonic time the process began, where that
        was before now (a plain process, which imports torch first: counted as imports)."""
        global _clock
        s = self.slots
        s[PH_STARTED] = began or time.monotonic()
        s[PH_WALL] = time.time() - time.monotonic()
        import torch
        import torch.distributed as dist
        import torch.utils.data as data

        if began:
            s[PH_IMPORTS] += time.monotonic() - began
        from .. import seam

        self._wrap(builtins, "__import__", self._timed_import)
        self._wrap(dist, "init_process_group", self._timed(PH_PG))
        self._wrap(torch, "load", self._timed(PH_LOAD))
        self._wrap(data.DataLoader, "__iter__", self._timed(PH_BATCH))
        self._wrap(seam.dataloader_iterator_type(), "__next__", self._timed(PH_BATCH))
        self._watch_dcp()
        self.watch_compile()
        _clock = self

    def watch_compile(self) -> None:
        """Time torch.compile's compilations, once ``torch._dynamo`` is imported (the
        template imports it; a script that compiles imports it before its first
        forward, when the probe calls this again)."""
        from .. import seam

        if self.done or self._compile_watched:
            return
        remove = seam.on_compile(self._compile_start, self._compile_end)
        if remove is not None:
            self._compile_watched = True
            self._undo.append(remove)

    def _watch_dcp(self) -> None:
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is not None and not self._dcp and hasattr(dcp, "load"):
            self._dcp = True
            self._wrap(dcp, "load", self._timed(PH_LOAD))

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        wrapper = functools.wraps(original)(make(original))
        setattr(owner, name, wrapper)

        def undo() -> None:
            if getattr(owner, name, None) is wrapper:  # nobody wrapped it after us
                setattr(owner, name, original)

        self._undo.append(undo)

    # ------------------------------------------------------------------ spans
    @contextlib.contextmanager
    def span(self, slot: int) -> Iterator[None]:
        """Time what runs inside into ``slot``: on the main thread, outside any other
        span, before the first iteration's end; otherwise nothing."""
        if self._open is not None or self.done or threading.get_ident() != self._main:
            yield
            return
        self._open = slot
        began = time.perf_counter()
        try:
            yield
        finally:
            self._open = None
            self.slots[slot] += time.perf_counter() - began

    def _timed(self, slot: int) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                with self.span(slot):
                    return original(*args, **kwargs)

            return timed

        return make

    def _timed_import(self, original: Any) -> Any:
        def timed_import(*args: Any, **kwargs: Any) -> Any:
            if self._open is not None or threading.get_ident() != self._main:
                return original(*args, **kwargs)
            with self.span(PH_IMPORTS):
                module = original(*args, **kwargs)
            if not self._dcp and "torch.distributed.checkpoint" in sys.modules:
                self._watch_dcp()
            return module

        return timed_import

    def _compile_start(self) -> None:
        if self._open is None and not self.done and threading.get_ident() == self._main:
            self._open = PH_COMPILE
            self._compile_started = time.perf_counter()

    def _compile_end(self) -> None:
        if self._open == PH_COMPILE and threading.get_ident() == self._main:
            self._open = None
            self.slots[PH_COMPILE] += time.perf_counter() - self._compile_started

    # ------------------------------------------------------------------ the probe's marks
    def first_forward(self, now: float) -> None:
        """The top module's first forward begins (monotonic ``now``)."""
        s = self.slots
        if self.done or s[PH_FIRST_FORWARD]:
            return
        s[PH_LOAD_AT], s[PH_COMPILE_AT], s[PH_BATCH_AT] = s[PH_LOAD], s[PH_COMPILE], s[PH_BATCH]
        s[PH_FIRST_FORWARD] = now
        self.watch_compile()

    def finish(self) -> None:
        """The first iteration ended: everything back as it was, the phases final."""
        global _clock
        if self.done:
            return
        self.done = True
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self._undo = []
        if _clock is self:
            _clock = None
        self.slots[PH_DONE] = 1.0


def read(slots: Any) -> dict[str, Any] | None:
    """A worker's phases once final (wall-clock epoch times, seconds), or None: the
    process start, the first forward's start and the first iteration's end, and the
    seconds of each phase; ``setup``: the rest before the first forward (model build and
    whatever else the script did, not told apart), ``first_step``: the rest from the
    first forward to the first iteration's end."""
    if slots[PH_DONE] != 1.0 or not slots[PH_STARTED] or not slots[FIRST_STEP]:
        return None
    wall = slots[PH_WALL]
    started, ended = slots[PH_STARTED], slots[FIRST_STEP]
    forward = slots[PH_FIRST_FORWARD] or ended  # no forward seen: all of it is setup
    load, compile_, batch = slots[PH_LOAD], slots[PH_COMPILE], slots[PH_BATCH]
    before = (slots[PH_LOAD_AT], slots[PH_COMPILE_AT], slots[PH_BATCH_AT])
    if not slots[PH_FIRST_FORWARD]:
        before = (load, compile_, batch)
    imports, pg = slots[PH_IMPORTS], slots[PH_PG]
    setup = (forward - started) - imports - pg - sum(before)
    first = (ended - forward) - (load - before[0]) - (compile_ - before[1]) - (batch - before[2])
    return {
        "process_start": round(started + wall, 6),
        "first_forward": round(forward + wall, 6),
        "first_step_end": round(ended + wall, 6),
        "imports": round(imports, 6),
        "init_process_group": round(pg, 6),
        "checkpoint_load": round(load, 6),
        "compile": round(compile_, 6),
        "first_batch": round(batch, 6),
        "setup": round(max(0.0, setup), 6),
        "first_step": round(max(0.0, first), 6),
    }
