"""The steps the goodput report counts, each with its duration: a script's own
``step_done`` events (their seconds derived where the script gave none), or, for a script
that reports none, the iterations its launchers saw (``steps_seen``, steadfast.progress)."""

from __future__ import annotations

from .. import events as ev

__all__ = ["StepTimer", "seen_steps", "timed", "untimed"]


def seen_steps(evs: list[ev.Event]) -> tuple[list[ev.Event], bool]:
    """``(step_done events, whether re-done steps can be told)`` from the ``steps_seen``
    of the lowest rank that has them. An iteration's seconds run from the one before it
    in the same process (a process's first counts none: its time is start-up). Its step
    is the script's own index where the optimizer keeps one (``base``); elsewhere each
    iteration gets an index of its own (no step is counted as re-done: unknown)."""
    seen = [e for e in evs if e.kind == ev.Kind.STEPS_SEEN and e.rank is not None]
    if not seen:
        return [], True
    rank = min(int(e.rank) for e in seen if e.rank is not None)
    out: list[ev.Event] = []
    known = True
    last_end: dict[tuple[object, object], float] = {}
    unique = 0
    for e in seen:
        if e.rank != rank:
            continue
        worker = (e.get("host"), e.get("worker_pid"))
        base, first = e.get("base"), int(e.get("first") or 1)
        for i, end in enumerate(e.get("ends") or []):
            n = first + i
            if base is None:
                known = False
                unique -= 1
                step = unique  # its own key: never equal to another's
            else:
                step = int(base) + n - 1
            before = last_end.get(worker)
            seconds = float(end) - before if before is not None else 0.0
            last_end[worker] = float(end)
            out.append(
                ev.Event(
                    time=float(end),
                    kind=ev.Kind.STEP_DONE,
                    rank=rank,
                    step=step,
                    cause=None,
                    fields={"seconds": seconds, "host": worker[0], "pid": worker[1]},
                )
            )
    out.sort(key=lambda x: x.time)
    return out, known


class StepTimer:
    """Each step's seconds, from one rank's events fed in time order (:meth:`see`): a
    ``step_done``'s own, else the time since the previous ``step_done`` of the same
    process (or its ``job_start``, its restore done), less the blocking checkpoint saves
    and loads that process logged between the two (each counted in its own cause); a
    process's first step with neither counts none (its time is start-up, as for the
    steps the launchers saw: :func:`seen_steps`). What a loop does between two steps that
    it does not log (an evaluation) is in the second one's time."""

    def __init__(self) -> None:
        self._mark: dict[tuple[object, object], float] = {}  # a process's last step or start
        self._held: dict[tuple[object, object], float] = {}  # its saves and loads since

    def see(self, e: ev.Event) -> float | None:
        """Take in one event of the rank: a ``step_done``'s seconds, or None (another
        event, or a process's first step with no start to count from)."""
        proc = (e.get("host"), e.get("pid"))
        if e.kind == ev.Kind.JOB_START:
            self._mark[proc], self._held[proc] = e.time, 0.0
        elif e.kind == ev.Kind.CHECKPOINT_SAVED:
            self._hold(proc, e.get("blocking_seconds", e.get("seconds")))
        elif e.kind == ev.Kind.CHECKPOINT_LOADED:
            self._hold(proc, e.get("seconds"))
        elif e.kind == ev.Kind.STEP_DONE:
            own = e.get("seconds")
            since, held = self._mark.get(proc), self._held.get(proc, 0.0)
            self._mark[proc], self._held[proc] = e.time, 0.0
            if isinstance(own, (int, float)):
                return float(own)
            return None if since is None else max(0.0, e.time - since - held)
        return None

    def _hold(self, proc: tuple[object, object], seconds: object) -> None:
        if isinstance(seconds, (int, float)):
            self._held[proc] = self._held.get(proc, 0.0) + float(seconds)


def untimed(evs: list[ev.Event]) -> bool:
    """Whether a ``step_done`` of ``evs`` has no seconds of its own."""
    return any(
        e.kind == ev.Kind.STEP_DONE and not isinstance(e.get("seconds"), (int, float)) for e in evs
    )


def timed(evs: list[ev.Event]) -> list[ev.Event]:
    """``evs`` (in time order) with every rank's ``step_done`` given its seconds where
    it has none (:class:`StepTimer`, one per rank; a process's first step with nothing to
    count from, 0): for the report and for what draws the steps."""
    if not untimed(evs):
        return evs
    timers: dict[int, StepTimer] = {}
    out: list[ev.Event] = []
    for e in evs:
        if e.rank is not None:
            seconds = timers.setdefault(e.rank, StepTimer()).see(e)
            if e.kind == ev.Kind.STEP_DONE and not isinstance(e.get("seconds"), (int, float)):
                e = ev.Event(e.time, e.kind, e.rank, e.step, e.cause,
                             {**e.fields, "seconds": seconds or 0.0})  # fmt: skip
        out.append(e)
    return out
