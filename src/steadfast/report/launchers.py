"""The launchers' account of a run: what ``steadfast launch`` saw, for any script.

A script that uses no steadfast API writes no event of its own; its launchers still
record, per node, their start and end (``launcher_start``, ``launcher_end``), each
generation of workers they ran (``workers_started``, ``workers_exited``: when, which
ranks, how each worker ended) and each fault they detected (``node_lost``,
``rank_failed``, ``rank_hung``, ``node_unhealthy``, ``node_isolated``), and each node
that joined later (``node_joined``). From those alone this module gives the run's true
wall time, its generations (one per rendezvous round, across nodes), every fault with
its node, cause, detection latency and the time to the next generation's start, and
the wall time split into time running workers, time lost to each fault, start-up (the
first launcher's start to the first generation running) and the end (the last worker's
exit to the last launcher's end).

Assumptions: every node's launcher writes to the same event log (a shared run
directory, as ``steadfast slurm`` and the multi-node tests do) and the nodes' clocks
agree to well under the latencies reported (NTP on a cluster: milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import events as ev

__all__ = [
    "Generation",
    "LauncherView",
    "ObservedFault",
    "OpenLauncher",
    "as_list",
    "launcher_view",
]

#: the launchers' own fault verdicts, and what each is called in the report
FAULT_KINDS: dict[str, str] = {
    ev.Kind.NODE_LOST: "node lost",
    ev.Kind.RANK_FAILED: "rank failed",
    ev.Kind.RANK_HUNG: "rank hung",
    ev.Kind.NODE_UNHEALTHY: "node unhealthy",
    ev.Kind.NODE_ISOLATED: "node cut off",
    ev.Kind.SDC_VERDICT: "silent corruption",
}


@dataclass
class Generation:
    """One generation of workers: a round of the rendezvous, across its nodes."""

    index: int  # 1 for the first, job-wide
    nodes: list[str]  # in node-rank order where known
    world_size: int
    start: float  # when its last node started its workers: the whole group is running
    end: float | None = None  # its last worker's exit
    outcome: str = "running"  # succeeded, failed or stopped (the worst of its nodes)
    in_job_restart: bool = False  # a launcher that ran an earlier one started it


@dataclass
class ObservedFault:
    """A fault a launcher detected, with what it cost."""

    what: str  # node lost, rank failed, rank hung, node unhealthy, node cut off
    cause: str
    node: str | None  # the node at fault
    rank: int | None  # the rank at fault, where it is one
    time: float  # when it was detected
    #: from the fault to then: its injection where one was logged; a dead rank's exit is
    #: seen as it ends (0); a hung rank's from its last sign of life
    detection_latency: float | None
    next_generation: float | None = None  # detection -> the next generation running
    replaced_by: list[str] = field(default_factory=list)  # nodes that joined in its place
    fault_id: str | None = None  # the nodes' agreed verdict it is (fault_culprit), if any
    #: a hang's confirmation in one line: who stopped where, where the others waited
    summary: str | None = None

    @property
    def cost(self) -> float | None:
        """Seconds it cost: from the fault itself to the next generation running."""
        if self.next_generation is None:
            return None
        return self.next_generation + (self.detection_latency or 0.0)

    @property
    def began(self) -> float:
        """When the fault itself happened (its detection less the latency)."""
        return self.time - (self.detection_latency or 0.0)


class OpenLauncher(NamedTuple):
    """A launcher with a ``launcher_start`` and no ``launcher_end``."""

    host: str
    pid: object
    last: float  # epoch time of its last event
    lost: bool  # a node_lost after its start names its host: it went with its node


@dataclass
class LauncherView:
    """The run as its launchers saw it (see the module's description)."""

    start: float
    end: float
    nodes: list[str]
    generations: list[Generation]
    faults: list[ObservedFault]
    running: float  # seconds with a generation of workers running
    startup: float  # first launcher start -> first generation running
    ending: float  # last worker exit -> last launcher end
    exit_codes: dict[str, int] = field(default_factory=dict)  # node -> its launcher's
    #: launchers with a start and no end
    unended: list[OpenLauncher] = field(default_factory=list)

    @property
    def running_launchers(self) -> list[OpenLauncher]:
        """Launchers with no end that no node_lost explains: still running when the log
        was read, or killed without a trace."""
        return [u for u in self.unended if not u.lost]

    @property
    def wall_time(self) -> float:
        return self.end - self.start

    @property
    def lost(self) -> float:
        """Seconds lost to faults: from each fault to the next generation running, the
        time that several faults of one generation share counted once."""
        spans = sorted((f.began, f.began + f.cost) for f in self.faults if f.cost is not None)
        total, reach = 0.0, float("-inf")
        for began, ended in spans:  # faults of one generation overlap: count time once
            if ended > reach:
                total += ended - max(began, reach)
                reach = ended
        return total


def as_list(value: object) -> list[Any]:
    """A list field of an event, or [] when a (hand-edited, older) log has another type."""
    return value if isinstance(value, list) else []


def _unended(evs: list[ev.Event]) -> list[OpenLauncher]:
    """Each launcher (host and pid) with a ``launcher_start`` and no ``launcher_end``
    (one pass over the log: a job of thousands of nodes writes millions of events)."""
    last: dict[tuple[object, object], float] = {}
    ended: set[tuple[object, object]] = set()
    lost_at: dict[object, list[float]] = {}  # node -> when a node_lost named it
    for e in evs:
        key = (e.get("host"), e.get("pid"))
        last[key] = max(last.get(key, e.time), e.time)
        if e.kind == ev.Kind.LAUNCHER_END:
            ended.add(key)
        elif e.kind == ev.Kind.NODE_LOST:
            lost_at.setdefault(e.get("node"), []).append(e.time)
    out = []
    for start in (e for e in evs if e.kind == ev.Kind.LAUNCHER_START):
        key = (start.get("host"), start.get("pid"))
        if key not in ended:
            lost = any(t >= start.time for t in lost_at.get(key[0], ()))
            out.append(OpenLauncher(str(key[0]), key[1], last[key], lost))
    return out


def _generations(
    evs: list[ev.Event], running: set[tuple[str, object]] | None = None
) -> list[Generation]:
    """Group every node's ``workers_started`` into job-wide generations: a generation
    takes one event per node until it has the round's ``nodes``; a node seen again
    starts the next one. ``running``: launchers (host, pid) with no end that no loss
    explains: a generation of theirs with no ``workers_exited`` did not end there, and
    says so instead of taking the others' outcome."""
    gens: list[Generation] = []
    hosts: list[str] = []
    want = 0
    # (host, launcher pid, its generation count) of the current one: a node's launcher
    # started again (a requeue, a resumed job) counts its generations from 1 again
    keys: list[tuple[str, object, int]] = []
    members: list[list[tuple[str, object, int]]] = []
    order: dict[int, dict[str, int]] = {}  # generation -> host -> node rank
    for e in (x for x in evs if x.kind == ev.Kind.WORKERS_STARTED):
        host = str(e.get("host"))
        if not gens or host in hosts or len(hosts) >= want:
            gens.append(Generation(len(gens) + 1, [], int(e.get("world_size") or 0), e.time))
            hosts, keys = [], []
            members.append(keys)
            want = int(e.get("nodes") or 1)
        hosts.append(host)
        keys.append((host, e.get("pid"), int(e.get("generation") or 0)))
        gen = gens[-1]
        gen.in_job_restart = gen.in_job_restart or int(e.get("generation") or 0) > 1
        rank = int(e.get("node_rank") or 0)
        order.setdefault(gen.index, {})[host] = rank
        gen.nodes = sorted([*gen.nodes, host], key=lambda h: order[gen.index].get(h, 0))
        gen.start = max(gen.start, e.time)
    ends = {
        (str(e.get("host")), e.get("pid"), int(e.get("generation") or 0)): e
        for e in evs
        if e.kind == ev.Kind.WORKERS_EXITED
    }
    severity = {"succeeded": 0, "stopped": 1, "failed": 2}
    for gen, keys_of in zip(gens, members, strict=True):
        mine = [ends[k] for k in keys_of if k in ends]
        if not mine:
            continue
        times = [
            float(x["time"])
            for e in mine
            for x in as_list(e.get("exits"))
            if isinstance(x, dict) and x.get("time")
        ]
        gen.end = max(times or [e.time for e in mine])
        gen.outcome = max((str(e.cause) for e in mine), key=lambda c: severity.get(c, 1))
        open_on = [k[0] for k in keys_of if k not in ends and (k[0], k[1]) in (running or ())]
        if open_on:
            gen.outcome = f"no end on {', '.join(open_on)}"
    return gens


def _exit_time(evs: list[ev.Event], host: str | None, pid: object) -> float | None:
    """When worker ``pid`` of ``host`` exited, from its node's ``workers_exited``."""
    for e in evs:
        if e.kind != ev.Kind.WORKERS_EXITED or e.get("host") != host:
            continue
        for x in as_list(e.get("exits")):
            if isinstance(x, dict) and x.get("pid") == pid and x.get("time"):
                return float(x["time"])
    return None


def _culprits(evs: list[ev.Event]) -> list[ObservedFault]:
    """One fault per ``fault_culprit`` (each node writes its copy: the first counts). A
    lost node's detection is its ``node_lost`` (the launcher that confirmed it, with the
    latency its ring measured), where the log has it; the claim's otherwise."""
    seen: dict[object, ObservedFault] = {}
    for e in evs:
        if e.kind != ev.Kind.FAULT_CULPRIT or e.get("fault_id") in seen:
            continue
        detected = float(e.get("detected") or e.time)
        began = e.get("fault_time")
        latency = None if began is None else max(0.0, detected - float(began))
        rank = e.get("culprit_rank")
        if rank is not None and began is not None and e.get("what") == "rank failed":
            detected, latency = float(began), 0.0  # its exit, seen through its pidfd
        elif rank is not None and e.get("what") == "rank hung":
            hang = [x for x in evs if x.kind == ev.Kind.RANK_HUNG and x.rank == rank
                    and x.get("host") == e.get("node") and x.time <= e.time]  # fmt: skip
            if hang and hang[-1].get("elapsed") is not None:  # the watcher's own
                detected, latency = hang[-1].time, float(hang[-1].get("elapsed"))
        if rank is None:
            confirmed = [
                x
                for x in evs
                if x.kind == ev.Kind.NODE_LOST
                and x.get("node") == e.get("node")
                and x.time <= e.time
                and x.get("latency") is not None
            ]
            if confirmed:  # the figure as measured, not recomputed from epoch times
                detected = confirmed[-1].time
                latency = float(confirmed[-1].get("latency"))
        seen[e.get("fault_id")] = ObservedFault(
            what=str(e.get("what") or "fault"),
            cause=str(e.cause or "-"),
            node=None if e.get("node") is None else str(e.get("node")),
            rank=None if rank is None else int(rank),
            time=detected,
            detection_latency=latency,
            fault_id=str(e.get("fault_id")),
        )
    return list(seen.values())


def _folded(evs: list[ev.Event]) -> set[int]:
    """The events (by ``id``) that an agreed culprit stands for: the signs of its fault
    on each node that wrote a ``fault_culprit`` for it (its ``rank_failed``, its hangs,
    its ``node_isolated``, within that node's generation), and the ``node_lost`` of the
    culprit node. A sign on a node that did not take part in the agreement stays a fault
    of its own."""
    starts: dict[tuple[object, object], list[tuple[int, float]]] = {}
    for e in evs:  # each launcher's generations (a launcher started again counts anew)
        if e.kind == ev.Kind.WORKERS_STARTED:
            key = (e.get("host"), e.get("pid"))
            starts.setdefault(key, []).append((int(e.get("generation") or 0), e.time))

    def window(key: tuple[object, object], generation: int) -> tuple[float, float] | None:
        gens = starts.get(key, [])
        for i, (g, began) in enumerate(gens):
            if g == generation:
                return began, gens[i + 1][1] if i + 1 < len(gens) else float("inf")
        return None

    spans: dict[tuple[object, object], list[tuple[float, float]]] = {}
    lost: list[tuple[str, float, float]] = []  # (node, from, to) of lost-node culprits
    for e in evs:
        if e.kind != ev.Kind.FAULT_CULPRIT:
            continue
        key = (e.get("host"), e.get("pid"))
        span = window(key, int(e.get("generation") or 0))
        if span is None:
            continue
        spans.setdefault(key, []).append(span)
        if e.get("culprit_rank") is None:
            lost.append((str(e.get("node")), *span))
    out = set()
    for e in evs:
        if e.kind in (ev.Kind.RANK_FAILED, ev.Kind.RANK_HUNG, ev.Kind.NODE_ISOLATED):
            within = spans.get((e.get("host"), e.get("pid")), [])
            agreed = e.kind == ev.Kind.RANK_FAILED and e.get("fault_id")
            if agreed or any(a <= e.time < b for a, b in within):
                out.add(id(e))
        elif e.kind == ev.Kind.NODE_LOST and any(
            n == e.get("node") and a <= e.time < b for n, a, b in lost
        ):
            out.add(id(e))
    return out


def _faults(evs: list[ev.Event], gens: list[Generation]) -> list[ObservedFault]:
    """Every fault the launchers saw: where the nodes agreed on a culprit
    (``fault_culprit``), that one fault, every other sign of it (the peers' exits, the
    hangs seen on other nodes, the loss's own event) folded in (:func:`_folded`);
    elsewhere (one node, an older log) each detection event."""
    out = _culprits(evs)
    folded = _folded(evs)
    confirmed = [e for e in evs if e.kind == ev.Kind.HANG_CONFIRMED]
    hung: set[tuple[object, object]] = set()  # (node, rank) found hung this generation
    for e in evs:
        if e.kind == ev.Kind.WORKERS_STARTED:
            hung.clear()
        if e.kind not in FAULT_KINDS or id(e) in folded:
            continue
        if e.kind == ev.Kind.RANK_HUNG:
            hung.add((e.get("host"), e.rank))
        elif e.kind == ev.Kind.RANK_FAILED and (e.get("host"), e.rank) in hung:
            continue  # the hung rank's termination: the same fault, already counted
        at = e.time
        if e.kind == ev.Kind.NODE_LOST:
            node, rank = e.get("node"), None
            latency = e.get("latency")
        elif e.kind == ev.Kind.SDC_VERDICT:  # the culprit (the first of a pair)
            node, rank = (
                (as_list(e.get("hosts")) or [None])[0],
                (as_list(e.get("culprits")) or [None])[0],
            )
            latency = None
        else:
            node, rank = e.get("host"), e.rank
            latency = None
            if e.kind == ev.Kind.RANK_FAILED:
                # seen as it ended (its pidfd): the event comes after the others stopped
                exited = _exit_time(evs, node, e.get("worker_pid"))
                at, latency = (exited, 0.0) if exited is not None else (at, None)
            elif e.kind == ev.Kind.RANK_HUNG:
                latency = e.get("elapsed")
        out.append(
            ObservedFault(
                what=FAULT_KINDS[e.kind],
                cause=str(e.cause or "-"),
                node=None if node is None else str(node),
                rank=None if rank is None else int(rank),
                time=at,
                detection_latency=None if latency is None else float(latency),
            )
        )
    starts = [e.time for e in evs if e.kind == ev.Kind.WORKERS_STARTED]
    _from_injections(evs, out, starts)
    out.sort(key=lambda f: f.time)
    for f in out:
        f.summary = _hang_summary(confirmed, f, starts)
        later = [g for g in gens if g.start > f.time]
        if later:
            f.next_generation = later[0].start - f.time
        if f.node is not None:
            f.replaced_by = sorted(
                {
                    str(j.get("node"))
                    for j in evs
                    if j.kind == ev.Kind.NODE_JOINED
                    and j.time >= f.time
                    and f.node in as_list(j.get("replaced"))
                }
            )
    return out


def _generation_at(t: float, starts: list[float]) -> tuple[float, float]:
    """The span of the generation running at ``t``: the newest start (``starts``, the
    ``workers_started`` times, sorted) at or before it, to the next one."""
    since = max((x for x in starts if x <= t), default=float("-inf"))
    until = min((x for x in starts if x > t), default=float("inf"))
    return since, until


def _from_injections(evs: list[ev.Event], faults: list[ObservedFault], starts: list[float]) -> None:
    """A rank's fault that was injected (``fault_injected`` of that rank, in the same
    generation, before its detection) began at its injection: its latency is then the
    injected-faults table's, one figure for one fault. Elsewhere a dead rank's is 0 (its
    pidfd: it is seen as it ends) and a hung rank's the watcher's (from its last sign of
    life). ``starts``: the ``workers_started`` times."""
    injected = [e for e in evs if e.kind == ev.Kind.FAULT_INJECTED and e.rank is not None]
    for f in faults:
        if f.rank is None or f.what == "silent corruption":
            continue
        since = _generation_at(f.time, starts)[0]
        mine = [e.time for e in injected if e.rank == f.rank and since <= e.time <= f.time]
        if mine:
            f.detection_latency = f.time - mine[-1]


def _hang_summary(
    confirmed: list[ev.Event], fault: ObservedFault, starts: list[float]
) -> str | None:
    """The one line of the hang confirmation behind ``fault`` (on its node, in its
    generation: ``starts`` are the ``workers_started`` times; its rank the culprit, or
    none told apart there), with the culprit's node named."""
    if fault.what not in ("rank hung", "rank failed"):
        return None
    since, until = _generation_at(fault.time, starts)
    for e in confirmed:
        culprit = e.get("culprit")
        if e.get("host") != fault.node or not since <= e.time < until:
            continue
        if culprit is not None and culprit != fault.rank:
            continue
        summary = str(e.get("summary") or "")
        if culprit is not None:
            summary = summary.replace(f"rank {culprit} ", f"rank {culprit} ({fault.node}) ", 1)
        return summary or None
    return None


def launcher_view(evs: list[ev.Event]) -> LauncherView | None:
    """The launchers' account of ``evs`` (sorted by time), or None where no launcher of
    this version wrote one (an older log, a script run without ``steadfast launch``)."""
    starts = [e for e in evs if e.kind == ev.Kind.LAUNCHER_START]
    if not starts:
        return None
    ends = [e for e in evs if e.kind == ev.Kind.LAUNCHER_END]
    start = min(min(e.time, float(e.get("process_start") or e.time)) for e in starts)
    end = max([e.time for e in ends] or [evs[-1].time])
    nodes = list(dict.fromkeys(str(e.get("host")) for e in starts))
    unended = _unended(evs)
    gens = _generations(evs, {(u.host, u.pid) for u in unended if not u.lost})
    faults = _faults(evs, gens)
    # running: each generation from its start to its end, or to the fault that ended it;
    # one with no end recorded (a launcher killed, a log of an older version) ran at most
    # until the next one started
    running = 0.0
    for i, g in enumerate(gens):
        nxt = gens[i + 1].start if i + 1 < len(gens) else None
        stop = g.end if g.end is not None else (nxt if nxt is not None else end)
        ended_by = [f.began for f in faults if g.start <= f.time and (nxt is None or f.time < nxt)]
        if ended_by:
            stop = min(stop, min(ended_by))
        running += max(0.0, stop - g.start)
    first = gens[0].start if gens else end
    last_exit = max((g.end for g in gens if g.end is not None), default=end)
    return LauncherView(
        start=start,
        end=end,
        nodes=nodes,
        generations=gens,
        faults=faults,
        running=running,
        startup=max(0.0, first - start),
        ending=max(0.0, end - last_exit),
        exit_codes={str(e.get("host")): int(e.get("exit_code") or 0) for e in ends},
        unended=unended,
    )
