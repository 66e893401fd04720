"""The watcher's use of progress: each rank's bound when its script sends no heartbeat,
and what to do when a bound passes (the decision after :class:`~.judge.Judge`'s look).

The bounds (seconds; ``cfg`` is the run's FaultToleranceConfig):

- **Learned**: once the node's ranks have shown ``learned_timeout_min_samples``
  intervals between marks after their first iteration, ``learned_timeout_margin`` x the
  longest (at least ``learned_timeout_floor``) after a rank's last mark. Kept across the
  launcher's generations (the longest seen by any rank).
- **Start-up** (before the first iteration, and until the bound is learned):
  ``progress_startup_bound`` (300 s) after the last mark or the worker's start: the
  time to a first step (imports, ``init_process_group``, compilation, the first batch)
  is unknown, and every rank waits in ``init_process_group`` for the slowest to come.
- **The cap**: ``progress_cap`` (600 s, NCCL's own watchdog default) after the last
  mark, whatever moves: a livelock (a rank spinning without a step), an evaluation that
  never ends, or a node whose ranks all wait in collectives for another node's rank.

When a bound passes, the ranks are looked at (a window of 1 s). If any moves and the
cap has not passed, nothing happens and they are looked at again 2 s later. If none
moves: the culprit (:func:`.judge.culprit`) is ended; where none can be told apart, the
node ends its lowest rank only if it holds the whole job, or once the cap passed (a
node whose ranks all wait in a collective may be waiting for another node's culprit,
which that node names and ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import events
from ..config import FaultToleranceConfig
from .judge import Judge, Verdict, culprit
from .layout import ask_path, read
from .native import native_stack
from .reporter import Reporter

if TYPE_CHECKING:
    from .layout import Rows

__all__ = ["Decision", "ProgressWatch", "record"]

logger = logging.getLogger(__name__)

#: Seconds between two looks while something moves past a bound.
RECHECK = 2.0


@dataclass(frozen=True)
class Decision:
    """A hang to act on: the rank to end (None: no culprit told apart, the lowest
    rank is ended), the verdict, and the cause."""

    local: int | None
    verdict: Verdict
    cause: str


class ProgressWatch:
    """Progress bounds and decisions for one node's watcher."""

    def __init__(
        self,
        table: Rows,
        cfg: FaultToleranceConfig,
        whole_job: bool,
        global_rank: Callable[[int], int],
    ) -> None:
        self.cfg = cfg
        self.whole_job = whole_job
        self.slots = {r: table.progress_area(r)[0] for r in range(table.rows)}
        #: the steps into the log, the stragglers (a thread: start/stop by the watcher)
        self.reporter = Reporter(self.slots, global_rank)
        self.judge = Judge(
            {r: (*table.progress_area(r), str(ask_path(table.path, r))) for r in range(table.rows)}
        )
        self._longest = 0.0  # carried across generations: the longest seen
        self._intervals = 0
        self._postponed: dict[int, float] = {}
        self._waiting_logged = False

    def new_generation(self, pids: dict[int, int]) -> None:
        self._postponed = {}
        self._waiting_logged = False
        self.reporter.watch(pids)

    def attached(self, local: int, pid: int) -> bool:
        """Whether ``local``'s worker ``pid`` has the progress hooks in."""
        return read(self.slots[local]).pid == pid

    def deadline(self, local: int, started: float) -> tuple[float, str, float, float]:
        """``(deadline, what, since, bound)`` of a rank without heartbeats."""
        cfg = self.cfg
        g = read(self.slots[local])
        if g.steps >= 1:
            self._longest = max(self._longest, g.longest)
            self._intervals = max(self._intervals, g.intervals)
        since = max(g.mark, started)
        if g.steps >= 1 and self._intervals >= cfg.learned_timeout_min_samples:
            bound = max(cfg.learned_timeout_margin * self._longest, cfg.learned_timeout_floor)
            bound, what = min(bound, cfg.progress_cap), "no_progress"
        else:
            bound = min(cfg.progress_startup_bound, cfg.progress_cap)
            what = "no_progress" if g.steps >= 1 else "startup"
        deadline = max(since + bound, self._postponed.get(local, 0.0))
        return deadline, what, since, bound

    def decide(
        self, pids: dict[int, int], local: int, what: str, since: float, explicit: bool
    ) -> Decision | None:
        """A bound of ``local`` passed: look at every rank; the hang to act on, or None
        (something moves, or the culprit may be another node's)."""
        if explicit:  # a timeout of the script's own heartbeats or sections: NVRx's
            # contract, acted on at once; the look only says where each rank is
            verdict = self.judge.look(pids, window=0.0)
            verdict.culprit = culprit(verdict.looks)
            chosen = verdict.culprit.local if verdict.culprit is not None else local
            return Decision(chosen, verdict, what)
        verdict = self.judge.look(pids)
        now = time.monotonic()
        past_cap = now - since >= self.cfg.progress_cap
        if verdict.moving and not past_cap:
            logger.info(
                "rank(s) silent past their bound (%s), but moving: %s",
                what,
                "; ".join(
                    f"local {look.local}: {', '.join(look.moved)}" for look in verdict.moving
                ),
            )
            self._postpone(pids, now)
            return None
        if verdict.culprit is not None:
            return Decision(verdict.culprit.local, verdict, what)
        if past_cap:
            livelock = [look for look in verdict.moving if not look.waiting]
            spinning = min(livelock, key=lambda look: look.local).local if livelock else None
            return Decision(spinning, verdict, "progress_cap")
        if self.whole_job:
            return Decision(None, verdict, what)
        if not self._waiting_logged:
            logger.warning(
                "no rank of this node moves, and every one waits in a collective (%s): "
                "waiting for another node to name the culprit (up to the cap, %.0fs)",
                ", ".join(sorted(verdict.waiting)) or "?",
                self.cfg.progress_cap,
            )
            self._waiting_logged = True
        self._postpone(pids, now)
        return None

    def _postpone(self, pids: dict[int, int], now: float) -> None:
        for other in pids:
            self._postponed[other] = now + RECHECK


def record(decision: Decision, global_rank: Callable[[int], int]) -> str:
    """Write ``hang_confirmed`` (and log the culprit's stack); the summary line."""
    verdict = decision.verdict
    culprit = next((look for look in verdict.looks if look.local == decision.local), None)
    waiting = {
        where: sorted(global_rank(local) for local in locals_)
        for where, locals_ in sorted(verdict.waiting.items())
        if decision.local not in locals_
    }
    others = "; ".join(
        f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''} waited in `{where}`"
        for where, ranks in waiting.items()
    )
    if culprit is not None:
        head = f"rank {global_rank(culprit.local)} " + (
            f"stopped in `{culprit.place}`" if culprit.answered else culprit.place
        )
    else:
        head = "no culprit could be told apart"
    summary = f"{head}; {others}" if others else head
    stack = culprit.stack.splitlines() if culprit is not None else []
    native: list[str] = []
    if culprit is not None and (culprit.stuck or not stack):  # its Python cannot say
        native = native_stack(culprit.pid).splitlines()
    logger.error("hang confirmed (%s): %s", decision.cause, summary)
    if stack or native:
        logger.error(
            "rank %d's stack:\n%s",
            global_rank(culprit.local),  # type: ignore[union-attr]
            "\n".join(stack or native),
        )
    events.emit(
        "hang_confirmed",
        cause=decision.cause,
        culprit=global_rank(culprit.local) if culprit is not None else None,
        where=culprit.place if culprit is not None else None,
        waiting=waiting,
        moving=sorted(global_rank(look.local) for look in verdict.moving),
        stack=stack[-24:],
        native=native,
        summary=summary,
    )
    return summary
