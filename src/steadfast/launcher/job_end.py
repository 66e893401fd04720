"""The end of a job of several nodes, as a launcher lives it: the exit barrier, left
within a bound whatever the round looks like from this node, and workers that outlive
the others' end, taken for hung instead of waited for.

A launcher whose workers finished waits for the round's other nodes (the store's host
must outlive their use of it), but never longer than ``job_end_timeout``: a node that
holds another view of the round (another rank, store prefix or round than this one
thinks) never marks the key this one reads, and a node whose workers never end never
marks it either. Leaving, the launcher names the nodes it did not hear finish
(``exit_barrier``). The other side of the same bound: a node that heard another node
finish (its goodbye over the ring, which needs no store key) and whose own workers still
run ``job_end_timeout`` later looks at them (:func:`after_the_end`): the job's last
collective is behind them, so ranks whose training is over, or that do not move, are
torn down (exit 0, ``worker_teardown``: issue 68); a rank that moves (a final save) is
waited for, up to ``progress_cap``; past it, or where no look can tell (progress not
watched), they are taken for hung at the job's end (``rank_hung``, cause ``job_end``)
and stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import events
from ..config import FaultToleranceConfig
from ..monitor import Watcher
from .nodes import NodeRoster

__all__ = ["after_the_end", "exit_barrier", "hung_at_end", "hung_in_teardown", "process_state"]

logger = logging.getLogger(__name__)


def exit_barrier(roster: NodeRoster, timeout: float, nodes: int) -> None:
    """Wait in the roster's exit barrier up to ``timeout`` seconds, then write
    ``exit_barrier``: how long it waited, the nodes it did not hear finish (cause
    ``timeout``) and those found lost."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    began = time.monotonic()
    try:
        missing, lost = roster.exit_barrier(timeout)
        cause = "timeout" if missing else "all_finished"
    except SignalException:
        raise  # stopped while waiting: the launcher ends as the signal says
    except Exception as exc:  # the store's host already gone: nothing to keep alive
        logger.info("exit barrier: %s", exc)
        missing, lost, cause = [], [], f"store_unreachable: {type(exc).__name__}: {exc}"
    events.emit(
        "exit_barrier",
        cause=cause,
        nodes=nodes,
        waited=round(time.monotonic() - began, 4),
        missing=missing,
        lost=lost,
    )


def after_the_end(
    watcher: Watcher,
    running: list[Any],
    pids: Mapping[int, int],
    overrun: float,
    ft: FaultToleranceConfig,
) -> list[int] | None:
    """This node's ``running`` workers (torch's ``Worker``s), ``overrun`` seconds after
    another node finished, past ``job_end_timeout``: torn down where their training is
    over or a look finds none moving (None: nothing more to do here), left alone while
    one moves (None), else a hang at the job's end: :func:`hung_at_end`'s global ranks,
    for the caller to stop."""
    locals_ = [int(w.local_rank) for w in running]
    if watcher.over(locals_):  # their training is over: teardown, not a fault
        watcher.tear_down(locals_, overrun, ", after another node finished")
        return None
    moving = watcher.moving({local: pids[local] for local in locals_ if local in pids})
    if moving is not None and overrun <= ft.job_end_timeout + ft.progress_cap:
        if not moving:
            watcher.tear_down(locals_, overrun, ", hung after another node finished")
        return None  # else working (a final save): looked at again at the next check
    return hung_at_end(running, pids, overrun, ft.job_end_timeout)


def hung_at_end(
    running: Iterable[Any], pids: Mapping[int, int], overrun: float, timeout: float
) -> list[int]:
    """``rank_hung`` (cause ``job_end``) for each worker of ``running`` (torch's
    ``Worker``s), ``overrun`` seconds after another node finished; their global ranks."""
    ranks = []
    for w in running:
        rank, local = int(w.global_rank), int(w.local_rank)
        pid = pids.get(local)
        state, wchan = process_state(pid) if pid is not None else ("unknown", None)
        events.emit(
            "rank_hung",
            cause="job_end",
            rank=rank,
            local_rank=local,
            section="job end",
            elapsed=round(overrun, 4),
            timeout=timeout,
            learned=False,
            worker_pid=pid,
            process=state,
            wchan=wchan,
        )
        logger.error(
            "rank %d (local %d, pid %s: %s%s) still running %.1f s after another node "
            "finished its workers (job_end_timeout=%g s): hung at the job's end; stopping it",
            rank,
            local,
            pid,
            state,
            f", waiting in {wchan}" if wchan else "",
            overrun,
            timeout,
        )
        ranks.append(rank)
    return sorted(ranks)


def hung_in_teardown(
    hung: Iterable[int], ended: float | None, global_rank: Callable[[int], int]
) -> tuple[list[int], float] | None:
    """The global ranks of this node's ``hung`` ranks (local) and how long after another
    node of the round finished its workers (``ended``, monotonic), if one did: every rank
    had then passed the job's last collective, so the hang is in the script's teardown
    (torch 2.13's gloo can deadlock there: docs/architecture.md), and a restart could
    only wait for a round the finished node never joins. None otherwise."""
    ranks = sorted(global_rank(r) for r in hung)
    if not ranks or ended is None:
        return None
    return ranks, time.monotonic() - ended


def process_state(pid: int) -> tuple[str, str | None]:
    """What process ``pid`` is doing, from ``/proc``: ``running`` (with the kernel
    function it waits in, ``wchan``, where it sleeps), ``zombie`` (it exited and its
    parent, the worker template, never reaped it: the launcher never learned its exit)
    or ``gone`` (it exited and was reaped, and the launcher never learned it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "gone", None
    if state in ("Z", "X"):
        return "zombie", None
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or None
    except OSError:
        wchan = None
    return "running", None if wchan in (None, "0") else wchan
