"""``steadfast report``: goodput accounting and the timeline picture, from the event log
(see :mod:`.goodput` for what is counted and :mod:`.timeline` for the picture)."""

from __future__ import annotations

import textwrap
from typing import Any

from .goodput import (
    BADPUT_CAUSES,
    DETECTION_KINDS,
    FaultRecord,
    GoodputReport,
    Incarnation,
    compute_report,
    load_events,
)
from .launchers import Generation, LauncherView, ObservedFault, OpenLauncher, launcher_view
from .replicas import replica_lines
from .timeline import plot_timeline

__all__ = [
    "BADPUT_CAUSES",
    "DETECTION_KINDS",
    "FaultRecord",
    "Generation",
    "GoodputReport",
    "Incarnation",
    "LauncherView",
    "ObservedFault",
    "compute_report",
    "format_report",
    "launcher_view",
    "load_events",
    "plot_timeline",
]

#: what a script adds to give the report its productive time (the one line per step)
STEP_LINE = 'steadfast.events.emit("step_done", step=step, seconds=step_seconds)'


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def format_report(report: GoodputReport, title: str = "") -> str:
    """The printed report: wall and productive time, goodput, time lost by cause, each
    fault with its detection latency and recovery time, and a verdict line. A script
    that reports no steps gets the launchers' account instead of the goodput: the wall
    time split into start-up, running workers, each fault's cost and the end."""
    wall = report.wall_time or 1.0
    view = report.launchers
    lines = [f"== steadfast report{': ' + title if title else ''} =="]
    lines.append(f"  wall time        {report.wall_time:8.2f} s")
    if report.reports_steps or view is None:
        goodput = f"goodput {100 * report.goodput:5.1f} %"
        lines.append(f"  productive time  {report.productive_time:8.2f} s   {goodput}")
        lines.append("  time lost by cause:")
        for cause in BADPUT_CAUSES:
            value = report.badput.get(cause, 0.0)
            lines.append(f"    {cause:<16} {value:8.2f} s  {100 * value / wall:5.1f} %")
        redone = "unknown" if report.steps_redone is None else report.steps_redone
        lines.append(
            f"  steps kept {report.steps_done}, re-done {redone}; "
            f"{report.generations} process generations, {report.restarts} in-job restarts"
            + (f", {report.requeues} Slurm requeues or resubmissions" if report.requeues else "")
        )
    else:
        lines.extend(_launchers_split(view, wall))
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
    if view is not None and view.generations:
        lines.extend(_generations(view))
    if view is not None and view.faults:
        lines.extend(_faults_seen(view))
    lines.extend(_restarts(report))
    if report.faults:
        lines.append(f"  faults ({len(report.faults)} injected):")
        lines.append("    (latency: the injection -> its detection; recovery: the detection ->")
        lines.append("    the first step done after it)")
        lines.append(
            f"    {'fault':<12} {'rank':>4} {'step':>5}  {'detected by':<19} "
            f"{'latency':>9} {'recovery':>9}"
        )
        for f in report.faults:
            recovery = _secs(f.recovery_time) if f.recovery_time is not None else (
                "stopped" if f.stopped else "reported" if f.recovered else "NOT")  # fmt: skip
            lines.append(
                f"    {f.fault:<12} {'-' if f.rank is None else f.rank:>4} "
                f"{'-' if f.step is None else f.step:>5}  {f.detected_by or 'NOT DETECTED':<19} "
                f"{_secs(f.detection_latency):>9} {recovery:>9}"
            )
    elif view is None or not view.faults:
        lines.append("  faults: none injected" + (", none seen" if view is not None else ""))
    lines.extend(replica_lines(report.replicas))
    for problem in report.problems:
        lines.append(f"  note: {problem}")
    for warning in report.warnings:
        lines.append(f"  warning: {warning}")
    lines.append(f"  verdict: {_verdict(report)}")
    return "\n".join(lines)


def _restarts(report: GoodputReport) -> list[str]:
    """Each restart: what it was for, its seconds to the first step, its phases."""
    if not report.restarts_phases:
        return []
    proofs = [r["proof"] for r in report.restarts_phases if "proof" in r]
    verified = [p for p in proofs if p["status"] == "verified"]
    cost = sum(p["proof_seconds"] for p in verified)
    lines = [
        f"  restarts, fault to first step ({len(report.restarts_phases)}; restores proven: "
        f"{len(verified)} of {len(proofs)}, their proofs re-did "
        f"{sum(p['proof_steps'] for p in verified)} step(s) in {cost:.2f} s):"
    ]
    for i, r in enumerate(report.restarts_phases, 1):
        nodes = len(r["nodes"])
        where = f"{r['node']}" + (f", last of {nodes} nodes" if nodes > 1 else "")
        total = "not back" if r["seconds"] is None else f"{r['seconds']:.2f} s"
        lines.append(f"    {i}. {r['kind']}, {r['what']} ({where}): {total}")
        parts = [
            f"{name} {seconds:.3f}"
            + (f" ({r['tier']})" if name == "checkpoint_load" and r["tier"] else "")
            for name, seconds in r["phases"].items()
        ]
        lines.extend(textwrap.wrap(", ".join(parts), 96, initial_indent=" " * 7,
                                   subsequent_indent=" " * 7))  # fmt: skip
        lines.extend(f"       note: {note}" for note in r["notes"])
        if "proof" in r:
            lines.append(f"       restore: {_proof_line(r['proof'])}")
    return lines


def _proof_line(proof: dict[str, Any]) -> str:
    """One restart's replay proof, in words (a malformed record gives what it can)."""
    status, tier = _at(proof, "status"), _at(proof, "tier")
    where = f"step {_at(proof, 'step')} ({tier})" if tier else ""
    if status == "verified":
        steps, against = _at(proof, "steps"), _at(proof, "against")
        extra = ""
        if _at(proof, "proof_steps"):
            took = _at(proof, "proof_seconds", 0.0)
            extra = f"; {_at(proof, 'proof_steps')} step(s) re-done only for it, {took:.2f} s"
        how = {
            "losses": f"re-done steps {steps} gave the logged losses",
            "state": f"the re-done state equals {against}",
            "both": f"re-done steps {steps} gave the logged losses, and the state equals {against}",
            "ledger": "its digest is the one logged at its save, and the run's earlier replay "
            "proof holds for its keys",
        }.get(str(_at(proof, "route")), "proven")
        if _at(proof, "exact", True) is False:
            gap = _at(proof, "difference")
            within = f"{gap:.2g}" if isinstance(gap, (int, float)) else "rounding"
            how += f" to a relative {within}, not bit for bit"
        return f"verified: {where}, {how}{extra}"
    if status == "mismatch":
        differs = _at(proof, "differs")
        first = differs[0] if isinstance(differs, list) and differs else {}
        first = first if isinstance(first, dict) else {}
        what = (
            f"its state differs in {', '.join(map(str, _at(first, 'objects')))}"
            if isinstance(_at(first, "objects"), list)
            else f"its digest {_at(first, 'digest')} is not the one logged at its save"
            if _at(first, "digest") is not None
            else f"gave loss {_at(first, 'loss')}, logged {_at(first, 'logged')}"
        )
        return f"MISMATCH: {where}, rank {_at(first, 'rank')}'s step {_at(first, 'step')} {what}"
    return f"not verified ({_at(proof, 'reason')})"


def _at(record: dict[str, Any], key: str, default: Any = None) -> Any:
    """``record[key]``, or ``default`` (a dict the report built, not an event)."""
    return record.get(key, default)


def _launchers_split(view: LauncherView, wall: float) -> list[str]:
    lines = [
        "  productive time  unknown: the script reports no steps; one line per step gives",
        f"                   it: {STEP_LINE}",
        "  the wall time, from the launchers:",
    ]
    parts = (
        ("start-up", view.startup, "first launcher start -> every worker of the first "
         "generation running"),
        ("running workers", view.running, ""),
        ("lost to faults", view.lost, f"{len(view.faults)} fault(s), each below"),
        ("end", view.ending, "last worker exit -> last launcher end"),
    )  # fmt: skip
    open_ones = view.running_launchers
    for name, value, note in parts:
        if name == "end" and open_ones:  # no end to claim while a launcher has none
            lines.append(f"    {'end':<16}  unknown   {_no_end(view, open_ones)}")
            continue
        lines.append(
            f"    {name:<16} {value:8.2f} s  {100 * value / wall:5.1f} %   {note}".rstrip()
        )
    restarts = sum(1 for g in view.generations if g.in_job_restart)
    lines.append(
        f"  {len(view.generations)} generations of workers, {restarts} in-job restarts "
        "(each a new rendezvous round of every node)"
    )
    return lines


def _no_end(view: LauncherView, open_ones: list[OpenLauncher]) -> str:
    """The launchers with no end that no loss explains, in words."""
    each = ", ".join(f"{u.host} (last event at {u.last - view.start:.2f} s)" for u in open_ones)
    return f"NO END recorded for the launcher of {each}: still running, or killed"


def _generations(view: LauncherView) -> list[str]:
    lines = ["  generations (seconds from the first launcher's start):"]
    for g in view.generations:
        end = "-" if g.end is None else f"{g.end - view.start:.2f}"
        lines.append(
            f"    {g.index:>2}  {','.join(g.nodes):<28} world {g.world_size:<4} "
            f"{g.start - view.start:7.2f} -> {end:>7}  {g.outcome}"
        )
    return lines


def _faults_seen(view: LauncherView) -> list[str]:
    lines = [
        f"  faults seen by the launchers ({len(view.faults)}):",
        "    (latency: the fault -> its detection: from its injection where one was logged,",
        "    a dead rank seen as it ends, a hung one from its last sign of life; next gen.:",
        "    the detection -> the next generation running; cost: both)",
        *(
            ["    one culprit per fault, agreed by the nodes: every other rank stopped after it"]
            if any(f.fault_id for f in view.faults)
            else []
        ),
        f"    {'what':<14} {'node':<8} {'rank':>4}  {'cause':<24} {'latency':>9} "
        f"{'next gen.':>9} {'cost':>9}  replaced by",
    ]
    for f in view.faults:
        lines.append(
            f"    {f.what:<14} {f.node or '-':<8} {'-' if f.rank is None else f.rank:>4}  "
            f"{f.cause[:24]:<24} {_secs(f.detection_latency):>9} "
            f"{_secs(f.next_generation):>9} {_secs(f.cost):>9}  {','.join(f.replaced_by) or '-'}"
        )
        if f.summary:
            lines.append(f"      {f.summary}")
    return lines


def _verdict(report: GoodputReport) -> str:
    view = report.launchers
    if report.faults:
        if report.all_recovered:
            return f"every injected fault ({len(report.faults)}) was detected and recovered"
        missed = [f.fault for f in report.faults if f.detected_by is None or not f.recovered]
        return f"NOT every fault was detected and recovered: {', '.join(missed)}"
    if view is None or not view.faults:
        return "no injected faults" + (", no fault seen" if view is not None else "")
    after = [f for f in view.faults if f.next_generation is not None]
    codes = sorted(set(view.exit_codes.values()))
    ended = "every launcher exited 0" if codes == [0] else f"launcher exit codes {codes}"
    gone = [u.host for u in view.unended if u.lost]
    if gone:
        ended = ended.replace("every launcher", "every other launcher") + (
            f" ({', '.join(gone)}: no end recorded, lost with the node)"
        )
    if view.running_launchers:
        ended += "; " + _no_end(view, view.running_launchers)
    n = len(view.faults)
    if len(after) == n:
        return f"{n} fault(s) seen, each followed by a new generation of workers; {ended}"
    return f"{n} fault(s) seen, {n - len(after)} with no new generation after; {ended}"
