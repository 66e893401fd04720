"""The fault-tolerant elastic agent: torch's LocalElasticAgent plus hang detection.

It owns the node's heartbeat table and watcher: before each start of the worker group
the rows are reset to the configured timeouts and the watcher follows the new pids; a
hung rank is terminated, which torch's agent sees as a failed worker and answers by
restarting the whole group (every node, through the rendezvous) while restarts remain.
On top of torch's behaviour:

- workers are stopped with SIGTERM, then SIGKILL after ``workers_stop_timeout``, to the
  whole process group of each worker (torch starts each in its own session);
- every failure and restart is an event (``rank_failed`` for the rank that failed
  first, ``rank_stopped`` for the ranks that went down after it, ``restart``); with
  more than one node, the first is agreed job-wide (``fault_culprit``, see
  :mod:`.nodes.culprit`), so every node's log names the same one;
- the progress guard (:mod:`.budget`): when ``max_no_progress_restarts`` consecutive
  generations, the job's earlier incarnations' included, ended without a step, the
  agent stops with :class:`NoProgressError` instead of restarting again;
- the re-run state machine's exit codes are not restarted on this hardware: a worker that
  exits 16 (resume on other hardware) or 17 (failed on result validation) stops the agent
  with :class:`RerunExit`;
- nodes (jobs of more than one node): the :class:`~.nodes.NodeRoster` watches the
  round's nodes; a lost node stops this node's workers at once (a collective with a dead
  peer may hang instead of failing), is expired from torch's rendezvous so a spare takes
  its place without waiting out its keep-alive, and bounds the next join by
  ``node_lost_timeout`` (then :class:`NodeLostError`); a node that fails its health check
  before a rendezvous leaves the job (:class:`NodeUnhealthyError`) without closing the
  rendezvous for the others;
- silent data corruption: the replicas' verdict (:mod:`.replicas`, steadfast.sdc) stops
  the workers, then rolls the job back to the checkpoint proven clean or ends it (80).

This module is the agent's loop (torch's life cycle hooks); beside it: the errors that
end a run (``errors.py``), the rendezvous handler it wraps (``rendezvous.py``), and the
reading and recording of a generation's failures (``failures.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)

from .. import events, seam
from ..checkpoint.memory import MEMORY_DIR_ENV, MemoryDir
from ..config import ConfigError, FaultToleranceConfig
from ..monitor import FT_CONFIG_ENV, HB_TABLE_ENV, HeartbeatTable, Watcher
from ..monitor.learned import LEARNED_FILE, Learned, learn_bits
from ..progress.layout import PH_COMPILE
from ..progress.probe import PROGRESS_ENV
from ..rendezvous.signed import bind_roster
from .blame import nodes_named, record_failures, record_loss
from .budget import ProgressGuard, carried_no_progress
from .compile_cache import CACHE_ENV, SHARED_NAME, CompileCache
from .errors import (
    JobEndHangError,
    NodeLostError,
    NodeUnhealthyError,
    NoProgressError,
    RerunExit,
    SilentCorruptionError,
)
from .failures import (
    describe,
    emit_agreed,
    first_failures,
    rerun_exit_code,
    stopped_failures,
)
from .generations import Generations
from .job_end import after_the_end, exit_barrier, hung_in_teardown
from .nodes import GpuCheck, Loss, NodeRoster, health_check
from .nodes.round import RoundKeys
from .rdzv_client import Rendezvous
from .replicas import LEAVE, STOP, ReplicaWatch
from .template import Template, take_prestarted

__all__ = [
    "FTAgent",
    "JobEndHangError",
    "NoProgressError",
    "NodeLostError",
    "NodeUnhealthyError",
    "RerunExit",
    "SilentCorruptionError",
    "first_failures",
    "rerun_exit_code",
]

logger = logging.getLogger(__name__)


def _local_gpus(local_world_size: int) -> int:
    """GPUs this node's workers use (0 on a CPU node): what the health check tests."""
    import torch

    try:
        return min(int(torch.cuda.device_count()), local_world_size)
    except Exception:
        return 0


class FTAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with the heartbeat table, watcher and restart policy."""

    def __init__(
        self,
        *args: Any,
        ft: FaultToleranceConfig,
        term_timeout: float | None = None,
        nnodes: int = 1,
        local_addr: str | None = None,
        rdzv_endpoint: str = "",
        **kwargs: Any,
    ) -> None:
        # torch's agent stops the workers with this on a signal it got (NVRx's
        # term_timeout); a stop for a restart uses workers_stop_timeout (_stop_workers)
        term = ft.workers_stop_timeout if term_timeout is None else term_timeout
        for key, value in seam.agent_grace(max(1, math.ceil(term))).items():
            kwargs.setdefault(key, value)
        super().__init__(*args, **kwargs)
        self.ft = ft
        spec = self.get_worker_group().spec
        self.rendezvous = Rendezvous(spec.rdzv_handler, retry_window=ft.node_lost_timeout)
        spec.rdzv_handler = self.rendezvous
        #: rounds of the rendezvous this node took part in
        self.rounds = 0
        self.roster = (
            NodeRoster(ft, host=local_addr, name=socket.gethostname()) if nnodes > 1 else None
        )
        self.lost: list[Loss] = []  # the nodes lost before the coming rendezvous
        self._gpus = GpuCheck(_local_gpus(spec.local_world_size))
        self._rdzv_host = rdzv_endpoint.rpartition(":")[0].strip("[]") or None
        self.table = HeartbeatTable.create(rows=spec.local_world_size)
        # the workers inherit these from the launcher's environment
        os.environ[HB_TABLE_ENV] = str(self.table.path)
        os.environ[FT_CONFIG_ENV] = json.dumps(ft.to_dict())
        # the memory tier's snapshots (CheckpointManager(memory_every=...)) live as long
        # as this launcher: they survive its workers' restarts, never the job
        self.memory_dir = MemoryDir()
        os.environ[MEMORY_DIR_ENV] = str(self.memory_dir.path)
        if ft.watch_progress:  # every worker's progress hooks (steadfast.progress)
            os.environ[PROGRESS_ENV] = "1"
        run_dir = _run_dir()
        self.compile_cache = CompileCache(
            str(spec.rdzv_handler.get_run_id()), run_dir / SHARED_NAME if run_dir else None
        )
        os.environ.update(self.compile_cache.env())  # the workers' torch.compile cache
        self.watcher = Watcher(
            self.table,
            ft,
            global_rank=self._global_rank,
            whole_job=nnodes == 1,
            job_over=self._another_node_finished,
        )
        if self.watcher.progress_watch is not None:  # shared once the first step compiled
            self.watcher.progress_watch.reporter.on_first_step = self._first_step
        self.watcher.start()
        self.replicas = ReplicaWatch(ft, self.table)  # DDP replicas compared (steadfast.sdc)
        # learned hang timeouts, kept beside the event log across job restarts
        self.learned = Learned(
            _learned_path() if ft.learn_timeouts else None, str(spec.rdzv_handler.get_run_id())
        )
        self._hangs_seen = 0
        self.restarts = 0
        restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        carried = carried_no_progress(os.environ.get("SLURM_JOB_ID"), restart_count)
        self.progress_guard = ProgressGuard(ft.max_no_progress_restarts, carried)
        self.generations = Generations()  # workers_started / workers_exited, once each
        self.template: Template | None = None
        if ft.worker_template:  # importing torch, in parallel with the rendezvous
            self.template = take_prestarted() or Template()

    def close(self) -> None:
        """Stop the watcher and the node roster, and remove the heartbeat table and the
        memory tier's snapshots: every step, whatever an earlier one raised (then raised
        at the end; a roster that failed to close once left the node's /dev/shm behind)."""
        own_cache = [] if self.compile_cache.users else [CACHE_ENV]  # a user's is kept
        with contextlib.ExitStack() as steps:  # run last to first
            for name in (HB_TABLE_ENV, FT_CONFIG_ENV, MEMORY_DIR_ENV, PROGRESS_ENV, *own_cache):
                steps.callback(os.environ.pop, name, None)
            closers = [self.memory_dir.remove, self.table.close, self.replicas.close]
            closers += [part.close for part in (self.template, self.roster) if part is not None]
            for close in [*closers, self.compile_cache.close, self._gpus.close, self.watcher.stop]:
                steps.callback(close)

    def _another_node_finished(self) -> bool:
        """Whether another node of the round finished its workers: the job's last
        collective is then behind every rank (a hang here is teardown, not a fault)."""
        return self.roster is not None and self.roster.job_ended_at() is not None

    def _global_rank(self, local_rank: int) -> int:
        for worker in self.get_worker_group().workers:
            if worker.local_rank == local_rank:
                return int(worker.global_rank)
        return local_rank

    def run(self, role: str = "default") -> RunResult:
        """torch's ``run``; a spare that never ran (the job ended while it waited: torch
        returns nothing) succeeded with the job."""
        try:
            try:
                result: RunResult | None = super().run(role)
            finally:
                self._generation_stopped()
        except (NodeLostError, NodeUnhealthyError, JobEndHangError):
            raise  # cut off or lost (nothing to tell), or it said so already (a goodbye)
        except SignalException:
            # stopped by a signal: a preemption or an operator's requeue, which reach
            # every node (and the ranks agree to stop together): the job stops, no node
            # is lost
            if self.roster is not None:
                self.roster.finish()
            raise
        except BaseException as exc:  # exit 16/17, no progress, an error of its own
            self._leave(f"its launcher stopped ({type(exc).__name__}: {exc})")
            raise
        if result is None:
            return RunResult(state=WorkerState.SUCCEEDED)
        if result.state != WorkerState.SUCCEEDED:
            self._leave(f"its workers {result.state.name}, no restarts left")
        return result

    def _generation_stopped(self) -> None:
        """``workers_exited`` for a generation that torch stopped itself (its
        ``_shutdown`` on a signal or an error, not ``_stop_workers``): otherwise the log
        never ends it and the report counts it running until the launcher's end, past
        the generations after it."""
        group = self.generations.group()
        if group is not None:
            self._workers_exited(group, "stopped", stopped_failures(group))

    def _exit_barrier(self) -> None:
        """The workers of this node finished: wait for the round's other nodes to finish
        theirs (see :func:`.job_end.exit_barrier`), up to ``job_end_timeout`` (or
        torch's ``exit_barrier_timeout``, where shorter). One node: nothing to wait for."""
        if self.roster is not None:
            timeout = min(seam.agent_exit_barrier_timeout(self), self.ft.job_end_timeout)
            exit_barrier(self.roster, timeout, int(self.get_worker_group().group_world_size or 1))

    def _job_end_hang(self, worker_group: WorkerGroup, overrun: float) -> None:
        """Another node of the round finished its workers ``overrun`` seconds ago, past
        ``job_end_timeout``, and this node's still run (:func:`.job_end.after_the_end`:
        torn down, waited for, or a hang at the job's end). For a hang: the workers are
        stopped, this node says goodbye (it is not a lost node) and the launcher ends
        (79): a restart would find no round."""
        exited = self.watcher.exit_times()
        running = [w for w in worker_group.workers if int(w.local_rank) not in exited]
        ranks = after_the_end(self.watcher, running, self.generations.pids(), overrun, self.ft)
        if ranks is None:
            return
        self._stop_workers(worker_group)  # unwatches them first
        if self.roster is not None:
            self.roster.finish()
        raise JobEndHangError(
            f"rank(s) {ranks} still ran {overrun:.1f} s after another node finished "
            f"(job_end_timeout={self.ft.job_end_timeout:g} s): stopped as hung at the job's end",
            ranks,
        )

    def _leave(self, reason: str) -> None:
        """This node's launcher stops on a fault of its own: record it for the nodes
        that watch it, which report it (``node_lost``, cause ``left``, with the reason)
        instead of a silent loss, and go on without it."""
        if self.roster is not None and not self.rendezvous.leaving:
            self.roster.leave_round(reason=reason, cause="left")

    # ------------------------------------------------------------------ life cycle hooks
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        handler = self.rendezvous.wrapped
        with self.generations.health_check():
            problem = health_check(self.ft, self._gpus, self._rdzv_host, self.generations.last_pids)
        if problem is not None:
            self._leave_unhealthy(*problem)
        if self.roster is not None:
            self.roster.leave_round()
        lost, self.lost = self.lost, []
        if not lost:
            with self.generations.rendezvous():
                super()._rendezvous(worker_group)
        else:
            names = nodes_named(loss.peer.host for loss in lost)
            hosts = sorted({loss.peer.host for loss in lost})
            try:
                with (
                    self.rendezvous.join_timeout(self.ft.node_lost_timeout),
                    self.generations.rendezvous(),
                ):
                    super()._rendezvous(worker_group)
            except RendezvousTimeoutError as exc:
                raise NodeLostError(
                    f"lost {names}, and no round formed again within "
                    f"node_lost_timeout={self.ft.node_lost_timeout:g} s: no spare came, and "
                    "the nodes left are fewer than --nnodes' minimum",
                    hosts,
                ) from exc
            except RendezvousClosedError as exc:
                raise NodeLostError(f"lost {names}, and another node ended the job", hosts) from exc
        self.rounds += 1
        if self.roster is not None:
            store = bind_roster(
                worker_group.store, handler.get_run_id(), seam.rendezvous_round(handler)
            )
            # static hands out one store for every round: the round's number, the same on
            # every node (they all restart together), keeps rounds apart
            generation = self.rounds if handler.get_backend() == "static" else None
            node, nodes = int(worker_group.group_rank or 0), int(worker_group.group_world_size or 1)
            self.roster.enter_round(
                store, node, nodes, handler.get_run_id(), self.rendezvous.node_id(), generation
            )
            self.replicas.bind(
                store, RoundKeys(handler.get_run_id(), generation).prefix, node, nodes
            )

    def _leave_unhealthy(self, check: str, reason: str) -> None:
        """This node leaves the job: the event, its place in the rendezvous given up
        (so that the others do not wait for it), the rendezvous left open for them."""
        events.emit("node_unhealthy", cause=check, reason=reason)
        if self.roster is not None:
            self.roster.leave_round(reason=f"unhealthy ({check}): {reason}")
        me = self.rendezvous.node_id()
        if me is not None:
            try:
                self.rendezvous.expire([me])
            except Exception as exc:  # the others then wait for its keep-alive to expire
                logger.warning("could not leave the rendezvous at once: %s", exc)
        self.rendezvous.leaving = True
        raise NodeUnhealthyError(check, reason)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        ft = self.ft
        if self.roster is not None:
            os.environ.update(self.roster.env())
        for row in range(self.table.rows):
            self.table.reset(
                row,
                ft.rank_section_timeouts,
                ft.initial_rank_heartbeat_timeout,
                ft.rank_heartbeat_timeout,
                ft.rank_out_of_section_timeout,
                learn=learn_bits(ft),
                learned=self.learned.kinds,
            )
        from .start import template_start_processes

        self.compile_cache.seed()  # a spare's, a requeued job's: warm from the run's
        self.generations.spawning()
        # for this call, torch's agent starts script workers from the template (or as
        # plain processes with the progress hooks' boot)
        starter = template_start_processes(self.template, self.watcher.exit_code)
        with seam.start_processes_from(starter):
            ids = super()._start_workers(worker_group)
        pcontext = seam.agent_pcontext(self)
        pids = {
            int(k): int(v) for k, v in (pcontext.pids() if pcontext is not None else {}).items()
        }
        if pcontext is not None:
            self.watcher.watch(pids)
        self._workers_started(worker_group, pids)
        return ids  # type: ignore[no-any-return]

    def _workers_started(self, worker_group: WorkerGroup, pids: Mapping[int, int]) -> None:
        restarts = worker_group.spec.max_restarts - seam.agent_remaining_restarts(self)
        self.generations.started(worker_group, pids, self.rounds, max(0, restarts))
        self.replicas.started({int(w.local_rank): int(w.global_rank) for w in worker_group.workers})

    def _workers_exited(
        self, worker_group: WorkerGroup, cause: str, failures: Mapping[int, Any] | None = None
    ) -> None:
        """``workers_exited`` of the running generation (once; the exit times are the
        watcher's, ms resolution), after what its ranks learned is kept."""
        if self.generations.running:
            self._preload_compiler()
            self._keep_learned()
            self.compile_cache.publish_soon()
            self.generations.exited(cause, self.rounds, self.watcher.exit_times(), failures)

    def _first_step(self) -> None:
        """The lowest rank's first iteration ended: its compiled graphs are worth sharing,
        and a job that compiles gets Inductor's compiler preloaded for its restarts."""
        self.compile_cache.publish_soon()
        self._preload_compiler()

    def _preload_compiler(self) -> None:
        """Once a worker of this node spent time in torch.compile, the template imports
        Inductor's compiler for the workers it forks next (never for a job that does not
        compile: seconds of a core beside its training, ~0.3 s more at each exit)."""
        compiled = any(
            self.table.progress_area(r)[0][PH_COMPILE] > 0 for r in range(self.table.rows)
        )
        if compiled and self.template is not None:
            self.template.preload(seam.COMPILER)

    def _keep_learned(self) -> None:
        """A generation ended: take in what its ranks learned (and, for a hang caught by
        a learned timeout, at least how long the interval ran: a long operation never
        seen before is taken for a hang once, not at every restart), and keep it."""
        if not self.ft.learn_timeouts:
            return
        for row in range(self.table.rows):
            self.learned.merge(self.table.snapshot(row))
        hangs, self._hangs_seen = self.watcher.hangs[self._hangs_seen :], len(self.watcher.hangs)
        for hang in hangs:
            if hang.learned:
                self.learned.overran(hang.what, hang.elapsed)
        try:
            self.learned.save()
        except (OSError, ConfigError) as exc:  # learning goes on in memory
            logger.warning("could not keep the learned timeouts: %s", exc)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        running = self.generations.running
        self.watcher.unwatch()
        self.replicas.stopped()
        timeout = max(1, math.ceil(self.ft.workers_stop_timeout))
        seam.agent_shutdown(self, signal.SIGTERM, timeout)
        if running:  # stopped while running: a node joining, a signal, the launcher's end
            self._workers_exited(worker_group, "stopped", stopped_failures(worker_group))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._look(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            try:  # a generation with no step (or second heartbeat), once ranks report
                self.progress_guard.generation_failed(
                    self.watcher.attached(), self.watcher.progress()
                )
            except NoProgressError:  # the last generation, its restarts spent or not
                self._stop_workers(worker_group)
                raise
        return result

    def _look(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        corrupted = self.replicas.verdict(result.state != WorkerState.HEALTHY)
        if corrupted is not None:  # before one more check's state is saved
            return self._corrupted(worker_group, corrupted)
        if result.state == WorkerState.HEALTHY and self.roster is not None:
            ended = self.roster.job_ended_at()
            overrun = time.monotonic() - ended if ended is not None else 0.0
            if overrun > self.ft.job_end_timeout:
                self._job_end_hang(worker_group, overrun)
            lost, isolated = self.roster.losses(), self.roster.isolated()
            if lost or isolated:  # a collective with a dead peer may hang: stop them now
                self._stop_workers(worker_group)  # unwatches them first
                record_loss(self.roster, lost, isolated, _worker_stops(worker_group), self.rounds)
                return RunResult(state=WorkerState.FAILED, failures=stopped_failures(worker_group))
        if result.state == WorkerState.SUCCEEDED and self.roster is not None:
            self.roster.finish()  # its launcher leaving now is not a lost node
        after_end = None
        if failed and self.roster is not None:
            after_end = hung_in_teardown(
                self.watcher.hung(), self.roster.job_ended_at(), self._global_rank
            )
        if failed:
            self._record_failures(result.failures)
        if result.state == WorkerState.SUCCEEDED:
            self._workers_exited(worker_group, "succeeded")
        elif failed:
            self._workers_exited(worker_group, "failed", result.failures)
        if result.state != WorkerState.HEALTHY:  # the group ended: no more hangs to watch
            self.watcher.unwatch()
            self.replicas.stopped()  # its last figures written
        if failed:
            # whether or not restarts remain: the same hardware would give the same answer
            rerun_code = rerun_exit_code({int(f.exitcode) for f in result.failures.values()})
            if rerun_code is not None:
                self._stop_workers(worker_group)
                raise RerunExit(rerun_code)
        if after_end is not None:  # the job's work is done: a restart would find no round
            ranks, overrun = after_end
            self._stop_workers(worker_group)
            if self.roster is not None:
                self.roster.finish()
            raise JobEndHangError(
                f"rank(s) {ranks} hung {overrun:.1f} s after another node finished its "
                "workers: stopped as hung at the job's end, not restarted",
                ranks,
            )
        return result

    def _corrupted(self, worker_group: WorkerGroup, verdict: Any) -> RunResult:
        """Replicas disagreed: the workers stopped, then a roll-back (a restart from the
        newest checkpoint proven clean, this node leaving where it holds the culprit) or
        the job's end (exit 80): :meth:`.replicas.ReplicaWatch.after`."""
        self._stop_workers(worker_group)
        self.replicas.told()  # the store may be this launcher's: the others read it
        what, why = self.replicas.after(verdict, seam.agent_remaining_restarts(self))
        logger.error("%s: %s", verdict.describe(), why)
        if what == STOP:
            raise SilentCorruptionError(verdict, why)
        if what == LEAVE:
            self._leave_unhealthy("silent_corruption", f"{verdict.describe()}: {why}")
        return RunResult(state=WorkerState.FAILED, failures=stopped_failures(worker_group))

    def _record_failures(self, failures: Mapping[int, Any]) -> None:
        """The failed group's events, its culprit agreed job-wide (:mod:`.blame`)."""
        record_failures(
            failures,
            roster=self.roster,
            watcher=self.watcher,
            node_rank=int(self.get_worker_group().group_rank or 0),
            rounds=self.rounds,
            global_rank=self._global_rank,
            grace=min(1.0, self.ft.node_heartbeat_timeout),
        )

    def _expire_lost(self) -> None:
        """Before the next rendezvous: the lost nodes are expired from torch's rendezvous
        (a spare takes their place now, not when their keep-alive runs out), and the
        join that follows is bounded by ``node_lost_timeout``."""
        if self.roster is None:
            return
        lost = self.roster.settle(self.roster.confirm_timeout + 1.0)
        if self.roster.isolated():  # cut off: nothing to expire, no round to wait for
            self.rendezvous.leaving = True
            raise NodeLostError(f"this node is cut off from the job: {self.roster.isolated()}")
        if not lost:
            return
        self.lost = lost
        ids = [loss.peer.rdzv for loss in lost if loss.peer.rdzv]
        try:
            self.rendezvous.expire(ids)
        except Exception as exc:  # the keep-alive expiry removes them in the end
            logger.warning("could not expire the lost nodes from the rendezvous: %s", exc)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.replicas.restarting()
        self.restarts += 1
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._expire_lost()
            cause, reason = "worker_failure", f"worker group {worker_group.state.name}"
        else:  # a membership change (a node joined): not a fault
            cause, reason = "membership_change", "nodes waiting to join"
            roster = self.roster
            if roster is not None and roster.fault_claimed():
                # a node whose workers failed rejoined first: its fault's consequence
                verdict = roster.agree_culprit(None)
                if verdict is not None:
                    emit_agreed(_worker_stops(worker_group), verdict, roster.name, self.rounds)
                    reason = f"a node rejoined after {describe(verdict.culprit)}"
        events.emit(
            "restart",
            cause=cause,
            restart_count=self.restarts,
            reason=reason,
            remaining_restarts=seam.agent_remaining_restarts(self),
        )
        super()._restart_workers(worker_group)


def _worker_stops(worker_group: WorkerGroup) -> dict[int, dict[str, Any]]:
    """The group's workers as stops (global rank -> their fields) for a fault's events,
    where the launcher stopped them itself (no exit code of their own)."""
    return {int(w.global_rank): {"local_rank": int(w.local_rank)} for w in worker_group.workers}


def _run_dir() -> Path | None:
    """The run directory: the event log's folder (none without a log)."""
    log = os.environ.get(events.EVENTS_ENV)
    if not log or log == events.EVENTS_OFF:
        return None
    return Path(log).parent


def _learned_path() -> Path | None:
    """Where the learned timeouts are kept: in the run directory."""
    run_dir = _run_dir()
    return run_dir / LEARNED_FILE if run_dir else None
