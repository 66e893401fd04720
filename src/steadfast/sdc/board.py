"""The launcher's side of the replica check: the node's board of fingerprints, compared
across the replicas on this node and with the next node's, and the verdict when they
disagree.

A thread of its own looks every ``interval`` seconds (the store: every
``store_interval``):

- **on this node**, it reads each worker's checks from its row (:mod:`.layout`) and
  compares the replicas of each group at each check once every replica on the node
  published it (:func:`.compare.judge`);
- **across nodes** (a round of several), it publishes the node's recent checks in the
  round's store (one key per node, written when they changed) and reads the next node's
  (node rank + 1, wrapping): O(1) store operations per node whatever the job's size.
  Replicas equal along the ring of nodes are equal everywhere.
- **on a disagreement**, it gathers every node's checks once (``sdc_detected``), judges
  the group at the first check that disagreed, and the first node to claim it writes
  the verdict (``sdc_verdict``) into the store, where every node's board reads it.

It never touches the workers: the agent asks :meth:`ReplicaBoard.verdict` at each of its
looks and stops them (steadfast.launcher.agent).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from .. import events
from . import layout
from .compare import judge
from .verdict import Verdict, gathered_verdict, published_checks

__all__ = ["BoardState", "ReplicaBoard", "RoundLink"]

logger = logging.getLogger(__name__)

_KEEP = 32  # checks remembered per group
_GATHER_LOOKS = 5  # looks a verdict waits for the replicas that did not publish its check


class BoardState(str, Enum):
    """Where a :class:`ReplicaBoard` is.

    - ``IDLE``: no workers to compare (before a generation's start, after its end);
    - ``WATCHING``: comparing the running generation's checks;
    - ``DISAGREED``: two replicas disagreed; the verdict is gathered, then held until
      the workers are stopped;
    - ``CLOSED``: its thread is gone.

    Transitions: ``IDLE`` -> ``WATCHING`` (:meth:`~ReplicaBoard.watch`);
    ``WATCHING`` -> ``DISAGREED`` (a mismatch here, or a verdict in the store);
    ``WATCHING``, ``DISAGREED`` -> ``IDLE`` (:meth:`~ReplicaBoard.unwatch`);
    any -> ``CLOSED`` (:meth:`~ReplicaBoard.close`).
    """

    IDLE = "idle"
    WATCHING = "watching"
    DISAGREED = "disagreed"
    CLOSED = "closed"


@dataclass(frozen=True)
class RoundLink:
    """The round's store as the board uses it: its keys under ``prefix``; this node's
    rank among ``nodes``."""

    store: Any
    prefix: str
    node: int
    nodes: int

    def key(self, name: str) -> str:
        return f"{self.prefix}sdc/{name}"


class ReplicaBoard:
    """The node's replica comparisons (see the module docstring)."""

    def __init__(
        self,
        rows: Any,
        host: str,
        interval: float = 0.25,
        store_interval: float = 1.0,
        report_every: float = 30.0,
    ) -> None:
        self.rows = rows
        self.host = host
        self.interval = interval
        self.store_interval = store_interval
        self._stored = 0.0  # monotonic time of the last store round
        self.report_every = report_every
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._looked = threading.Condition()  # each look's end, for poll
        self._looks = 0
        self.state = BoardState.IDLE
        self._ranks: dict[int, int] = {}  # local rank -> global rank
        self._link: RoundLink | None = None
        self._seen: dict[int, dict[int, dict[int, layout.Entry]]] = {}  # group, count, rank
        self._groups: dict[int, int] = {}  # global rank -> its group, once it published
        self._judged: dict[int, int] = {}  # group -> highest count judged here
        self._agreed: dict[int, layout.Entry] = {}  # group -> the last agreeing check
        self._linked: dict[int, int] = {}  # group -> the last check the next node agreed on
        self._checks = 0  # checks agreed in this generation
        self._reported = 0.0
        self._published = ""
        self._mismatch: tuple[int, int] | None = None  # (group, count)
        self._looks_left = _GATHER_LOOKS
        self._verdict: Verdict | None = None
        self._thread = threading.Thread(target=self._run, name="steadfast-replicas", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the agent's side
    def watch(self, ranks: Mapping[int, int], link: RoundLink | None) -> None:
        """A generation's workers started: ``ranks`` (local -> global) on this node,
        ``link`` the round's store where the round has several nodes."""
        with self._lock:
            if self.state is BoardState.CLOSED:
                return
            self._ranks, self._link = dict(ranks), link
            self._seen, self._judged, self._agreed, self._linked = {}, {}, {}, {}
            self._groups = {}
            self._checks, self._published, self._mismatch = 0, "", None
            self._looks_left, self._verdict = _GATHER_LOOKS, None
            self._reported = time.monotonic()
            self.state = BoardState.WATCHING

    def unwatch(self) -> None:
        """The generation's workers stopped: its last figures written, nothing more to
        compare."""
        with self._lock:
            if self.state in (BoardState.WATCHING, BoardState.DISAGREED):
                self._report(force=True)
                self.state = BoardState.IDLE

    def verdict(self) -> Verdict | None:
        """The verdict on this generation's replicas, once there is one."""
        with self._lock:
            return self._verdict

    def checked(self) -> bool:
        """Whether this generation's workers published any check."""
        with self._lock:
            return bool(self._seen)

    def poll(self, timeout: float) -> Verdict | None:
        """Look now, and again until ``timeout`` passed or a verdict is known (the agent,
        at its workers' end: their last checks, another node's verdict)."""
        end = time.monotonic() + timeout
        while True:
            with self._looked:
                after = self._looks + 2  # one may be under way: the next is fresh
                until = time.monotonic() + self.interval + 5.0
                while self._looks < after and time.monotonic() < until:
                    self._wake.set()  # for each look: the thread clears it as it wakes
                    self._looked.wait(timeout=min(self.interval, until - time.monotonic()))
            found = self.verdict()
            if found is not None or time.monotonic() >= end:
                return found
            time.sleep(min(0.2, self.interval))

    def wait_seen(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until every node of the round read the verdict (the
        store may live in this launcher: it must not leave before the others learn why
        their peers stopped). Whether they all did; True on one node."""
        link = self._link
        if link is None:
            return True
        end = time.monotonic() + timeout
        while True:
            try:
                if int(link.store.add(link.key("seen"), 0)) >= link.nodes:
                    return True
            except Exception as exc:  # the store gone: nothing to wait for
                logger.debug("replica board: %s", exc)
                return False
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)

    def close(self) -> None:
        with self._lock:
            self.state = BoardState.CLOSED
            self._link = None  # the round's store is the agent's to close
        self._wake.set()
        self._thread.join(10)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            with self._lock:
                if self.state is BoardState.CLOSED:
                    return
                if self.state is BoardState.IDLE:
                    continue
                try:
                    self._look()
                except Exception as exc:  # a store gone at the job's end, a torn read
                    logger.debug("replica board: %s: %s", type(exc).__name__, exc)
            with self._looked:
                self._looks += 1
                self._looked.notify_all()

    def _look(self) -> None:
        for local, rank in self._ranks.items():
            slots, _ = self.rows.progress_area(local)
            group, entries = layout.read(slots)
            if entries:
                self._groups[rank] = group
            for e in entries:
                self._seen.setdefault(group, {}).setdefault(e.count, {})[rank] = e
        for counts in self._seen.values():
            while len(counts) > _KEEP:
                del counts[min(counts)]
        if self.state is BoardState.WATCHING:
            self._compare_here()
        link = self._link
        now = time.monotonic()
        if link is not None and (
            self._mismatch is not None or now - self._stored >= self.store_interval
        ):
            self._stored = now
            self._publish(link)
            if self.state is BoardState.WATCHING:
                self._compare_next(link)
            if self._verdict is None:
                self._read_verdict(link)
        if self._mismatch is not None and self._verdict is None:
            self._decide()
        self._mark_proven()
        self._report()

    def _members_here(self, group: int) -> set[int]:
        return {r for r, g in self._groups.items() if g == group}

    def _compare_here(self) -> None:
        for group, counts in self._seen.items():
            members = self._members_here(group)
            for count in sorted(c for c in counts if c > self._judged.get(group, 0)):
                entries = counts[count]
                if not members <= set(entries):
                    continue  # a replica here did not publish it yet
                self._judged[group] = count
                self._judge(group, count, entries)

    def _judge(self, group: int, count: int, entries: Mapping[int, layout.Entry]) -> None:
        j = judge({r: e.fingerprint for r, e in entries.items()})
        if j.agreed:
            last = self._agreed.get(group)
            if last is None or count > last.count:
                self._agreed[group] = next(iter(entries.values()))
            self._checks += 1
        elif self._mismatch is None:
            self._disagree(group, count, entries)

    def _disagree(self, group: int, count: int, entries: Mapping[int, layout.Entry]) -> None:
        self._mismatch = (group, count)
        self.state = BoardState.DISAGREED
        step = next(iter(entries.values())).step
        events.emit(
            "sdc_detected",
            cause="replica_mismatch",
            step=step,
            check=count,
            replicas=sorted(entries),
            fingerprints={str(r): e.fp for r, e in sorted(entries.items())},
        )
        logger.error(
            "replicas disagree after step %d: fingerprints %s",
            step,
            {r: f"{e.fp:x}" for r, e in sorted(entries.items())},
        )

    # ------------------------------------------------------------------ across nodes
    def _mine(self) -> dict[str, Any]:
        ranks: dict[str, Any] = {}
        for local, rank in self._ranks.items():
            group = self._groups.get(rank, 0)
            if not group:
                continue
            counts = self._seen.get(group, {})
            recent = sorted(c for c in counts if rank in counts[c])[-layout.RING :]
            ranks[str(rank)] = {
                "g": group,
                "local": local,
                "e": [list(asdict(counts[c][rank]).values()) for c in recent],
            }
        return {"host": self.host, "ranks": ranks}

    def _publish(self, link: RoundLink) -> None:
        text = json.dumps(self._mine(), separators=(",", ":"))
        if text != self._published:
            link.store.set(link.key(f"n/{link.node}"), text)
            self._published = text

    def _read_node(self, link: RoundLink, node: int) -> dict[str, Any] | None:
        key = link.key(f"n/{node}")
        if not link.store.check([key]):
            return None
        value = json.loads(link.store.get(key))
        return value if isinstance(value, dict) else None

    def _compare_next(self, link: RoundLink) -> None:
        theirs = self._read_node(link, (link.node + 1) % link.nodes)
        if theirs is None:
            return
        for rank, published in published_checks(theirs).items():
            group = published.group
            members = self._members_here(group)
            for e in published.entries:
                here = self._seen.get(group, {}).get(e.count)
                if here is None or not members or not members <= set(here):
                    continue
                both = {**dict(here), rank: e}
                if not judge({r: x.fingerprint for r, x in both.items()}).agreed:
                    if self._mismatch is None:
                        self._disagree(group, e.count, both)
                    return
                if e.count > self._linked.get(group, 0):
                    self._linked[group] = e.count

    def _read_verdict(self, link: RoundLink) -> None:
        key = link.key("verdict")
        if link.store.check([key]):
            self._verdict = Verdict.from_json(link.store.get(key))
            self.state = BoardState.DISAGREED
            link.store.add(link.key("seen"), 1)

    def _decide(self) -> None:
        """Gather every replica's checks of the mismatched group, judge them, and (the
        first node to claim it) write the verdict."""
        assert self._mismatch is not None
        group, count = self._mismatch
        link = self._link
        nodes: list[dict[str, Any]] = [self._mine()]
        if link is not None:
            others = [n for n in range(link.nodes) if n != link.node]
            keys = [link.key(f"n/{n}") for n in others]
            if keys and link.store.check(keys):
                nodes += [json.loads(v) for v in link.store.multi_get(keys)]
            elif keys:
                nodes += [d for d in (self._read_node(link, n) for n in others) if d]
        self._looks_left -= 1
        verdict = gathered_verdict(
            nodes, group, count, self._agreed.get(group), complete=self._looks_left <= 0
        )
        if verdict is None:
            return  # a replica has not published that check yet: the next look
        verdict = replace(
            verdict,
            clean_step=self._proven(verdict.last_agreed_check),
            restorable=self._restorable(),
        )
        if link is not None:
            if int(link.store.add(link.key("claim"), 1)) != 1:
                self._read_verdict(link)  # another node claimed it: its verdict rules
                return
            link.store.set(link.key("verdict"), verdict.to_json())
            link.store.add(link.key("seen"), 1)
        self._verdict = verdict
        verdict.emit()

    def _restorable(self) -> bool:
        """Whether the script saves through steadfast's CheckpointManager."""
        return any(int(self.rows.progress_area(local)[0][layout.SAVES]) for local in self._ranks)

    def _proven(self, count: int | None) -> int | None:
        """The newest checkpoint step whose state was captured at or before check
        ``count``, which agreed: proven clean (a flipped replica stays apart)."""
        if count is None:
            return None
        saved = [e.saved for per in self._seen.values() for e in per.get(count, {}).values()]
        newest = max(saved, default=-1)
        return newest if newest >= 0 else None

    def proven(self) -> int | None:
        """The newest checkpoint step this generation's checks proved clean as far as
        this node sees: its replicas agreed, and (several nodes) the next node's agreed
        with them; None after a disagreement, or with nothing proven."""
        with self._lock:
            return self._proven_now()

    def _proven_now(self) -> int | None:
        if self._mismatch is not None or self._verdict is not None:
            return None
        counts = [e.count for e in self._agreed.values()]
        if self._link is not None:
            counts += [self._linked.get(g, 0) for g in self._agreed]
        return self._proven(min(counts)) if counts else None

    def _mark_proven(self) -> None:
        """Tell the workers which checkpoint is proven clean (their retention keeps it)."""
        proven = self._proven_now()
        if proven is None:
            return
        for local in self._ranks:
            slots, _ = self.rows.progress_area(local)
            if proven + 1 > slots[layout.PROVEN]:
                slots[layout.PROVEN] = float(proven + 1)

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._checks or (not force and now - self._reported < self.report_every):
            return
        self._reported = now
        for group, last in self._agreed.items():
            members = self._members_here(group)
            local = next((lr for lr, r in self._ranks.items() if r in members), None)
            slots = self.rows.progress_area(local)[0] if local is not None else None
            events.emit(
                "replicas_checked",
                checks=self._checks,
                last_agreed_step=last.step,
                proven_step=self._proven(last.count),
                replicas=group >> 32,
                ranks=sorted(members),
                state_bytes=int(slots[layout.TOTAL]) if slots is not None else None,
                chunks=int(slots[layout.CHUNKS]) if slots is not None else None,
            )
