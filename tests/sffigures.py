"""The figures of a run's report held against what the test measured on its own.

``clean_end/sitecustomize.py`` records, for every Python process a page starts, its
start (the kernel's) and end (its last exit handler), and each optimizer step global
rank 0 ends (a hook on torch's optimizers). :func:`check_run` reads a run's event log as
``steadfast report`` does and says where a figure the user reads is not the measured
one:

- **wall time**: the report's, from its launchers' process start to their end, is the
  measured life of those processes, less at most :data:`WALL_SLACK` (what a launcher
  does after its last event: closing its endpoint, the interpreter's exit);
- **a healthy run** (no fault injected or seen, one generation) whose rank 0 steps a
  torch optimizer: every step counted, goodput within :data:`GOODPUT_BAND` of the
  measured (rank 0's optimizer steps, first to last, over the measured wall time: the
  time between steps; a process's first step is its start-up in both), and "other" at
  most :data:`OTHER_SHARE` of the wall time. A loop that gives each step's ``seconds``
  itself says which part of that time is its step: there its goodput is at most the
  measured, and with what the report puts between steps (straggling, saves, "other":
  the library's per-step calls, a snapshot) it is the measured, within the band;
- **a fault** has one latency: where the launchers saw a fault of an injected one's
  rank, both tables give it the same figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from steadfast import events as ev
from steadfast.report import GoodputReport, compute_report, load_events

#: seconds a launcher runs after its last event, at most (its endpoint, its exit)
WALL_SLACK = 0.5
#: a healthy run's goodput is within this much (absolute) of the measured
GOODPUT_BAND = 0.05
#: "other" is at most this share of a healthy run's wall time
OTHER_SHARE = 0.10
#: faults' latencies that are one figure differ by less than this (rounding)
SAME_LATENCY = 0.005


@dataclass
class Process:
    """One measured process."""

    start: float
    end: float | None = None
    argv: str = ""
    steps: list[float] = field(default_factory=list)  # rank 0's optimizer steps' ends


def measured(folder: Path) -> dict[int, Process]:
    """Every process the sitecustomize recorded in ``folder``, by pid."""
    out: dict[int, Process] = {}
    for path in folder.glob("*.txt"):
        proc: Process | None = None
        for line in path.read_text().splitlines():
            what, _, rest = line.partition(" ")
            value, _, argv = rest.partition(" ")
            if what == "start":
                proc = Process(float(value), argv=argv)
            elif proc is not None and what == "step":
                proc.steps.append(float(value))
            elif proc is not None and what == "end":
                proc.end = float(value)
        if proc is not None:
            out[int(path.stem)] = proc
    return out


def check_run(log: Path, procs: dict[int, Process]) -> tuple[list[str], bool]:
    """``(the figures of the report of ``log`` that are not what was measured, whether
    its run was measured)``: a run whose launchers the sitecustomize did not see (another
    PID namespace, Slurm's environment) is not."""
    evs, problems = load_events(log)
    report = compute_report(evs, problems)
    launchers = [procs.get(int(e.get("pid") or 0)) for e in evs if e.kind == "launcher_start"]
    if not launchers or any(p is None or p.end is None for p in launchers):
        return [], False
    where = f"{log}"
    wrong: list[str] = []
    began = min(p.start for p in launchers if p is not None)
    ended = max(p.end for p in launchers if p is not None and p.end is not None)
    wall = ended - began
    if not wall - WALL_SLACK <= report.wall_time <= wall + 0.05:
        wrong.append(f"{where}: wall time {report.wall_time:.2f} s, measured {wall:.2f} s")
    wrong.extend(_one_latency(report, where))
    view = report.launchers
    healthy = (
        not report.faults
        and view is not None
        and not view.faults
        and len(view.generations) == 1
        and not any(e.kind in ("nan_detected", "rollback", "restart") for e in evs)
    )
    if not healthy:
        return wrong, True
    workers = {int(p) for e in evs if e.kind == "workers_started" for p in e.get("pids") or []}
    steps = [p.steps for pid, p in procs.items() if pid in workers and p.steps]
    if not steps:  # a loop with no torch optimizer (sections and sleeps): no truth to hold
        return wrong, True
    if len(steps) != 1:
        wrong.append(f"{where}: rank 0's optimizer steps measured in {len(steps)} processes")
        return wrong, True
    (mine,) = steps
    if report.steps_done != len(mine):
        wrong.append(f"{where}: {report.steps_done} steps reported, {len(mine)} measured")
    truth = (mine[-1] - mine[0]) / wall if wall > 0 else 0.0
    measured = (
        f"measured {100 * truth:.1f} % (rank 0's steps {mine[-1] - mine[0]:.2f} s of {wall:.2f} s)"
    )
    declared = all(isinstance(e.get("seconds"), (int, float)) for e in evs if e.kind == "step_done")
    if not declared and abs(report.goodput - truth) > GOODPUT_BAND:
        wrong.append(f"{where}: goodput {100 * report.goodput:.1f} %, {measured}")
    if declared:  # a step's own seconds are its time; the rest between steps is "other"
        between = sum(report.badput.get(k, 0.0) for k in ("straggling", "checkpoint_save", "other"))
        loop = (report.productive_time + between) / report.wall_time
        if report.goodput > truth + GOODPUT_BAND or abs(loop - truth) > GOODPUT_BAND:
            wrong.append(
                f"{where}: goodput {100 * report.goodput:.1f} %, with what the report puts "
                f"between the steps {100 * loop:.1f} %, {measured}"
            )
    other = report.badput.get("other", 0.0)
    if other > OTHER_SHARE * report.wall_time:
        wrong.append(
            f"{where}: 'other' is {other:.2f} s of a healthy run's {report.wall_time:.2f} s "
            f"({', '.join(f'{k} {v:.2f}' for k, v in report.badput.items())})"
        )
    return wrong, True


def _one_latency(report: GoodputReport, where: str) -> list[str]:
    """Each injected fault the launchers also saw (the first fault of its rank they saw
    after it, before the next injection) has one latency in both tables."""
    view = report.launchers
    if view is None:
        return []
    wrong = []
    injected = sorted(report.faults, key=lambda f: f.time)
    for i, f in enumerate(injected):
        if f.detection_latency is None or f.rank is None:
            continue
        until = injected[i + 1].time if i + 1 < len(injected) else float("inf")
        seen = [o for o in view.faults if o.rank == f.rank and f.time <= o.time < until]
        if seen and seen[0].detection_latency is not None:
            o = seen[0]
            if abs(o.detection_latency - f.detection_latency) > SAME_LATENCY:  # type: ignore[operator]
                wrong.append(
                    f"{where}: {f.fault} of rank {f.rank}: latency {f.detection_latency:.2f} s "
                    f"injected, {o.detection_latency:.2f} s as the launchers saw it ({o.what})"
                )
    return wrong


def logs_written(folder: Path, since: float) -> list[Path]:
    """The event logs below ``folder`` written since ``since`` (epoch seconds)."""
    found = [
        p
        for p in folder.rglob("*.jsonl")
        if p.name.startswith(("events", Path(ev.DEFAULT_EVENTS_FILE).stem))
        and p.stat().st_mtime >= since
    ]
    return sorted(found)
