"""The verdict on replicas that disagreed: who (the culprit ranks, their hosts and
devices), and when (the last check every replica agreed on, the first that disagreed),
from every node's published checks (:mod:`.board`).

A verdict is what a user acts on: the state at ``last_agreed_step`` is proven clean (the
replicas agreed on it bit for bit), every state after ``first_bad_step`` holds a model no
fault-free run produces, and the culprit's node is kept out by the node ledger (an
``sdc_verdict`` counts against it: steadfast.ledger.records).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .. import events
from . import layout
from .compare import judge

__all__ = ["Published", "Verdict", "gathered_verdict", "published_checks"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """Replicas of ``replicas`` ranks disagreed: ``culprits`` (global ranks), found as
    ``how`` (``odd_one_out`` or ``pair``: :mod:`.compare`), on ``hosts`` (one per
    culprit) as ``local_ranks`` there (their device, under one GPU per rank); the last
    check that all agreed on was after ``last_agreed_step`` (None: none seen), the first
    that disagreed after ``first_bad_step``."""

    culprits: tuple[int, ...]
    how: str
    hosts: tuple[str, ...]
    local_ranks: tuple[int, ...]
    replicas: int
    last_agreed_step: int | None
    first_bad_step: int
    #: the check's number of ``last_agreed_step`` (optimizer steps in its generation)
    last_agreed_check: int | None = None
    #: the newest checkpoint step of steadfast's CheckpointManager proven clean (its
    #: state captured at or before the last agreed check); None: none saved by then
    clean_step: int | None = None
    #: whether the script saves through steadfast's CheckpointManager (it can roll back)
    restorable: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Verdict:
        data = json.loads(text)
        return cls(
            culprits=tuple(int(r) for r in data["culprits"]),
            how=str(data["how"]),
            hosts=tuple(str(h) for h in data["hosts"]),
            local_ranks=tuple(int(r) for r in data["local_ranks"]),
            replicas=int(data["replicas"]),
            last_agreed_step=_int(data["last_agreed_step"]),
            first_bad_step=int(data["first_bad_step"]),
            last_agreed_check=_int(data.get("last_agreed_check")),
            clean_step=_int(data.get("clean_step")),
            restorable=bool(data.get("restorable")),
        )

    def describe(self) -> str:
        who = ", ".join(
            f"rank {r} ({h}, local rank {lr})"
            for r, h, lr in zip(self.culprits, self.hosts, self.local_ranks, strict=True)
        )
        kind = "the odd one out" if self.how == "odd_one_out" else "one of the pair"
        last = "none" if self.last_agreed_step is None else str(self.last_agreed_step)
        clean = (
            ""
            if self.clean_step is None
            else f"; newest checkpoint proven clean: {self.clean_step}"
        )
        return (
            f"silent data corruption: {who}: {kind} among {self.replicas} replicas; "
            f"last step all agreed: {last}, first that disagreed: {self.first_bad_step}{clean}"
        )

    def emit(self) -> None:
        events.emit(
            "sdc_verdict",
            cause=self.how,
            culprits=list(self.culprits),
            hosts=list(self.hosts),
            local_ranks=list(self.local_ranks),
            replicas=self.replicas,
            last_agreed_step=self.last_agreed_step,
            first_bad_step=self.first_bad_step,
            clean_step=self.clean_step,
            step=self.first_bad_step,
        )
        logger.error("%s", self.describe())


def gathered_verdict(
    nodes: Iterable[Mapping[str, Any]],
    group: int,
    count: int,
    agreed: layout.Entry | None,
    complete: bool = False,
) -> Verdict | None:
    """The verdict on ``group`` from every node's published checks (``nodes``, as
    :mod:`.board` publishes them), the mismatch seen at check ``count``; None while a
    replica has not published that check (unless ``complete``: judge what is there).
    ``agreed``: the last check this node saw agree (where the gathered ones are newer)."""
    checks: dict[int, dict[int, layout.Entry]] = {}  # rank -> count -> entry
    where: dict[int, tuple[str, int]] = {}
    for node in nodes:
        for r, published in published_checks(node).items():
            if published.group == group:
                checks[r] = {e.count: e for e in published.entries}
                where[r] = (published.host, published.local)
    replicas = group >> 32
    if not complete and (len(checks) < replicas or any(count not in c for c in checks.values())):
        return None
    counts = sorted({c for per in checks.values() for c in per})
    mine = agreed is not None and agreed.count < count
    last_agreed = agreed.step if mine and agreed is not None else None
    last_check = agreed.count if mine and agreed is not None else None
    first_bad = count
    for c in counts:
        fps = _fingerprints(checks, c)
        if not judge(fps).agreed:
            first_bad = min(c, count)
            break
        if len(fps) == replicas and c < count:
            last_agreed, last_check = _step(checks, c), c
    # the culprits from the fullest of the two: the first disagreement, the one seen
    verdict_at = max((_fingerprints(checks, c) for c in {first_bad, count}), key=len)
    j = judge(verdict_at)
    culprits = j.culprits or tuple(sorted(verdict_at))
    return Verdict(
        culprits=culprits,
        how=j.how or "pair",
        hosts=tuple(where.get(r, ("?", -1))[0] for r in culprits),
        local_ranks=tuple(where.get(r, ("?", -1))[1] for r in culprits),
        replicas=replicas,
        last_agreed_step=last_agreed,
        first_bad_step=_step(checks, first_bad),
        last_agreed_check=last_check,
    )


@dataclass(frozen=True)
class Published:
    """One rank's checks as its node published them in the round's store."""

    group: int
    local: int
    host: str
    entries: list[layout.Entry]


def published_checks(node: Mapping[str, Any]) -> dict[int, Published]:
    """A node's published record (:mod:`.board`: ``{"host", "ranks": {rank: {"g",
    "local", "e": [[count, chunk, fp, step, saved], ...]}}}``) by global rank; a record
    of another shape gives nothing."""
    out: dict[int, Published] = {}
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        for rank, data in (node.get("ranks") or {}).items():
            entries = [layout.Entry(*map(int, e)) for e in data["e"]]
            out[int(rank)] = Published(int(data["g"]), int(data["local"]),
                                       str(node.get("host")), entries)  # fmt: skip
    return out


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _fingerprints(
    checks: Mapping[int, Mapping[int, layout.Entry]], count: int
) -> dict[int, tuple[int, int]]:
    return {r: per[count].fingerprint for r, per in checks.items() if count in per}


def _step(checks: Mapping[int, Mapping[int, layout.Entry]], count: int) -> int:
    for per in checks.values():
        if count in per:
            return per[count].step
    return count
