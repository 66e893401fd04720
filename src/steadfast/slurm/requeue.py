"""Requeueing a Slurm job through ``scontrol``: job retries and node exclusion.

:func:`requeue_job` asks Slurm to requeue the job (the launcher's job retries, the
batch script after a preemption) and records a ``job_requeued`` event;
:func:`failure_requeues` reads those events back to count the retries spent, and
:func:`doubted_hosts` the hosts the re-run state machine wants re-checked elsewhere;
:func:`exclusion_plan` keeps the requeued job away from lost or doubted nodes. Facts
from real Slurm that shape this module (checked in ``tests/slurm/``, on one node and
on a cluster of network-namespace nodes):

- ``SLURM_RESTART_COUNT`` counts every requeue: preemptions and an operator's
  ``scontrol requeue`` as well as failures. Job retries count only the failures, from
  the ``job_requeued`` events of the run's event log (:func:`failure_requeues`).
- ``scontrol update ExcNodeList`` is refused while a job runs ("no longer pending"), so
  a requeue sets it after ``scontrol requeue``, and Slurm SIGTERMs every process of the
  requeued job, an ``scontrol`` child included: that one runs with the signals ignored
  (:func:`_run_shielded`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import events

__all__ = [
    "FAILURE_REQUEUE_CAUSES",
    "ExclusionPlan",
    "doubted_hosts",
    "exclusion_plan",
    "failure_requeues",
    "requeue_job",
]

#: ``job_requeued`` causes that spend a job retry (``num_job_retries_on_failure``); a
#: preemption or an operator's requeue does not.
FAILURE_REQUEUE_CAUSES = ("restarts_exhausted", "restart_elsewhere", "node_lost")

logger = logging.getLogger(__name__)


def requeue_job(
    job_id: str | None = None,
    timeout: float = 60.0,
    cause: str = "restarts_exhausted",
    exclude: Sequence[str] = (),
    kept_out: Sequence[str] = (),
) -> bool:
    """Ask Slurm to requeue the job (``scontrol requeue <job_id>``, default this job).

    Used for a job retry after the in-job restarts are spent (``cause``
    ``restarts_exhausted``, ``restart_elsewhere`` or ``node_lost``) and by the batch script after a
    preemption (``preempted``); ``cause`` goes into the ``job_requeued`` event, which
    :func:`failure_requeues` reads back. True if scontrol accepted it; the reason is
    logged when it did not (no scontrol, a job that is not requeueable...).

    ``exclude`` names hosts the requeued job must not run on again: a lost node, or the
    node whose result the re-run state machine must re-check on other hardware (exit
    16), which Slurm would otherwise be free to hand back, and which would then fail the
    same way. They are added to the job's ``ExcNodeList`` once it is pending again
    (Slurm refuses the change while it runs), as the job's own Slurm node names
    (:func:`exclusion_plan`); the event's ``excluded`` lists them. ``kept_out``: the
    nodes the node ledger keeps out of jobs; those of this job are excluded too (the
    others are out of its allocation already, or were never in it)."""
    job = job_id or os.environ.get("SLURM_JOB_ID")
    if not job:
        logger.error("cannot requeue: not a Slurm job (SLURM_JOB_ID is not set)")
        return False
    plan = exclusion_plan(job, exclude, timeout, kept_out) if exclude or kept_out else None
    # Slurm SIGTERMs every process of the job as soon as it accepts the requeue: hold
    # the signals until the event is written, or the retry would go uncounted (and a
    # failing job could be requeued for ever). They are delivered on the way out.
    with _signals_held():
        # shielded too: Slurm SIGTERMs every process of the job, this scontrol included,
        # as soon as it accepts the requeue, often before scontrol exits (seen in CI:
        # "scontrol requeue 5 failed (exit -15)", though the job was requeued, so no
        # exclusion was made and the job came back on the node it had to leave)
        if _scontrol(["requeue", job], timeout, shielded=True) is None:  # reason logged
            return False
        excluded = _exclude(job, plan, timeout) if plan is not None else []
        events.emit("job_requeued", cause=cause, slurm_job=job, excluded=excluded)
        logger.warning(
            "requeued Slurm job %s (%s)%s",
            job,
            cause,
            f", away from {','.join(excluded)}" if excluded else "",
        )
        return True


#: what Slurm sends the processes of a job it requeues (and what may come with it)
_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                 signal.SIGUSR2)  # fmt: skip


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Record :data:`_HELD_SIGNALS` instead of acting on them, and pass them to the
    handlers they had on the way out.

    Blocking them in this thread is not enough: the kernel hands a process's signal to
    any thread that does not block it (a launcher has several), and Python then runs the
    handler in the main thread all the same. Only the main thread can swap handlers;
    elsewhere the signals are left as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, _frame: Any) -> None:
        pending.append(signum)

    before = {sig: signal.signal(sig, hold) for sig in _HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(pending):  # once each, in the order they came
            signal.raise_signal(signum)


#: runs a command with the signals of a requeue ignored (an ignored signal stays ignored
#: across exec): Slurm signals every process of the requeued job, this one included
_SHIELD = ["sh", "-c", "trap '' TERM INT HUP QUIT USR1 USR2; exec \"$@\"", "sh"]


def _run_shielded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` under :data:`_SHIELD`, born with :data:`_HELD_SIGNALS` blocked.

    The trap alone leaves a window: a SIGTERM that lands between the fork and the
    shell's ``trap`` kills the child (seen in CI: ``scontrol update ... failed (exit
    -15)``, and the requeued job came back on the node it had to leave). A signal mask is
    inherited across fork and exec, so the child is spawned with them blocked; once the
    shell ignores them, the pending ones are dropped. This thread's mask is restored as
    soon as the child exists, so the launcher still gets its signals."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        proc = subprocess.Popen(
            [*_SHIELD, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _scontrol(args: list[str], timeout: float, shielded: bool = False) -> str | None:
    """``scontrol ARGS``' output, or None (the reason logged) when it failed;
    ``shielded``: safe from the signals Slurm sends the job it requeues."""
    cmd = ["scontrol", *args]
    try:
        if shielded:
            proc = _run_shielded(cmd, timeout)
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.error("scontrol %s failed: %s", " ".join(args), exc)
        return None
    if proc.returncode != 0:
        logger.error(
            "scontrol %s failed (exit %d): %s", " ".join(args), proc.returncode, proc.stderr.strip()
        )
        return None
    return proc.stdout


def _hostnames(hostlist: str, timeout: float) -> list[str]:
    """Slurm's compressed host list (``node[2-4],gpu7``) as names."""
    if not hostlist or hostlist == "(null)":
        return []
    out = _scontrol(["show", "hostnames", hostlist], timeout)
    return out.split() if out is not None else []


@dataclass
class ExclusionPlan:
    """The ``ExcNodeList`` a requeued job gets (see :func:`exclusion_plan`)."""

    added: list[str]
    nodes: list[str]  # every node excluded from then on: the job's earlier ones too


def exclusion_plan(
    job: str, hosts: Sequence[str], timeout: float = 60.0, kept_out: Sequence[str] = ()
) -> ExclusionPlan | None:
    """What to add to job ``job``'s ``ExcNodeList`` to keep it away from ``hosts``.

    A host is matched to the job's Slurm node names (its allocation,
    ``$SLURM_JOB_NODELIST``, else ``scontrol show job``) by name or short name; one that
    is not a node of the job is left out with a warning (Slurm would refuse it). A plan
    that would leave the partition fewer nodes than the job needs excludes nothing more,
    with an error: a job that can never be placed again is worse than one that may meet
    the same node. Read before the requeue, while the job still holds its allocation.
    ``kept_out`` (the node ledger's) are matched alike, and left out without a word when
    they are not nodes of the job."""
    record = _scontrol(["show", "job", "-o", job], timeout)
    if record is None:
        return None
    fields = dict(re.findall(r"(\S+?)=(\S*)", record))
    ours = os.environ.get("SLURM_JOB_ID") == job
    allocation = os.environ.get("SLURM_JOB_NODELIST") if ours else None
    names = _hostnames(allocation or fields.get("NodeList", ""), timeout)
    before = _hostnames(fields.get("ExcNodeList", ""), timeout)
    added: list[str] = []
    for host in [*hosts, *kept_out]:
        name = next((n for n in names if n in (host, host.split(".")[0])), None)
        if name is None and host in hosts:
            logger.warning("cannot exclude %s: not a node of job %s (%s)", host, job, names)
        elif name is not None and name not in before and name not in added:
            added.append(name)
    if not added:
        return ExclusionPlan([], before)
    needed = _int_field(fields, "NumNodes")
    partition = _scontrol(["show", "partition", "-o", fields.get("Partition", "")], timeout)
    total = _int_field(dict(re.findall(r"(\S+?)=(\S*)", partition or "")), "TotalNodes")
    if needed is not None and total is not None and total - len(before) - len(added) < needed:
        logger.error(
            "not excluding %s from job %s: its partition would have %d node(s) left for a "
            "job of %d",
            ",".join(added),
            job,
            total - len(before) - len(added),
            needed,
        )
        return ExclusionPlan([], before)
    return ExclusionPlan(added, before + added)


def _int_field(fields: dict[str, str], name: str) -> int | None:
    match = re.match(r"^(\d+)", fields.get(name, ""))
    return int(match.group(1)) if match else None


def _exclude(job: str, plan: ExclusionPlan, timeout: float) -> list[str]:
    """Set the requeued (pending) job's ``ExcNodeList``; the nodes added, [] on failure."""
    if not plan.added:
        return []
    update = ["update", f"JobId={job}", f"ExcNodeList={','.join(plan.nodes)}"]
    done = _scontrol(update, timeout, shielded=True)  # the job's SIGTERM is under way
    return list(plan.added) if done is not None else []


def _logged_events(what: str) -> list[Any] | None:
    """The run's event log, as events ([] before its first event); None when there is no
    log (``STEADFAST_EVENTS=off``) or it cannot be read (a warning says ``what`` was
    not read from it)."""
    path = events.current_path()
    if path is None:
        return None
    if not os.path.exists(path):
        return []
    try:
        return list(events.read_events(path))
    except (OSError, events.EventLogError) as exc:
        logger.warning("cannot read %s from %s: %s", what, path, exc)
        return None


def doubted_hosts(job_id: str, restart_count: int = 0) -> list[str]:
    """The hosts whose results the re-run state machine must re-check on other hardware
    in this incarnation of job ``job_id`` (``SLURM_RESTART_COUNT`` ``restart_count``):
    the ``rerun_elsewhere`` events of the run's event log. Empty when the log cannot
    tell (``STEADFAST_EVENTS=off``)."""
    hosts: list[str] = []
    for ev in _logged_events("the doubted nodes") or []:
        if (
            ev.kind == events.Kind.RERUN_ELSEWHERE
            and ev.get("slurm_job_id") == job_id
            and (ev.get("slurm_restart") or 0) == restart_count
            and ev.get("host")
            and ev.get("host") not in hosts
        ):
            hosts.append(str(ev.get("host")))
    return hosts


def failure_requeues(job_id: str, restart_count: int = 0) -> int | None:
    """How many job retries job ``job_id`` has spent: its ``job_requeued`` events whose
    cause is a failure (:data:`FAILURE_REQUEUE_CAUSES`) in this process's event log.

    ``SLURM_RESTART_COUNT`` cannot tell: it also counts preemptions and an operator's
    requeues, which must not use up the retries of a job that never failed. None when
    the log cannot tell either: ``STEADFAST_EVENTS=off``, an unreadable log, or a job
    that was requeued (``restart_count`` > 0) whose log holds no event of an earlier
    incarnation (a log on a node-local disk, a new log per incarnation). The caller then
    falls back to ``SLURM_RESTART_COUNT``, which can only retry less, never more."""
    logged = _logged_events("the job's requeues")
    if logged is None:
        return None
    failures = 0
    earlier = False
    for ev in logged:
        incarnation = ev.get("slurm_restart") or 0
        if ev.get("slurm_job_id") == job_id and incarnation < restart_count:
            earlier = True
        if (
            ev.kind == events.Kind.JOB_REQUEUED
            and ev.get("slurm_job") == job_id
            and ev.cause in FAILURE_REQUEUE_CAUSES
        ):
            failures += 1
    if restart_count > 0 and not earlier:
        logger.warning(
            "the event log %s has no event of this job's earlier runs: job retries are "
            "counted from SLURM_RESTART_COUNT instead",
            events.current_path(),
        )
        return None
    return failures
