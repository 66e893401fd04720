"""The launcher's watcher: reads the heartbeat table and terminates hung ranks.

Instead of polling every ``workload_check_interval`` (the original's 5 s, so a hang is
seen up to 5 s late), the watcher computes each rank's nearest deadline from its row and
sleeps until then, then re-reads the row: a rank that made progress meanwhile moved its
deadline; one that did not is hung. Detection lags the timeout only by the thread's
wake-up latency, whatever the phase of the watcher's reads:

- A deadline that *starts* after a read (a section opened, a heartbeat sent, a section
  left) ends no sooner than the read plus the row's shortest timeout, so the watcher
  never sleeps longer than that (:func:`shortest_timeout`), nor longer than
  ``workload_check_interval``. Without this bound a read that found no open section
  (between two steps) slept the whole interval, and a hang in the next section was seen
  up to that late (1.2 s on average with 5 s and a 3 s timeout).
- A rank that *lowers* a timeout (calculated or loaded timeouts) wakes the watcher
  through the table's wake channel, so a deadline computed from the old timeouts is not
  slept through. Heartbeats and sections (the hot path) make no system call.

The watcher also holds a pidfd of each worker, so it learns the moment each one exits:
the agent uses the order to tell the rank that failed first from the ranks that went
down after it (:meth:`Watcher.exit_times`).

On a hang: a ``rank_hung`` event (rank, what timed out, elapsed, timeout), the rank's
Python stacks (:data:`~steadfast.monitor.client.STACK_DUMP_SIGNAL`, registered by the
client with faulthandler), then ``rank_termination_signal`` to the rank's process group.
The elastic agent sees the worker die and restarts the group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from .. import events
from ..config import FaultToleranceConfig
from ..progress.proc import running
from ..progress.watch import ProgressWatch, record
from .ending import Endings, Hang
from .exits import ExitClock
from .learned import effective
from .ranks import Ranks, RankState
from .table import HeartbeatTable, RowSnapshot
from .teardown import Teardown

__all__ = ["Hang", "Watcher", "next_deadline", "shortest_timeout"]

logger = logging.getLogger(__name__)

_FIELDS = FaultToleranceConfig.__dataclass_fields__
_INITIAL_DEFAULT = _FIELDS["initial_rank_heartbeat_timeout"].default

#: How long the other ranks of a hang may outlive its culprit before each is judged on
#: its own (they waited for it in a collective: its end ends them within milliseconds).
HELD_GRACE = 1.0


def _wall(monotonic: float) -> float:
    """The epoch time of a ``time.monotonic()`` reading (the two clocks read together)."""
    return time.time() - (time.monotonic() - monotonic)


def next_deadline(
    snap: RowSnapshot, started: float, warmup_iterations: int
) -> tuple[float, str, float, float]:
    """The row's nearest deadline: ``(deadline, what, since, timeout)``; the deadline is
    ``inf`` when nothing can time out. ``started`` is when the worker was started; the
    first heartbeat is due ``initial_heartbeat_timeout`` after it, or after the rank
    attached once it has."""
    best = (math.inf, "", 0.0, math.inf)

    def consider(since: float, timeout: float, what: str) -> None:
        nonlocal best
        if math.isfinite(timeout) and since + timeout < best[0]:
            best = (since + timeout, what, since, timeout)

    if snap.last_heartbeat == 0:
        # from the worker's start until it attaches (stuck in an import, say); then from
        # its attach, which is what a calculated initial timeout measured (the client's
        # init_workload_monitoring to its first heartbeat)
        since = snap.attached if snap.attached > 0 else started
        consider(since, snap.initial_heartbeat_timeout, "initial_heartbeat")
    else:
        consider(snap.last_heartbeat, snap.heartbeat_timeout, "heartbeat")
    for name, opened in snap.open_sections.items():  # nested or overlapping: each its own
        timeout = snap.section_timeouts.get(name, math.inf)
        warmup = snap.section_timeouts.get("warmup")
        if name == "step" and warmup is not None and snap.steps < warmup_iterations:
            timeout = warmup
        consider(opened, timeout, f"section:{name}")
    if not snap.open_sections and snap.out_of_section_start > 0:  # not before the first step
        consider(snap.out_of_section_start, snap.out_of_section_timeout, "out_of_section")
    return best


def shortest_timeout(snap: RowSnapshot) -> float:
    """The shortest finite timeout of the row (``inf`` if none): no deadline that starts
    after a read of the row can end sooner than the read plus this."""
    candidates = [
        snap.heartbeat_timeout,
        snap.out_of_section_timeout,
        *snap.section_timeouts.values(),
    ]
    return min((t for t in candidates if math.isfinite(t) and t > 0), default=math.inf)


class Watcher:
    """Watches the rows of ``table`` for the workers the agent started.

    Args:
        table: The node's heartbeat table.
        cfg: Timeouts, termination signal, check interval and warm-up iterations.
        global_rank: Maps a local rank to its global rank (for events).
        on_hang: Called after a hang was handled (tests, the launcher's bookkeeping).
        whole_job: This node holds every rank of the job (a hang with no culprit told
            apart is then acted on at once; see steadfast.progress.watch).
        job_over: Whether another node of the job finished its workers (a hang
            confirmed then is after the job's last collective: teardown, not a fault).
    """

    def __init__(
        self,
        table: HeartbeatTable,
        cfg: FaultToleranceConfig,
        global_rank: Callable[[int], int] = lambda local: local,
        on_hang: Callable[[Hang], None] | None = None,
        whole_job: bool = True,
        job_over: Callable[[], bool] = lambda: False,
    ) -> None:
        self.job_over = job_over
        self.table = table
        self.cfg = cfg
        #: the script's progress without its help (steadfast.progress), when watched;
        #: ``whole_job``: this node holds every rank of the job
        self.progress_watch = (
            ProgressWatch(table, cfg, whole_job, global_rank) if cfg.watch_progress else None
        )
        self.global_rank = global_rank
        #: each rank's state (steadfast.monitor.ranks): the one place it is kept
        self.ranks = Ranks({r: table.progress_area(r)[0] for r in range(table.rows)})
        #: ranks whose training is over: their teardown bounded, never a fault
        self.teardown = Teardown(
            self.ranks,
            cfg.teardown_timeout,
            global_rank,
            self._where,
            cfg.workers_stop_timeout,
            self._moving if self.progress_watch is not None else None,
            cfg.progress_cap,
        )
        self._endings = Endings(cfg, on_hang)  # hung ranks on their way out (the thread's)
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._generation = 0
        self._started = 0.0
        self._exits = ExitClock()  # when each worker exited (its pidfd; the thread's)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._poll: select.poll | None = None
        self._ctl_r = self._ctl_w = self._wake_fd = -1
        self.hangs: list[Hang] = []

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the watcher thread."""
        self._wake_fd = self.table.open_wake_reader()
        self._ctl_r, self._ctl_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        for fd in (self._ctl_r, self._wake_fd):
            self._poll.register(fd, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="steadfast-watcher", daemon=True)
        self._thread.start()
        if self.progress_watch is not None:
            self.progress_watch.reporter.start()

    def stop(self) -> None:
        """Stop the watcher thread, wait for it, and close its descriptors."""
        with self._lock:
            self._stop = True
        self._kick()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.progress_watch is not None:
            self.progress_watch.reporter.stop()
        self._endings.kill()  # hung ranks not yet gone: as a stopped watcher would
        self._exits.close(self._poll)
        fds = (self._ctl_r, self._ctl_w, self._wake_fd)
        self._ctl_r = self._ctl_w = self._wake_fd = -1
        self._poll = None
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _kick(self) -> None:
        """Wake the watcher thread (a new generation, unwatch, stop)."""
        if self._ctl_w >= 0:
            with contextlib.suppress(OSError):  # full: a wake is pending anyway
                os.write(self._ctl_w, b"k")

    def watch(self, pids: Mapping[int, int]) -> None:
        """Start watching a new generation of workers (``local_rank -> pid``); their rows
        must have been reset."""
        with self._lock:
            self._pids = dict(pids)
            self._generation += 1
            self._started = time.monotonic()
            self.ranks.new_generation(pids)
            self._exits.new_generation(self._generation)
        if self.progress_watch is not None:
            self.progress_watch.new_generation(dict(pids))
        self._kick()

    def unwatch(self) -> None:
        """Stop watching (the workers are being stopped)."""
        with self._lock:
            self._pids = {}
            self._generation += 1
            self._exits.new_generation(self._generation, keep=True)
        if self.progress_watch is not None:
            self.progress_watch.reporter.unwatch()
        self._kick()

    def exit_times(self) -> dict[int, float]:
        """When each worker of the current generation that has ended exited
        (``local_rank -> time.monotonic()``), as seen through its pidfd, once the watcher
        thread took in every exit that happened (:class:`~.exits.ExitClock`, bounded);
        empty where the kernel has no pidfds."""
        return self._exits.times() if self._thread is not None else self._exits.times(0)

    def exit_code(self, local: int, pid: int, code: int) -> int:
        """The code torch's agent is to see for worker ``pid`` (``local``) that exited
        with ``code``: 0 where its training was over (:meth:`.teardown.Teardown.exit_code`)."""
        return self.teardown.exit_code(local, pid, code)

    def over(self, locals_: Iterable[int]) -> bool:
        """Whether the training of every rank of ``locals_`` is over (each marked it)."""
        return all(self.ranks.over(local) is not None for local in locals_)

    def moving(self, pids: Mapping[int, int]) -> bool | None:
        """Whether any of ``pids`` (``local -> pid``) moves, through one look's window;
        None where no look can tell (progress is not watched)."""
        if self.progress_watch is None or not pids:
            return None
        return bool(self.progress_watch.judge.look(dict(pids)).moving)

    def tear_down(self, locals_: Iterable[int], after: float, why: str) -> None:
        """End ``locals_`` (ranks whose training is over) as teardown, not a fault."""
        for local in locals_:
            rank = self.ranks.get(local)
            if rank is not None:
                self.teardown.tear_down(rank, after, why)

    def hung(self) -> dict[int, tuple[str, float]]:
        """The ranks of the current generation found hung: ``local_rank -> (what timed
        out, the epoch time of its last sign of life)``."""
        # a hung rank stays in this list once it exited (ENDED): its hang is the claim
        return {r.local: r.hang for r in self.ranks if r.hang is not None}

    def progress(self) -> int:
        """Progress of the current generation: ``step`` sections completed, or for a
        rank that only sends heartbeats, heartbeats after its first (max over ranks)."""
        best = 0
        for r in range(self.table.rows):
            snap = self.table.snapshot(r)
            best = max(best, snap.steps, snap.heartbeats - 1)
        return best

    def attached(self) -> bool:
        """Whether any rank of the current generation uses the client."""
        return any(self.table.snapshot(r).pid for r in range(self.table.rows))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        generation = -1
        while True:
            with self._lock:
                if self._stop:
                    return
                pids, started = dict(self._pids), self._started
                new_generation = generation != self._generation
                generation = self._generation
            if new_generation:
                assert self._poll is not None
                self._exits.follow(self._poll, pids, generation)
            now = time.monotonic()
            soonest = now + self.cfg.workload_check_interval
            reread = False  # a rank was judged: read every row again before any sleep
            for local, pid in pids.items():
                rank = self.ranks.observe(local, pid, alive=False)  # the row's end marks
                if rank is None or local >= self.table.rows:
                    continue
                if rank.state in (RankState.HUNG, RankState.ENDED):
                    continue  # being ended (its way out is the Endings'), or gone
                finished = self.teardown.due(rank, now)
                if finished is not None:  # its training is over: no hang to look for
                    soonest = min(soonest, finished)
                    continue
                held = self._hold(local, now)
                if held is not None:  # the culprit of its hang is being ended
                    soonest = min(soonest, held)
                    continue
                deferred = rank.deferred
                if deferred > now:  # it waits for a culprit still within its own bound
                    soonest = min(soonest, deferred)
                    continue
                snap, learned = effective(self.table.snapshot(local), self.cfg)
                if snap.closed:
                    continue
                watch = self.progress_watch
                alive = snap.pid == pid or (watch is not None and watch.attached(local, pid))
                self.ranks.observe(local, pid, alive=alive)
                deadline, hang, plain, judged = self._account(
                    snap, learned, local, pid, started, now
                )
                if deadline <= now:
                    if self.progress_watch is None:
                        self._detect(hang, pid, snap.pid == pid)
                        continue
                    self._judge(hang, pids, started, explicit=not judged)
                    reread = True  # what is handled, held or deferred changed
                    break
                # a deadline that starts after this read ends no sooner than this
                soonest = min(soonest, deadline, now + shortest_timeout(snap))
                if snap.learn or plain:  # a learned bound may become ready before then
                    soonest = min(soonest, now + self.cfg.learned_timeout_floor)
            soonest = min(soonest, self._endings.advance(time.monotonic(), self._current))
            if reread:
                # ``soonest`` holds only the rows read before the judged one: sleeping
                # on it slept through the others' deadlines (a rank whose bound passed
                # first, deferred for its culprit still within its own bound, left that
                # culprit's hang seen a whole check interval late)
                continue
            self._sleep(soonest - time.monotonic() + 0.0005)

    def _where(self, local: int, pid: int) -> str:
        """Where a worker is: its stack, where its progress thread answers."""
        if self.progress_watch is None:
            raise LookupError("no progress hooks to ask")
        look = self.progress_watch.judge.look({local: pid}, window=0).looks[0]
        return look.stack or look.place

    def _moving(self, local: int, pid: int) -> bool:
        """Whether a worker moves, through one look's window (its marks, CPU, I/O,
        stack, children)."""
        return bool(self.moving({local: pid}))

    def _hold(self, local: int, now: float) -> float | None:
        """Until when ``local`` waits for the culprit it waited for to be gone (inf while
        the culprit runs: its exit wakes the watcher); None: judged on its own. A rank
        the culprit's end does not take down within HELD_GRACE is judged on its own."""
        rank = self.ranks.get(local)
        if rank is None or rank.held is None:
            return None
        culprit, until = rank.held
        if math.isinf(until) and not running(culprit):
            until = now + HELD_GRACE
            self.ranks.set(local, rank.pid, held=(culprit, until))
        if now < until:
            return until
        self.ranks.set(local, rank.pid, held=None)
        return None

    def _account(
        self,
        snap: RowSnapshot,
        learned: set[str],
        local: int,
        pid: int,
        started: float,
        now: float,
    ) -> tuple[float, Hang, bool, bool]:
        """A rank's nearest deadline and the hang it would be at ``now``; whether its
        progress hooks are in with no client attached (``plain``), and whether its
        silence is then judged from the script's own progress rather than by a timeout
        of the script's client (``judged``)."""
        deadline, what, since, timeout = next_deadline(
            snap, started, self.cfg.num_warmup_iterations
        )
        watch = self.progress_watch
        plain = watch is not None and snap.pid != pid and watch.attached(local, pid)
        if plain:
            assert watch is not None
            progress = watch.deadline(local, started)
            # a first heartbeat the config asks for (a script that attaches a client
            # later) still holds, where it is the sooner
            asked = self.cfg.initial_rank_heartbeat_timeout != _INITIAL_DEFAULT
            if not (asked and (deadline, what, since, timeout) < progress):
                deadline, what, since, timeout = progress
                return deadline, Hang(local, what, now - since, timeout, since, True), True, True
        hang = Hang(local, what, now - since, timeout, since, what in learned)
        return deadline, hang, plain, False

    def _judge(self, hang: Hang, pids: Mapping[int, int], started: float, explicit: bool) -> None:
        """A bound passed: look at every rank before acting, and act on the culprit."""
        watch = self.progress_watch
        assert watch is not None
        if not running(pids[hang.local_rank]):  # it exited (the agent will see it)
            self.ranks.to(hang.local_rank, pids[hang.local_rank], RankState.ENDED)
            return
        since = hang.since
        decision = watch.decide(dict(pids), hang.local_rank, hang.what, since, explicit)
        if decision is None:
            return
        local = decision.local if decision.local is not None else min(pids)
        if local != hang.local_rank:  # the culprit's own account of its silence
            snap, learned = effective(self.table.snapshot(local), self.cfg)
            now = time.monotonic()
            _, own, _, _ = self._account(snap, learned, local, pids[local], started, now)
            left = own.timeout - own.elapsed
            if (
                decision.cause != "progress_cap"
                and math.isfinite(left)
                and left > 0
                and hang.elapsed < self.cfg.progress_cap
            ):
                # the rank past its bound waits (in a collective) for one that is within
                # its own: it started its section late (rank 0 writing a checkpoint
                # while the others waited in the next step). Not a hang yet: judged
                # again once the culprit's own bound passes, if the wait lasts that long
                logger.info(
                    "local rank %d past its bound (%s, %.2fs) waits for local rank %d, "
                    "within its own (%.2fs left): judged again then",
                    hang.local_rank,
                    hang.what,
                    hang.elapsed,
                    local,
                    left,
                )
                self.ranks.set(hang.local_rank, pids[hang.local_rank], deferred=now + left)
                return
            hang = own
        else:  # the look took its window: the silence as it stands now, not before it
            hang = replace(hang, elapsed=time.monotonic() - since)
        if decision.cause == "progress_cap":
            hang = replace(hang, what="progress_cap", timeout=self.cfg.progress_cap, learned=False)
        rank = self.ranks.get(local)
        if (
            rank is not None
            and rank.watched
            and (self.ranks.others_finished(local) or self.job_over())
        ):
            # every other rank's training is over (or another node's): the job's last
            # collective is behind this one, and a restart would train a finished job
            self.teardown.tear_down(rank, hang.elapsed, ", after the others finished")
            return
        record(decision, self.global_rank)
        for other in pids:  # one fault: the others wait for the culprit, and go with it
            if other != local:
                self.ranks.set(other, pids[other], held=(pids[local], math.inf))
        snap = self.table.snapshot(local)
        self._detect(hang, pids[local], snap.pid == pids[local])

    def _sleep(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a control message, a rank's wake-up, or a worker's
        exit (recorded), whichever comes first."""
        assert self._poll is not None
        # poll() takes milliseconds as a C int; an hour is as good as any longer sleep
        ready = self._poll.poll(max(0, math.ceil(min(seconds, 3600.0) * 1000)))
        when = time.monotonic()
        for fd, _ in ready:
            if fd in (self._ctl_r, self._wake_fd):
                with contextlib.suppress(OSError):
                    while os.read(fd, 512):
                        pass
        self._exits.take(self._poll, (fd for fd, _ in ready), when)

    def _detect(self, hang: Hang, pid: int, dumps_stacks: bool) -> None:
        """A hang: the event, then the rank's way out (:class:`~.ending.Endings`), which
        does not hold up the other ranks' checks meanwhile."""
        with self._lock:
            if self._pids.get(hang.local_rank) != pid:
                return  # that generation is gone already
        if not running(pid):  # it exited (the agent will see it): not a hang to act on
            self.ranks.to(hang.local_rank, pid, RankState.ENDED)
            return
        if (
            self.ranks.to(hang.local_rank, pid, RankState.HUNG, hang=(hang.what, _wall(hang.since)))
            is None
        ):
            return
        rank = self.global_rank(hang.local_rank)
        logger.error(
            "rank %d (local %d, pid %d) hung: %s for %.2fs (timeout %.2fs%s); terminating it",
            rank,
            hang.local_rank,
            pid,
            hang.what,
            hang.elapsed,
            hang.timeout,
            ", learned" if hang.learned else "",
        )
        events.emit(
            "rank_hung",
            cause=hang.what,
            rank=rank,
            local_rank=hang.local_rank,
            section=hang.what.removeprefix("section:"),
            elapsed=round(hang.elapsed, 4),
            fault_time=round(_wall(hang.since), 6),
            timeout=hang.timeout,
            learned=hang.learned,
            worker_pid=pid,
        )
        self.hangs.append(hang)
        now = time.monotonic()
        self._endings.begin(hang, pid, rank, dumps_stacks, now)
        self._endings.advance(now, self._current)

    def _current(self, local: int, pid: int) -> bool:
        with self._lock:
            return not self._stop and self._pids.get(local) == pid
