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
  once, with compare-and-set (the best claim and the number of claims, as one value), by
  the node that completes the count, or by a node whose :data:`CLAIM_WINDOW` passed
  first: the first confirmed claim wins, and every node, whenever it asks, gets that same
  verdict. About 8 store operations per node (a wait for the verdict is one blocking
  call on a connection of its own), whatever the job's size.

The window bounds how long a claimant waits for nodes that never count: a node lost
with the fault (the survivors leave out the losses they know of), a node whose workers
went on running (blocked in a collective under NCCL, until their own timeout ends them:
the next round cannot form before such a node leaves its generation anyway, so the
window costs nothing there), a node whose workers had finished. Nodes whose workers all
fail (gloo: every peer's collective fails at once) detect it within the agent's monitor
interval and the roster's 1 s loss grace of each other, and complete the count without
waiting; a claim that comes after the verdict is sealed reads it instead.

A hang in a collective blocks every rank at about the same moment: the claims of hung
ranks then differ by less than the nodes' clock skew, and the earliest is the culprit
only within that precision.

The calls here block on the store: the roster runs them on its store thread.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from ...records import MalformedRecord, Refusals, loads
from ...rendezvous.signed import RecordRefused
from ...signals import signal_name
from .records import parse_claim, parse_verdict, read
from .round import Round

__all__ = ["CLAIM_WINDOW", "Claim", "Verdict", "agree", "exit_cause", "node_claim", "rank_claim"]

#: The longest a node waits for the other nodes' claims before sealing the verdict.
CLAIM_WINDOW = 2.0

#: How strongly a claim says "this is where the fault began" (see :meth:`Claim.beats`).
WEIGHT = {"node lost": 2, "rank hung": 1, "rank killed": 1, "rank failed": 0}

#: The signals that end a rank of their own accord (the kernel's, an operator's kill):
#: a rank that lost its peer ends with an exit code, or with SIGABRT (NCCL's watchdog
#: and error handling abort the process), and one the launcher stopped with SIGTERM;
#: those weigh as an exit code.
_OWN_SIGNALS = {
    int(signal.SIGKILL),
    int(signal.SIGSEGV),
    int(signal.SIGBUS),
    int(signal.SIGILL),
    int(signal.SIGFPE),
}


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
        """From the store; :class:`~steadfast.records.MalformedRecord` for a record no
        node wrote."""
        return cls(**parse_claim(loads(raw, "a culprit claim")))


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
    global_rank: Callable[[int], int] | None = None,
) -> Claim | None:
    """This node's claim for a failed generation: a rank the watcher found hung (the
    earliest last sign of life), else the first rank to go down (``first``, from the
    watcher's exit order). ``failures``: torch's by global rank; ``exits``: exit times
    by local rank (epoch); ``hung``: local rank -> (what timed out, its last sign of
    life, epoch); ``detected``: when the agent saw the failure (default: now);
    ``global_rank``: a local rank's global rank (default: from ``failures``)."""
    now = time.time() if detected is None else detected
    by_local = {int(f.local_rank): int(r) for r, f in failures.items()}
    if hung:
        local, (what, since) = min(hung.items(), key=lambda kv: kv[1][1])
        rank = global_rank(local) if global_rank is not None else by_local.get(local, local)
        return Claim("rank hung", node, node_rank, rank, what, since, now, WEIGHT["rank hung"])
    if not first:
        return None
    rank = min(first, key=lambda r: (exits.get(int(failures[r].local_rank), now), r))
    code = int(failures[rank].exitcode)
    what = "rank killed" if -code in _OWN_SIGNALS else "rank failed"
    return Claim(
        "rank failed",
        node,
        node_rank,
        int(rank),
        exit_cause(code),
        exits.get(int(failures[rank].local_rank), now),
        now,
        WEIGHT[what],
    )


def exit_cause(code: int) -> str:
    """How a worker ended, as events say it: ``signal SIGKILL``, ``exit 1``."""
    return f"signal {signal_name(-code)}" if code < 0 else f"exit {code}"


def node_claim(node: str, node_rank: int | None, cause: str, latency: float | None) -> Claim:
    """A survivor's claim for a node lost from the round: the fault is its last sign of
    life (``latency`` before now, where the ring saw it go; now, where the store told)."""
    now = time.time()
    return Claim("node lost", node, node_rank, None, cause, now - (latency or 0.0), now, 2)


def _offer(store: Any, key: str, mine: Claim, refused: Refusals) -> None:
    """Put ``mine`` in ``key`` unless the claim there beats it (compare-and-set: a claim
    that beats ours replaces it under our feet, and we look again). A claim there that
    no node wrote (refused) is replaced by ours."""
    raw = mine.dumps().encode()
    expected = b""
    while True:
        now = store.compare_set(key, expected, raw)
        now = now if isinstance(now, bytes) else str(now).encode()
        if now == raw:
            return
        try:
            if not mine.beats(Claim.loads(now)):
                return
        except MalformedRecord as exc:
            refused.malformed(key, now, exc)
        expected = now


def _seal(store: Any, keys: Any, refused: Refusals) -> bytes:
    """Write the verdict once: the best claim and the claims made so far, as one value
    (the first node to seal it wins; every node reads that one). With no claim, or one
    no node wrote (refused), the verdict names no culprit: the nodes still waiting for
    it stop waiting."""
    best = None
    if store.check([keys.fault_claim]):
        best = read(store, keys.fault_claim, refused, Claim.loads)
    claims = int(store.add(keys.fault_claims, 0))
    claim = None if best is None else asdict(best)
    value = json.dumps({"claim": claim, "claims": claims}, sort_keys=True)
    sealed = store.compare_set(keys.fault_verdict, "", value)
    return sealed if isinstance(sealed, bytes) else str(sealed).encode()


def agree(current: Round, mine: Claim | None, expected: int, window: float) -> Verdict | None:
    """The round's one culprit: offer ``mine`` (None: this node has nothing to claim but
    takes part), count this node in; the node that completes the count of ``expected``
    seals the verdict at once, the others wait for it (one blocking wait on a connection
    of their own) up to ``window`` and seal it themselves if it has not come. About 8
    store operations per node. None when no node claimed anything, or when a claim or
    verdict not bound to the job's secret holds its key (said once): a sealed
    compare-and-set cannot replace a value that does not open, so no node acts on it
    and each reports its own view."""
    keys = current.keys
    store = current.waits  # the wait below must not hold the roster's client
    if mine is not None:
        with contextlib.suppress(RecordRefused):
            _offer(store, keys.fault_claim, mine, current.peers.refused)
        store.add(keys.fault_claims, 1)
    counted = int(store.add(keys.fault_count, 1))
    if counted < expected and not store.check([keys.fault_verdict]):
        # the window passed (a node that never counts): this node seals it below
        with contextlib.suppress(Exception):
            store.wait([keys.fault_verdict], timedelta(seconds=window))
    try:
        if store.check([keys.fault_verdict]):
            sealed = store.get(keys.fault_verdict)
        else:
            sealed = _seal(store, keys, current.peers.refused)
    except RecordRefused:
        return None
    try:
        claim, claims = parse_verdict(sealed)
    except MalformedRecord as exc:  # no verdict: each node reports its own view
        current.peers.refused.malformed(keys.fault_verdict, sealed, exc)
        return None
    if claim is None:
        return None
    return Verdict(Claim(**claim), f"{keys.record}/{current.token}", claims)
