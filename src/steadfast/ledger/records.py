"""What the node ledger holds, and which faults count against a node.

One **entry** per writer (a launcher: its host, its job, its process): the stints it
took part in (node, job, start, end: the node-hours a fault rate divides by) and the
faults it saw that point at a node. An entry is one JSON document; a writer replaces
its own entry whole, never another's (:mod:`.store`).

Only causes that point at the hardware or the node count (:func:`fault_of`):

- ``health_check``: the node failed its health check (``node_unhealthy``), the
  ledger's own refusal and a node leaving for a corruption's verdict (charged as such)
  excepted;
- ``node_lost``: the node was lost from a running round (``node_lost``; the launcher
  that reported it writes it, once per loss). A node that *left*, saying why (cause
  ``left``: its workers failed with no restarts left, its launcher stopped; cause
  ``unhealthy``: its health check failed, the ledger's refusal included), was not lost:
  what failed there is in its own events, and counts only if one of them does (a
  failed check once, as ``health_check``; a refusal never);
- ``hardware_signal``: a worker died of ``SIGBUS`` (the kernel's signal for a memory
  error it could not correct: machine-check, ECC). A ``SIGSEGV`` does not count: from
  outside the process it cannot be told from a bug in the script's own native code;
- ``hang_outside_code``: the job's agreed hang culprit was stuck outside the script's
  code: in uninterruptible sleep in the kernel (a driver, a file system), or in native
  code that never let its Python thread answer (``hang_confirmed``'s ``where``). A
  rank stopped (state T) or stopped in Python does not count;
- ``rerun_persistent``: the re-run state machine's ``persistent`` verdict: the
  rejected result did not reproduce on other hardware, so the node that produced it
  (its ``rerun_elsewhere``) is at fault. Exit 17's "possible application error"
  (``correct``) and ``transient`` do not count;
- ``silent_corruption``: the node's rank was the odd one out among three or more DDP
  replicas that disagreed (``sdc_verdict``, cause ``odd_one_out``: steadfast.sdc);
  ``silent_corruption_pair``: one of two replicas that disagreed, with nothing to tell
  which (each culprit's node is charged; a node met in pairs with other partners is
  the one its rate keeps out).

A Python exception is the script's, never the node's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..records import MAX_TEXT, MalformedRecord, loads, moment, text

__all__ = ["CAUSES", "Entry", "Fault", "LedgerError", "Stint", "fault_of", "faults_of_verdict"]

#: the causes that count against a node
CAUSES = (
    "health_check",
    "node_lost",
    "hardware_signal",
    "hang_outside_code",
    "rerun_persistent",
    "silent_corruption",
    "silent_corruption_pair",
)
#: the version of an entry's format
VERSION = 1
#: the most stints and faults one entry keeps (the latest: within the 4 MiB a record may be)
MAX_ITEMS = 2_000
#: hang_confirmed's ``where`` for a culprit stuck outside the script's code
_OUTSIDE_CODE = ("uninterruptible I/O", "no answer (its main thread holds the GIL)")


class LedgerError(ValueError):
    """A ledger that cannot be read or written: one message naming the entry or place."""


@dataclass(frozen=True)
class Fault:
    """A fault that points at ``node`` (a host name), seen in ``job`` at ``time``."""

    node: str
    job: str
    time: float
    cause: str
    evidence: str


@dataclass
class Stint:
    """``node`` took part in ``job`` from ``start`` to ``end`` (epoch seconds)."""

    node: str
    job: str
    start: float
    end: float

    @property
    def hours(self) -> float:
        return max(0.0, self.end - self.start) / 3600.0


@dataclass
class Entry:
    """One writer's records."""

    writer: str
    stints: list[Stint] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def dumps(self) -> bytes:
        body = {"version": VERSION, "writer": self.writer,
                "stints": [asdict(s) for s in self.stints[-MAX_ITEMS:]],
                "faults": [asdict(f) for f in self.faults[-MAX_ITEMS:]]}  # fmt: skip
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def loads(cls, raw: bytes, where: str) -> Entry:
        """The entry in ``raw``; :class:`LedgerError` naming ``where`` and the field."""
        try:
            data = loads(raw, "a ledger entry")
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise MalformedRecord(f"not a version {VERSION} ledger entry")
            if not text(data.get("writer")):
                raise MalformedRecord("writer: not a name")
            stints = [_stint(s, i) for i, s in enumerate(_items(data, "stints"))]
            faults = [_fault(f, i) for i, f in enumerate(_items(data, "faults"))]
        except MalformedRecord as exc:
            raise LedgerError(f"ledger entry {where}: {exc}") from None
        return cls(str(data["writer"]), stints, faults)


def _items(data: dict[str, Any], name: str) -> list[Any]:
    items = data.get(name)
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise MalformedRecord(f"{name}: not a list of at most {MAX_ITEMS}")
    return items


def _fields(item: Any, where: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(item, dict) or set(item) != set(names):
        raise MalformedRecord(f"{where}: expected the fields {', '.join(names)}")
    return item


def _stint(item: Any, i: int) -> Stint:
    s = _fields(item, f"stints[{i}]", ("node", "job", "start", "end"))
    if not (text(s["node"]) and text(s["job"]) and moment(s["start"]) and moment(s["end"])):
        raise MalformedRecord(f"stints[{i}]: a name or a time of the wrong type")
    return Stint(s["node"], s["job"], float(s["start"]), float(s["end"]))


def _fault(item: Any, i: int) -> Fault:
    f = _fields(item, f"faults[{i}]", ("node", "job", "time", "cause", "evidence"))
    if f["cause"] not in CAUSES:
        raise MalformedRecord(f"faults[{i}].cause: {str(f['cause'])[:40]!r} is not one of "
                              f"{', '.join(CAUSES)}")  # fmt: skip
    if not (text(f["node"]) and text(f["job"]) and moment(f["time"])):
        raise MalformedRecord(f"faults[{i}]: a name or a time of the wrong type")
    if not text(f["evidence"], MAX_TEXT):
        raise MalformedRecord(f"faults[{i}].evidence: not text of at most {MAX_TEXT} characters")
    return Fault(f["node"], f["job"], float(f["time"]), f["cause"], f["evidence"])


#: ``node_lost`` causes that are the node's own words (``nodes.confirm.record_leaving``)
_LEFT_SAYING_WHY = ("left", "unhealthy")


def _evidence(text_: str) -> str:
    return text_[: MAX_TEXT - 1]


def fault_of(event: Mapping[str, Any], job: str) -> Fault | None:
    """The fault ``event`` (an event record as :func:`steadfast.events.emit` returns it)
    holds against a node, or None. A hang and a persistent re-run verdict need more than
    their own event (the agreed culprit, the node doubted): :class:`~.recorder.Recorder`
    joins them."""
    kind, cause = event.get("kind"), str(event.get("cause") or "")
    at = float(event.get("time") or 0.0)
    if not math.isfinite(at):
        return None
    host = str(event.get("host") or "")
    if kind == "node_unhealthy" and cause not in ("ledger", "silent_corruption"):
        why = _evidence(f"{cause} check failed: {event.get('reason') or ''}")
        return Fault(host, job, at, "health_check", why)
    if kind == "node_lost" and event.get("node") and cause not in _LEFT_SAYING_WHY:
        how = _evidence(f"lost ({cause}): {event.get('how') or ''}, seen by {host}")
        return Fault(str(event["node"]), job, at, "node_lost", how)
    if kind == "rank_failed" and cause == "signal SIGBUS":
        rank = event.get("rank")
        return Fault(host, job, at, "hardware_signal", f"rank {rank} died of SIGBUS")
    return None


def faults_of_verdict(event: Mapping[str, Any], job: str) -> list[Fault]:
    """The faults an ``sdc_verdict`` holds against its culprits' nodes (one per node)."""
    if event.get("kind") != "sdc_verdict" or event.get("cause") == "transient":
        return []  # a fault that did not come back counts against no node
    at = float(event.get("time") or 0.0)
    cause = "silent_corruption" if event.get("cause") == "odd_one_out" else "silent_corruption_pair"
    why = _evidence(
        f"rank(s) {event.get('culprits')} of {event.get('replicas')} replicas disagreed "
        f"({event.get('cause')}) after step {event.get('first_bad_step')}"
    )
    hosts = [str(h) for h in event.get("hosts") or [] if h]
    return (
        [Fault(h, job, at, cause, why) for h in dict.fromkeys(hosts)] if math.isfinite(at) else []
    )


def outside_code(where: object) -> bool:
    """Whether a hang culprit's ``where`` (``hang_confirmed``) is outside the script's
    code: in the kernel, or in native code holding its Python thread."""
    return isinstance(where, str) and where.startswith(_OUTSIDE_CODE)
