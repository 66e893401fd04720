"""``steadfast report``: goodput accounting and the timeline picture, from the event log
(see :mod:`.goodput` for what is counted and :mod:`.timeline` for the picture)."""

from __future__ import annotations

from .goodput import (
    BADPUT_CAUSES,
    DETECTION_KINDS,
    FaultRecord,
    GoodputReport,
    Incarnation,
    compute_report,
    load_events,
)
from .timeline import plot_timeline

__all__ = [
    "BADPUT_CAUSES",
    "DETECTION_KINDS",
    "FaultRecord",
    "GoodputReport",
    "Incarnation",
    "compute_report",
    "format_report",
    "load_events",
    "plot_timeline",
]


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def format_report(report: GoodputReport, title: str = "") -> str:
    """The printed report: wall and productive time, goodput, time lost by cause, each
    fault with its detection latency and recovery time, and a verdict line."""
    wall = report.wall_time or 1.0
    lines = [f"== steadfast report{': ' + title if title else ''} =="]
    lines.append(f"  wall time        {report.wall_time:8.2f} s")
    goodput = f"goodput {100 * report.goodput:5.1f} %"
    lines.append(f"  productive time  {report.productive_time:8.2f} s   {goodput}")
    lines.append("  time lost by cause:")
    for cause in BADPUT_CAUSES:
        value = report.badput.get(cause, 0.0)
        lines.append(f"    {cause:<16} {value:8.2f} s  {100 * value / wall:5.1f} %")
    lines.append(
        f"  steps kept {report.steps_done}, re-done {report.steps_redone}; "
        f"{report.generations} process generations, {report.restarts} in-job restarts"
        + (f", {report.requeues} Slurm requeues or resubmissions" if report.requeues else "")
    )
    if len(report.incarnations) > 1 or len(report.nodes) > 1:
        lines.append(f"  nodes: {', '.join(report.nodes)}")
    if len(report.incarnations) > 1:
        lines.append(f"  Slurm incarnations ({len(report.incarnations)}):")
        for inc in report.incarnations:
            ended = f"requeued ({inc.requeued})" if inc.requeued else "not requeued"
            if inc.lost:
                ended += f", lost {','.join(inc.lost)}"
            if inc.excluded:
                ended += f", excluded {','.join(inc.excluded)}"
            lines.append(
                f"    job {inc.slurm_job_id} restart {inc.slurm_restart}: "
                f"{','.join(inc.nodes) or '-'}: {ended}"
            )
    if report.faults:
        lines.append(f"  faults ({len(report.faults)} injected):")
        lines.append(
            f"    {'fault':<12} {'rank':>4} {'step':>5}  {'detected by':<19} "
            f"{'latency':>9} {'recovery':>9}"
        )
        for f in report.faults:
            recovery = _secs(f.recovery_time) if f.recovery_time is not None else (
                "reported" if f.recovered else "NOT")  # fmt: skip
            lines.append(
                f"    {f.fault:<12} {'-' if f.rank is None else f.rank:>4} "
                f"{'-' if f.step is None else f.step:>5}  {f.detected_by or 'NOT DETECTED':<19} "
                f"{_secs(f.detection_latency):>9} {recovery:>9}"
            )
    else:
        lines.append("  faults: none injected")
    for problem in report.problems:
        lines.append(f"  note: {problem}")
    if not report.faults:
        verdict = "no injected faults"
    elif report.all_recovered:
        verdict = f"every injected fault ({len(report.faults)}) was detected and recovered"
    else:
        missed = [f.fault for f in report.faults if f.detected_by is None or not f.recovered]
        verdict = f"NOT every fault was detected and recovered: {', '.join(missed)}"
    lines.append(f"  verdict: {verdict}")
    return "\n".join(lines)
