"""Reading the event log: :class:`Event` (one parsed line, whose :meth:`Event.get`
refuses a field its kind does not declare), :func:`parse_event` for one line, and
:func:`read_events` for a file, skipping (and describing) the malformed lines a killed
process may leave."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schema import EVENT_KINDS, EventLogError

#: The longest line read as an event (the writer refuses events over 64 KiB): a longer
#: one is refused unparsed.
MAX_LINE = 1 << 20


@dataclass(frozen=True)
class Event:
    """One parsed line of the event log."""

    time: float
    kind: str
    rank: int | None
    step: int | None
    cause: str | None
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A kind-specific (or common non-core) field by name. Asking for a field that
        the kind does not declare is an :class:`EventLogError` (a reader's typo); an
        event of a kind this version does not know is read as it is."""
        spec = EVENT_KINDS.get(self.kind)
        if spec is not None and not spec.allows(key):
            raise EventLogError(
                f"event kind {self.kind!r} has no field {key!r}; its fields: "
                f"{', '.join(spec.fields) or 'none'}"
            )
        return self.fields.get(key, default)


def parse_event(line: str, where: str = "<event>") -> Event:
    """Parse one line of an event log; :class:`EventLogError` (naming ``where``) if it is
    not a valid event. For readers that follow a growing log."""
    return _parse_line(line, where)


def _parse_line(raw: str, where: str) -> Event:
    if len(raw) > MAX_LINE:
        raise EventLogError(f"{where}: {len(raw)} characters, longer than any event is written")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise EventLogError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise EventLogError(f"{where}: nested deeper than any event is written") from None
    if not isinstance(obj, dict):
        raise EventLogError(f"{where}: an event must be a JSON object")
    for key, typ in (("time", (int, float)), ("kind", str)):
        if not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool):
            raise EventLogError(f"{where}: field {key!r} is missing or has the wrong type")
    if not math.isfinite(obj["time"]) or not obj["kind"] or len(obj["kind"]) > 64:
        raise EventLogError(f"{where}: field 'time' or 'kind' out of bounds")
    for key in ("rank", "step"):
        val = obj.get(key)
        if val is not None and (not isinstance(val, int) or isinstance(val, bool)):
            raise EventLogError(f"{where}: field {key!r} must be an integer or null")
    cause = obj.get("cause")
    if cause is not None and not isinstance(cause, str):
        raise EventLogError(f"{where}: field 'cause' must be a string or null")
    extras = {k: v for k, v in obj.items() if k not in ("time", "kind", "rank", "step", "cause")}
    return Event(
        time=float(obj["time"]),
        kind=obj["kind"],
        rank=obj.get("rank"),
        step=obj.get("step"),
        cause=cause,
        fields=extras,
    )


def read_events(
    path: str | os.PathLike[str], *, strict: bool = False, problems: list[str] | None = None
) -> Iterator[Event]:
    """Yield the events of a log file in file order.

    A malformed line (for example the truncated last line of a killed process) is skipped
    and described in ``problems`` (when given), so a report uses what it can read; with
    ``strict=True`` it raises :class:`EventLogError` naming the file and line instead.
    Unknown kinds are passed through: a newer writer must not break an older reader.
    """
    p = Path(path)
    if not p.is_file():
        raise EventLogError(f"event log {p} does not exist or is not a file")
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield _parse_line(raw, f"{p}:{lineno}")
            except EventLogError as exc:
                if strict:
                    raise
                if problems is not None:
                    problems.append(str(exc))
