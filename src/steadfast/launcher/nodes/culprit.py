"""One culprit per fault, agreed job-wide through the round's store.

A fault in one rank brings down the whole round: the peers of a killed rank fail in
their next collective, and each node's agent sees only its own workers go. Left to
itself, each node would name the first exit among its own workers, so a rank killed on
node2 could make node1 and node3 each report a "first" rank too. Instead every node
that saw its workers go makes a :class:`Claim` (the fault as it saw it: a lost node, a
hung rank, a rank killed by a signal, a rank that exited with an error; its node, rank
and the time of the fault itself), and the claims meet in the round's store:

- ``fault/claim`` holds the strongest claim so far: a node offers its own with
  compare-and-set and stops as soon as the claim there beats it (:meth:`Claim.beats`:
  a lost node over a rank, a rank killed by a signal or hung over one that exited with
  a code, which is how a rank ends when a collective lost its peer; then the earlier
  fault). Offered in random order, the best claim is replaced ~ln N times job-wide:
  O(1) store operations per node.
- ``fault/count`` counts the nodes that took part (a node with nothing to claim, whose
  workers were stopped for the others' fault, counts too); ``fault/verdict`` is written
  once, with compare-and-set, by the first node that finds every node counted or its
  :data:`CLAIM_WINDOW` over: the first confirmed claim wins, and every node, whenever it
  asks, gets that same verdict.

The window bounds how long a claimant waits for nodes that never count (a node lost
with the fault, a node whose workers went on running). Every node that saw a failure of
its own detects it within the agent's monitor interval and the roster's 1 s loss grace
of the others, so claims arrive well inside 2 s of each other; a claim that comes after
the verdict is sealed reads it instead.

The calls here block on the store: the roster runs them on its store thread.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .round import Round

__all__ = ["CLAIM_WINDOW", "Claim", "Verdict", "agree", "node_claim", "rank_claim"]

#: The longest a node waits for the other nodes' claims before sealing the verdict.
CLAIM_WINDOW = 2.0

#: How strongly a claim says "this is where the fault began" (see :meth:`Claim.beats`).
WEIGHT = {"node lost": 2, "rank hung": 1, "rank killed": 1, "rank failed": 0}


@dataclass(frozen=True)
class Claim:
    """A node's account of where a round's fault began."""

    what: str  # node lost, rank hung, rank failed
    node: str  # the culprit's host name
    node_rank: int | None  # its node rank in the round
    rank: int | None  # the culprit's global rank (None: the node as a whole)
    cause: str  # as its event says it (signal SIGKILL, exit 1, heartbeat, silent...)
    time: float  # epoch seconds of the fault itself (exit, last heartbeat, last beacon)
    detected: float  # epoch seconds it was detected
    weight: int  # see WEIGHT

    def beats(self, other: Claim) -> bool:
        """Whether this claim names the fault's beginning better than ``other``: a
        heavier one (a lost node takes its ranks with it; a rank killed or hung failed
        of itself, while one that exited with a code may have lost a peer), then the
        earlier fault (nodes' clocks agree to milliseconds under NTP), then a fixed
        order, so that every node ranks two claims alike."""
        return self._order() > other._order()

    def _order(self) -> tuple[int, float, str, int]:
        return (self.weight, -self.time, self.node, -1 if self.rank is None else -self.rank)

    def dumps(self) -> str:
        """As the store keeps it."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, raw: bytes | str) -> Claim:
        """From the store."""
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Verdict:
    """The round's culprit as sealed in the store, the same on every node."""

    culprit: Claim
    fault_id: str  # the same on every node: the run and the round's token
    claims: int  # claims made for the round


def rank_claim(
    node: str,
    node_rank: int,
    failures: Mapping[int, Any],
    exits: Mapping[int, float],
    hung: Mapping[int, tuple[str, float]],
    first: set[int],
    detected: float | None = None,
) -> Claim | None:
    """This node's claim for a failed generation: a rank the watcher found hung (the
    earliest last sign of life), else the first rank to go down (``first``, from the
    watcher's exit order). ``failures``: torch's by global rank; ``exits``: exit times
    by local rank (epoch); ``hung``: local rank -> (what timed out, its last sign of
    life, epoch); ``detected``: when the agent saw the failure (default: now)."""
    now = time.time() if detected is None else detected
    by_local = {int(f.local_rank): r for r, f in failures.items()}
    if hung:
        local, (what, since) = min(hung.items(), key=lambda kv: kv[1][1])
        return Claim(
            "rank hung", node, node_rank, by_local.get(local), what, since, now, WEIGHT["rank hung"]
        )
    if not first:
        return None
    rank = min(first, key=lambda r: (exits.get(int(failures[r].local_rank), now), r))
    code = int(failures[rank].exitcode)
    killed = code < 0 and code != -signal.SIGTERM
    try:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    except ValueError:
        how = f"signal {-code}"
    what = "rank killed" if killed else "rank failed"
    return Claim(
        "rank failed",
        node,
        node_rank,
        int(rank),
        how,
        exits.get(int(failures[rank].local_rank), now),
        now,
        WEIGHT[what],
    )


def node_claim(node: str, node_rank: int | None, cause: str, latency: float | None) -> Claim:
    """A survivor's claim for a node lost from the round: the fault is its last sign of
    life (``latency`` before now, where the ring saw it go; now, where the store told)."""
    now = time.time()
    return Claim("node lost", node, node_rank, None, cause, now - (latency or 0.0), now, 2)


def _offer(store: Any, key: str, mine: Claim) -> None:
    """Put ``mine`` in ``key`` unless the claim there beats it (compare-and-set: a claim
    that beats ours replaces it under our feet, and we look again)."""
    raw = mine.dumps()
    expected = ""
    while True:
        now = store.compare_set(key, expected, raw)
        now = now.decode() if isinstance(now, bytes) else str(now)
        if now == raw:
            return
        if not mine.beats(Claim.loads(now)):
            return
        expected = now


def agree(current: Round, mine: Claim | None, expected: int, window: float) -> Verdict | None:
    """The round's one culprit: offer ``mine`` (None: this node has nothing to claim but
    takes part), count this node in, wait until ``expected`` nodes are counted, or a
    verdict is sealed, or ``window`` passes, then seal the best claim as the verdict
    (the first node to seal it wins). None when no node claimed anything."""
    store, keys = current.store, current.keys
    if mine is not None:
        _offer(store, keys.fault_claim, mine)
        store.add(keys.fault_claims, 1)
    counted = int(store.add(keys.fault_count, 1))
    deadline = time.monotonic() + window
    pause = 0.005
    while counted < expected and time.monotonic() < deadline:
        if store.check([keys.fault_verdict]):
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
        counted = int(store.add(keys.fault_count, 0))
    if not store.check([keys.fault_claim]):
        return None
    best = store.get(keys.fault_claim)
    sealed = store.compare_set(keys.fault_verdict, "", best)
    claims = int(store.add(keys.fault_claims, 0))
    token = current.token
    return Verdict(Claim.loads(sealed), f"{keys.record}/{token}", claims)
