"""A launcher's part of the node ledger: its stint (this node in this job, from the
launcher's start to its end) and the faults it sees that point at a node, written as
its own entry (:mod:`.store`) at its start, at each fault and at its end.

The faults come from the events the launcher itself emits (:func:`.records.fault_of`),
so no fault site knows of the ledger. Two need more than their own event:

- a hang counts once the nodes agreed on its culprit: a ``hang_confirmed`` outside the
  script's code is held until a ``fault_culprit`` for a hung rank names this node (or
  another: then dropped); where no agreement comes (one node, no roster) it counts at
  the launcher's end;
- a ``persistent`` re-run verdict is a worker's event: at its end the launcher reads the
  run's event log for this job's verdicts written on this node, and charges the node
  whose result was doubted (the ``rerun_elsewhere`` before it).

The stint's end moves on with each publication, and the launcher's own events publish
it at most once a minute (:data:`REFRESH`): a launcher killed outright loses at most
that much of its node-hours. A ledger that cannot be written is said once in the log;
the job goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from .. import events
from ..events import writer as event_writer
from .records import Entry, Fault, LedgerError, Stint, fault_of, faults_of_verdict, outside_code
from .store import LedgerStore, entry_name

__all__ = ["Recorder"]

logger = logging.getLogger(__name__)

#: seconds between two publications that only move the stint's end on
REFRESH = 60.0


class Recorder:
    """This launcher's entry in ``store``: ``host`` in ``job``."""

    def __init__(self, store: LedgerStore, host: str, job: str) -> None:
        self.store, self.host, self.job = store, host, job
        self.name = entry_name(host, job, os.getpid(), uuid.uuid4().hex[:8])
        now = time.time()
        self._stint = Stint(host, job, now, now)
        self._entry = Entry(self.name, [self._stint], [])
        self._hang: Fault | None = None  # a hang outside the code, awaiting its culprit
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # one at a time, the newest last
        self._published = 0.0
        self._log_from = 0
        self._failed = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Publish the stint and listen to this process's events."""
        path = events.current_path()
        with contextlib.suppress(OSError):  # where this stint's part of the log begins
            self._log_from = os.path.getsize(path) if path else 0
        self._publish()
        event_writer.record_listeners.append(self.observe)

    def close(self) -> None:
        """The stint ends now; a hang no agreement came for counts; the event log's
        persistent verdicts are read; the entry published a last time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.observe in event_writer.record_listeners:
            event_writer.record_listeners.remove(self.observe)
        with self._lock:
            if self._hang is not None:
                self._entry.faults.append(self._hang)
                self._hang = None
            self._entry.faults.extend(self._persistent_verdicts())
        self._publish()

    # ------------------------------------------------------------------ events
    def observe(self, record: Mapping[str, Any]) -> None:
        """An event this process emitted (``event_writer.record_listeners``)."""
        kind = record.get("kind")
        fault = fault_of(record, self.job)
        with self._lock:
            if fault is not None:
                self._entry.faults.append(fault)
            elif kind == "sdc_verdict":
                self._entry.faults.extend(faults_of_verdict(record, self.job))
            elif kind == "hang_confirmed" and outside_code(record.get("where")):
                why = f"hung in {record['where']}: {record.get('summary') or ''}"[:2000]
                self._hang = Fault(self.host, self.job, float(record["time"]),
                                   "hang_outside_code", why)  # fmt: skip
            elif kind == "fault_culprit" and record.get("what") == "rank hung":
                held, self._hang = self._hang, None
                if held is None or record.get("node") != self.host:
                    return  # another node's hang: not this one's to charge
                self._entry.faults.append(held)
                fault = held
            elif time.monotonic() - self._published < REFRESH:
                return
        self._publish()

    def _persistent_verdicts(self) -> list[Fault]:
        """This job's ``persistent`` verdicts written on this node since the stint
        began, each charged to the node its result was doubted on (the
        ``rerun_elsewhere`` before it, in an earlier incarnation). Only this stint's part
        of the log is read, unless it holds such a verdict: a long job's log is large."""
        path = events.current_path()
        if path is None or not os.path.exists(path):
            return []
        try:
            if not self._verdicts(path, self._log_from, {"rerun_verdict"}):
                return []
            doubted: str | None = None
            found = []
            for ev in self._verdicts(path, 0, {"rerun_verdict", "rerun_elsewhere"}):
                if ev.kind == events.Kind.RERUN_ELSEWHERE:
                    doubted = str(ev.get("host") or "") or None
                elif self._mine(ev) and doubted is not None:
                    why = f"step {ev.step}'s result did not reproduce off {doubted}"
                    found.append(Fault(doubted, self.job, ev.time, "rerun_persistent", why))
        except (OSError, events.EventLogError) as exc:
            logger.warning("node ledger: cannot read the re-run verdicts from %s: %s", path, exc)
            return []
        return found

    def _mine(self, ev: Any) -> bool:
        """A persistent verdict of this job written on this node in this stint."""
        return bool(
            ev.kind == events.Kind.RERUN_VERDICT
            and ev.get("verdict") == "persistent"
            and ev.get("host") == self.host
            and ev.time >= self._stint.start
        )

    def _verdicts(self, path: str, offset: int, kinds: set[str]) -> list[Any]:
        """This job's events of ``kinds`` in the log from byte ``offset`` on (a line is
        parsed only when it names one of them); with ``offset``, only persistent
        verdicts of this stint."""
        wanted = [f'"kind":"{kind}"'.encode() for kind in kinds]
        found = []
        with open(path, "rb") as log:
            log.seek(offset)
            for number, line in enumerate(log, 1):
                if not any(w in line for w in wanted):
                    continue
                ev = events.parse_event(line.decode(errors="replace"), f"{path}:+{number}")
                if self._this_job(ev) and (not offset or self._mine(ev)):
                    found.append(ev)
        return found

    def _this_job(self, ev: Any) -> bool:
        job = ev.get("slurm_job_id")
        return job is None or str(job) == self.job

    # ------------------------------------------------------------------ writing
    def _publish(self) -> None:
        with self._publishing:
            with self._lock:
                self._stint.end = max(self._stint.end, time.time())
                entry = Entry(self.name, list(self._entry.stints), list(self._entry.faults))
                self._published = time.monotonic()
            try:
                self.store.publish(self.name, entry)
            except LedgerError as exc:
                if not self._failed:
                    self._failed = True
                    logger.warning("%s; the job goes on without it", exc)
