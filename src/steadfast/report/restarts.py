"""Every restart, phase by phase: from the fault to the first iteration after it, each
second put in exactly one phase, from what the launchers and the workers' progress
hooks wrote (no line of the script needed).

A restart is seen on each node that restarted: a launcher's generation after one that
failed or was stopped (an in-job restart, a lost node's survivors, a spare's first
round), a launcher's first generation after an earlier incarnation of the job ended (a
Slurm requeue), or an in-process restart (``inprocess_restart``). The nodes' restarts of
one fault are one job restart; its figure is the node that was back last (the job steps
again only when every rank does).

The phases, in order (:data:`PHASES`); each is measured, never estimated. What cannot
be told apart is one phase, named for all it holds (``setup``, ``launcher``), and a
phase the log does not time is absent, not zero: an older log, a script whose first
iteration no hook saw. The launcher's phases come from ``workers_started`` (health
check, rendezvous, spawn) and ``workers_exited`` (the old workers' exits); the worker's
from ``first_step`` (steadfast.progress.phases); the fault and its detection from the
first of ``fault_injected``, ``fault_culprit``, ``rank_hung``, ``hang_confirmed``,
``rank_failed``, ``node_lost``, ``node_isolated``, a preemption's signal or a node
joining.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .. import events as ev

__all__ = ["PHASES", "NodeRestart", "Restart", "restarts"]

#: Every phase a restart's time is split into, in order, with what it holds.
PHASES: dict[str, str] = {
    "detection": "the fault to its detection",
    "stopping": "stopping the old workers (the detection to the last one's exit)",
    "requeue": "Slurm: the old incarnation's end, the queue, the new launcher's start",
    "health_check": "the node's health check before the rendezvous",
    "rendezvous": "the rendezvous that formed the new round",
    "launcher": "the launcher's own work between the phases above (not told apart)",
    "process_start": "the spawn to the worker's first instruction",
    "imports": "the main thread's imports",
    "init_process_group": "init_process_group",
    "setup": "model build and the script's other work before its first forward (not told apart)",
    "checkpoint_load": "loading the checkpoint (with its tier)",
    "first_batch": "the DataLoader's first batches",
    "compile": "torch.compile's compilations",
    "first_step": "the first iteration, less the compile and batches inside it",
    "inprocess_restart": "in-process: abort, barrier and re-entry of the wrapped function "
    "(not told apart)",
    "inprocess_first_step": "in-process: the re-entry to the first step (the process group, "
    "the restore and the step, not told apart)",
}

_WORKER_PHASES = (
    "imports", "init_process_group", "setup", "checkpoint_load", "first_batch", "compile",
    "first_step",
)  # fmt: skip


@dataclass
class NodeRestart:
    """One node's restart: its launcher (host, pid), what it restarted for, the fault's
    time, the first iteration's end (None: never seen), and the phases' seconds."""

    kind: str  # in-job, requeue, in-process
    host: str
    launcher_pid: int | None
    generation: int | None
    what: str
    fault_time: float
    end: float | None
    phases: dict[str, float] = field(default_factory=dict)
    tier: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.fault_time


@dataclass
class Restart:
    """One job restart: its nodes' restarts, and the one that was back last."""

    nodes: list[NodeRestart]
    #: the replay proof of its restore: status (verified, mismatch, not verified), what
    #: it compared or why not, the steps and seconds re-done only for it
    proof: dict[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> NodeRestart:
        done = [n for n in self.nodes if n.end is not None]
        return max(done, key=lambda n: n.end or 0.0) if done else self.nodes[0]

    def to_dict(self) -> dict[str, Any]:
        last = self.last
        return {
            "kind": last.kind,
            "what": last.what,
            "fault_time": last.fault_time,
            "seconds": last.seconds,
            "phases": last.phases,
            "tier": last.tier,
            "notes": last.notes,
            "node": last.host,
            "nodes": [_node_dict(n) for n in self.nodes],
            "proof": self.proof,
        }


def _node_dict(n: NodeRestart) -> dict[str, Any]:
    return {
        "kind": n.kind, "host": n.host, "generation": n.generation, "what": n.what,
        "fault_time": n.fault_time, "end": n.end, "seconds": n.seconds,
        "phases": n.phases, "tier": n.tier, "notes": n.notes,
    }  # fmt: skip


def _launcher(e: ev.Event) -> tuple[str, int | None]:
    """The process that wrote ``e`` (a launcher, or a worker): its host and pid."""
    return (str(e.fields.get("host") or ""), e.fields.get("pid"))


def restarts(evs: list[ev.Event]) -> list[Restart]:
    """The run's restarts, in order (``evs`` sorted by time)."""
    by_launcher: dict[tuple[str, int | None], list[ev.Event]] = defaultdict(list)
    for e in evs:
        by_launcher[_launcher(e)].append(e)
    # the in-process restarts' figure is the lowest rank's (every rank restarts)
    lowest = min((e.rank for e in evs if e.kind == ev.Kind.INPROCESS_RESTART
                  and e.rank is not None), default=None)  # fmt: skip
    found: list[NodeRestart] = []
    for key, own in by_launcher.items():
        found.extend(_in_job(key, own, evs))
        if lowest is not None and any(
            e.kind == ev.Kind.INPROCESS_RESTART and e.rank == lowest for e in own
        ):
            found.extend(_in_process(key, own, evs))
    out = _group(found)
    for i, r in enumerate(out):
        r.proof = _proof(r, out[i + 1] if i + 1 < len(out) else None, evs)
    return out


def _proof(r: Restart, after: Restart | None, evs: list[ev.Event]) -> dict[str, Any]:
    """What proved (or failed to prove) the restore of restart ``r``: the first
    ``restore_*`` event between its fault and the next restart's."""
    until = after.last.fault_time if after is not None else float("inf")
    found = next(
        (e for e in evs if e.kind in _PROOFS and r.last.fault_time <= e.time < until), None
    )
    if found is None:
        return {"status": "not verified", "reason": "no restore_verified: the script restores "
                "without steadfast's CheckpointManager, or did not restore"}  # fmt: skip
    status = _PROOFS[found.kind]
    proof: dict[str, Any] = {"status": status, "step": found.step, "tier": found.get("tier")}
    if status == "verified":
        extra = int(found.get("proof_steps") or 0)
        first = found.step if isinstance(found.step, int) else 0
        took = _seconds(evs, found, first, first + extra)
        proof.update(route=found.get("route"), steps=found.get("steps"),
                     against=found.get("against"), proof_steps=extra,
                     proof_seconds=round(took, 6),
                     # a log from before the tolerance has no `exact`: those were exact
                     exact=found.fields.get("exact", True) is not False,
                     difference=found.fields.get("difference"))  # fmt: skip
    elif status == "mismatch":
        proof["differs"] = found.get("differs")
    else:
        proof["reason"] = found.get("reason")
    return proof


def _seconds(evs: list[ev.Event], proof: ev.Event, first: int, end: int) -> float:
    """The time of the re-done steps ``first`` to ``end - 1`` (the proof's cost): the
    proving rank's first ``step_done`` of each after the restore was proven's start."""
    since = max((e.time for e in evs if e.kind == ev.Kind.JOB_START and e.time <= proof.time
                 and e.rank == proof.rank), default=proof.time)  # fmt: skip
    took: dict[int, float] = {}
    for e in evs:
        if (e.kind == ev.Kind.STEP_DONE and e.rank == proof.rank and e.time >= since
                and isinstance(e.step, int) and first <= e.step < end):  # fmt: skip
            took.setdefault(e.step, float(e.get("seconds") or 0.0))
    return sum(took.values())


_PROOFS: dict[str, str] = {
    ev.Kind.RESTORE_VERIFIED: "verified",
    ev.Kind.RESTORE_MISMATCH: "mismatch",
    ev.Kind.RESTORE_UNVERIFIED: "not verified",
}


def _group(found: list[NodeRestart]) -> list[Restart]:
    """Node restarts whose windows overlap are one job restart."""
    out: list[Restart] = []
    reach = float("-inf")
    for n in sorted(found, key=lambda n: n.fault_time):
        if out and n.fault_time <= reach:
            out[-1].nodes.append(n)
        else:
            out.append(Restart([n]))
            reach = float("-inf")
        reach = max(reach, n.end or n.fault_time)
    return out


# ---------------------------------------------------------------------- in-job, requeue
def _in_job(
    key: tuple[str, int | None], own: list[ev.Event], evs: list[ev.Event]
) -> list[NodeRestart]:
    started = [e for e in own if e.kind == ev.Kind.WORKERS_STARTED]
    exited = [e for e in own if e.kind == ev.Kind.WORKERS_EXITED]
    firsts = {e.get("worker_pid"): e for e in own if e.kind == ev.Kind.FIRST_STEP}
    out = []
    for ws in started:
        before = [x for x in exited if x.time <= ws.time]
        requeue = not before  # this launcher's first round: after an earlier incarnation?
        prev = before[-1] if before else _previous_incarnation(own, evs)
        if prev is None:
            continue
        if prev.cause == "succeeded" and not requeue:
            continue  # (a job relaunched after a planned stop, a preemption's, goes on)
        prev_key = _launcher(prev)
        window_start = _generation_start(evs, prev_key, prev)
        what, fault, detected = _fault(evs, prev_key, window_start, prev, ws)
        first = next((firsts[p] for p in ws.get("pids") or [] if p in firsts), None)
        out.append(_phases(key, ws, prev, first, requeue, what, fault, detected, own, evs))
    return out


def _previous_incarnation(own: list[ev.Event], evs: list[ev.Event]) -> ev.Event | None:
    """The last generation another launcher ended before this one started, where this
    launcher is the job's next incarnation (a Slurm requeue, ``SLURM_RESTART_COUNT`` >
    0; or a relaunch: every launcher that started before it had ended), not a spare
    joining a running job."""
    start = next((e for e in own if e.kind == ev.Kind.LAUNCHER_START), None)
    if start is None:
        return None

    if start.fields.get("slurm_restart") in (None, 0):
        earlier = {_launcher(e) for e in evs if e.kind == ev.Kind.LAUNCHER_START
                   and e.time < start.time}  # fmt: skip
        ended = {_launcher(e) for e in evs if e.kind == ev.Kind.LAUNCHER_END
                 and e.time <= start.time}  # fmt: skip
        if not earlier or earlier - ended:
            return None
    exited = [
        e
        for e in evs
        if e.kind == ev.Kind.WORKERS_EXITED
        and e.time <= start.time
        and _launcher(e) != _launcher(start)
    ]
    return exited[-1] if exited else None


def _generation_start(evs: list[ev.Event], key: tuple[str, int | None], exited: ev.Event) -> float:
    starts = [
        e.time
        for e in evs
        if e.kind == ev.Kind.WORKERS_STARTED
        and _launcher(e) == key
        and e.get("generation") == exited.get("generation")
        and e.time <= exited.time
    ]
    return starts[-1] if starts else exited.time


def _exit_time(exited: ev.Event, rank: int | None) -> float | None:
    for x in exited.get("exits") or []:
        if x.get("rank") == rank and x.get("time"):
            return float(x["time"])
    return None


def _fault(
    evs: list[ev.Event],
    key: tuple[str, int | None],
    since: float,
    exited: ev.Event,
    restarted: ev.Event,
) -> tuple[str, float, float]:
    """What the restart was for, when the fault happened and when it was detected."""
    faults: list[tuple[float, float, str]] = []  # (fault, detected, what)
    signals: list[tuple[float, float, str]] = []  # a preemption's: when no fault is seen
    injected: list[float] = []
    for e in evs:
        if e.time < since or e.time > restarted.time:
            continue
        mine = _launcher(e) == key
        t = e.time
        if e.kind == ev.Kind.FAULT_INJECTED and e.time <= exited.time:
            injected.append(t)
        elif not mine:
            if e.kind in (ev.Kind.PREEMPTION_SIGNAL, ev.Kind.SHUTDOWN_REQUESTED):
                signals.append((t, t, f"{e.kind} ({e.cause})"))
            continue
        elif e.kind == ev.Kind.FAULT_CULPRIT and e.get("generation") in (
            None,
            exited.get("generation"),
        ):  # agreed after the stop, for the generation that ended
            faults.append((float(e.get("fault_time") or t), float(e.get("detected") or t),
                           f"{e.get('what')} on {e.get('node')} ({e.cause})"))  # fmt: skip
        elif e.kind == ev.Kind.RANK_HUNG:
            began = e.get("fault_time")  # older logs: from the event's time
            began = float(began) if began is not None else t - float(e.get("elapsed") or 0.0)
            faults.append((began, t, f"rank {e.rank} hung"))
        elif e.kind == ev.Kind.HANG_CONFIRMED:
            faults.append((t, t, f"rank {e.get('culprit')} hung ({e.cause})"))
        elif e.kind == ev.Kind.RANK_FAILED:
            # seen when its launcher's watcher saw the process end (a pidfd, ms); the
            # event itself comes after torch's agent stopped the others: stopping time
            at = min(_exit_time(exited, e.rank) or t, t)
            faults.append((at, at, f"rank {e.rank} failed ({e.cause})"))
        elif e.kind == ev.Kind.NODE_LOST:
            faults.append((t - float(e.get("latency") or 0.0), t, f"node {e.get('node')} lost"))
        elif e.kind == ev.Kind.NODE_ISOLATED:
            faults.append((t, t, f"this node cut off ({e.cause})"))
        elif e.kind == ev.Kind.RESTART and e.cause == "membership_change":
            faults.append((t, t, "a node joined"))
    faults = faults or signals  # a signal to a worker: the cause only when no fault is
    if not faults:
        at = exited.time
        return f"workers {exited.cause}", min([at, *injected]), at
    # the fault injected last before the detection: an earlier one was another fault's
    injected = [t for t in injected if t <= min(d for _, d, _ in faults)][-1:]
    fault = min([f for f, _, _ in faults] + injected)
    detected = min(d for _, d, _ in faults)
    what = min(faults, key=lambda f: f[1])[2]
    return what, fault, max(detected, fault)


def _phases(
    key: tuple[str, int | None],
    ws: ev.Event,
    prev: ev.Event,
    first: ev.Event | None,
    requeue: bool,
    what: str,
    fault: float,
    detected: float,
    own: list[ev.Event],
    evs: list[ev.Event],
) -> NodeRestart:
    exits = [float(x["time"]) for x in prev.get("exits") or [] if x.get("time")]
    stopped = max(exits, default=prev.time)
    n = NodeRestart(
        kind="requeue" if requeue else "in-job",
        host=key[0], launcher_pid=key[1], generation=ws.get("generation"), what=what,
        fault_time=round(fault, 6), end=None,
    )  # fmt: skip
    p = n.phases
    p["detection"] = detected - fault
    p["stopping"] = max(0.0, stopped - detected)
    start = next((e for e in own if e.kind == ev.Kind.LAUNCHER_START), None)
    if requeue and start is not None:
        p["requeue"] = max(0.0, start.time - stopped)
    rendezvous, spawn = ws.get("rendezvous"), ws.get("spawn")
    if ws.get("health_check") is not None:
        p["health_check"] = float(ws.get("health_check"))
    if isinstance(rendezvous, list) and len(rendezvous) == 2:
        p["rendezvous"] = float(rendezvous[1]) - float(rendezvous[0])
    if first is None or spawn is None:
        n.notes.append("no first iteration seen after it (or an older log): phases to the "
                       "spawn only")  # fmt: skip
        last = float(spawn) if spawn is not None else ws.time
        p["launcher"] = max(0.0, last - fault - sum(p.values()))
        return _rounded(n)
    p["process_start"] = float(first.get("process_start")) - float(spawn)
    for name in _WORKER_PHASES:
        p[name] = float(first.get(name) or 0.0)
    n.end = round(float(first.get("first_step_end")), 6)
    rest = n.end - fault - sum(p.values())
    p["launcher"] = max(0.0, rest)
    if rest < -0.001:
        n.notes.append(f"phases overlap by {-rest:.3f} s (clocks of different processes)")
    loaded = [  # the node's lowest rank's, written by the worker itself
        e
        for e in evs
        if e.kind == ev.Kind.CHECKPOINT_LOADED
        and e.rank == first.rank
        and _launcher(e)[0] == key[0]
        and ws.time <= e.time <= n.end
    ]
    if loaded:
        n.tier = str(loaded[0].get("tier") or "disk")
    return _rounded(n)


def _rounded(n: NodeRestart) -> NodeRestart:
    n.phases = {k: round(n.phases[k], 6) for k in PHASES if k in n.phases}
    return n


# ---------------------------------------------------------------------- in-process
def _in_process(
    key: tuple[str, int | None], own: list[ev.Event], evs: list[ev.Event]
) -> list[NodeRestart]:
    """The in-process restarts of a worker process (its events: ``pid`` is the worker's),
    one per restart."""
    out = []
    since = float("-inf")
    for r in (e for e in own if e.kind == ev.Kind.INPROCESS_RESTART):
        # any rank's first record of the interruption: the one that saw the fault
        interrupted = [
            e for e in evs if e.kind == ev.Kind.INPROCESS_INTERRUPTED and since < e.time <= r.time
        ]
        detected = interrupted[0].time if interrupted else r.time
        injected = [
            e.time for e in evs if e.kind == ev.Kind.FAULT_INJECTED and since < e.time <= detected
        ]
        fault = min([detected, *injected])
        what = (
            f"rank {interrupted[0].rank} interrupted ({interrupted[0].cause})"
            if interrupted
            else "interrupted"
        )
        step = _next_step(own, evs, str(key[0]), r.time)
        n = NodeRestart("in-process", key[0], key[1], r.get("iteration"), what, round(fault, 6),
                        None)  # fmt: skip
        n.phases["detection"] = detected - fault
        n.phases["inprocess_restart"] = r.time - detected
        if step is None:
            n.notes.append("no step after it")
        else:
            n.end = round(step, 6)
            loads = [e for e in own if e.kind == ev.Kind.CHECKPOINT_LOADED
                     and r.time <= e.time <= step]  # fmt: skip
            load = sum(float(e.get("seconds") or 0.0) for e in loads)
            if loads:
                n.tier = str(loads[0].get("tier") or "disk")
                n.phases["checkpoint_load"] = load
            n.phases["inprocess_first_step"] = max(0.0, step - r.time - load)
        out.append(_rounded(n))
        since = r.time
    return out


def _next_step(own: list[ev.Event], evs: list[ev.Event], host: str, after: float) -> float | None:
    """When the first step after ``after`` ended: the process's own ``step_done``, else
    the one its launcher saw (``steps_seen`` of the same host)."""
    for e in own:
        if e.kind == ev.Kind.STEP_DONE and e.time > after:
            return e.time
    ends = [
        float(t)
        for e in evs
        if e.kind == ev.Kind.STEPS_SEEN and _launcher(e)[0] == host
        for t in e.get("ends") or []
        if float(t) > after
    ]
    return min(ends, default=None)
