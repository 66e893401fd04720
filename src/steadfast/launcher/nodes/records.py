"""The node roster's records as its launchers write them, read back with checks
(:mod:`steadfast.records`): a node's :class:`~.round.Peer`, a round's token and hosts,
a node's reason for leaving, a loss's description and place, and a fault's culprit
claims. Each ``parse_*`` raises :class:`~steadfast.records.MalformedRecord` for
anything a node of the job does not write; the roster says each refused record once
(:class:`~steadfast.records.Refusals`, cause ``malformed``).

What the roster does with a refused record (never acting on it):

- a node's :class:`~.round.Peer`: a stand-in that names the node by its rank and is
  not watched (a wrong address would have it taken for lost);
- the round's token, read by a node that is not node rank 0: read again until node
  rank 0's arrives, up to the roster's timeout, then one error naming the key;
- the job's round record (fence probes, loss claims): no newer round is known;
- the previous round's hosts: no ``node_joined`` for the round;
- a node's reason for leaving: the loss is reported as seen;
- a loss's description: ``unknown``; a loss's place (``lost_seq``) out of the round:
  skipped;
- a culprit claim or verdict: no verdict (each node reports its own view).

Where the job has a secret, a record that is not bound to it never reaches a parser:
the signed store refuses it (cause ``unsigned`` or ``bad_signature``), and :func:`read`
hands the roster None, as for a record a parser refuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from ...records import MAX_TEXT, MalformedRecord, Refusals, count, loads, moment, text
from ...rendezvous.signed import RecordRefused

__all__ = [
    "parse_claim",
    "parse_hosts",
    "parse_leaving",
    "parse_loss",
    "parse_peer",
    "parse_rank",
    "parse_round",
    "parse_token",
    "parse_verdict",
    "read",
]

T = TypeVar("T")

_TOKEN = re.compile(r"^[0-9a-f]{32}$")
#: the most nodes a round may hold (the rendezvous bounds a round's members alike)
MAX_NODES = 1 << 16
_CLAIM = {
    "what": str,
    "node": str,
    "node_rank": (int, type(None)),
    "rank": (int, type(None)),
    "cause": str,
    "time": float,
    "detected": float,
    "weight": int,
}


def _decode(raw: bytes | str, what: str, limit: int = MAX_TEXT) -> str:
    if len(raw) > limit:
        raise MalformedRecord(f"{what}: {len(raw)} bytes, more than any node writes")
    try:
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise MalformedRecord(f"{what}: not UTF-8") from None


def parse_peer(raw: bytes | str, rank: int) -> dict[str, Any]:
    """Node ``rank``'s :class:`~.round.Peer` (its fields) as its launcher publishes it."""
    data = loads(raw, "a node's record")
    rdzv = data.get("rdzv") if isinstance(data, dict) else None
    if not (
        isinstance(data, dict)
        and set(data) == {"rank", "host", "addr", "port", "pid", "rdzv"}
        and data["rank"] == rank
        and count(data["rank"], 0, MAX_NODES)
        and text(data["host"])
        and data["host"]
        and text(data["addr"])
        and data["addr"]
        and count(data["port"], 1, 65535)
        and count(data["pid"], 1, 1 << 31)
        and (rdzv is None or (isinstance(rdzv, list) and len(rdzv) <= 8))
        and all(text(x) or count(x, -(1 << 63), 1 << 63) for x in rdzv or [])
    ):
        raise MalformedRecord(f"not node rank {rank}'s record as its launcher writes it")
    return dict(data)


def parse_token(raw: bytes | str) -> str:
    """A round's token (32 hex digits)."""
    token = _decode(raw, "a round's token", 64)
    if not _TOKEN.match(token):
        raise MalformedRecord("a round's token: not the 32 hex digits node rank 0 writes")
    return token


def parse_round(raw: bytes | str) -> str:
    """The token in the job's round record (``{"token": ...}``)."""
    data = loads(raw, "the job's round record")
    if not (isinstance(data, dict) and set(data) == {"token"} and isinstance(data["token"], str)):
        raise MalformedRecord('the job\'s round record: not {"token": ...}')
    return parse_token(data["token"])


def parse_hosts(raw: bytes | str) -> list[str]:
    """A round's hosts by node rank."""
    data = loads(raw, "a round's hosts")
    if not (
        isinstance(data, list) and 0 < len(data) <= MAX_NODES and all(text(h) and h for h in data)
    ):
        raise MalformedRecord("a round's hosts: not a list of host names")
    return list(data)


def parse_leaving(raw: bytes | str) -> tuple[str, str]:
    """Why a node left the job: ``(cause, reason)``."""
    data = loads(raw, "a node's reason for leaving")
    if not (
        isinstance(data, dict)
        and set(data) == {"cause", "reason"}
        and text(data["cause"], 64)
        and data["cause"]
        and text(data["reason"])
    ):
        raise MalformedRecord("a node's reason for leaving: not {cause, reason}")
    return data["cause"], data["reason"]


def parse_loss(raw: bytes | str) -> tuple[str, str]:
    """How a node was lost (``cause:how``): ``(cause, how)``."""
    value = _decode(raw, "a loss's description")
    cause, sep, how = value.partition(":")
    if not sep or not cause or len(cause) > 64:
        raise MalformedRecord("a loss's description: not cause:how")
    return cause, how


def parse_rank(raw: bytes | str, nodes: int) -> int:
    """A node rank of a round of ``nodes`` nodes."""
    value = _decode(raw, "a node rank", 16)
    if not (value.isascii() and value.isdigit() and int(value) < nodes):
        raise MalformedRecord(f"a node rank: {value[:16]!r} is not one of 0-{nodes - 1}")
    return int(value)


def parse_claim(data: Any) -> dict[str, Any]:
    """A culprit claim's fields (from its JSON), as :class:`~.culprit.Claim` takes them."""
    if not (isinstance(data, dict) and set(data) == set(_CLAIM)):
        raise MalformedRecord("a culprit claim: not the fields a claim has")
    for name, kind in _CLAIM.items():
        value = data[name]
        if kind is str:
            ok = text(value)
        elif kind is float:
            ok = moment(value)
        elif kind is int:
            ok = count(value, 0, 16)
        else:
            ok = value is None or count(value, 0, 1 << 24)
        if not ok:
            raise MalformedRecord(f"a culprit claim: {name} out of bounds or of the wrong type")
    return dict(data)


def parse_verdict(raw: bytes | str) -> tuple[dict[str, Any] | None, int]:
    """A sealed culprit verdict: the claim's fields (None: no node claimed one that a
    node wrote) and the claims made."""
    data = loads(raw, "a culprit verdict")
    if not (
        isinstance(data, dict)
        and set(data) == {"claim", "claims"}
        and count(data["claims"], 0, MAX_NODES)
    ):
        raise MalformedRecord("a culprit verdict: not {claim, claims}")
    return (None if data["claim"] is None else parse_claim(data["claim"])), data["claims"]


def read(store: Any, key: str, refused: Refusals, parse: Callable[[bytes], T]) -> T | None:
    """The record at ``key`` as ``parse`` reads it; None for one no node of the job
    wrote: not bound to the job's secret (:class:`RecordRefused`: the signed store said
    so) or refused by ``parse`` (said here, once per key)."""
    try:
        raw = store.get(key)
    except RecordRefused:
        return None
    try:
        return parse(raw)
    except MalformedRecord as exc:
        refused.malformed(key, raw, exc)
        return None
