"""Goodput accounting from a run's event log, across in-job restarts and requeues.

Goodput is the share of the wall time spent on training steps whose result the final
model keeps. The rest is badput, split by cause after the categories of Google's
ml-goodput-measurement:

===================== ====================================================================
``startup``           process start to the first step of a generation (imports, process
                      group, model build), less the checkpoint load; for the first, from
                      the launcher process's start (its imports, the workers' spawn)
``checkpoint_load``   ``checkpoint_loaded`` seconds (training preparation after a restart)
``checkpoint_save``   ``checkpoint_saved`` blocking seconds (an async save blocks briefly)
``wasted_progress``   steps that were run and then run again: the work lost to a restart
                      or a rollback past the last checkpoint ("lost work re-done")
``detection``         from an injected fault (or, without one, the last completed step)
                      until the fault was detected
``restart``           from the detection until the new processes started (stopping the old
                      ones, the rendezvous; for a requeue: the queue)
``straggling``        the excess over the median step time of steps that took more than
                      ``slow_factor`` x the median and :data:`SLOW_EXCESS` over it (of
                      steps that carry their own seconds)
``teardown``          from the run's last step or save to its end: the script's end (its
                      process group's destruction), the processes' exit, the launchers' end
``other``             the remainder: time between steps, logging, anything not above
===================== ====================================================================

A step's seconds are its ``step_done``'s own; a loop that writes none gets the time
since its previous step in the same process, less the saves and loads between them
(:func:`.steps.timed`): what it does between steps is then in its steps' time, and
a slow step is not told from a long evaluation (no straggling: the excess is "other").
Without ``job_start``, a process's start is the launchers' (``first_step``) and its
start-up runs to its first step.

Events read (the training loop writes the first two, the library the others):
``job_start`` (with ``process_start``), ``step_done`` (``seconds``), ``checkpoint_saved``,
``checkpoint_loaded``, ``fault_injected``, ``rank_hung``, ``rank_failed``,
``nan_detected``, ``rollback``, ``straggler_detected``, ``shutdown_requested``,
``preemption_signal``, ``restart``; under Slurm, the ``slurm_job_id`` and
``slurm_restart`` of each ``job_start`` count the requeues. Step time is taken from the
lowest rank that reports steps (rank 0), which waits for the others in its collectives.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import events as ev
from ..faults import FaultKind
from .launchers import LauncherView, launcher_view
from .replicas import replica_summary
from .restarts import _exit_time, _launcher
from .restarts import restarts as restart_phases
from .steps import seen_steps, timed, untimed

__all__ = [
    "BADPUT_CAUSES",
    "DETECTION_KINDS",
    "FaultRecord",
    "GoodputReport",
    "compute_report",
    "load_events",
]

BADPUT_CAUSES = (
    "startup",
    "checkpoint_load",
    "checkpoint_save",
    "wasted_progress",
    "detection",
    "restart",
    "straggling",
    "teardown",
    "other",
)

#: A slow step is also at least this many seconds over the median: on a busy machine a
#: millisecond step's scheduling jitter is often 1.5x its median, and is not straggling.
SLOW_EXCESS = 0.05

#: Which events detect which injected fault (``fault_injected``'s ``fault`` field): the
#: table of :class:`steadfast.faults.FaultKind`, the one vocabulary of faults.
DETECTION_KINDS: dict[str, tuple[str, ...]] = {k.value: k.detected_by for k in FaultKind}
#: Names earlier versions wrote for the same faults (their logs are still read).
_FORMER_NAMES = {"nan_loss": FaultKind.NAN_BURST, "slow": FaultKind.SLOW_RANK}
_ANY_DETECTION = tuple(sorted({k for kinds in DETECTION_KINDS.values() for k in kinds}))


@dataclass
class FaultRecord:
    """One injected fault: when it happened, when it was detected, when training was
    back (the first step completed after the recovery)."""

    fault: str
    rank: int | None
    step: int | None
    time: float
    detected_by: str | None = None
    detection_latency: float | None = None
    recovery_time: float | None = None  # detection -> first step done after recovery
    recovered: bool = False
    stopped: bool = False  # the job stopped with a verdict (exit 80): its recovery


@dataclass
class Incarnation:
    """One run of a Slurm job (its id and ``SLURM_RESTART_COUNT``): the nodes its
    training processes ran on, the nodes lost while it ran, and the requeue that ended
    it (its cause and the nodes it excluded), if one did."""

    slurm_job_id: str
    slurm_restart: int
    nodes: list[str]
    lost: list[str] = field(default_factory=list)
    requeued: str | None = None
    excluded: list[str] = field(default_factory=list)


@dataclass
class GoodputReport:
    """The accounting of one run (see the module docstring)."""

    wall_time: float
    productive_time: float
    badput: dict[str, float]
    faults: list[FaultRecord]
    steps_done: int
    #: None where the script's own step index is unknown (steps seen by the launchers
    #: of a script whose optimizer keeps no step count)
    steps_redone: int | None
    generations: int
    restarts: int
    problems: list[str] = field(default_factory=list)
    #: Slurm incarnations after the first (a requeue for any reason: a job retry, a
    #: preemption, an operator; or a new job resubmitted into the same run), from the
    #: distinct (slurm_job_id, slurm_restart) pairs.
    requeues: int = 0
    #: every host that ran a training process, in the order they first did
    nodes: list[str] = field(default_factory=list)
    #: the Slurm incarnations, in order: each one's nodes and how it ended
    incarnations: list[Incarnation] = field(default_factory=list)
    #: what the launchers recorded (any script): generations, faults seen, the wall
    #: time's split; None for a run without ``steadfast launch`` (or an older log)
    launchers: LauncherView | None = None
    #: every restart, phase by phase (:mod:`.restarts`; ``Restart.to_dict()`` each)
    restarts_phases: list[dict[str, Any]] = field(default_factory=list)
    #: what went wrong without being a fault (a finished worker's teardown), a line each
    warnings: list[str] = field(default_factory=list)
    #: the replica checks (steadfast.sdc): checks agreed, the newest step proven clean,
    #: the verdicts (:func:`.replicas.replica_summary`); None where none ran
    replicas: dict[str, Any] | None = None

    @property
    def reports_steps(self) -> bool:
        """Whether the script reported its steps (``step_done``): without them the
        productive time is unknown, not zero."""
        return self.steps_done > 0

    @property
    def goodput(self) -> float:
        """Productive time / wall time (0 for an empty run)."""
        return self.productive_time / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def all_recovered(self) -> bool:
        """Every injected fault was detected and recovered from."""
        return all(f.detected_by is not None and f.recovered for f in self.faults)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``steadfast report --json``)."""
        out = asdict(self)
        out["goodput"] = self.goodput
        out["all_recovered"] = self.all_recovered
        return out


def _is_event_log(name: str) -> bool:
    """``events*.jsonl`` (a run folder's) or ``steadfast_events*.jsonl`` (the default)."""
    return name.startswith(("events", Path(ev.DEFAULT_EVENTS_FILE).stem))


def load_events(source: str | os.PathLike[str]) -> tuple[list[ev.Event], list[str]]:
    """The events of a run directory (every ``events*.jsonl`` and
    ``steadfast_events*.jsonl`` below it) or of one file,
    sorted by time, and the problems met reading them (malformed lines, unknown kinds).
    Raises :class:`~steadfast.events.EventLogError` when there is nothing to read."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if _is_event_log(p.name))
        if not files:
            raise ev.EventLogError(
                f"{path}: no events*.jsonl or {ev.DEFAULT_EVENTS_FILE} file in this directory"
            )
    elif path.is_file():
        files = [path]
    else:
        raise ev.EventLogError(f"{path}: no such file or directory")
    problems: list[str] = []
    out: list[ev.Event] = []
    for f in files:
        out.extend(ev.read_events(f, problems=problems))
    unknown: dict[str, int] = {}
    for e in out:
        if e.kind not in ev.EVENT_KINDS:
            unknown[e.kind] = unknown.get(e.kind, 0) + 1
    for kind, n in sorted(unknown.items()):
        problems.append(f"unknown event kind {kind!r} ({n} events): not used in the report")
    if not out:
        raise ev.EventLogError(f"{source}: no events could be read ({'; '.join(problems)})")
    out.sort(key=lambda e: e.time)
    return out, problems


def _began(job_start: ev.Event) -> float:
    """When a generation's process started (its job_start's time when not recorded)."""
    value = job_start.get("process_start")
    return float(value) if value is not None else job_start.time


def _step_rank(events: list[ev.Event]) -> int | None:
    ranks = [e.rank for e in events if e.kind == ev.Kind.STEP_DONE and e.rank is not None]
    return min(ranks) if ranks else None


def compute_report(
    events: Iterable[ev.Event], problems: list[str] | None = None, slow_factor: float = 1.5
) -> GoodputReport:
    """Account the wall time of a run's events (sorted by time) into productive time and
    badput by cause, and follow each injected fault to its detection and recovery."""
    evs = sorted(events, key=lambda e: e.time)
    if not evs:
        return GoodputReport(0.0, 0.0, dict.fromkeys(BADPUT_CAUSES, 0.0), [], 0, 0, 0, 0)
    rank = _step_rank(evs)
    mine = [e for e in evs if e.rank == rank] if rank is not None else []
    steps = [e for e in mine if e.kind == ev.Kind.STEP_DONE and e.step is not None]
    redone_known, seen, derived = True, False, False
    if rank is None:  # a script that reports no steps: the ones its launchers saw
        steps, redone_known = seen_steps(evs)
        seen = bool(steps)
    elif untimed(steps):  # a loop that writes no seconds: each step's from the one before
        derived = True
        mine = timed(mine)
        steps = [e for e in mine if e.kind == ev.Kind.STEP_DONE and e.step is not None]
    starts = [e for e in mine if e.kind == ev.Kind.JOB_START]
    if steps and not starts and not seen:  # each process's first step, its start the launchers'
        starts = _first_steps(evs, steps)
    view = launcher_view(evs)
    t0 = min([evs[0].time, *[_began(e) for e in starts], *([view.start] if view else [])])
    wall = evs[-1].time - t0
    badput = dict.fromkeys(BADPUT_CAUSES, 0.0)

    # productive vs re-done: the last run of each step index is the one the model keeps
    last_run: dict[int, int] = {}
    for i, e in enumerate(steps):
        last_run[int(e.step)] = i  # type: ignore[arg-type]
    kept = set(last_run.values())
    seconds = [float(e.get("seconds") or 0.0) for e in steps]
    kept_seconds = [seconds[i] for i in sorted(kept)]
    median = statistics.median(kept_seconds) if kept_seconds else 0.0
    productive = 0.0
    for i, s in enumerate(seconds):
        if i not in kept:
            badput["wasted_progress"] += s
        elif median > 0 and s > slow_factor * median and s - median > SLOW_EXCESS:
            # a seen (or derived) step's time runs from the step before: it holds what the
            # script did between them (an evaluation), left to "other"
            badput["straggling"] += 0.0 if seen or derived else s - median
            productive += median
        else:
            productive += s

    badput["checkpoint_save"] = sum(
        float(e.get("blocking_seconds", e.get("seconds")) or 0.0)
        for e in mine
        if e.kind == ev.Kind.CHECKPOINT_SAVED
    )
    badput["checkpoint_load"] = sum(
        float(e.get("seconds") or 0.0) for e in mine if e.kind == ev.Kind.CHECKPOINT_LOADED
    )
    # start-up: process start to job_start, less the load done in between; the first
    # from the run's start (the launcher's: its own start and the workers' spawn)
    for i, start in enumerate(starts):
        began = t0 if i == 0 else _began(start)
        loads = sum(
            float(e.get("seconds") or 0.0)
            for e in mine
            if e.kind == ev.Kind.CHECKPOINT_LOADED and began <= e.time <= start.time
        )
        badput["startup"] += max(0.0, start.time - began - loads)
    gaps = _generation_gaps(mine, starts)
    if seen and not starts:  # a script that reports nothing: its launchers' first_step
        gaps = _seen_startup(evs, steps, t0, badput)

    faults = _faults(evs, steps)
    # disruptions: from a generation's last progress (a step or a save) to the next
    # generation's process start: detection (the fault -> its detection), then restart
    for prev_end, next_start in gaps:
        _disruption(prev_end, next_start, "restart", evs, faults, badput)
    # the end: the run's last progress (or a generation's start) to the log's end
    progress = [e.time for e in [*steps, *starts]] + [
        e.time for e in mine if e.kind == ev.Kind.CHECKPOINT_SAVED
    ]
    if progress:
        _disruption(max(progress), evs[-1].time, "teardown", evs, faults, badput)
    accounted = productive + sum(badput.values())
    badput["other"] = max(0.0, wall - accounted)
    # a process is its host and pid: pids of different nodes (or PID namespaces) repeat
    generations = len({(e.get("host"), e.get("pid")) for e in starts})
    restarts = sum(1 for e in evs if e.kind == ev.Kind.RESTART)
    if view is not None:  # job-wide, not once per node that restarted
        restarts = sum(1 for g in view.generations if g.in_job_restart)
        if not starts:  # a script that reports nothing: its generations of workers
            generations = len(view.generations)
    incarnations = {
        (e.get("slurm_job_id"), e.get("slurm_restart"))
        for e in starts
        if e.get("slurm_job_id") is not None
    }
    nodes = list(
        dict.fromkeys(
            str(e.get("host")) for e in evs if e.kind == ev.Kind.JOB_START and e.get("host")
        )
    )
    if view is not None and not nodes:
        nodes = [n for g in view.generations for n in g.nodes] or view.nodes
        nodes = list(dict.fromkeys(nodes))
    return GoodputReport(
        wall_time=wall,
        productive_time=productive,
        badput=badput,
        faults=faults,
        steps_done=len(last_run),
        steps_redone=len(steps) - len(kept) if redone_known else None,
        generations=generations,
        restarts=restarts,
        problems=list(problems or []),
        requeues=max(0, len(incarnations) - 1),
        nodes=nodes,
        incarnations=_incarnations(evs),
        launchers=view,
        restarts_phases=[r.to_dict() for r in restart_phases(evs)],
        warnings=[_teardown(e) for e in evs if e.kind == ev.Kind.WORKER_TEARDOWN],
        replicas=replica_summary(evs),
    )


def _disruption(
    start: float,
    end: float,
    rest: str,
    evs: list[ev.Event],
    faults: list[FaultRecord],
    badput: dict[str, float],
) -> None:
    """Account ``start`` -> ``end`` (a generation's last progress -> the next one's process
    start, or the run's end): detection (the fault, or ``start``, -> its detection), then
    ``rest``; without a detection in it (a planned stop, a requeue, a clean end), all of it
    is ``rest``."""
    window = [e for e in evs if e.kind in _ANY_DETECTION and start <= e.time <= end]
    # the launcher's own verdicts first: a survivor's shutdown_requested can come
    # a moment earlier, when the agent stops the others
    primary = [e for e in window if e.kind in (ev.Kind.RANK_HUNG, ev.Kind.RANK_FAILED)]
    det = _seen_at((primary or window)[0], evs) if window else None
    if det is None:
        badput[rest] += max(0.0, end - start)
        return
    began = max([start, *[f.time for f in faults if start <= f.time <= det]])
    badput["detection"] += max(0.0, det - began)
    badput[rest] += max(0.0, end - max(det, start))


def _first_steps(evs: list[ev.Event], steps: list[ev.Event]) -> list[ev.Event]:
    """For a script that writes its steps and no ``job_start``: each process's first
    step as its start, with its process start from the launchers' ``first_step`` of that
    worker (where they have one)."""
    began = {
        (e.get("host"), e.get("worker_pid")): e.get("process_start")
        for e in evs
        if e.kind == ev.Kind.FIRST_STEP
    }
    out: dict[tuple[object, object], ev.Event] = {}
    for e in steps:
        proc = (e.get("host"), e.get("pid"))
        if proc not in out:
            fields = {"host": proc[0], "pid": proc[1], "process_start": began.get(proc)}
            out[proc] = ev.Event(e.time, ev.Kind.JOB_START, e.rank, e.step, None, fields)
    return list(out.values())


def _teardown(e: ev.Event) -> str:
    """A ``worker_teardown`` event as the report's warning line."""
    how = {
        "hung": f"had not exited after {e.get('after')} s (teardown_timeout): ended",
        "signal": f"died of {e.get('signal')}",
        "exit_code": f"exited {e.get('exit_code')}",
    }.get(str(e.cause), str(e.cause))
    return f"rank {e.rank} {how} in its teardown, its script finished: not a fault, not re-run"


def _incarnations(evs: list[ev.Event]) -> list[Incarnation]:
    """The Slurm incarnations of the run, from every rank's events (not only the
    reporting rank's: a node's name is in its own ranks' events)."""
    found: dict[tuple[str, int], Incarnation] = {}
    for e in evs:
        job = e.get("slurm_job_id")
        if job is None:
            continue
        key = (str(job), int(e.get("slurm_restart") or 0))
        inc = found.get(key)
        if inc is None:
            inc = found[key] = Incarnation(key[0], key[1], [])
        if e.kind == ev.Kind.JOB_START and e.get("host") and e.get("host") not in inc.nodes:
            inc.nodes.append(str(e.get("host")))
        elif e.kind == ev.Kind.NODE_LOST and e.get("node") and e.get("node") not in inc.lost:
            inc.lost.append(str(e.get("node")))
        elif e.kind == ev.Kind.JOB_REQUEUED:
            inc.requeued = e.cause
            excluded = e.get("excluded")
            inc.excluded = [str(n) for n in excluded] if isinstance(excluded, list) else []
    return [inc for _, inc in sorted(found.items())]


def _generation_gaps(mine: list[ev.Event], starts: list[ev.Event]) -> list[tuple[float, float]]:
    """For each job_start after the first: (the previous generation's last progress,
    a step or a save, and this generation's process start)."""
    gaps = []
    progress = [e for e in mine if e.kind in (ev.Kind.STEP_DONE, ev.Kind.CHECKPOINT_SAVED)]
    for s in starts[1:]:
        began = _began(s)
        me = (s.get("host"), s.get("pid"))
        before = [
            e.time for e in progress if e.time < began and (e.get("host"), e.get("pid")) != me
        ]
        if before:
            gaps.append((max(before), began))
    return gaps


def _seen_startup(
    evs: list[ev.Event], steps: list[ev.Event], t0: float, badput: dict[str, float]
) -> list[tuple[float, float]]:
    """For a script that reports nothing, what job_start events give the others: each
    generation's start-up and checkpoint load from the launchers' ``first_step`` of
    the lowest rank that has them (its process start to its first iteration's end, less
    the load; the first generation from the run's start), added to ``badput``; and the
    gaps between generations: (the last iteration seen before a generation's process
    start, that start)."""
    firsts = [e for e in evs if e.kind == ev.Kind.FIRST_STEP and e.rank is not None]
    if not firsts:
        return []
    rank = min(int(e.rank) for e in firsts if e.rank is not None)
    gaps = []
    for i, e in enumerate(sorted((e for e in firsts if e.rank == rank), key=lambda e: e.time)):
        began = float(e.get("process_start") or e.time)
        ready = float(e.get("first_step_end") or e.time)
        load = float(e.get("checkpoint_load") or 0.0)
        badput["checkpoint_load"] += load
        badput["startup"] += max(0.0, ready - (t0 if i == 0 else began) - load)
        before = [s.time for s in steps if s.time < began]
        if i > 0 and before:
            gaps.append((max(before), began))
    return gaps


def _faults(evs: list[ev.Event], steps: list[ev.Event]) -> list[FaultRecord]:
    out = []
    for inj in (e for e in evs if e.kind == ev.Kind.FAULT_INJECTED):
        name = str(inj.get("fault") or inj.cause or "unknown")
        rec = FaultRecord(fault=name, rank=inj.rank, step=inj.step, time=inj.time)
        kind = FaultKind(name) if name in DETECTION_KINDS else _FORMER_NAMES.get(name)
        wanted = kind.detected_by if kind is not None else _ANY_DETECTION
        det = next((e for e in evs if e.kind in wanted and e.time >= inj.time), None)
        if det is not None:
            rec.detected_by = det.kind
            seen = max(inj.time, _seen_at(det, evs))
            rec.detection_latency = seen - inj.time
            recovery = kind.recovery if kind is not None else "in_place"  # any next step
            if recovery == "reported":  # the slowdown itself is the straggler's
                rec.recovered = True
            elif recovery == "stopped":  # the answer is the job stopped with its verdict
                rec.stopped = rec.recovered = any(
                    e.kind == ev.Kind.LAUNCHER_END and e.get("exit_code") == 80
                    for e in evs if e.time >= det.time
                )  # fmt: skip
            else:
                back, rec.recovered = _recovery(recovery, det, evs, steps)
                rec.recovery_time = back + det.time - seen if back is not None else None
        out.append(rec)
    return out


def _seen_at(det: ev.Event, evs: list[ev.Event]) -> float:
    """When the fault ``det`` reports was detected: the event's time, but a
    ``rank_failed``'s is the failed rank's end as its launcher's watcher saw it (a pidfd,
    in the ``workers_exited`` that follows): the event itself comes only after torch's
    agent stopped the other workers, whose stopping is the restart's, not detection."""
    if det.kind != ev.Kind.RANK_FAILED:
        return det.time
    launcher = _launcher(det)
    exited = next((e for e in evs if e.kind == ev.Kind.WORKERS_EXITED and e.time >= det.time
                   and _launcher(e) == launcher), None)  # fmt: skip
    seen = _exit_time(exited, det.rank) if exited is not None else None
    return min(seen, det.time) if seen is not None else det.time


def _recovery(
    recovery: str, det: ev.Event, evs: list[ev.Event], steps: list[ev.Event]
) -> tuple[float | None, bool]:
    """Detection -> the first step completed after the recovery action: for a restart,
    a step of a new process or one after an in-process restart; in place, a step after
    the rollback (if any) or the next one."""
    nxt: ev.Event | None
    if recovery == "restart":
        old_pids = {e.get("pid") for e in steps if e.time <= det.time}
        restarted = next(
            (e.time for e in evs if e.kind == ev.Kind.INPROCESS_RESTART and e.time >= det.time),
            None,
        )
        nxt = next(
            (
                e
                for e in steps
                if e.time > det.time
                and (e.get("pid") not in old_pids or (restarted is not None and e.time > restarted))
            ),
            None,
        )
    else:
        after = det.time
        rollback = next((e for e in evs if e.kind == ev.Kind.ROLLBACK and e.time >= after), None)
        if rollback is not None:
            after = rollback.time
        nxt = next((e for e in steps if e.time > after), None)
    if nxt is None:
        return None, False
    return nxt.time - det.time, True
