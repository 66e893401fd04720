"""The straggler Detector: section timing on every rank, scores and reports.

Timing: each profiled call of a section records its CPU wall time
(``perf_counter_ns``) and, with ``profile_cuda`` on a GPU, a pair of CUDA events that are
read only when a report is made (one synchronisation per report, none per step). On a CPU
run the "GPU" scores are computed from the section times (documented fallback).

NVRx's class-level use works too: ``Detector.initialize(...)`` makes the class's own
detector, and ``Detector.detection_section(...)``, ``Detector.wrap_callables(...)``,
``Detector.generate_report_if_interval_elapsed()``... then act on it (until
``Detector.shutdown()``); on an instance the same methods act on that instance.

Reports are collective: every rank calls :meth:`Detector.generate_report` (directly, or
through :meth:`Detector.generate_report_if_interval_elapsed`) at the same call, and one
all-gather of a small per-rank summary (:class:`~steadfast.dist.PendingGather`: fixed
slots, one collective) gives every rank the same data. From
that same data every rank computes the same scores, the same verdict, and the same call
at which the next report is due (from the slowest rank's call rate), so no rank ever
waits in a report collective that another rank skipped, and a ``stop_if_detected``
verdict needs no further broadcast.

Scoring window: a report scores each section on the samples made since the previous
report, reaching back before it until there are at least ``window_samples``
(:data:`WINDOW_SAMPLES`, 3) spanning at least ``window_seconds`` (:data:`WINDOW_SECONDS`,
0.25 s). With NVRx's long intervals (minutes) this floor never binds and a report is
NVRx's median over its interval. With a short ``report_time_interval`` (a report every
step or few) the window is the floor: the recent samples, not a period that began before
a slowdown and mixes the steps before it with the slow ones.

The floor is the least window whose median needs the slowdown to hold, measured on a
shared 2-core machine (``bench/bench_straggler_verdict.py``: healthy 6 ms steps beside 3
busy processes, a report at every step):

- samples: a single sample is often a hiccup (a scheduler delay, a GC pause): a window
  of 1 flagged a healthy rank in about 1 report of 30, and the median of 2 (their mean)
  moves with one bad sample. The median of 3 is slow only once 2 of the 3 are: the
  slowdown has repeated;
- seconds: hiccups come in bursts, so windows of 3 and 5 samples (about 20 and 35 ms)
  still flagged up to 1 report in 100, 10 samples (70 ms) none; 0.25 s is several times
  the longest burst, and short against the steps of the demo's pace.

So with a report at every step, pace ``p`` (seconds per step) and a rank slowed
``f``-fold, the earliest verdict is the report at the end of the 2nd slow step,
``2 * f * p`` after the slowdown began, as long as those 3 samples span the seconds
(``p * (1 + 2 * f) >= window_seconds``); with shorter steps the window is
``window_seconds`` long and the verdict comes once more than half of it is slow,
``f / (1 + f) * window_seconds`` after. At the demo's pace (``p`` = 0.34 s, ``f`` = 2):
1.36 s; a window of 5 would need 3 slow steps, 2.04 s, over the 2 s the demo is held to.
With a report every ``n >= 3`` steps the window is those ``n`` steps, and a verdict can
take up to ``1.5 * n`` slow steps (a report whose window is not yet half slow waits for
the next one). A blocking report waits for its all-gather, that is for the slowest rank:
1.3-2 ms for 2 ranks here (two collectives, sizes then bytes, before). Split in two,
:meth:`Detector.start_report` sends the summary and :meth:`Detector.finish_report`
scores it; :class:`~steadfast.straggler.StragglerDetectionManager` starts a due report
at one step and finishes it at the next, so no step waits for the gather and the
verdict comes one step later (on every rank at the same step): at the demo's pace 1.70 s.
``window_samples=1, window_seconds=0`` score only the samples since the previous report
(the design before issue 30).
"""

from __future__ import annotations

import functools
import inspect
import socket
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import require_number
from ..dist import PendingGather, member_index
from ..progress.probe import note_own_stragglers
from .reporting import Report
from .scores import individual_scores, relative_scores

__all__ = ["CallableId", "Detector", "PendingReport", "Report"]

F = TypeVar("F", bound=Callable[..., Any])

#: Calls before the first report: enough samples for a median, few enough to report early.
FIRST_REPORT_CALLS = 10
#: The scoring window's floor in samples: the least whose median needs 2 slow samples.
WINDOW_SAMPLES = 3
#: The scoring window's floor in seconds: longer than a burst of hiccups (module docstring).
WINDOW_SECONDS = 0.25

#: One profiled call: (start, duration) in perf_counter ns, and its CUDA events or None.
_Sample = tuple[int, int, Any]


@dataclass
class PendingReport:
    """A report started by :meth:`Detector.start_report`: its gather in flight, the call
    it was started at and the seconds spent starting it."""

    gather: PendingGather
    calls: int
    seconds: float


class _Section:
    """Samples of one section on this rank: those made since the last report, after the
    ``kept`` ones before it that the last report's window reached back to."""

    __slots__ = ("calls", "kept", "samples")

    def __init__(self) -> None:
        self.calls = 0
        self.samples: list[_Sample] = []
        self.kept = 0


class _Timing:
    """One timed call of a section (a plain class: cheaper than a generator)."""

    __slots__ = ("_cuda", "_events", "_every", "_section", "_start")

    def __init__(self, section: _Section, cuda: bool, every: int) -> None:
        self._section, self._cuda, self._every = section, cuda, every
        self._events: tuple[Any, Any] | None = None
        self._start = 0

    def __enter__(self) -> None:
        section = self._section
        section.calls += 1
        if section.calls % self._every:
            self._start = -1  # not profiled this time
            return
        if self._cuda:
            self._events = _cuda_events()
            if self._events is not None:
                self._events[0].record()
        self._start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        if self._start < 0:
            return
        took = time.perf_counter_ns() - self._start
        if self._events is not None:
            self._events[1].record()
        self._section.samples.append((self._start, took, self._events))


@dataclass(frozen=True)
class CallableId:
    """A callable to time as a section: ``getattr(obj, name)`` (NVRx's ``CallableId``);
    its section is named ``"<object>.<name>"``. ``arg_filter_fn``, ``extra_args_fn`` and
    ``ignored_args`` are accepted for NVRx code and not used."""

    obj: object
    name: str
    arg_filter_fn: Callable[..., bool] | None = None
    extra_args_fn: Callable[..., dict[str, Any]] | None = None
    ignored_args: tuple[str, ...] | None = None

    def __str__(self) -> str:
        obj = self.obj
        if inspect.ismodule(obj):
            owner = obj.__name__
        elif inspect.isclass(obj):
            owner = f"{obj.__module__}.{obj.__name__}"
        else:
            owner = type(obj).__name__
        return f"{owner}.{self.name}"


class _Either:
    """A method that acts on an instance, or, called on the class, on the class's own
    detector made by ``Detector.initialize`` (NVRx's class-level Detector)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: type | None = None) -> Callable[..., Any]:
        if obj is None:
            obj = getattr(cls, "_default", None)
            if obj is None:

                def not_initialized(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError(
                        "Detector is not initialized: call Detector.initialize() first, or "
                        "use an instance (Detector(...))"
                    )

                return not_initialized
        return types.MethodType(self.fn, obj)


class Detector:
    """Times detection sections on this rank and builds straggler reports.

    Args:
        report_time_interval: Seconds between reports made by
            :meth:`generate_report_if_interval_elapsed` (one ``all_gather`` each): a
            slowed rank waits for the next report, so a short one (a step or a few)
            gives a verdict within the scoring window's floor (module docstring).
        profiling_interval: Profile every n-th call of each section (1 = every call).
        calc_relative: Compute relative scores.
        calc_individual: Compute individual scores.
        group: Process group of the ranks compared (default: the world).
        node_name: This rank's node in reports (default: the host name).
        gather_on_rank0: None (steadfast's): every rank gets every rank's scores (so all
            reach the same verdict); True: rank 0 gets them all and the other ranks None;
            False: each rank its own (NVRx's two modes).
        window_samples: The scoring window's floor in samples (module docstring).
        window_seconds: The scoring window's floor in seconds (module docstring).
    """

    #: NVRx's class-level API: whether ``Detector.initialize`` made the class's detector
    initialized: bool = False
    _default: Detector | None = None

    def __init__(
        self,
        report_time_interval: float = 300.0,
        profiling_interval: int = 1,
        calc_relative: bool = True,
        calc_individual: bool = True,
        group: Any = None,
        node_name: str | None = None,
        gather_on_rank0: bool | None = None,
        *,
        window_samples: int = WINDOW_SAMPLES,
        window_seconds: float = WINDOW_SECONDS,
    ) -> None:
        self.gather_on_rank0 = gather_on_rank0
        self.window_samples: int = require_number(
            "window_samples", window_samples, minimum=1, integer=True
        )
        self.window_seconds = float(require_number("window_seconds", window_seconds, minimum=0))
        self.original_callables: dict[CallableId, Any] = {}
        self._elapsed = False  # whether the last interval check made a report
        self.report_time_interval = float(
            require_number("report_time_interval", report_time_interval, exclusive_minimum=0)
        )
        self.profiling_interval = require_number(
            "profiling_interval", profiling_interval, minimum=1, integer=True
        )
        self.calc_relative = bool(calc_relative)
        self.calc_individual = bool(calc_individual)
        self.group = group
        self.node_name = node_name or socket.gethostname()
        self._sections: dict[str, _Section] = {}
        self._cuda_possible = _cuda_available()
        self._best: dict[str, dict[int, float]] = {}  # section -> rank -> best median
        self._calls = 0  # calls of generate_report_if_interval_elapsed
        # a report's gather slot: each rank receives world x slot bytes; doubled until
        # the largest summary fits (every rank sees every length: the same slot)
        self._summary_slot = 512
        self._next_report = FIRST_REPORT_CALLS
        self._last_report_time = time.monotonic()
        self._last_report_calls = 0
        note_own_stragglers()  # the launcher leaves the straggler reports to this one

    # ------------------------------------------------------------------ NVRx's class API
    @classmethod
    def initialize(
        cls,
        scores_to_compute: Sequence[str] | str = "all",
        gather_on_rank0: bool = True,
        profiling_interval: int = 1,
        report_time_interval: float = 60,
        node_name: str | None = None,
    ) -> None:
        """Make the class's own detector (NVRx's ``Detector.initialize``; its defaults):
        ``Detector.detection_section(...)`` and the other methods called on the class
        then act on it, until :meth:`shutdown`."""
        if cls._default is not None:
            raise RuntimeError("Detector is initialized already: Detector.shutdown() first")
        wanted = (
            {"relative_perf_scores", "individual_perf_scores"}
            if str(scores_to_compute) == "all"
            else set(scores_to_compute)
        )
        cls._default = cls(
            report_time_interval=report_time_interval,
            profiling_interval=profiling_interval,
            calc_relative="relative_perf_scores" in wanted,
            calc_individual="individual_perf_scores" in wanted,
            node_name=node_name,
            gather_on_rank0=gather_on_rank0,
        )
        cls.initialized = True

    @classmethod
    def shutdown(cls) -> None:
        """Put back wrapped callables and drop the class's detector."""
        if cls._default is not None:
            cls._default.restore_original_callables()
        cls._default = None
        cls.initialized = False

    # ------------------------------------------------------------------ timing
    @_Either
    def detection_section(self, name: str | None = None, profile_cuda: bool = True) -> _Timing:
        """Time the enclosed code (``with detector.detection_section(name): ...``) as
        section ``name`` (default: the ``with``'s file and line), every
        ``profiling_interval``-th call; with ``profile_cuda`` on a GPU, its device time is
        recorded too (CUDA events, read at the next report)."""
        if name is None:
            caller = sys._getframe(1)
            name = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        section = self._sections.get(name)
        if section is None:
            section = self._sections[name] = _Section()
        return _Timing(section, profile_cuda and self._cuda_possible, self.profiling_interval)

    @_Either
    def wrap_callables(self, callable_ids: Iterable[CallableId], profile_cuda: bool = True) -> None:
        """Time every call of each ``getattr(id.obj, id.name)`` as section ``str(id)``,
        by replacing the attribute (put back by :meth:`restore_original_callables`)."""
        for callable_id in callable_ids:
            original = getattr(callable_id.obj, callable_id.name)
            self.original_callables.setdefault(callable_id, original)
            wrapped = self.wrap_callable(original, str(callable_id), profile_cuda)
            setattr(callable_id.obj, callable_id.name, wrapped)

    @_Either
    def restore_original_callables(self) -> None:
        """Put back what :meth:`wrap_callables` replaced."""
        for callable_id, original in self.original_callables.items():
            setattr(callable_id.obj, callable_id.name, original)
        self.original_callables = {}

    @_Either
    def wrap_callable(self, fn: F, name: str | None = None, profile_cuda: bool = True) -> F:
        """``fn`` timed as a section (named after it unless ``name`` is given)."""
        section: str = name or str(getattr(fn, "__name__", "callable"))

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.detection_section(section, profile_cuda):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]

    # ------------------------------------------------------------------ reports
    @_Either
    def generate_report_if_interval_elapsed(self) -> Report | None:
        """Call once per step on every rank: a report when one is due, else None.
        Which call is due is agreed at the previous report (see the module docstring)."""
        if not self.report_due():
            return None
        report: Report | None = self.generate_report()
        return report

    def report_due(self) -> bool:
        """Count this call (one per step, on every rank) and say whether a report is due;
        :meth:`generate_report_if_interval_elapsed` without the report."""
        self._calls += 1
        if self._calls == 1:  # the call rate is measured from the loop's first call
            self._last_report_time = time.monotonic()
            self._last_report_calls = 1
        self._elapsed = self._calls >= self._next_report
        return self._elapsed

    @_Either
    def is_interval_elapsed(self) -> bool:
        """Whether the last :meth:`generate_report_if_interval_elapsed` made a report."""
        return self._elapsed

    @_Either
    def generate_report(self) -> Report | None:
        """Gather every rank's section medians (one collective) and score them; who
        gets which ranks' scores follows ``gather_on_rank0``."""
        return self.finish_report(self.start_report())

    def start_report(self) -> PendingReport:
        """Send this rank's summary (its section medians and call period) in one
        all-gather that runs in the background; :meth:`finish_report` scores it. Every
        rank starts its report at the same call."""
        start = time.monotonic()
        summary = {
            "node": self.node_name,
            "medians": self._medians(),
            "period": (start - self._last_report_time)
            / max(1, self._calls - self._last_report_calls),
        }
        self._last_report_time, self._last_report_calls = start, self._calls
        gather = PendingGather(summary, self.group, slot=self._summary_slot)
        return PendingReport(gather, self._calls, time.monotonic() - start)

    def finish_report(self, pending: PendingReport) -> Report | None:
        """Score the report :meth:`start_report` began (waits for its gather if it still
        runs) and set the call the next one is due at."""
        start = time.monotonic()
        shares = pending.gather.read()
        while self._summary_slot < pending.gather.largest:  # the same on every rank
            self._summary_slot *= 2
        report = self._score(shares)
        slowest = max((s["period"] for s in shares), default=0.0)
        per_interval = max(1, round(self.report_time_interval / slowest)) if slowest > 0 else 1
        self._next_report = pending.calls + per_interval
        report.generate_report_elapsed_time = pending.seconds + time.monotonic() - start
        return self._for_this_rank(report)

    def _for_this_rank(self, report: Report) -> Report | None:
        """NVRx's gathering modes (every rank computed every score from the same data)."""
        if self.gather_on_rank0 is None:
            return report
        rank = member_index(self.group)
        report.gather_on_rank0 = self.gather_on_rank0
        if self.gather_on_rank0:
            return report if rank == 0 else None
        report.rank = rank

        def mine(scores: dict[int, float]) -> dict[int, float]:
            return {r: v for r, v in scores.items() if r == rank}

        report.gpu_relative_perf_scores = mine(report.gpu_relative_perf_scores)
        report.gpu_individual_perf_scores = mine(report.gpu_individual_perf_scores)
        for table in (report.section_relative_perf_scores, report.section_individual_perf_scores):
            for name in table:
                table[name] = mine(table[name])
        report.rank_to_node = {r: n for r, n in report.rank_to_node.items() if r == rank}
        return report

    def _medians(self) -> dict[str, float]:
        """Each section's median over its scoring window; the samples older than the
        window are dropped (the next window never reaches further back)."""
        windows: dict[str, list[_Sample]] = {}
        for name, section in self._sections.items():
            samples = section.samples
            n = _window(samples, len(samples) - section.kept, self.window_samples,
                        self.window_seconds)  # fmt: skip
            if n:
                del samples[:-n]
                windows[name] = samples
            section.kept = len(samples)
        if any(events is not None for w in windows.values() for _, _, events in w):
            import torch

            torch.cuda.synchronize()  # device time: one synchronisation per report
        out: dict[str, float] = {}
        for name, window in windows.items():
            times = [ev[0].elapsed_time(ev[1]) / 1e3 for _, _, ev in window if ev is not None]
            out[name] = statistics.median(times or [took / 1e9 for _, took, _ in window])
        return out

    def _score(self, shares: list[dict[str, Any]]) -> Report:
        report = Report(rank_to_node={r: s["node"] for r, s in enumerate(shares)})
        names = sorted({n for s in shares for n in s["medians"]})
        totals: dict[int, float] = {}
        for name in names:
            medians = {r: s["medians"][name] for r, s in enumerate(shares) if name in s["medians"]}
            for r, m in medians.items():
                totals[r] = totals.get(r, 0.0) + m
            if self.calc_relative:
                report.section_relative_perf_scores[name] = relative_scores(medians)
            if self.calc_individual:
                scores, self._best[name] = individual_scores(medians, self._best.get(name, {}))
                report.section_individual_perf_scores[name] = scores
        # the "GPU" score: the rank's total time over all sections (device time on GPU)
        if self.calc_relative:
            report.gpu_relative_perf_scores = relative_scores(totals)
        if self.calc_individual:
            scores, self._best["\0total"] = individual_scores(totals, self._best.get("\0total", {}))
            report.gpu_individual_perf_scores = scores
        return report


def _window(samples: Sequence[_Sample], fresh: int, least: int, seconds: float) -> int:
    """How many of the newest ``samples`` a report scores: the ``fresh`` ones (made since
    the last report) and, before them, as many more as make ``least`` samples spanning
    ``seconds`` (from the oldest's start to the newest's end), as far as there are; 0
    when none is fresh (the section did not run since: it is left out, as before)."""
    if fresh <= 0 or not samples:
        return 0
    n = min(len(samples), max(fresh, least))
    end = samples[-1][0] + samples[-1][1]
    span = int(seconds * 1e9)
    while n < len(samples) and end - samples[-n][0] < span:
        n += 1
    return n


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def _cuda_events() -> tuple[Any, Any] | None:
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    return start, end
