"""``steadfast watch RUN_DIR``: a running job in one terminal screen, read from its event
log as it grows (:mod:`steadfast.metrics.figures`): its nodes and ranks, the step rate,
goodput so far, the last faults and their culprits, the stragglers. It redraws in place
with plain ANSI escapes (home, clear to the end of each line), so it works over ``ssh``
in any terminal, and a line never wraps (it is cut to the terminal's width). ``--once``
prints one frame and ends."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from . import events
from .metrics.figures import Figures

__all__ = ["Screen", "add_watch_parser"]

#: the detections shown under "last faults"
_FAULTS = {"rank_failed", "rank_hung", "node_lost", "node_unhealthy", "node_isolated",
           "nan_detected", "hang_confirmed", "sdc_verdict"}  # fmt: skip
#: seconds of history the step rate is measured over
RATE_WINDOW = 30.0


def _log_of(run: Path) -> Path:
    if run.is_file():
        return run
    found = sorted(run.glob("events*.jsonl")) or sorted(run.glob("steadfast_events*.jsonl"))
    return found[0] if found else run / "events.jsonl"


class Screen:
    """What the view shows, kept up to date from the log at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures = Figures(str(path))
        self.ranks = 0
        self.faults: deque[str] = deque(maxlen=5)
        self.samples: deque[tuple[float, int]] = deque()
        self.ended: str | None = None

    def refresh(self) -> None:
        for ev in self.figures.refresh():
            self._note(ev)
        now = time.monotonic()
        self.samples.append((now, self.figures.steps))
        while self.samples and now - self.samples[0][0] > RATE_WINDOW:
            self.samples.popleft()

    def _note(self, ev: events.Event) -> None:
        if ev.kind == events.Kind.WORKERS_STARTED:
            self.ranks = int(ev.get("world_size") or self.ranks)
            self.ended = None
        elif ev.kind in _FAULTS:
            when = time.strftime("%H:%M:%S", time.localtime(ev.time))
            f = ev.fields  # the fields each kind has (a node lost names its node, ...)
            who = f.get("node") or (f"rank {ev.rank}" if ev.rank is not None else f.get("host"))
            if ev.kind == events.Kind.SDC_VERDICT:  # the culprit, where the launcher wrote it
                who = f"rank(s) {f.get('culprits')}"
                f = {**f, "host": ",".join(f.get("hosts") or []),
                     "summary": f"{ev.cause} after step {f.get('last_agreed_step')}"}  # fmt: skip
            what = f.get("summary") or f.get("how") or f.get("reason") or ev.cause or ""
            self.faults.append(f"{when}  {ev.kind:<15} {who} on {f.get('host')}: {what}")
        elif ev.kind == events.Kind.FAULT_CULPRIT and self.faults:
            culprit = f"{ev.get('node')} rank {ev.get('culprit_rank')}"
            if "culprit" not in self.faults[-1]:
                self.faults[-1] += f"  [culprit agreed: {culprit}]"
        elif ev.kind == events.Kind.LAUNCHER_END:
            self.ended = f"a launcher ended: exit {ev.get('exit_code')} ({ev.get('reason')})"

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def lines(self) -> list[str]:
        f = self.figures
        goodput = "-" if f.goodput is None else f"{100 * f.goodput:.1f} %"
        out = [
            f"steadfast watch {self.path}    {time.strftime('%Y-%m-%d %H:%M:%S')}",
            f"job    {len(f.nodes)} nodes, {self.ranks} ranks    steps {f.steps:,} "
            f"({self.rate():.2f}/s)    goodput {goodput}    restarts "
            f"{f.restarts['in_job']} in-job, {f.restarts['requeue']} requeued",
            "nodes  " + ("   ".join(f"{h} {s}" for h, s in sorted(f.nodes.items())) or "-"),
            "last faults" + ("" if self.faults else "  none"),
            *(f"  {line}" for line in self.faults),
        ]
        if f.replica_checks:
            out.append(f"replicas  {f.replica_checks:,} checks agreed; newest step proven "
                       f"clean {f.proven_step}")  # fmt: skip
        slow = sorted((s, r) for r, s in f.stragglers.items() if s < 0.9)
        out.append("stragglers  " + (", ".join(f"rank {r} {s:.2f}" for s, r in slow[:8])
                                       or "none (every rank within 10 % of the best)"))  # fmt: skip
        if self.ended:
            out.append(self.ended)
        return out


def draw(screen: Screen, out: TextIO, width: int) -> None:
    """One frame, in place: home, each line cut to ``width`` and cleared to its end,
    then the rest of the screen cleared."""
    frame = "\x1b[H" + "".join(f"{line[:width]}\x1b[K\n" for line in screen.lines()) + "\x1b[J"
    out.write(frame)
    out.flush()


def _watch(ns: argparse.Namespace) -> int:
    run = Path(ns.run_dir)
    if not run.exists():
        print(f"steadfast watch: {run}: no such run folder or event log", file=sys.stderr)
        return 2
    screen = Screen(_log_of(run))
    if ns.once:
        screen.refresh()
        print("\n".join(screen.lines()))
        return 0
    sys.stdout.write("\x1b[2J")
    try:
        while True:
            screen.refresh()
            draw(screen, sys.stdout, shutil.get_terminal_size().columns)
            time.sleep(ns.interval)
    except KeyboardInterrupt:
        return 0


def add_watch_parser(sub: Any) -> None:
    """``steadfast watch`` on the ``steadfast`` command's sub-parsers."""
    p = sub.add_parser("watch", help="a running job in one terminal screen, from its event log")
    p.add_argument("run_dir", help="the run folder (its events*.jsonl) or an event log")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    p.add_argument("--once", action="store_true", help="print one frame and end")
    p.set_defaults(func=_watch)
