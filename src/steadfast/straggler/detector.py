"""The straggler Detector: section timing on every rank, scores and reports.

Timing: each profiled call of a section records its CPU wall time
(``perf_counter_ns``) and, with ``profile_cuda`` on a GPU, a pair of CUDA events that are
read only when a report is made (one synchronisation per report, none per step). On a CPU
run the "GPU" scores are computed from the section times (documented fallback).

Reports are collective: every rank calls :meth:`Detector.generate_report` (directly, or
through :meth:`Detector.generate_report_if_interval_elapsed`) at the same call, and one
``all_gather_object`` of a small per-rank summary gives every rank the same data. From
that same data every rank computes the same scores, the same verdict, and the same call
at which the next report is due (from the slowest rank's call rate), so no rank ever
waits in a report collective that another rank skipped, and a ``stop_if_detected``
verdict needs no further broadcast.
"""

from __future__ import annotations

import functools
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..config import require_number
from .scores import StragglerId, individual_scores, relative_scores

__all__ = ["Detector", "Report"]

F = TypeVar("F", bound=Callable[..., Any])

#: Calls before the first report: enough samples for a median, few enough to report early.
FIRST_REPORT_CALLS = 10


@dataclass
class Report:
    """Scores of every rank (the same object on every rank)."""

    gpu_relative_perf_scores: dict[int, float] = field(default_factory=dict)
    gpu_individual_perf_scores: dict[int, float] = field(default_factory=dict)
    section_relative_perf_scores: dict[str, dict[int, float]] = field(default_factory=dict)
    section_individual_perf_scores: dict[str, dict[int, float]] = field(default_factory=dict)
    rank_to_node: dict[int, str] = field(default_factory=dict)
    generate_time: float = 0.0

    def identify_stragglers(
        self,
        gpu_rel_threshold: float = 0.75,
        section_rel_threshold: float = 0.75,
        gpu_indiv_threshold: float = 0.75,
        section_indiv_threshold: float = 0.75,
    ) -> dict[str, Any]:
        """Ranks whose scores are below the thresholds, under NVRx's keys and defaults
        (0.75; Megatron Bridge's manager passes its own 0.7). A section appears only
        when some rank straggles in it, so an empty result is falsy all the way down."""

        def below(scores: dict[int, float], threshold: float) -> set[StragglerId]:
            return {
                StragglerId(rank, self.rank_to_node.get(rank, "?"))
                for rank, score in scores.items()
                if score < threshold
            }

        def sections(table: dict[str, dict[int, float]], threshold: float) -> dict[str, Any]:
            found = {name: below(scores, threshold) for name, scores in table.items()}
            return {name: ranks for name, ranks in found.items() if ranks}

        return {
            "straggler_gpus_relative": below(self.gpu_relative_perf_scores, gpu_rel_threshold),
            "straggler_gpus_individual": below(
                self.gpu_individual_perf_scores, gpu_indiv_threshold
            ),
            "straggler_sections_relative": sections(
                self.section_relative_perf_scores, section_rel_threshold
            ),
            "straggler_sections_individual": sections(
                self.section_individual_perf_scores, section_indiv_threshold
            ),
        }

    def format_scores(self, title: str, scores: dict[int, float], num: int) -> str:
        """The seed's block: worst and best ``num`` ranks with rank, node and score."""
        ordered = sorted(scores.items(), key=lambda item: (item[1], item[0]))
        n, total = min(num, len(ordered)), len(ordered)
        lines = [f"{title}:", f" Worst performing {n}/{total} ranks:"]
        lines += [self._line(r, s) for r, s in ordered[:n]]
        lines.append(f" Best performing {n}/{total} ranks:")
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        lines += [self._line(r, s) for r, s in best[:n]]
        return "\n".join(lines)

    def _line(self, rank: int, score: float) -> str:
        return f"  Rank={rank} Node={self.rank_to_node.get(rank, '?')} Score={score:.2f}"


class _Section:
    """Samples of one section on this rank since the last report."""

    __slots__ = ("calls", "cpu_ns", "cuda_events")

    def __init__(self) -> None:
        self.calls = 0
        self.cpu_ns: list[int] = []
        self.cuda_events: list[tuple[Any, Any]] = []


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
        self._section.cpu_ns.append(time.perf_counter_ns() - self._start)
        if self._events is not None:
            self._events[1].record()
            self._section.cuda_events.append(self._events)


class Detector:
    """Times detection sections on this rank and builds straggler reports.

    Args:
        report_time_interval: Seconds between reports made by
            :meth:`generate_report_if_interval_elapsed`.
        profiling_interval: Profile every n-th call of each section (1 = every call).
        calc_relative: Compute relative scores.
        calc_individual: Compute individual scores.
        group: Process group of the ranks compared (default: the world).
        node_name: This rank's node in reports (default: the host name).
    """

    def __init__(
        self,
        report_time_interval: float = 300.0,
        profiling_interval: int = 1,
        calc_relative: bool = True,
        calc_individual: bool = True,
        group: Any = None,
        node_name: str | None = None,
    ) -> None:
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
        self._next_report = FIRST_REPORT_CALLS
        self._last_report_time = time.monotonic()
        self._last_report_calls = 0

    # ------------------------------------------------------------------ timing
    def detection_section(self, name: str, profile_cuda: bool = True) -> _Timing:
        """Time the enclosed code (``with detector.detection_section(name): ...``) as
        section ``name``, every ``profiling_interval``-th call; with ``profile_cuda`` on a
        GPU, its device time is recorded too (CUDA events, read at the next report)."""
        section = self._sections.get(name)
        if section is None:
            section = self._sections[name] = _Section()
        return _Timing(section, profile_cuda and self._cuda_possible, self.profiling_interval)

    def wrap_callable(self, fn: F, name: str | None = None, profile_cuda: bool = True) -> F:
        """``fn`` timed as a section (named after it unless ``name`` is given)."""
        section: str = name or str(getattr(fn, "__name__", "callable"))

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.detection_section(section, profile_cuda):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]

    # ------------------------------------------------------------------ reports
    def generate_report_if_interval_elapsed(self) -> Report | None:
        """Call once per step on every rank: a report when one is due, else None.
        Which call is due is agreed at the previous report (see the module docstring)."""
        self._calls += 1
        if self._calls == 1:  # the call rate is measured from the loop's first call
            self._last_report_time = time.monotonic()
            self._last_report_calls = 1
        if self._calls < self._next_report:
            return None
        return self.generate_report()

    def generate_report(self) -> Report:
        """Gather every rank's section medians (one collective) and score them."""
        start = time.monotonic()
        summary = {
            "node": self.node_name,
            "medians": self._medians(),
            "period": (start - self._last_report_time)
            / max(1, self._calls - self._last_report_calls),
        }
        shares = _all_gather(summary, self.group)
        report = self._score(shares)
        slowest = max((s["period"] for s in shares), default=0.0)
        per_interval = max(1, round(self.report_time_interval / slowest)) if slowest > 0 else 1
        self._next_report = self._calls + per_interval
        self._last_report_time = time.monotonic()
        self._last_report_calls = self._calls
        for section in self._sections.values():
            section.cpu_ns.clear()
            section.cuda_events.clear()
        report.generate_time = time.monotonic() - start
        return report

    def _medians(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if any(section.cuda_events for section in self._sections.values()):
            import torch

            torch.cuda.synchronize()  # device time: one synchronisation per report
        for name, section in self._sections.items():
            if section.cuda_events:
                times = [s.elapsed_time(e) / 1e3 for s, e in section.cuda_events]
            else:
                times = [ns / 1e9 for ns in section.cpu_ns]
            if times:
                out[name] = statistics.median(times)
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


def _all_gather(summary: dict[str, Any], group: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [summary]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, summary, group=group)
    return out
