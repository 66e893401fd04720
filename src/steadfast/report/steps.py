"""The steps of a script that reports none, as its launchers saw them (``steps_seen``,
steadfast.progress): one ``step_done`` per iteration rebuilt for the goodput report."""

from __future__ import annotations

from .. import events as ev

__all__ = ["seen_steps"]


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
