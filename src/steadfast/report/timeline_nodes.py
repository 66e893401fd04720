"""The timeline of a multi-node run, laid out: what :func:`.timeline.plot_timeline` draws
when the workers of a run started on more than one node.

A lane is one worker seat, a node's local rank: it is under the node that ran it, the
nodes in node order (the node rank of the round each first ran in; a spare after the
nodes it joined), each node's lanes together. A lane holds one segment per generation
of workers, from the worker's start to its exit, coloured by how it ended; the global
rank it ran is the lane's label (all of them, in order, if a new round renumbered it).
Seats, not global ranks, make the lanes because a global rank can move: a spare takes
the lost node's ranks, an elastic round renumbers the survivors. A lane per seat keeps
every segment under the node that really ran it, with as many lanes as the node has
workers, where a lane per global rank would either cross nodes or multiply.

Across every lane: a lost node, a node joining (a spare) and a requeue, or a job's
launchers started again, each a vertical mark named. Each fault's culprit is the one
highlighted: the segment of the rank (every segment of the node, for a lost node) with
a label naming it. Its culprit is the ``fault_culprit`` verdict every node's launcher
writes (one fault per ``fault_id``); a generation without one (an older log) takes the
first of the launchers' own fault events (``node_lost``, ``rank_hung``, ``rank_failed``,
as :mod:`.launchers` reads them): a rank that failed after a lost node or a peer's exit
is not a culprit. The ranks that went down after the culprit are drawn as ended after a
fault, plainly, whatever their exit code.

:func:`node_layout` is pure (events in, positions and labels out) so that tests check
what is drawn without reading pixels; :mod:`.timeline` draws it (a thin matplotlib layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import events as ev
from .launchers import FAULT_KINDS, Generation, ObservedFault, as_list, launcher_view

__all__ = ["Culprit", "Lane", "Mark", "NodeGroup", "NodeLayout", "Segment", "is_multinode",
           "node_layout"]  # fmt: skip

#: a worker's segment, by how it ended (the culprit's own colour is CULPRIT)
OUTCOME_COLOURS = {
    "succeeded": "tab:blue",
    "after fault": "tab:gray",  # stopped, or failed, after another rank's or node's fault
    "stopped": "tab:olive",  # stopped with no fault: a preemption, a new round
    "failed": "tab:orange",  # failed with no culprit named (should not be seen)
    "lost": "tab:gray",  # lost with its node, the node not the culprit
    "running": "lightsteelblue",  # no end recorded: the log ends first
}
CULPRIT = "crimson"
MARK_COLOURS = {"node lost": "red", "node joined": "green", "requeue": "purple"}
_GAP = 0.5  # between two nodes' lanes, in lanes
_TIER = 0.42  # the height of a row of mark labels above the lanes, in lanes


@dataclass
class Segment:
    """One worker of one generation on a lane; times in seconds since the layout's t0."""

    start: float
    end: float
    rank: int
    generation: int  # job-wide, 1 for the first
    outcome: str  # succeeded, after fault, stopped, failed, lost, running
    culprit: bool = False


@dataclass
class Lane:
    """A worker seat of a node (its local rank) and what ran there."""

    node: str
    local_rank: int
    y: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)  # (start, length)
    saves: list[tuple[float, float]] = field(default_factory=list)
    injected: list[tuple[float, str]] = field(default_factory=list)  # fault_injected
    #: a folded lane's label, and the ranks it stands for (:mod:`.timeline_fold`)
    title: str | None = None
    folded: list[int] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        """The global ranks that ran here, in order."""
        return list(dict.fromkeys(s.rank for s in self.segments))

    @property
    def label(self) -> str:
        """The y axis' label: the rank, or the ranks in order (a round renumbered it)."""
        if self.title is not None:
            return self.title
        ranks = self.ranks
        if not ranks:
            return "no workers"
        return ("rank " if len(ranks) == 1 else "ranks ") + " > ".join(map(str, ranks))


@dataclass
class NodeGroup:
    """A node's lanes, with its launchers' lives (start, end)."""

    node: str
    lanes: list[Lane]
    launchers: list[tuple[float, float]] = field(default_factory=list)

    @property
    def span(self) -> tuple[float, float]:
        """The lowest and highest lane's y."""
        ys = [lane.y for lane in self.lanes]
        return min(ys), max(ys)


@dataclass
class Mark:
    """A job-wide moment drawn across every lane."""

    what: str  # node lost, node joined, requeue
    time: float
    label: str
    tier: int = 0  # the row of its label above the lanes (labels close in time stack)


@dataclass
class Culprit:
    """One fault's culprit, highlighted."""

    what: str  # rank failed, rank hung, node lost, ...
    node: str
    rank: int | None  # None: the node as a whole
    cause: str
    time: float  # the fault itself
    generation: int
    lanes: list[Lane]  # whose segment of that generation is highlighted
    from_verdict: bool  # a fault_culprit event (else the launchers' fault events)

    @property
    def label(self) -> str:
        """Who, what and why: "node2 rank 3 failed (SIGKILL)", "node2 lost (silent)"."""
        who = self.node if self.rank is None else f"{self.node} rank {self.rank}"
        subject, _, verb = self.what.partition(" ")
        happened = verb if subject in ("rank", "node") and verb else self.what
        return f"{who} {happened}" + (f" ({self.cause})" if self.cause else "")


@dataclass
class NodeLayout:
    """What the multi-node timeline draws; times in seconds since ``t0`` (epoch)."""

    t0: float
    end: float
    groups: list[NodeGroup]
    marks: list[Mark]
    culprits: list[Culprit]

    @property
    def lanes(self) -> list[Lane]:
        """Every lane, top first."""
        return [lane for g in self.groups for lane in g.lanes]


def is_multinode(events: list[ev.Event]) -> bool:
    """Whether workers of the run started on more than one node."""
    hosts = {e.get("host") for e in events if e.kind == ev.Kind.WORKERS_STARTED}
    return len(hosts) > 1 and any(e.kind == ev.Kind.LAUNCHER_START for e in events)


def node_layout(events: list[ev.Event]) -> NodeLayout:
    """Lay out a multi-node run's ``events`` (sorted by time): its node groups and
    lanes, each lane's segments (the culprits' marked), the job-wide marks and the
    culprits (see the module's description)."""
    if not events:
        raise ValueError("no events to draw")
    t0 = min(e.time for e in events)
    end = max(e.time for e in events) - t0
    kinds: dict[str, list[ev.Event]] = {}
    for e in events:
        kinds.setdefault(e.kind, []).append(e)
    view = launcher_view(events)
    firsts = _generation_starts(kinds, view.generations if view is not None else [])
    lanes = _lanes(kinds, t0, end, firsts)
    faults = view.faults if view is not None else []
    # the nodes' verdicts (the report's reading of fault_culprit: one per fault_id), then
    # for each generation without one, the first fault the launchers saw in it
    verdicts = [f for f in faults if f.fault_id]
    judged = {_generation_at(firsts, f.began) for f in verdicts}
    culprits = []
    for f in verdicts + _first_faults(faults, firsts, judged):
        rank, cause = f.rank, "" if f.cause == "-" else f.cause
        culprits.append(_culprit(lanes, f.what, str(f.node), rank, cause, f.began - t0,
                                 _generation_at(firsts, f.began), bool(f.fault_id)))  # fmt: skip
    struck = {c.generation for c in culprits}
    for lane in lanes.values():
        for s in lane.segments:
            if s.generation in struck and not s.culprit and s.outcome != "succeeded":
                s.outcome = "after fault"  # it went down after the culprit: plainly
    _place(events, t0, lanes)
    groups = _groups(kinds, t0, end, lanes, firsts)
    marks = _tiers(_marks(events, t0, firsts), end)
    return NodeLayout(t0, end, groups, marks, sorted(culprits, key=lambda c: c.time))


def _generation_starts(kinds: dict[str, list[ev.Event]], gens: list[Generation]) -> list[float]:
    """When each job-wide generation began: its first node's ``workers_started`` (a
    generation's ``start`` is its last node's, when the whole group runs)."""
    out = []
    prev = float("-inf")
    started = kinds.get(ev.Kind.WORKERS_STARTED, [])
    for g in gens:
        mine = [e.time for e in started if prev < e.time <= g.start and e.get("host") in g.nodes]
        out.append(min(mine, default=g.start))
        prev = g.start
    return out


def _generation_at(firsts: list[float], t: float) -> int:
    """The job-wide generation running at ``t`` (1 for the first; 0 before it)."""
    return sum(1 for start in firsts if start <= t)


def _lanes(
    kinds: dict[str, list[ev.Event]], t0: float, end_of_log: float, firsts: list[float]
) -> dict[tuple[str, int], Lane]:
    """Every worker's segment, on the lane of its node and local rank."""
    lanes: dict[tuple[str, int], Lane] = {}
    failed = {(x.get("host"), x.rank, x.time) for x in kinds.get(ev.Kind.RANK_FAILED, [])}
    for e in kinds.get(ev.Kind.WORKERS_STARTED, []):
        host, count = str(e.get("host")), int(e.get("generation") or 0)
        exited = next(
            (
                x
                for x in kinds.get(ev.Kind.WORKERS_EXITED, [])
                if x.time >= e.time
                and x.get("host") == host
                and x.get("pid") == e.get("pid")
                and int(x.get("generation") or 0) == count
            ),
            None,
        )
        lost = [
            x.time - float(x.get("latency") or 0.0)
            for x in kinds.get(ev.Kind.NODE_LOST, [])
            if x.time >= e.time and x.get("node") == host
        ]
        exits = {
            w.get("rank"): w
            for w in as_list(exited.get("exits") if exited is not None else None)
            if isinstance(w, dict)
        }
        generation = _generation_at(firsts, e.time)
        for slot, rank in enumerate(as_list(e.get("ranks"))):
            w = exits.get(rank)
            if exited is None:  # its node went with it, or the log ends first
                end, outcome = (lost[0] - t0, "lost") if lost else (end_of_log, "running")
            else:
                end = (float(w["time"]) if w is not None and w.get("time") else exited.time) - t0
                code = w.get("exit_code") if w is not None else None
                own = any(  # its launcher named it failed, not stopped
                    h == host and r == rank and e.time <= t <= exited.time + 5.0
                    for h, r, t in failed
                )
                if code == 0 or (w is None and exited.cause == "succeeded"):
                    outcome = "succeeded"
                else:
                    outcome = "failed" if own or exited.cause != "stopped" else "stopped"
            seg = Segment(e.time - t0, max(e.time - t0, end), int(rank), generation, outcome)
            lanes.setdefault((host, slot), Lane(host, slot)).segments.append(seg)
    return lanes


#: the launchers' fault events that name a culprit where no verdict does
_CULPRIT_KINDS = {
    FAULT_KINDS[k] for k in (ev.Kind.NODE_LOST, ev.Kind.RANK_FAILED, ev.Kind.RANK_HUNG)
}


def _first_faults(
    faults: list[ObservedFault], firsts: list[float], judged: set[int]
) -> list[ObservedFault]:
    """For each generation without a verdict, the first fault the launchers saw in it
    (a node lost, a rank hung or failed): what went down after it is not a culprit."""
    first: dict[int, ObservedFault] = {}
    for f in faults:
        if f.what not in _CULPRIT_KINDS or f.node is None:
            continue
        gen = _generation_at(firsts, f.began)
        if gen not in judged and (gen not in first or f.began < first[gen].began):
            first[gen] = f
    return [first[g] for g in sorted(first)]


def _culprit(
    lanes: dict[tuple[str, int], Lane],
    what: str,
    node: str,
    rank: int | None,
    cause: str,
    time: float,
    gen: int,
    verdict: bool,
) -> Culprit:
    """The culprit, its segments of generation ``gen`` marked: the rank's (a global rank
    runs once in a generation), or every one of the node's."""
    picks = [
        (lane, s)
        for (host, _), lane in sorted(lanes.items())
        for s in lane.segments
        if s.generation == gen and (host == node if rank is None else s.rank == rank)
    ]
    for _, s in picks:
        s.culprit = True
    return Culprit(what, node, rank, cause, time, gen, [lane for lane, _ in picks], verdict)


def _groups(
    kinds: dict[str, list[ev.Event]],
    t0: float,
    end_of_log: float,
    lanes: dict[tuple[str, int], Lane],
    firsts: list[float],
) -> list[NodeGroup]:
    """The nodes in node order (the node rank of the first round each ran in, a spare
    after the nodes of the rounds before its own; nodes that ran no workers last), each
    with its lanes (top first) and its launchers' lives."""
    order: dict[str, tuple[int, int, int]] = {}
    for e in kinds.get(ev.Kind.WORKERS_STARTED, []):
        rank = int(e.get("node_rank") or 0)
        order.setdefault(str(e.get("host")), (0, _generation_at(firsts, e.time), rank))
    for e in kinds.get(ev.Kind.LAUNCHER_START, []):
        order.setdefault(str(e.get("host")), (1, 0, 0))
    groups = []
    y = 0.0
    for host in sorted(order, key=lambda h: (order[h], h)):
        mine = [lane for (h, _), lane in sorted(lanes.items()) if h == host] or [Lane(host, -1)]
        for lane in mine:
            lane.y, y = y, y - 1.0
        y -= _GAP
        groups.append(NodeGroup(host, mine, _launchers(kinds, host, t0, end_of_log)))
    return groups


def _launchers(
    kinds: dict[str, list[ev.Event]], host: str, t0: float, end_of_log: float
) -> list[tuple[float, float]]:
    """Each of ``host``'s launchers: from its start to its end (or its node's loss, or
    the next launcher's start there, or the end of the log)."""
    ends = [
        (x.time, x.get("pid")) for x in kinds.get(ev.Kind.LAUNCHER_END, []) if x.get("host") == host
    ]
    ends += [
        (x.time - float(x.get("latency") or 0.0), None)
        for x in kinds.get(ev.Kind.NODE_LOST, [])
        if x.get("node") == host
    ]
    starts = [x for x in kinds.get(ev.Kind.LAUNCHER_START, []) if x.get("host") == host]
    lives = []
    for i, e in enumerate(starts):
        nxt = starts[i + 1].time if i + 1 < len(starts) else float("inf")
        mine = [t for t, pid in ends if e.time <= t <= nxt and pid in (None, e.get("pid"))]
        lives.append((e.time - t0, min(mine) - t0 if mine else min(nxt - t0, end_of_log)))
    return lives


def _marks(evs: list[ev.Event], t0: float, firsts: list[float]) -> list[Mark]:
    """The job-wide marks (a lost node, a node joining, a requeue or the launchers started
    again), each once for the job however many nodes wrote it."""
    marks: dict[tuple[object, ...], Mark] = {}
    started: set[object] = set()  # hosts whose launcher started in this incarnation
    incarnation = 0
    for e in evs:
        x = e.time - t0
        if e.kind == ev.Kind.NODE_LOST:
            node = str(e.get("node"))
            key: tuple[object, ...] = (e.kind, node, _generation_at(firsts, e.time))
            marks.setdefault(key, Mark("node lost", x, f"{node} lost"))
        elif e.kind == ev.Kind.NODE_JOINED:
            node = str(e.get("node"))
            replaced = ", ".join(str(n) for n in as_list(e.get("replaced")))
            label = f"{node} joins" + (f" for {replaced}" if replaced else "")
            key = (e.kind, node, _generation_at(firsts, e.time))
            marks.setdefault(key, Mark("node joined", x, label))
        elif e.kind == ev.Kind.JOB_REQUEUED:
            key = ("requeue", incarnation, e.get("slurm_job"), e.get("slurm_restart"))
            marks.setdefault(key, Mark("requeue", x, f"requeue ({e.cause or '-'})"))
        elif e.kind == ev.Kind.LAUNCHER_START:
            if e.get("host") in started:  # a node's launcher again: the job started again
                if not any(k[:2] == ("requeue", incarnation) for k in marks):
                    marks[("again", incarnation)] = Mark("requeue", x, "the job starts again")
                started.clear()
                incarnation += 1
            started.add(e.get("host"))
    return sorted(marks.values(), key=lambda m: m.time)


#: a label's width as a part of the time axis, per character (fontsize 7 on the figure)
_CHAR = 1 / 190


def _tiers(marks: list[Mark], end: float) -> list[Mark]:
    """Give each mark's label the lowest row where it does not run into another."""
    reach: list[float] = []  # per row: where its last label ends
    for m in marks:
        row = next((i for i, r in enumerate(reach) if r <= m.time), len(reach))
        if row == len(reach):
            reach.append(0.0)
        reach[row] = m.time + (len(m.label) + 3) * _CHAR * max(end, 1e-9)
        m.tier = row
    return marks


_RANK_KINDS = (ev.Kind.STEP_DONE, ev.Kind.CHECKPOINT_SAVED, ev.Kind.FAULT_INJECTED)


def _place(evs: list[ev.Event], t0: float, lanes: dict[tuple[str, int], Lane]) -> None:
    """Put the ranks' own events (steps, checkpoint saves, injected faults) on the lane
    whose segment ran that rank, on that node, at that time."""
    runs: dict[object, list[tuple[float, float, str, Lane]]] = {}
    for (host, _), lane in lanes.items():
        for s in lane.segments:
            runs.setdefault(s.rank, []).append((s.start, s.end, host, lane))
    for spans in runs.values():
        spans.sort(key=lambda r: -r[0])  # the latest start first
    for e in evs:
        if e.rank is None or e.kind not in _RANK_KINDS:
            continue
        x, host = e.time - t0, e.get("host")
        found = next(
            (
                ln
                for start, stop, h, ln in runs.get(e.rank, [])
                if start <= x <= stop + 1.0 and host in (None, h)
            ),
            None,
        )
        if found is None:
            continue
        lane = found
        if e.kind == ev.Kind.FAULT_INJECTED:
            lane.injected.append((x, str(e.get("fault") or e.cause)))
            continue
        seconds = float(e.get("seconds") or 0.0)
        (lane.steps if e.kind == ev.Kind.STEP_DONE else lane.saves).append((x - seconds, seconds))
