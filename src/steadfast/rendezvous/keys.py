"""The store keys of steadfast's rendezvous (one owner), the compact encoding of a
round's members, and a round's verdict (:class:`Verdict`).

Every key a node writes is its own or a counter: no value that every node rewrites
(torch's dynamic rendezvous rewrites one pickled state holding every node). Under the
job's prefix ``/steadfast/<run_id>/``:

- ``round``: the round now forming or running (moved on once, by compare-and-set);
- ``closed``: the job ended; no round forms again;
- ``hb/<node>``: the heartbeat (wall time) of a node that has waited longer than a
  keep-alive interval for its round to form, ``0`` once it is expired;
- ``lost/<node>``: who expired the node first (so a loss counts once);
- ``<r>/lost_count``, ``<r>/lost_seq/<i>``: the members of round r expired, in order;
- ``<r>/ticket``: round r's ticket counter (``add``);
- ``<r>/t/<ticket>``: the node that holds a ticket: its key, its seat in the round
  before (-1: a newcomer), when it took the ticket, and its address and a free port
  there (the workers' store, should it be node rank 0);
- ``<r>/verdict``: round r's members, written once (compare-and-set) by one node;
- ``<r>/leaving``: members of round r that started the next one (the first moves
  ``round`` on and writes ``<r>/ended``, which the nodes waiting for round r wait on);
- ``<r>/delta``: the next round's size minus round r's: +1 per node waiting (a spare, a
  late node), -1 per member lost;
- ``<r>/waiting``: nodes that arrived late while round r has room (they make the members
  restart for them: torch's ``num_nodes_waiting``);
- ``<r>/s/``: the round's own store (the node roster's keys, the workers' master
  address).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..records import MalformedRecord, count, loads, moment, text

__all__ = [
    "BACKEND",
    "Keys",
    "MalformedRecord",
    "Verdict",
    "decode_members",
    "encode_members",
    "parse_holder",
    "rank_of",
]

_RUNS = re.compile(r"^(\d+(-\d+)?)?(,\d+(-\d+)?)*$")


def parse_holder(raw: bytes | str) -> list[Any]:
    """A ticket holder's record ``[node, seat, time, host, port, order]`` as a node
    writes it; raises :class:`MalformedRecord` for anything else."""
    info = loads(raw, "ticket holder")
    if not (
        isinstance(info, list)
        and len(info) in (5, 6)
        and text(info[0])
        and info[0]
        and count(info[1], -1, 1 << 24)
        and moment(info[2])
        and text(info[3])
        and count(info[4], 0, 65535)
        and (len(info) == 5 or count(info[5], 0, 1))
    ):
        raise MalformedRecord("not a ticket holder's record")
    return info


#: the name torchrun's ``--rdzv-backend`` knows it by
BACKEND = "steadfast"


class Keys:
    """The key names of one rendezvous (``run_id``)."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"/steadfast/{run_id}/"
        self.round = self.prefix + "round"
        self.closed = self.prefix + "closed"

    def heartbeat(self, node: str) -> str:
        return f"{self.prefix}hb/{node}"

    def lost(self, node: str) -> str:
        return f"{self.prefix}lost/{node}"

    def ticket(self, r: int) -> str:
        return f"{self.prefix}{r}/ticket"

    def holder(self, r: int, ticket: int) -> str:
        return f"{self.prefix}{r}/t/{ticket}"

    def verdict(self, r: int) -> str:
        return f"{self.prefix}{r}/verdict"

    def leaving(self, r: int) -> str:
        return f"{self.prefix}{r}/leaving"

    def lost_count(self, r: int) -> str:
        return f"{self.prefix}{r}/lost_count"

    def lost_seq(self, r: int, index: int) -> str:
        return f"{self.prefix}{r}/lost_seq/{index}"

    def ended(self, r: int) -> str:
        return f"{self.prefix}{r}/ended"

    def delta(self, r: int) -> str:
        return f"{self.prefix}{r}/delta"

    def members(self, r: int) -> str:
        """How many members of round ``r - 1`` have come back for round ``r``."""
        return f"{self.prefix}{r}/members"

    def waiting(self, r: int) -> str:
        return f"{self.prefix}{r}/waiting"

    def round_store(self, r: int) -> str:
        return f"{self.prefix}{r}/s/"


def encode_members(tickets: Sequence[int]) -> str:
    """Tickets in rank order as runs: ``[1, 2, 3, 7, 5, 6]`` -> ``"1-3,7,5-6"``: the
    size grows with the holes and the reordering, not with the number of nodes."""
    runs: list[str] = []
    i = 0
    while i < len(tickets):
        j = i
        while j + 1 < len(tickets) and tickets[j + 1] == tickets[j] + 1:
            j += 1
        runs.append(str(tickets[i]) if i == j else f"{tickets[i]}-{tickets[j]}")
        i = j + 1
    return ",".join(runs)


def decode_members(text: str) -> Iterable[tuple[int, int]]:
    """The runs of :func:`encode_members` as ``(first, last)`` ticket pairs."""
    for run in filter(None, text.split(",")):
        first, _, last = run.partition("-")
        yield int(first), int(last or first)


def rank_of(text: str, ticket: int) -> int | None:
    """The rank of ``ticket`` in the encoded members (its position), None if absent."""
    position = 0
    for first, last in decode_members(text):
        if first <= ticket <= last:
            return position + ticket - first
        position += last - first + 1
    return None


@dataclass(frozen=True)
class Verdict:
    """A formed round: its size, the round before's size (``previous``), the seats of
    that round left vacant (``vacant``, encoded runs) and the newcomers admitted, by
    ticket (``newcomers``, encoded runs), who fill the vacant seats first, in order."""

    world: int
    previous: int
    vacant: str
    newcomers: str
    master_addr: str = ""  # node rank 0's address and a free port there: the workers'
    master_port: int = 0  # store (torch's bootstrap_store_info), with no read more

    def to_json(self) -> str:
        return json.dumps(
            {"w": self.world, "p": self.previous, "v": self.vacant, "n": self.newcomers,
             "a": self.master_addr, "o": self.master_port}
        )  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes) -> Verdict:
        """The verdict a node wrote; raises :class:`MalformedRecord` for anything else."""
        data = loads(raw, "verdict")
        if not (
            isinstance(data, dict)
            and count(data.get("w"), 1, 1 << 24)
            and count(data.get("p"), 0, 1 << 24)
            and all(text(data.get(f)) and _RUNS.match(data[f]) for f in ("v", "n"))
            and text(data.get("a", ""))
            and count(data.get("o", 0), 0, 65535)
        ):
            raise MalformedRecord("not a verdict a node writes")
        runs = [r for f in ("v", "n") for r in decode_members(data[f])]
        if any(first > last for first, last in runs) or sum(
            last - first + 1 for first, last in runs
        ) > (1 << 16):
            raise MalformedRecord("a verdict's members out of bounds")
        return cls(data["w"], data["p"], data["v"], data["n"], data.get("a", ""),
                   data.get("o", 0))  # fmt: skip

    def rank(self, ticket: int, seat: int) -> int | None:
        """The rank of the node that holds ``ticket`` (``seat``: its rank in the round
        before, -1 for a newcomer); None when it is not admitted."""
        if seat >= 0:
            if rank_of(self.vacant, seat) is not None:
                return None  # judged lost (or its seat given away): it was too late
            return seat - self._removed_before(seat)
        filled = rank_of(self.newcomers, ticket)
        if filled is None:
            return None
        seat = self._seat_of_newcomer(filled)
        return seat - self._removed_before(seat)

    def _seat_of_newcomer(self, index: int) -> int:
        """Newcomer ``index`` (0-based, by ticket) takes the index-th vacant seat, or a
        new seat after the round before's once the vacant ones are taken."""
        position = 0
        for first, last in decode_members(self.vacant):
            if index < position + last - first + 1:
                return first + index - position
            position += last - first + 1
        return self.previous + index - position

    def _removed_before(self, seat: int) -> int:
        """How many vacant seats no newcomer took lie before ``seat`` (the ranks after
        them close up)."""
        admitted = sum(last - first + 1 for first, last in decode_members(self.newcomers))
        position = removed = 0
        for first, last in decode_members(self.vacant):
            for s in range(first, last + 1):
                if position >= admitted and s < seat:
                    removed += 1
                position += 1
        return removed
