"""Reading records that other processes wrote to a shared store: bounded, typed, and
refused with one error naming the record when they are not what a node of the job
writes. The rendezvous (:mod:`steadfast.rendezvous.keys`) and the node roster
(:mod:`steadfast.launcher.nodes.records`) read every record through these checks, so a
damaged record, a peer's, or one from another version never reaches the code that
acts on it as a ``KeyError``, a ``TypeError`` or a value out of range.

A store that lets anyone write cannot bound what it hands back: the reader does
(:data:`MAX_TEXT`, :data:`MAX_RECORD`)."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = [
    "MAX_RECORD",
    "MAX_TEXT",
    "MalformedRecord",
    "count",
    "loads",
    "moment",
    "text",
]

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
