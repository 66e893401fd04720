"""Reading records that other processes wrote to a shared store: bounded, typed, and
refused with one error naming the record when they are not what a node of the job
writes. The rendezvous (:mod:`steadfast.rendezvous.keys`) and the node roster
(:mod:`steadfast.launcher.nodes.records`) read every record through these checks, so a
damaged record, a peer's, or one from another version never reaches the code that
acts on it as a ``KeyError``, a ``TypeError`` or a value out of range.

A store that lets anyone write cannot bound what it hands back: the reader does
(:data:`MAX_TEXT`, :data:`MAX_RECORD`). A record refused, by these checks or by the
job's seal (:mod:`steadfast.rendezvous.signed`), is said once per key by
:class:`Refusals` (``record_refused``)."""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any

from . import events

__all__ = [
    "MAX_RECORD",
    "MAX_TEXT",
    "MalformedRecord",
    "Refusals",
    "count",
    "loads",
    "moment",
    "text",
]

logger = logging.getLogger(__name__)

#: The longest node key, host name, reason or encoded member list a record may hold.
MAX_TEXT = 4096
#: The longest record read whole (a round's host list: 65,536 hosts of ~60 bytes).
MAX_RECORD = 4 << 20


class MalformedRecord(ValueError):
    """A record that no node of the job wrote (damaged, or a peer's)."""


def text(value: object, limit: int = MAX_TEXT) -> bool:
    """Whether ``value`` is a string of at most ``limit`` characters."""
    return isinstance(value, str) and len(value) <= limit


def count(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is a whole number (not a bool) in ``[low, high]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def moment(value: object) -> bool:
    """Whether ``value`` is a finite number of seconds (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def loads(raw: bytes | str, what: str) -> Any:
    """``raw``'s JSON value; raises :class:`MalformedRecord` naming ``what`` (not JSON,
    or longer than :data:`MAX_RECORD`)."""
    if len(raw) > MAX_RECORD:
        raise MalformedRecord(f"{what}: {len(raw)} bytes, more than any node writes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MalformedRecord(f"{what}: not JSON ({exc.__class__.__name__})") from None


class Refusals:
    """The records one reader refused, each said once: logged, and a ``record_refused``
    event naming the key and the writer the record claims."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def say(self, key: str, raw: bytes | str, cause: str, why: str = "") -> None:
        """Report ``key``'s record refused for ``cause`` (``why``: what is wrong with it,
        for the log), unless said already."""
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        peer = _claimed_writer(raw)
        logger.error(
            "store record %s refused (%s): not one this job's nodes wrote; ignored%s",
            key,
            f"{cause}: {why}" if why else cause,
            f" (it names {peer})" if peer else "",
        )
        events.emit("record_refused", cause=cause, key=key, peer=peer)

    def malformed(self, key: str, raw: bytes | str, exc: MalformedRecord) -> None:
        """Report ``key``'s record refused by a reader's checks."""
        self.say(key, raw, "malformed", str(exc))


def _claimed_writer(raw: bytes | str) -> str | None:
    """The writer a refused record names (a node's key, host or address), if any."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if isinstance(record, list) and record and isinstance(record[0], str):
        return record[0][:200] or None  # a ticket holder's: [node, seat, ...]
    if not isinstance(record, dict):
        return None
    for field in ("node", "host", "name", "key", "addr", "a"):
        if isinstance(record.get(field), str) and record[field]:
            return str(record[field])[:200]
    return None
