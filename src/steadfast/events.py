"""The structured event log: one JSON object per line, shared by every component.

Every detection, restart, skip, rollback and save in steadfast is an *event*. Events are
appended to one file per run (many processes, one file) so that ``steadfast report`` can
rebuild what happened across restarts and requeues.

Schema (one JSON object per line; this is the single place it is defined)
-------------------------------------------------------------------------
Common fields, present on every line:

``time``      float, unix seconds (``time.time()``) when the event was made
``kind``      str, one of :data:`EVENT_KINDS` (below)
``rank``      int or null, the global rank (``RANK``) of the process that wrote it
``step``      int or null, the training step the event refers to
``cause``     str or null, a short machine-readable reason (e.g. ``"loss"``, ``"SIGTERM"``)
``host``      str, the host name
``pid``       int, the process id
``restart``   int, ``TORCHELASTIC_RESTART_COUNT`` (in-job restart number, 0 first)

Added when running under Slurm: ``slurm_job_id`` (str) and ``slurm_restart`` (int, the
``SLURM_RESTART_COUNT``; 0 before the first requeue). Any other keys are kind-specific:
each kind declares its fields in :data:`EVENT_KINDS` (an :class:`EventKind`), and
:func:`emit` rejects one that is not declared.

Where the log goes
------------------
1. ``$STEADFAST_EVENTS`` when set: ``steadfast launch`` owns the run's log and sets it
   for every worker (``--events PATH`` / ``--run-dir DIR``; see
   :mod:`steadfast.launcher`); ``STEADFAST_EVENTS=off`` writes no file;
2. else a path the script gave :func:`set_default_path` itself (no steadfast
   constructor changes it);
3. else ``steadfast_events.jsonl`` in the working directory (also the launcher's
   default, so a script run with and without the launcher writes to the same place).

Every event also goes to the ``steadfast.events`` logger at DEBUG level.

Writes are safe from many processes: the file is opened with ``O_APPEND`` and each event
is exactly one ``os.write`` of one line, which the kernel appends atomically on a local
file system. No lock is taken, so :func:`emit` may be called from a signal handler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMMON_FIELDS",
    "DEFAULT_EVENTS_FILE",
    "EVENTS_ENV",
    "EVENTS_OFF",
    "EVENT_KINDS",
    "Event",
    "EventKind",
    "EventLogError",
    "current_path",
    "emit",
    "job_start",
    "parse_event",
    "process_start_time",
    "read_events",
    "register_kind",
    "set_default_path",
    "SLURM_FIELDS",
]

logger = logging.getLogger("steadfast.events")

EVENTS_ENV = "STEADFAST_EVENTS"
#: ``STEADFAST_EVENTS=off`` turns the file off (events still reach the logger).
EVENTS_OFF = "off"
#: The file used when neither ``$STEADFAST_EVENTS`` nor :func:`set_default_path` says.
DEFAULT_EVENTS_FILE = "steadfast_events.jsonl"

COMMON_FIELDS: tuple[str, ...] = ("time", "kind", "rank", "step", "cause", "host", "pid", "restart")

#: Added by :func:`emit` under Slurm: the job id and ``SLURM_RESTART_COUNT``.
SLURM_FIELDS: tuple[str, ...] = ("slurm_job_id", "slurm_restart")


@dataclass(frozen=True)
class EventKind:
    """One kind of event: what it records and the kind-specific fields it may carry
    (each with what it means). :func:`emit` rejects a field that is not declared, and
    :meth:`Event.get` one that is not declared for the event's kind, so a misspelt field
    is an error at once instead of an event the report silently ignores."""

    name: str
    description: str
    fields: Mapping[str, str] = field(default_factory=dict)

    def allows(self, name: str) -> bool:
        """Whether ``name`` is a field of this kind (or a common or Slurm field)."""
        return name in self.fields or name in COMMON_FIELDS or name in SLURM_FIELDS

    def __str__(self) -> str:
        names = ", ".join(self.fields) or "none"
        return f"{self.description}; fields: {names}"


def _kinds(*specs: tuple[str, str, dict[str, str]]) -> dict[str, EventKind]:
    return {name: EventKind(name, text, fields) for name, text, fields in specs}


_WORKER = {
    "exit_code": "the worker's exit code (negative: killed by that signal)",
    "signal": "the signal's name when it was killed by one, else null",
    "local_rank": "its rank on the node",
    "worker_pid": "its process id",
}

#: Every event kind, with the fields it carries: the schema, as code. Components register
#: further kinds with :func:`register_kind` (not ad hoc), so the report and the docs have
#: one list to read.
EVENT_KINDS: dict[str, EventKind] = _kinds(
    # health / NaN detection
    ("nan_detected", "a non-finite loss or gradient on some rank", {
        "source": "'loss' or 'gradients'",
        "local": "this rank's own value was non-finite",
        "ranks_affected": "how many ranks saw one",
        "consecutive": "bad steps in a row so far",
        "total": "bad steps in the run so far",
        "action": "what the detector does: warn, skip or raise",
        "value": "the loss, when it was the loss",
        "params": "the first parameters with non-finite gradients",
    }),
    ("nan_rollback_recommended", "consecutive NaN steps reached max_consecutive", {
        "consecutive": "bad steps in a row",
        "max_consecutive": "the configured limit",
        "last_good_step": "the last step with finite values",
    }),
    ("health_check", "a GPU or collective health check", {
        "check": "'gpu' or 'collective'", "ok": "the result", "details": "what was measured",
    }),
    # shutdown / signals
    ("shutdown_requested", "a shutdown signal arrived (cause: its name)", {
        "signal": "its number",
    }),
    ("shutdown_agreed", "ranks agreed to stop after this step", {
        "ranks_signalled": "how many ranks had the signal",
    }),
    ("shutdown_forced", "graceful shutdown exceeded its timeout, process force-exited", {
        "timeout_sec": "the timeout", "exit_code": "the forced exit code",
    }),
    ("shutdown_complete", "graceful shutdown finished (handler.finish())", {}),
    ("preemption_signal", "this rank received the preemption signal (cause: its name)", {
        "signal": "its number",
    }),
    ("preemption_exit", "all ranks stop for preemption after this step", {
        "ranks_signalled": "the ranks that had the signal",
    }),
    # checkpoints
    ("checkpoint_saved", "a checkpoint is complete and visible", {
        "path": "its folder", "bytes": "its size", "seconds": "the whole save",
        "blocking_seconds": "the part the training loop waited for",
    }),
    ("checkpoint_loaded", "a checkpoint was verified and loaded", {
        "path": "its folder", "seconds": "the load",
        "tier": "disk, memory (the rank's own snapshot) or replica (one kept on another "
        "node)", "from_rank": "the rank whose node held the snapshot (memory tier)",
    }),
    ("checkpoint_corrupt", "a checkpoint failed verification; an older one (or another "
     "tier) is used (cause: verify, load, memory, replica)", {
        "path": "its folder", "reason": "what failed",
    }),
    ("checkpoint_deleted", "an old checkpoint was removed (keep_last_n, or a framework "
     "rotating its own)", {"path": "its folder"}),
    ("checkpoint_fenced", "a rank wrote no checkpoint: its node no longer holds the job's "
     "rendezvous (cut off, or the job went on without it)", {
        "path": "the checkpoint folder", "reason": "what the launcher answered",
    }),
    # monitoring / launcher
    ("rank_hung", "a rank overstayed a timeout and is terminated (cause: what timed out)", {
        "section": "the section, or what timed out", "elapsed": "seconds since it began",
        "timeout": "the timeout", "local_rank": _WORKER["local_rank"],
        "worker_pid": _WORKER["worker_pid"],
    }),
    ("rank_failed", "a worker failed: the first of its group to go down", dict(_WORKER)),
    ("rank_stopped", "a worker that went down after another rank failed (stopped by the "
     "launcher, or it lost its peer): not a fault of its own", {
        **_WORKER, "first_failed_rank": "the rank whose failure it followed",
    }),
    ("restart", "the launcher restarts the worker group in-job (cause: worker_failure or "
     "membership_change)", {
        "restart_count": "restarts so far", "reason": "in words",
        "remaining_restarts": "in-job restarts left",
    }),
    # nodes (the launcher's node roster; host: the launcher that saw it)
    ("node_lost", "a node of the running round is lost (cause: connection_reset, silent, "
     "left or unhealthy)", {
        "node": "the lost node's host name", "node_rank": "its rank among the round's nodes",
        "how": "how it was seen, in words", "latency": "seconds from its last sign of life "
        "to the detection", "nodes": "nodes in the round it left",
    }),
    ("node_joined", "a node joined the job in a later round (a spare taking a lost node's "
     "place, or a node added to an elastic job)", {
        "node": "its host name", "node_rank": "its rank among the round's nodes",
        "nodes": "nodes in the new round", "replaced": "the nodes of the previous round "
        "that are not in this one",
    }),
    ("node_unhealthy", "this node failed its health check before a rendezvous: it does not "
     "join (cause: the check)", {"reason": "what failed"}),
    ("node_isolated", "this node lost its peers and the rendezvous at once (cause "
     "partition: a partition on its side), or found the job went on without it (cause "
     "replaced: a healed partition): its workers are stopped and write nothing", {
        "how": "in words", "nodes": "nodes in the round it was cut off from",
    }),
    # the launcher's own record of its node (host: the node), for any script
    ("launcher_start", "a node's launcher started (steadfast launch)", {
        "nnodes": "--nnodes as given", "nproc_per_node": "workers per node",
        "entrypoint": "the script or program", "max_restarts": "in-job restarts allowed",
        "rdzv_backend": "the rendezvous backend",
    }),
    ("workers_started", "this node's launcher started its workers for a round of the "
     "rendezvous (a generation)", {
        "generation": "this node's round count (1 for its first)",
        "restart_count": "TORCHELASTIC_RESTART_COUNT given to the workers",
        "node_rank": "this node's rank in the round", "nodes": "nodes in the round",
        "world_size": "ranks in the round", "ranks": "the global ranks started here",
        "pids": "their process ids",
    }),
    ("workers_exited", "this node's workers of a generation ended (cause: succeeded, "
     "failed, stopped: by the launcher after a fault elsewhere, a lost node or a node "
     "joining)", {
        "generation": "as in workers_started", "exits": "per worker: rank, local_rank, "
        "pid, exit_code, signal, time (epoch seconds it exited, when known)",
        "seconds": "from workers_started to the last exit",
    }),
    ("launcher_end", "a node's launcher ended", {
        "exit_code": "its exit status", "reason": "why, in words",
    }),
    ("job_requeued", "the Slurm job was requeued (cause: restarts_exhausted, node_lost, or "
     "restart_elsewhere after a worker's exit 16: these spend a job retry; preempted, by "
     "the batch script of steadfast slurm: spends none)", {
        "slurm_job": "the job id", "excluded": "Slurm nodes the requeued job is kept away "
        "from from now on (a lost node, the node of a result to re-check elsewhere)",
    }),
    ("job_start", "a training process (re)started, after its restore", {
        "world_size": "ranks in the job", "resumed_from": "the checkpoint, or null",
        "process_start": "epoch seconds the process began (see job_start())",
    }),
    ("step_done", "a training step completed on this rank: what the goodput report counts "
     "as productive", {"seconds": "its duration", "loss": "its loss (optional)"}),
    ("rollback", "training state rolled back to a checkpoint (a NaN burst)", {
        "to_step": "the step it went back to",
    }),
    ("job_end", "a training process ended", {"exit_code": "its code", "reason": "why"}),
    ("fault_injected", "a simulated fault fired (steadfast.faults)", {
        "fault": "its FaultKind name", "factor": "a slowdown's factor",
    }),
    # re-run state machine
    ("rerun_result_rejected", "a validated result was rejected on this rank", {
        "result": "the value", "invocation": "which run of the step",
    }),
    ("rerun_elsewhere", "this rank reproduced its rejected result in place (or was "
     "restarted on the hardware that did): it exits 16, and the job must re-run the step "
     "on other hardware (the host of this event is the node to move away from)", {
        "hardware": "the hardware id (node/device) of the doubted result",
    }),
    ("rerun_verdict", "attribution of a rejected result", {
        "verdict": "transient, persistent or correct",
    }),
    # in-process restart (rank: the initial rank, this process's identity for the call)
    ("inprocess_interrupted", "an in-process restart iteration was interrupted (cause: "
     "exception, soft_timeout, hard_timeout, rank_died, heartbeat_lost, left)", {
        "iteration": "the interrupted iteration", "fault_rank": "the rank at fault",
        "detail": "in words", "first": "whether this record was the first of the iteration",
    }),
    ("inprocess_restart", "this rank restarts the wrapped function in-process", {
        "iteration": "the new one", "world_size": "ranks left", "active_world_size":
        "active ranks", "terminated": "ranks gone", "causes": "the interruptions",
        "seconds": "from the first interruption record to the restart",
    }),
    ("inprocess_terminated", "a rank left the job for good: terminated by its monitor "
     "process on the hard timeout, or found dead", {
        "iteration": "the iteration", "terminated_rank": "the rank",
        "signal": "the last signal sent, null if it was already dead",
    }),
    ("inprocess_rank_reassigned", "rank assignment gave this rank a new rank", {
        "iteration": "the iteration", "from_rank": "before", "to_rank": "after",
        "world_size": "the new world size",
    }),
    # straggler detection
    ("straggler_report", "a periodic straggler report", {
        "relative": "{rank: relative score}", "individual": "{rank: individual score}",
        "seconds": "the report's cost",
    }),
    ("straggler_detected", "scores below the thresholds", {
        "ranks": "the stragglers", "relative": "the ranks below the relative threshold",
        "individual": "the ranks below the individual threshold",
        "scores": "{rank: relative score}",
    }),
)  # fmt: skip

_MAX_LINE = 64 * 1024  # one write stays well under any pipe/file atomicity concern


class EventLogError(ValueError):
    """An event or an event file is malformed; the message names the field or line."""


def register_kind(
    kind: str, description: str, fields: Mapping[str, str] | Iterable[str] = ()
) -> EventKind:
    """Add an event kind to :data:`EVENT_KINDS`: what it records and its kind-specific
    fields (a mapping of name to meaning, or just the names).

    Components outside this module call this once at import so that their kinds are
    documented and accepted by :func:`emit`, with exactly those fields.
    """
    if not kind or not kind.replace("_", "").isalnum() or kind != kind.lower():
        raise EventLogError(f"event kind {kind!r} must be lower_snake_case")
    declared = dict(fields) if isinstance(fields, Mapping) else dict.fromkeys(fields, "")
    clash = sorted(set(declared) & (set(COMMON_FIELDS) | set(SLURM_FIELDS)))
    if clash:
        raise EventLogError(f"event kind {kind!r}: {clash} are common fields, not its own")
    spec = EventKind(kind, description, declared)
    EVENT_KINDS[kind] = spec
    return spec


@dataclass(frozen=True)
class Event:
    """One parsed line of the event log."""

    time: float
    kind: str
    rank: int | None
    step: int | None
    cause: str | None
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A kind-specific (or common non-core) field by name. Asking for a field that
        the kind does not declare is an :class:`EventLogError` (a reader's typo); an
        event of a kind this version does not know is read as it is."""
        spec = EVENT_KINDS.get(self.kind)
        if spec is not None and not spec.allows(key):
            raise EventLogError(
                f"event kind {self.kind!r} has no field {key!r}; its fields: "
                f"{', '.join(spec.fields) or 'none'}"
            )
        return self.fields.get(key, default)


class _Writer:
    """Process-local state of the log file: the open fd, reopened after fork or a path
    change. Deliberately lock-free (see the module docstring): the open file is one tuple
    ``(fd, path, pid)`` published with a single assignment, so a signal handler that emits
    in the middle of an update sees either the old or the new file, never a mix."""

    def __init__(self) -> None:
        self.default_path: str | None = None
        self._open: tuple[int, str, int] | None = None
        self._host = socket.gethostname()

    def path(self) -> str | None:
        env = os.environ.get(EVENTS_ENV)
        if env:
            return None if env == EVENTS_OFF else env
        if self.default_path is not None:
            return self.default_path
        return os.path.abspath(DEFAULT_EVENTS_FILE)

    def fd(self, path: str) -> int:
        current = self._open
        pid = os.getpid()
        if current is not None and current[1] == path and current[2] == pid:
            return current[0]
        self.close()  # the path changed
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._open = (fd, path, pid)
        return fd

    def close(self) -> None:
        current, self._open = self._open, None  # unpublish first, then close
        if current is not None and current[2] == os.getpid():
            with contextlib.suppress(OSError):
                os.close(current[0])

    def after_fork_in_child(self) -> None:
        """A forked child closes its copy of the parent's fd and opens its own lazily."""
        current, self._open = self._open, None
        if current is not None:
            with contextlib.suppress(OSError):
                os.close(current[0])

    @property
    def host(self) -> str:
        return self._host


_writer = _Writer()
os.register_at_fork(after_in_child=_writer.after_fork_in_child)


def set_default_path(path: str | os.PathLike[str] | None) -> None:
    """Set where events go when ``$STEADFAST_EVENTS`` is not set (None: back to the
    default, ``steadfast_events.jsonl`` in the working directory)."""
    _writer.default_path = os.fspath(path) if path is not None else None
    _writer.close()


def current_path() -> str | None:
    """The file events are appended to now, or None when ``STEADFAST_EVENTS=off``."""
    return _writer.path()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _jsonable(value: Any) -> Any:
    """Make kind-specific values JSON-safe: non-finite floats become strings, tensors
    and other objects their ``str``; keeps the log one valid JSON object per line."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _jsonable(item())
        except (RuntimeError, ValueError, TypeError):
            pass
    return str(value)


def emit(
    kind: str,
    *,
    step: int | None = None,
    cause: str | None = None,
    rank: int | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Record one event: append it as a JSON line to the run's event log and log it.

    ``rank`` defaults to ``$RANK``. Returns the record written (also when no file is
    configured), so callers can reuse it. Raises :class:`EventLogError` for an unknown
    kind or a field that shadows a common one: a typo must not silently produce an event
    the report cannot understand. I/O errors writing the file are logged, never raised:
    losing an event must not kill a training run.
    """
    if kind not in EVENT_KINDS:
        raise EventLogError(
            f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(EVENT_KINDS))} "
            "(add new ones with steadfast.events.register_kind)"
        )
    clash = set(fields) & set(COMMON_FIELDS)
    if clash:
        raise EventLogError(f"event field(s) {sorted(clash)} are common fields, not extras")
    spec = EVENT_KINDS[kind]
    undeclared = sorted(name for name in fields if name not in spec.fields)
    if undeclared:
        raise EventLogError(
            f"event {kind!r}: undeclared field(s) {undeclared}; its fields: "
            f"{', '.join(spec.fields) or 'none'} (declare fields in "
            "steadfast.events.EVENT_KINDS or with register_kind)"
        )
    record: dict[str, Any] = {
        "time": time.time(),
        "kind": kind,
        "rank": rank if rank is not None else _env_int("RANK"),
        "step": step,
        "cause": cause,
        "host": _writer.host,
        "pid": os.getpid(),
        "restart": _env_int("TORCHELASTIC_RESTART_COUNT") or 0,
    }
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        record["slurm_job_id"] = job_id
        record["slurm_restart"] = _env_int("SLURM_RESTART_COUNT") or 0
    for key, value in fields.items():
        record[key] = _jsonable(value)
    line = json.dumps(record, separators=(",", ":"), allow_nan=False)
    if len(line) > _MAX_LINE:
        raise EventLogError(f"event {kind!r} is {len(line)} bytes; the limit is {_MAX_LINE}")
    logger.debug("event %s", line)
    path = _writer.path()
    if path is not None:
        data = (line + "\n").encode()
        try:
            fd = _writer.fd(path)
            written = os.write(fd, data)
            if written != len(data):  # pragma: no cover - only on a full disk
                logger.error("event log %s: short write (%d of %d bytes)", path, written, len(data))
        except OSError as exc:
            logger.error("cannot write event %s to %s: %s", kind, path, exc)
    return record


def process_start_time(pid: int | None = None) -> float | None:
    """When this process (or ``pid``) started, in epoch seconds (Linux ``/proc``: its
    start in clock ticks since boot, against ``/proc/uptime``, both 10 ms resolution);
    None where it cannot be read. The goodput report counts process start to
    ``job_start`` as start-up time (imports, process group, model build)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as fh:
            stat = fh.read().decode()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        now = time.time()
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def job_start(step: int, world_size: int, resumed_from: str | None = None) -> None:
    """Emit ``job_start`` for this training process, once its state is restored, with the
    process's start time (for the report's start-up time)."""
    emit(
        "job_start",
        step=step,
        world_size=world_size,
        resumed_from=resumed_from,
        process_start=process_start_time(),
    )


def parse_event(line: str, where: str = "<event>") -> Event:
    """Parse one line of an event log; :class:`EventLogError` (naming ``where``) if it is
    not a valid event. For readers that follow a growing log."""
    return _parse_line(line, where)


def _parse_line(raw: str, where: str) -> Event:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise EventLogError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise EventLogError(f"{where}: an event must be a JSON object")
    for key, typ in (("time", (int, float)), ("kind", str)):
        if not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool):
            raise EventLogError(f"{where}: field {key!r} is missing or has the wrong type")
    for key in ("rank", "step"):
        val = obj.get(key)
        if val is not None and (not isinstance(val, int) or isinstance(val, bool)):
            raise EventLogError(f"{where}: field {key!r} must be an integer or null")
    cause = obj.get("cause")
    if cause is not None and not isinstance(cause, str):
        raise EventLogError(f"{where}: field 'cause' must be a string or null")
    extras = {k: v for k, v in obj.items() if k not in ("time", "kind", "rank", "step", "cause")}
    return Event(
        time=float(obj["time"]),
        kind=obj["kind"],
        rank=obj.get("rank"),
        step=obj.get("step"),
        cause=cause,
        fields=extras,
    )


def read_events(
    path: str | os.PathLike[str], *, strict: bool = False, problems: list[str] | None = None
) -> Iterator[Event]:
    """Yield the events of a log file in file order.

    A malformed line (for example the truncated last line of a killed process) is skipped
    and described in ``problems`` (when given), so a report uses what it can read; with
    ``strict=True`` it raises :class:`EventLogError` naming the file and line instead.
    Unknown kinds are passed through: a newer writer must not break an older reader.
    """
    p = Path(path)
    if not p.is_file():
        raise EventLogError(f"event log {p} does not exist or is not a file")
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield _parse_line(raw, f"{p}:{lineno}")
            except EventLogError as exc:
                if strict:
                    raise
                if problems is not None:
                    problems.append(str(exc))
