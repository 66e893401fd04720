"""The store keys of steadfast's rendezvous (one owner), and the compact encoding of a
round's members.

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

from collections.abc import Iterable, Sequence

__all__ = ["Keys", "decode_members", "encode_members", "rank_of"]


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
