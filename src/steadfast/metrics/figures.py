"""A running job's figures, folded from its event log as it grows (what the ranks and
the launchers already write: nothing is added to the workers' processes).

- steps: the ``step_done`` lines of the lowest rank that writes them, else the steps
  the launchers saw a plain script make (``steps_seen``), and their durations;
- faults by kind (a bounded set: :data:`FAULT_KINDS`), restarts (in-job, requeues) and
  each restart's phases (the report's :mod:`~steadfast.report.restarts`);
- each node's state (:data:`NODE_STATES`);
- the latest straggler scores, by rank;
- the replica checks (steadfast.sdc): checks agreed, every node's and generation's, and
  the newest step proven clean;
- goodput so far: the report's own accounting (:func:`steadfast.report.compute_report`)
  of every event so far, computed again when events came, at most every
  :data:`GOODPUT_EVERY` seconds, and at once after a generation's start or end, a
  restart and the launcher's end (so the last figure is the report's).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import events
from ..report.replicas import ReplicaTally
from ..report.steps import StepTimer
from .follow import LogFollower

__all__ = ["FAULT_KINDS", "GOODPUT_EVERY", "NODE_STATES", "Figures"]

#: the detections counted as faults (the ``kind`` label: nothing else can appear there)
FAULT_KINDS = ("rank_failed", "rank_hung", "node_lost", "node_unhealthy", "node_isolated",
               "nan_detected", "checkpoint_corrupt", "restore_mismatch",
               "sdc_verdict")  # fmt: skip
#: a node's states (a state set: one is 1 at a time)
NODE_STATES = ("training", "restarting", "lost", "unhealthy", "cut_off", "finished")
#: seconds between two recomputations of goodput
GOODPUT_EVERY = 10.0
#: events after which goodput is computed again at once: a generation's start or end, a
#: restart, the launcher's end (the figure a screen or a scrape shows at the end is final)
_TURNS = frozenset({events.Kind.WORKERS_STARTED, events.Kind.WORKERS_EXITED,
                    events.Kind.RESTART, events.Kind.LAUNCHER_END})  # fmt: skip
#: the step-duration histogram's buckets (seconds)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class Figures:
    """The figures of the log at ``path`` (:meth:`refresh` reads what came)."""

    path: str
    steps: int = 0
    step_count: int = 0
    step_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    restarts: dict[str, int] = field(default_factory=lambda: {"in_job": 0, "requeue": 0})
    restart_phases: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    stragglers: dict[int, float] = field(default_factory=dict)
    goodput: float | None = None

    def __post_init__(self) -> None:
        self._follower = LogFollower(self.path)
        self._all: list[events.Event] = []
        self._step_rank: int | None = None
        self._goodput_at = 0.0
        self._lock = threading.Lock()
        self._replicas = ReplicaTally()
        self._timer = StepTimer()  # the step rank's steps' seconds (derived where none)

    def refresh(self) -> list[events.Event]:
        """Fold in the events written since the last call; returns them."""
        with self._lock:
            new = self._follower.read()
            for ev in new:
                self._fold(ev)
            self._all.extend(new)
            now = time.monotonic()
            due = not self._goodput_at or now - self._goodput_at >= GOODPUT_EVERY
            if new and (due or any(e.kind in _TURNS for e in new)):
                self._goodput_at = now
                self._account()
        return new

    # ------------------------------------------------------------------ the fold
    def _fold(self, ev: events.Event) -> None:
        kind = ev.kind
        if (kind == events.Kind.STEP_DONE and ev.rank is not None
                and (self._step_rank is None or ev.rank < self._step_rank)):  # fmt: skip
            self._step_rank, self._timer = ev.rank, StepTimer()
        if ev.rank is not None and ev.rank == self._step_rank:
            seconds = self._timer.see(ev)  # a save's, a start's: what the next step is less
            if kind == events.Kind.STEP_DONE:
                self.steps += 1
                self._observe(seconds)
        if kind == events.Kind.STEPS_SEEN and self._step_rank is None:
            if ev.get("local_rank") == 0 and ev.get("first") is not None:
                ends = ev.get("ends") or []
                self.steps += len(ends) if isinstance(ends, list) else 0
        elif kind in FAULT_KINDS:
            self.faults[kind] += 1
        if kind == events.Kind.RESTART:
            self.restarts["in_job"] += 1
        elif kind == events.Kind.JOB_REQUEUED:
            self.restarts["requeue"] += 1
        elif kind == events.Kind.REPLICAS_CHECKED:
            self._replicas.add(ev)
        elif kind == events.Kind.STRAGGLER_REPORT:
            scores = ev.get("relative")
            if isinstance(scores, dict):
                self.stragglers = {int(r): float(s) for r, s in scores.items()
                                   if str(r).isdigit() and isinstance(s, (int, float))}  # fmt: skip
        self._node_state(ev)

    @property
    def replica_checks(self) -> int:
        """Checks agreed, summed over every node and generation."""
        return self._replicas.checks

    @property
    def proven_step(self) -> int | None:
        """The newest step every replica agreed on."""
        return self._replicas.newest

    def _observe(self, seconds: Any) -> None:
        if not isinstance(seconds, (int, float)) or seconds < 0:
            return
        self.step_count += 1
        self.step_sum += float(seconds)
        for i, bound in enumerate(STEP_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1

    def _node_state(self, ev: events.Event) -> None:
        host = str(ev.get("host") or "")
        kind = ev.kind
        if kind == events.Kind.WORKERS_STARTED and host:
            self.nodes[host] = "training"
        elif kind == events.Kind.WORKERS_EXITED and host:
            self.nodes[host] = "finished" if ev.cause == "succeeded" else "restarting"
        elif kind == events.Kind.NODE_LOST and ev.get("node"):
            self.nodes[str(ev.get("node"))] = "lost"
        elif kind == events.Kind.NODE_UNHEALTHY and host:
            self.nodes[host] = "unhealthy"
        elif kind == events.Kind.NODE_ISOLATED and host:
            self.nodes[host] = "cut_off"

    def _account(self) -> None:
        """Goodput so far and the restarts' phases: the report's accounting."""
        if not self._all:
            return
        from ..report import compute_report

        report = compute_report(self._all)
        if report.reports_steps or report.steps_done:
            self.goodput = max(0.0, min(1.0, report.goodput))
        phases: dict[str, float] = {}
        for restart in report.restarts_phases:
            for phase, seconds in (restart.get("phases") or {}).items():
                phases[phase] = phases.get(phase, 0.0) + float(seconds)
        self.restart_phases = phases
