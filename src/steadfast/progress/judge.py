"""The launcher's judgement of a silence: is it a hang, and whose?

A bound passing (a learned silence, a section's timeout) is only a suspicion. Before a
single process is killed, :meth:`Judge.look` watches every rank of the node for a
window (:data:`WINDOW`, 1 s) through signals that need nothing of the script:

- the rank's progress marks (steps, top-module forwards: :mod:`.probe`);
- ``/proc``: its state (``T`` stopped, ``D`` in uninterruptible I/O), its main thread's
  CPU time, the time it was runnable but waited for a CPU, and its read/write bytes,
  its children's CPU time (a DataLoader's workers);
- its main thread's Python stack, sampled at the window's start and end by the rank's
  own thread (which can answer while the main thread waits in C with the GIL released).

A rank *moves* when its marks advance, its main thread reads or writes, its stack
changes between the samples, its children compute, or its main thread computes on a
process without CUDA (on CUDA a rank waiting in ``cudaStreamSynchronize`` spins at
100 %: CPU time alone proves nothing there). Computing is being runnable: the CPU time
it got and the time it waited on a run queue for a CPU that others' work held (on a
node shared with other jobs, a busy rank may get much less than a core; a rank blocked
in a collective or asleep is not runnable and accrues neither). A rank that cannot
answer (stopped, or its main thread holding the GIL) is stuck. Any rank moving is
progress: a 25 s evaluation, a save on rank 0 while the others wait in a barrier.

When nothing moves, the culprit is the rank that is not where the others are: a
stopped or unanswering rank first, then a rank outside any collective (asleep in its
step, waiting for a DataLoader batch) while the others wait in one (a
``torch.distributed`` call, or under DDP the backward, which holds DDP's all-reduce).
When every rank waits in a collective, no culprit can be told apart, and the verdict
says so instead of guessing.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .layout import ANSWER, ASK, FLAG_CUDA, FLAG_DDP, Progress, read, read_stack
from .proc import ProcSample, sample

__all__ = ["Look", "Verdict", "Judge", "summarize_stack"]

#: The confirmation window (seconds): two stack samples this far apart.
WINDOW = 1.0
#: How long a rank's thread has to answer a stack request (it answers in ~1 ms; a
#: machine busy with other work may leave it unscheduled for a while: only a rank that
#: does not answer this long is taken for one that holds the GIL).
ANSWER_WAIT = 1.0
#: A main thread runnable (computing, or waiting for a CPU) at least this share of the
#: window moves (no CUDA).
CPU_SHARE = 0.2


def summarize_stack(stack: str, ddp: bool = False) -> tuple[str, bool]:
    """``(where, waiting)`` for a stack text (``file:line qualname`` per line, outermost
    first): where the rank is, in a few words, and whether that is a collective."""
    frames = [line.rsplit(" ", 1) for line in stack.splitlines() if " " in line]
    for place, name in frames:  # the outermost frame of c10d's API: the collective
        if "/torch/distributed/distributed_c10d.py" in place:
            return name, True
    for place, name in frames:
        if "/torch/distributed/" in place and "/elastic/" not in place:
            return name, True
    if ddp and any("/torch/autograd/" in place for place, _ in frames):
        return "backward (DDP's all-reduce)", True
    for place, name in frames:  # the library call the script made
        if "/site-packages/" in place or "/torch/" in place:
            return name, False
    if frames:
        place, name = frames[-1]
        return f"{name} ({os.path.basename(place)})", False
    return "unknown", False


@dataclass
class Look:
    """One rank through the window."""

    local: int
    pid: int
    state: str
    moved: list[str]  # what moved: progress, io, stack, cpu, children
    answered: bool | None  # None: it has no progress thread to ask (no hooks in)
    stack: str
    where: str
    waiting: bool
    wchan: str = ""

    @property
    def stuck(self) -> bool:
        """It cannot answer: stopped, in uninterruptible I/O, or holding the GIL."""
        return self.state in ("T", "t", "D") or (self.answered is False and self.state != "?")

    @property
    def place(self) -> str:
        if self.state in ("T", "t"):
            return "stopped (state T)"
        if self.state == "D":
            return f"uninterruptible I/O ({self.wchan or 'unknown'})"
        if self.answered is False:
            return "no answer (its main thread holds the GIL)"
        return self.where


@dataclass
class Verdict:
    """What the window showed: the ranks that moved, and the culprit if nothing did."""

    looks: list[Look]
    culprit: Look | None = None
    waiting: dict[str, list[int]] = field(default_factory=dict)  # where -> local ranks

    @property
    def moving(self) -> list[Look]:
        return [look for look in self.looks if look.moved]


def _ask(slots: Any, fifo: str) -> float | None:
    """Ask a rank's thread for its stack: the request number, None if it cannot hear."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # no thread has it open
        return None
    try:
        asked = slots[ASK] + 1
        slots[ASK] = asked
        os.write(fd, b"a")
    except OSError:
        return None
    finally:
        os.close(fd)
    return float(asked)


class Judge:
    """Looks at a node's ranks (``rows``: local rank -> (progress slots, area, ask
    FIFO))."""

    def __init__(self, rows: dict[int, tuple[Any, Any, str]]) -> None:
        self.rows = rows

    def _samples(
        self, pids: dict[int, int]
    ) -> dict[int, tuple[ProcSample, Progress, str | None, bool | None]]:
        procs = {local: sample(pid) for local, pid in pids.items()}
        asked: dict[int, float] = {}
        hooked = {local for local, pid in pids.items() if read(self.rows[local][0]).pid == pid}
        for local, proc in procs.items():
            if local in hooked and proc.state not in ("T", "t", "D", "Z", "?"):
                slots, _, fifo = self.rows[local]
                number = _ask(slots, fifo)
                if number is not None:
                    asked[local] = number
        deadline = time.monotonic() + ANSWER_WAIT
        while asked and time.monotonic() < deadline:
            if all(self.rows[local][0][ANSWER] >= n for local, n in asked.items()):
                break
            time.sleep(0.005)
        out = {}
        for local, proc in procs.items():
            slots, area, _ = self.rows[local]
            n = asked.get(local)
            stack = read_stack(slots, area) if n is not None and slots[ANSWER] >= n else None
            answered = None if local not in hooked else stack is not None
            out[local] = (proc, read(slots), stack, answered)
        return out

    def look(self, pids: dict[int, int], window: float = WINDOW) -> Verdict:
        """Watch every rank for ``window`` seconds (0: one sample, where each is); the
        verdict."""
        begun = time.monotonic()
        first = self._samples(pids)
        if window > 0:
            time.sleep(max(0.0, begun + window - time.monotonic()))
            second = self._samples(pids)
        else:  # where the ranks are, not whether they move: one sample
            second = first
        span = max(time.monotonic() - begun, 1e-3)
        looks = []
        for local, pid in pids.items():
            (p1, g1, s1, _), (p2, g2, s2, answered) = first[local], second[local]
            moved = []
            if (g2.mark, g2.steps) != (g1.mark, g1.steps):
                moved.append("progress")
            if p2.io > p1.io:
                moved.append("io")
            if s1 is not None and s2 is not None and s1 != s2:
                moved.append("stack")
            if p2.children_cpu - p1.children_cpu >= CPU_SHARE * span:
                moved.append("children")
            runnable = (p2.cpu - p1.cpu) + (p2.waited - p1.waited)
            if not g2.flags & FLAG_CUDA and runnable >= CPU_SHARE * span:
                moved.append("cpu")
            if p2.state in ("T", "t", "D", "Z", "?"):
                moved = []  # whatever it did before, it is not moving now
            where, waiting = summarize_stack(s2 or s1 or "", bool(g2.flags & FLAG_DDP))
            looks.append(
                Look(
                    local,
                    pid,
                    p2.state,
                    moved,
                    answered,
                    s2 or s1 or "",
                    where,
                    waiting,
                    p2.wchan,
                )
            )
        verdict = Verdict(looks)
        for look in looks:
            if look.waiting and not look.stuck:
                verdict.waiting.setdefault(look.where, []).append(look.local)
        if not verdict.moving:
            verdict.culprit = culprit(looks)
        return verdict


def culprit(looks: list[Look]) -> Look | None:
    """The rank not where the others are (see the module docstring), None where none can
    be told apart."""
    live = [look for look in looks if look.state not in ("Z", "?")]
    stuck = [look for look in live if look.stuck]
    if stuck:  # stopped first, then in D, then not answering: the surest signs first
        order = {"T": 0, "t": 0, "D": 1}
        return min(stuck, key=lambda look: (order.get(look.state, 2), look.local))
    outside = [look for look in live if not look.waiting]
    if outside and len(outside) < len(live):
        return min(outside, key=lambda look: look.local)
    if len(live) > 2:  # every rank in a collective: one alone in another place
        places = Counter(look.where for look in live)
        if len(places) > 1:
            (common, _), *_ = places.most_common(1)
            odd = [look for look in live if look.where != common]
            if len(odd) == 1:
                return odd[0]
    if len(live) == 1 and len(looks) == 1 and not live[0].waiting:
        return live[0]  # a job of one rank: it is its own culprit
    return None
