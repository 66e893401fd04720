"""Slurm job information, requeue detection, job retries and the sbatch script.

Parity with ``kempnerforge.resilience`` (seed 000): :class:`SLURMInfo`,
:func:`get_slurm_info`, :func:`is_slurm_job`, :func:`is_slurm_requeue`,
:func:`log_job_info`. On top of it: :func:`requeue_job` and :func:`failure_requeues`
(the launcher's job retries) and :func:`render_sbatch` (``steadfast slurm``: the batch
script that runs ``steadfast launch`` on every node). Facts from real Slurm that shape
this module (checked against a real single-node Slurm in ``tests/slurm/``):

- ``SLURM_RESTART_COUNT`` is *unset* until the first requeue, so unset means 0.
- ``SLURM_NTASKS_PER_NODE`` is only set when ``--ntasks-per-node`` was given; otherwise the
  per-node task count is in ``SLURM_TASKS_PER_NODE`` in Slurm's compressed form
  (``"4(x2),3"``), of which the first node's count is used.
- ``SLURM_JOB_NUM_NODES`` is the newer name of ``SLURM_NNODES``; both are read.
- ``--signal=B:SIG@T`` delivers ``SIG`` to the batch shell only (without ``B:``, to the
  srun steps only); a shell blocked in a foreground ``srun`` runs its trap only after
  srun returns, so the script runs srun in the background, ``wait``s, and forwards the
  signal to srun, which passes it to every task (the launchers).
- ``SLURM_RESTART_COUNT`` counts every requeue: preemptions and an operator's
  ``scontrol requeue`` as well as failures. Job retries count only the failures, from
  the ``job_requeued`` events of the run's event log (:func:`failure_requeues`).

Across nodes (checked on a cluster of network-namespace nodes in ``tests/slurm/``):

- ``scontrol update ExcNodeList`` is refused while a job runs ("no longer pending"), so
  a requeue sets it after ``scontrol requeue``, and Slurm SIGTERMs every process of the
  requeued job, an ``scontrol`` child included: that one runs with the signals ignored.
- A job without ``--no-kill`` is ended (``NODE_FAIL``) and requeued by Slurm once a node
  is DOWN (``SlurmdTimeout``). With ``--no-kill`` Slurm removes the node and the job goes
  on (what spares need), but a job that loses its *first* node, and with it the batch
  script, keeps running until its time limit: only jobs with spares are ``--no-kill``.

A variable that is set but malformed raises :class:`~steadfast.config.ConfigError`
naming it, instead of a bare ``int()`` traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, _signal, require_number

__all__ = [
    "FAILURE_REQUEUE_CAUSES",
    "SLURMInfo",
    "ExclusionPlan",
    "SbatchSpec",
    "doubted_hosts",
    "exclusion_plan",
    "failure_requeues",
    "get_slurm_info",
    "is_slurm_job",
    "is_slurm_requeue",
    "log_job_info",
    "parse_time_limit",
    "render_sbatch",
    "requeue_job",
]

#: ``job_requeued`` causes that spend a job retry (``num_job_retries_on_failure``); a
#: preemption or an operator's requeue does not.
FAILURE_REQUEUE_CAUSES = ("restarts_exhausted", "restart_elsewhere", "node_lost")

logger = logging.getLogger(__name__)


@dataclass
class SLURMInfo:
    """Information about the current SLURM job."""

    job_id: str
    job_name: str
    node_list: str
    num_nodes: int
    ntasks_per_node: int
    restart_count: int
    partition: str
    array_task_id: str | None

    @property
    def is_requeued(self) -> bool:
        """Whether this job has been requeued (restart_count > 0)."""
        return self.restart_count > 0


def _int_var(names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        text = raw.strip()
        if name == "SLURM_TASKS_PER_NODE":  # compressed form: "4(x2),3" -> 4
            match = re.match(r"^(\d+)", text)
            text = match.group(1) if match else text
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
        if value < 0:
            raise ConfigError(f"environment variable {name}={raw!r} must not be negative")
        return value
    return default


def get_slurm_info() -> SLURMInfo | None:
    """Read SLURM job information from environment variables.

    Returns:
        SLURMInfo if running under SLURM, None otherwise.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return SLURMInfo(
        job_id=job_id,
        job_name=os.environ.get("SLURM_JOB_NAME", ""),
        node_list=os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "")),
        num_nodes=_int_var(("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), 1),
        ntasks_per_node=_int_var(("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), 1),
        restart_count=_int_var(("SLURM_RESTART_COUNT",), 0),
        partition=os.environ.get("SLURM_JOB_PARTITION", ""),
        array_task_id=os.environ.get("SLURM_ARRAY_TASK_ID") or None,
    )


def is_slurm_job() -> bool:
    """Check if we are running under SLURM (``SLURM_JOB_ID`` is set)."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def is_slurm_requeue() -> bool:
    """Check if this is a requeued SLURM job.

    Uses ``SLURM_RESTART_COUNT`` (set by SLURM on requeue; unset before the first one).
    """
    return _int_var(("SLURM_RESTART_COUNT",), 0) > 0


def log_job_info() -> None:
    """Log SLURM job information (if running under SLURM)."""
    info = get_slurm_info()
    if info is None:
        logger.info("Not running under SLURM")
        return
    logger.info(
        "SLURM job: id=%s, name=%s, nodes=%d, tasks/node=%d, partition=%s, restart_count=%d%s",
        info.job_id,
        info.job_name,
        info.num_nodes,
        info.ntasks_per_node,
        info.partition,
        info.restart_count,
        f", array_task_id={info.array_task_id}" if info.array_task_id else "",
    )
    if info.is_requeued:
        logger.info("Job was requeued (restart #%d) - will auto-resume", info.restart_count)


def requeue_job(
    job_id: str | None = None,
    timeout: float = 60.0,
    cause: str = "restarts_exhausted",
    exclude: Sequence[str] = (),
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
    (:func:`exclusion_plan`); the event's ``excluded`` lists them."""
    from . import events

    job = job_id or os.environ.get("SLURM_JOB_ID")
    if not job:
        logger.error("cannot requeue: not a Slurm job (SLURM_JOB_ID is not set)")
        return False
    plan = exclusion_plan(job, exclude, timeout) if exclude else None
    # Slurm SIGTERMs every process of the job as soon as it accepts the requeue: hold
    # the signals until the event is written, or the retry would go uncounted (and a
    # failing job could be requeued for ever). They are delivered on the way out.
    with _signals_held():
        if _scontrol(["requeue", job], timeout) is None:  # the reason is logged
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


def exclusion_plan(job: str, hosts: Sequence[str], timeout: float = 60.0) -> ExclusionPlan | None:
    """What to add to job ``job``'s ``ExcNodeList`` to keep it away from ``hosts``.

    A host is matched to the job's Slurm node names (its allocation,
    ``$SLURM_JOB_NODELIST``, else ``scontrol show job``) by name or short name; one that
    is not a node of the job is left out with a warning (Slurm would refuse it). A plan
    that would leave the partition fewer nodes than the job needs excludes nothing more,
    with an error: a job that can never be placed again is worse than one that may meet
    the same node. Read before the requeue, while the job still holds its allocation."""
    record = _scontrol(["show", "job", "-o", job], timeout)
    if record is None:
        return None
    fields = dict(re.findall(r"(\S+?)=(\S*)", record))
    ours = os.environ.get("SLURM_JOB_ID") == job
    allocation = os.environ.get("SLURM_JOB_NODELIST") if ours else None
    names = _hostnames(allocation or fields.get("NodeList", ""), timeout)
    before = _hostnames(fields.get("ExcNodeList", ""), timeout)
    added: list[str] = []
    for host in hosts:
        name = next((n for n in names if n in (host, host.split(".")[0])), None)
        if name is None:
            logger.warning("cannot exclude %s: not a node of job %s (%s)", host, job, names)
        elif name not in before and name not in added:
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
    from . import events

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
            ev.kind == "rerun_elsewhere"
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
            ev.kind == "job_requeued"
            and ev.get("slurm_job") == job_id
            and ev.cause in FAILURE_REQUEUE_CAUSES
        ):
            failures += 1
    if restart_count > 0 and not earlier:
        from . import events

        logger.warning(
            "the event log %s has no event of this job's earlier runs: job retries are "
            "counted from SLURM_RESTART_COUNT instead",
            events.current_path(),
        )
        return None
    return failures


# --------------------------------------------------------------------- sbatch script

_TIME_FORMATS = (  # Slurm's --time forms, as regular expressions of (days, h, m, s)
    (re.compile(r"^(\d+)$", re.ASCII), ("m",)),
    (re.compile(r"^(\d+):(\d+)$", re.ASCII), ("m", "s")),
    (re.compile(r"^(\d+):(\d+):(\d+)$", re.ASCII), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$", re.ASCII), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$", re.ASCII), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$", re.ASCII), ("d", "h", "m", "s")),
)
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_time_limit(text: str, field_name: str = "time") -> int:
    """Seconds in a Slurm time limit (``--time``): ``minutes``, ``minutes:seconds``,
    ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes`` or
    ``days-hours:minutes:seconds``, rounded up to whole minutes as Slurm does. A
    :class:`ConfigError` naming ``field_name`` for any other text (``UNLIMITED``
    included: a preemption signal needs a limit)."""
    value = text.strip()
    for pattern, units in _TIME_FORMATS:
        match = pattern.match(value)
        if match:
            seconds = sum(
                int(g) * _UNIT_SECONDS[u] for g, u in zip(match.groups(), units, strict=True)
            )
            if seconds <= 0:
                break
            return -(-seconds // 60) * 60  # Slurm's resolution is the minute
    raise ConfigError(
        f"{field_name}: {text!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, "
        "D-HH, D-HH:MM or D-HH:MM:SS, more than zero)"
    )


#: Preemption signals the batch script can pass on: the launcher handles them (torch's
#: ``--signals-to-handle``) and its worker template ignores them. The training loop must
#: handle the one chosen (``ShutdownHandler``: SIGTERM, SIGUSR1; ``PreemptionHandler``:
#: its ``exit_signal``).
PREEMPT_SIGNALS = ("USR1", "USR2", "TERM", "HUP", "QUIT", "ALRM")


def _signal_name(value: str | int, field_name: str) -> str:
    text = str(value).strip()
    sig = _signal(field_name, int(text) if text.isascii() and text.isdigit() else value)
    name = sig.name.removeprefix("SIG")
    if name not in PREEMPT_SIGNALS:
        raise ConfigError(
            f"{field_name}: SIG{name} cannot be the preemption signal; use one of "
            + ", ".join("SIG" + n for n in PREEMPT_SIGNALS)
        )
    return name


#: The rendezvous backends a batch script can name: c10d (the store on the first node),
#: etcd-v2 and etcd (torch's backends on an etcd cluster; ``steadfast[etcd]``).
RDZV_BACKENDS = ("c10d", "etcd-v2", "etcd")


@dataclass
class SbatchSpec:
    """What ``steadfast slurm`` writes into a batch script (see :func:`render_sbatch`).

    ``script`` and ``script_args`` are the training script and its flags; ``nodes``
    run them and ``spare_nodes`` more are allocated and wait in the rendezvous, each
    ready to take a lost node's place without a requeue;
    ``nproc_per_node`` is ``steadfast launch --nproc-per-node`` (a number, ``gpu`` or
    ``auto``); ``preempt_signal`` reaches the batch shell ``preempt_time`` seconds before
    the time limit (``--signal=B:SIG@T``, only with a ``time``); ``max_restarts`` are
    the in-job restarts and ``num_job_retries_on_failure`` the requeues after them;
    ``run_dir`` holds the event log of every incarnation of the job (and, by default,
    the output); ``sbatch_lines`` are extra ``#SBATCH`` options, ``setup`` shell lines run
    before srun (``module load``, ``source venv/bin/activate``), ``launcher_args`` extra
    ``steadfast launch`` flags (``--ft-cfg-path ft.yaml``), ``srun_args`` extra srun flags.
    ``rdzv_backend`` is ``c10d`` (the store on the allocation's first node, at
    ``rdzv_port``) or ``etcd-v2`` / ``etcd`` with ``rdzv_endpoint`` naming an etcd cluster
    (``host1:2379,host2:2379,host3:2379``) outside the job: then losing any node, the
    first included, leaves the rendezvous standing.
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    spare_nodes: int = 0
    nproc_per_node: str = "1"
    job_name: str = "steadfast"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    output: str | None = None
    error: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    preempt_signal: str = "USR1"
    preempt_time: int = 120
    max_restarts: int = 3
    num_job_retries_on_failure: int = 2
    rdzv_port: int | None = None
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    run_dir: str | None = None
    python: str = sys.executable
    sbatch_lines: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    launcher_args: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """One :class:`ConfigError` naming the first field that is wrong."""
        if not self.script.strip():
            raise ConfigError("script: the training script is missing")
        for name in ("script", "python", "partition", "account", "output", "error", "run_dir"):
            value = getattr(self, name)
            spaced = name not in ("script", "python") and value is not None
            if value is not None and ("\n" in value or (spaced and re.search(r"\s", value))):
                raise ConfigError(f"{name}: {value!r} must be one word on one line")
        for name in ("nodes", "spare_nodes", "max_restarts", "num_job_retries_on_failure"):
            minimum = 1 if name == "nodes" else 0
            setattr(
                self, name, require_number(name, getattr(self, name), minimum=minimum, integer=True)
            )
        if self.rdzv_port is not None:
            self.rdzv_port = require_number("rdzv_port", self.rdzv_port, minimum=1, integer=True)
            if self.rdzv_port > 65535:
                raise ConfigError(f"rdzv_port: {self.rdzv_port} is not a TCP port (1-65535)")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ConfigError(
                f"rdzv_backend: {self.rdzv_backend!r} (expected one of {', '.join(RDZV_BACKENDS)})"
            )
        if self.rdzv_endpoint is not None and (
            not self.rdzv_endpoint.strip() or re.search(r"\s", self.rdzv_endpoint.strip())
        ):
            raise ConfigError(f"rdzv_endpoint: {self.rdzv_endpoint!r} must be one word")
        if self.rdzv_backend != "c10d" and not self.rdzv_endpoint:
            raise ConfigError(
                f"rdzv_endpoint: rdzv_backend={self.rdzv_backend} needs the etcd cluster's "
                "client addresses (host1:2379,host2:2379,host3:2379)"
            )
        nproc = str(self.nproc_per_node).strip()
        digits = nproc.isascii() and nproc.isdigit()
        if not (nproc in ("gpu", "auto", "cpu") or (digits and int(nproc) > 0)):
            raise ConfigError(
                f"nproc_per_node: expected a positive integer, 'gpu', 'cpu' or 'auto', "
                f"got {self.nproc_per_node!r}"
            )
        self.nproc_per_node = nproc
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                require_number(name, getattr(self, name), minimum=1, integer=True)
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.job_name):
            raise ConfigError(f"job_name: {self.job_name!r} (letters, digits and _.+- only)")
        self.preempt_signal = _signal_name(self.preempt_signal, "preempt_signal")
        self.preempt_time = require_number(
            "preempt_time", self.preempt_time, minimum=0, integer=True
        )
        if self.preempt_time > 65535:  # Slurm's own limit on --signal's time
            raise ConfigError(f"preempt_time: {self.preempt_time} s is over Slurm's 65535")
        if self.time is not None:
            self.time = self.time.strip()
            limit = parse_time_limit(self.time, "time")
            if self.preempt_time >= limit:
                raise ConfigError(
                    f"preempt_time: {self.preempt_time} s before a time limit of {limit} s "
                    f"(time={self.time!r}) would signal the job before it starts"
                )
        for i, line in enumerate(self.sbatch_lines):
            opt = line.strip().removeprefix("#SBATCH").strip()
            if not opt.startswith("-") or "\n" in opt:
                raise ConfigError(f"sbatch_lines[{i}]: {line!r} is not one sbatch option")
            self.sbatch_lines[i] = opt
        for i, line in enumerate(self.setup):
            if "\n" in line:
                raise ConfigError(f"setup[{i}]: one shell line per entry, got {line!r}")

    def sbatch_options(self) -> list[str]:
        """The ``#SBATCH`` options, in the order written."""
        run_dir = self.run_dir or f"runs/{self.job_name}"
        opts = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes + self.spare_nodes}",
            "--ntasks-per-node=1",  # one steadfast launch per node; it starts the ranks
            "--requeue",
            "--open-mode=append",  # a requeued job adds to the same output files
            f"--output={self.output or run_dir + '/slurm-%j.out'}",
        ]
        if self.spare_nodes:
            # a lost node must not end the job: a spare takes its place. Only then: a
            # --no-kill job whose *first* node is lost loses its batch script but keeps
            # running (Slurm 22.05), holding the other nodes until its time limit, while
            # without it Slurm ends such a job (NODE_FAIL) and requeues it
            opts.append("--no-kill")
        if self.error:
            opts.append(f"--error={self.error}")
        if self.time is not None:
            opts.append(f"--time={self.time}")
            if self.preempt_time > 0:
                opts.append(f"--signal=B:{self.preempt_signal}@{self.preempt_time}")
        for name in ("partition", "account"):
            if getattr(self, name):
                opts.append(f"--{name}={getattr(self, name)}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        return opts + list(self.sbatch_lines)


def render_sbatch(spec: SbatchSpec, command_line: str | None = None) -> str:
    """The batch script for ``spec``: ``spec.nodes`` nodes, each running one
    ``steadfast launch`` (through srun) that starts ``spec.nproc_per_node`` ranks, all
    meeting in a c10d rendezvous on the first node of the allocation; with
    ``spec.spare_nodes``, that many more launchers wait there as spares.

    Faults are answered in three layers: a failed or hung rank restarts every node's
    workers in the job (``--max-restarts``); when those are spent the launcher of
    ``SLURM_PROCID`` 0 requeues the job while job retries remain (exit 17 and 76 are
    final); the preemption signal (``--signal=B:...``, sent to this batch shell only) is
    forwarded to the launchers and from them to the ranks, which save, and then the
    script requeues the job, which resumes from the latest checkpoint. Every
    incarnation appends to one event log, ``<run_dir>/events.jsonl``.
    """
    q = shlex.quote
    run_dir = spec.run_dir or f"runs/{spec.job_name}"
    handled = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    if "SIG" + spec.preempt_signal not in handled:
        handled.append("SIG" + spec.preempt_signal)
    srun = " ".join(
        [
            "srun",
            f"--nodes={spec.nodes + spec.spare_nodes}",
            "--ntasks-per-node=1",
            *(["--no-kill"] if spec.spare_nodes else []),  # the step outlives a lost node
            "--kill-on-bad-exit=0",  # the launcher of SLURM_PROCID 0 must live to requeue
            # srun does not take the batch job's --cpus-per-task (Slurm 22.05 to 23.02)
            *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []),
            *(q(a) for a in spec.srun_args),
        ]
    )
    command = [
        srun,
        '"$SF_PYTHON" -m steadfast.cli launch',
        f"--nnodes={spec.nodes} --nproc-per-node={spec.nproc_per_node}",
        f"--rdzv-backend={spec.rdzv_backend} --rdzv-endpoint="
        + (q(spec.rdzv_endpoint) if spec.rdzv_endpoint else '"$SF_HEAD:$SF_RDZV_PORT"')
        + ' --rdzv-id="$SLURM_JOB_ID"',
        f"--max-restarts={spec.max_restarts} "
        f"--ft-num-job-retries-on-failure={spec.num_job_retries_on_failure}",
        f"--signals-to-handle={','.join(handled)}",
    ]
    if spec.launcher_args:
        command.append(" ".join(q(a) for a in spec.launcher_args))
    command.append(" ".join([q(spec.script), *(q(a) for a in spec.script_args)]))
    body = " \\\n    ".join(command)
    lines = ["#!/bin/bash"]
    lines += [
        f"# Written by `steadfast slurm`: {spec.nodes} node(s) x {spec.nproc_per_node} "
        f"process(es) of {spec.script}"
        + (f", and {spec.spare_nodes} spare node(s)." if spec.spare_nodes else "."),
    ]
    if command_line:
        lines.append(f"#   {command_line}")
    lines += [f"#SBATCH {opt}" for opt in spec.sbatch_options()]
    preempt = (
        f"SIG{spec.preempt_signal} {spec.preempt_time} s before the time limit"
        if spec.time is not None and spec.preempt_time > 0
        else f"SIG{spec.preempt_signal} (no time limit given: from scancel or a scheduler)"
    )
    lines += [
        "",
        "# Faults, in three layers:",
        f"#  1. a rank fails or hangs: every node restarts its ranks in the job "
        f"(--max-restarts={spec.max_restarts});",
        *(
            [
                f"#  -  a node is lost: one of the {spec.spare_nodes} spare node(s) waiting in "
                "the rendezvous takes",
                "#     its place in the job (--no-kill: Slurm does not end the job for it;",
                "#     the first node lost takes the batch script with it: use an etcd",
                "#     rendezvous, and see the README on losing the first node);",
            ]
            if spec.spare_nodes
            else []
        ),
        "#  2. those are spent (or a node is lost, no spare left): the launcher of",
        "#     SLURM_PROCID 0 requeues the job while job retries remain",
        f"#     (num_job_retries_on_failure={spec.num_job_retries_on_failure}), away from a "
        "lost node and from the",
        "#     node of a result to re-check on other hardware (exit 16); exit 17, a result",
        "#     that failed validation, and 76, restarts that made no progress, are final;",
        f"#  3. preemption: {preempt}",
        "#     reaches this shell only: it is passed on to the launchers (scancel --signal),",
        "#     which pass it to the ranks; they save a checkpoint and stop; then this",
        "#     script requeues the job.",
        "# A requeued job resumes from the latest checkpoint (the training script's own",
        "# resume). Every incarnation appends to one event log: steadfast report RUN_DIR.",
        "set -o pipefail",
        "",
        f"SF_PYTHON={q(spec.python)}",
        f"SF_RUN_DIR={q(run_dir)}",
        'case "$SF_RUN_DIR" in /*) ;; *) SF_RUN_DIR="$PWD/$SF_RUN_DIR" ;; esac',
        # two jobs that share their first node must not share a port: by default it
        # follows the job id (a requeued job keeps its id, and so its port)
        "SF_RDZV_PORT="
        + (str(spec.rdzv_port) if spec.rdzv_port else "$((29400 + SLURM_JOB_ID % 1000))"),
        'mkdir -p "$SF_RUN_DIR" || exit 1',
        'export STEADFAST_EVENTS="${STEADFAST_EVENTS:-$SF_RUN_DIR/events.jsonl}"',
        *spec.setup,
        'SF_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '[ -n "$SF_HEAD" ] || { echo "steadfast: no first node in $SLURM_JOB_NODELIST" >&2;'
        " exit 1; }",
        'echo "steadfast: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on'
        " $SLURM_JOB_NUM_NODES node(s), rendezvous "
        + (
            f"{spec.rdzv_backend} {spec.rdzv_endpoint}"
            if spec.rdzv_endpoint
            else "$SF_HEAD:$SF_RDZV_PORT"
        )
        + '"',
        "",
        "sf_preempted=''",
        "sf_forward() {  # Slurm signalled this shell only. srun would pass on only USR1",
        "    sf_preempted=$1  # and USR2 (it ends the step on TERM): signal the steps",
        '    echo "steadfast: SIG$1 (preemption): passing it on to the launchers" >&2',
        '    scancel --signal="$1" "$SLURM_JOB_ID"',
        "}",
        f"trap 'sf_forward {spec.preempt_signal}' {spec.preempt_signal}",
        "",
        body + " &",
        "sf_srun=$!",
        "# a trapped signal ends `wait` early: wait again until srun is gone, then take",
        "# its exit status",
        'while kill -0 "$sf_srun" 2>/dev/null; do wait "$sf_srun"; done',
        'wait "$sf_srun"',
        "sf_rc=$?",
        f"trap - {spec.preempt_signal}",
        "# a launcher that got the signal exits 128+N after its ranks saved; 0 is a",
        "# finished run, which must not run again",
        'if [ -n "$sf_preempted" ] && [ "$sf_rc" -ne 0 ]; then',
        '    echo "steadfast: preempted (SIG$sf_preempted); the launchers exited $sf_rc;'
        ' requeueing job $SLURM_JOB_ID" >&2',
        '    "$SF_PYTHON" -m steadfast.cli requeue --cause preempted && exit 0',
        "fi",
        'exit "$sf_rc"',
        "",
    ]
    return "\n".join(lines)
