"""What ``/proc`` says of a worker, for the launcher's confirmation of a hang: the
process state, its main thread's CPU time, the time it was runnable but waited for a CPU
(``schedstat``: a machine busy with other work), and its I/O, and the CPU time of its
children (a DataLoader's workers); whether it still runs, and a signal to its process
group (the watcher's and the teardown's end of a worker)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

__all__ = ["ProcSample", "running", "sample", "signal_group"]

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcSample:
    """One read of a worker: ``state`` is ``/proc``'s letter (``R`` running, ``S``
    sleeping, ``D`` uninterruptible I/O, ``T``/``t`` stopped, ``Z`` zombie, ``?`` gone);
    ``cpu``: its main thread's user+system seconds; ``io``: the bytes its main thread
    read and wrote (every ``read``/``write``, storage or not); ``children_cpu``: its
    children's user+system seconds, their own children included; ``waited``: the seconds
    its main thread was runnable but waited on a run queue (0 where the kernel does not
    say)."""

    state: str
    cpu: float
    io: int
    children_cpu: float
    wchan: str = ""
    waited: float = 0.0


def _stat(path: str) -> tuple[str, float] | None:
    try:
        with open(path, "rb") as fh:
            fields = fh.read().decode().rsplit(")", 1)[1].split()
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    # after the name: state (3), ... utime (14), stime (15)
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


def _waited(path: str) -> float:
    """``schedstat``'s second field: the time runnable on a run queue, not running."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _io(path: str) -> int:
    total = 0
    try:
        with open(path) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar"):
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total


def _children(pid: int, depth: int = 2) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids = [int(x) for x in fh.read().split()]
        except (OSError, ValueError):
            continue
        for kid in kids:
            out.append(kid)
            if depth > 1:
                out.extend(_children(kid, depth - 1))
    return out


def sample(pid: int) -> ProcSample:
    """A read of worker ``pid`` (state ``?`` where it is gone)."""
    task = f"/proc/{pid}/task/{pid}"  # its main thread
    main = _stat(f"{task}/stat")
    if main is None:
        return ProcSample("?", 0.0, 0, 0.0)
    children = 0.0
    for kid in _children(pid):
        stat = _stat(f"/proc/{kid}/stat")
        if stat is not None:
            children += stat[1]
    wchan = ""
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read().strip()
    except OSError:
        pass
    return ProcSample(
        main[0], main[1], _io(f"{task}/io"), children, wchan, _waited(f"{task}/schedstat")
    )


def running(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the worker's process group (its own: grandchildren too), else to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            os.kill(pid, sig)
