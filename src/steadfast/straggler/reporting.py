"""Straggler reports: the :class:`Report` every score ends up in, and NVRx's
:class:`ReportGenerator`, which scores timing summaries that the caller collected.

A *summary* is ``{Statistic: value}`` for one section or one CUDA kernel on this rank
(:func:`summarize` makes one from raw times). ``ReportGenerator.generate_report`` is
collective (every rank calls it) and scores, as NVRx does:

- a section: ``reference / median`` on this rank; the relative reference is the least
  median over the ranks that ran the section, the individual one this rank's least median
  so far;
- the GPU: the same ratio per kernel, averaged with each kernel's total time (``NUM x
  AVG``) as its weight, over the kernels every rank ran; ``ncclDev*`` kernels are left
  out (their times differ by an order of magnitude between ranks that wait and ranks
  that are waited for).

``gather_on_rank0=True``: rank 0's report has every rank's scores and the other ranks get
None; ``False``: each rank's report has its own scores only. One ``all_gather_object`` of
the ranks' medians per report (NVRx reduces tensors of name ids; the result is the same).
"""

from __future__ import annotations

import enum
import math
import socket
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..dist import all_gather_object, member_index
from .scores import StragglerId

__all__ = ["Report", "ReportGenerator", "Statistic", "summarize"]


class Statistic(enum.Enum):
    """The statistics of a timing summary (NVRx's ``straggler.Statistic``)."""

    MIN = enum.auto()
    MAX = enum.auto()
    MED = enum.auto()
    AVG = enum.auto()
    STD = enum.auto()
    NUM = enum.auto()


def summarize(times: Iterable[float]) -> dict[Statistic, float]:
    """The summary of a section's or kernel's times on this rank (NaN STD for one)."""
    values = list(times)
    if not values:
        raise ValueError("summarize: no times")
    return {
        Statistic.MIN: min(values),
        Statistic.MAX: max(values),
        Statistic.MED: statistics.median(values),
        Statistic.AVG: statistics.fmean(values),
        Statistic.STD: statistics.pstdev(values) if len(values) > 1 else math.nan,
        Statistic.NUM: float(len(values)),
    }


@dataclass
class Report:
    """Performance scores (0..1, 1 the best) by rank; see the module docstring for who
    gets which ranks. ``local_*_summaries``: this rank's timing summaries."""

    gpu_relative_perf_scores: dict[int, float] = field(default_factory=dict)
    gpu_individual_perf_scores: dict[int, float] = field(default_factory=dict)
    section_relative_perf_scores: dict[str, dict[int, float]] = field(default_factory=dict)
    section_individual_perf_scores: dict[str, dict[int, float]] = field(default_factory=dict)
    rank_to_node: dict[int, str] = field(default_factory=dict)
    generate_report_elapsed_time: float = 0.0
    local_section_summaries: dict[str, Any] = field(default_factory=dict)
    local_kernel_summaries: dict[str, Any] = field(default_factory=dict)
    gather_on_rank0: bool = False
    rank: int | None = None

    @property
    def generate_time(self) -> float:
        """Seconds it took to make this report."""
        return self.generate_report_elapsed_time

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

        def below(scores: Mapping[int, float], threshold: float) -> set[StragglerId]:
            return {
                StragglerId(rank, self.rank_to_node.get(rank, "?"))
                for rank, score in scores.items()
                if score < threshold
            }

        def sections(table: Mapping[str, Mapping[int, float]], threshold: float) -> dict[str, Any]:
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


def _median(summary: Mapping[Any, float]) -> float:
    return float(summary[Statistic.MED])


def _gpu_score(kernels: Mapping[str, Mapping[Any, float]], reference: Mapping[str, float]) -> float:
    """The time-weighted average of ``reference / median`` over the kernels that have a
    reference (NaN when none has)."""
    weighted = weights = 0.0
    for name, summary in kernels.items():
        ref = reference.get(name, math.nan)
        if math.isnan(ref):
            continue
        weight = float(summary[Statistic.NUM]) * float(summary[Statistic.AVG])
        weighted += ref / _median(summary) * weight
        weights += weight
    return weighted / weights if weights > 0 else math.nan


class ReportGenerator:
    """Scores this rank's section and kernel summaries against the other ranks' and its
    own past (NVRx's ``straggler.reporting.ReportGenerator``; module docstring).

    Args:
        scores_to_compute: Which scores: ``"relative_perf_scores"``,
            ``"individual_perf_scores"`` (or ``"all"``).
        gather_on_rank0: Every rank's scores on rank 0 (others get None), or each
            rank's own on each rank.
        pg: The process group of the ranks compared (default: the world).
        node_name: This rank's node in reports (default: the host name).
    """

    def __init__(
        self,
        scores_to_compute: Iterable[str] | str = "all",
        gather_on_rank0: bool = True,
        pg: Any = None,
        node_name: str | None = None,
    ) -> None:
        wanted = (
            {"relative_perf_scores", "individual_perf_scores"}
            if str(scores_to_compute) == "all"
            else set(scores_to_compute)
        )
        self.relative = "relative_perf_scores" in wanted
        self.individual = "individual_perf_scores" in wanted
        self.gather_on_rank0 = bool(gather_on_rank0)
        self.group = pg
        self.node_name = node_name or socket.gethostname()
        self._best: dict[str, float] = {}  # "s:" / "k:" + name -> least median seen here

    def generate_report(
        self,
        section_summaries: Mapping[str, Mapping[Any, float]],
        kernel_summaries: Mapping[str, Mapping[Any, float]],
    ) -> Report | None:
        """This rank's report (collective: every rank calls it with its summaries)."""
        start = time.perf_counter()
        kernels = {k: v for k, v in kernel_summaries.items() if "ncclDev" not in k}
        section_medians = {s: _median(v) for s, v in section_summaries.items()}
        kernel_medians = {k: _median(v) for k, v in kernels.items()}
        mine = {"node": self.node_name, "sections": section_medians, "kernels": kernel_medians}
        shares = all_gather_object(mine, self.group)
        rank = member_index(self.group)
        for key, name_medians in (("s:", section_medians), ("k:", kernel_medians)):
            for name, median in name_medians.items():
                self._best[key + name] = min(self._best.get(key + name, math.inf), median)
        own = self._scores(section_summaries, kernels, shares)
        report = Report(
            rank_to_node={r: s["node"] for r, s in enumerate(shares)},
            local_section_summaries=dict(section_summaries),
            local_kernel_summaries=dict(kernels),
            gather_on_rank0=self.gather_on_rank0,
            rank=None if self.gather_on_rank0 else rank,
        )
        if self.gather_on_rank0:
            everyone = all_gather_object(own, self.group)  # rank 0 keeps them all
            if rank != 0:
                return None
            for r, scores in enumerate(everyone):
                _put(report, r, scores)
        else:
            report.rank_to_node = {rank: self.node_name}
            _put(report, rank, own)
        report.generate_report_elapsed_time = time.perf_counter() - start
        return report

    def _scores(
        self,
        sections: Mapping[str, Mapping[Any, float]],
        kernels: Mapping[str, Mapping[Any, float]],
        shares: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """This rank's scores: ``{"gpu": (individual, relative), "sections": {name:
        (individual, relative)}}`` (None where a score is not computed)."""

        def least(kind: str, name: str) -> float:  # over every rank; NaN if one lacks it
            values = [s[kind].get(name) for s in shares]
            return math.nan if None in values else min(v for v in values if v is not None)

        out: dict[str, Any] = {"gpu": (None, None), "sections": {}}
        best_k = {k: self._best["k:" + k] for k in kernels}
        rel_k = {k: least("kernels", k) for k in kernels}
        out["gpu"] = (
            _gpu_score(kernels, best_k) if self.individual else None,
            _gpu_score(kernels, rel_k) if self.relative else None,
        )
        for name, summary in sections.items():
            median = _median(summary)
            out["sections"][name] = (
                self._best["s:" + name] / median if self.individual else None,
                least("sections", name) / median if self.relative else None,
            )
        return out


def _put(report: Report, rank: int, scores: Mapping[str, Any]) -> None:
    """This rank's computed scores into the report: NaN where there is no reference
    (no kernel common to every rank, no kernels at all), as NVRx reports it."""
    individual, relative = scores["gpu"]
    if individual is not None:
        report.gpu_individual_perf_scores[rank] = individual
    if relative is not None:
        report.gpu_relative_perf_scores[rank] = relative
    for name, (ind, rel) in scores["sections"].items():
        if ind is not None:
            report.section_individual_perf_scores.setdefault(name, {})[rank] = ind
        if rel is not None:
            report.section_relative_perf_scores.setdefault(name, {})[rank] = rel
