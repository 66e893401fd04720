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
``SLURM_RESTART_COUNT``; 0 before the first requeue). Any other keys are kind-specific and
listed with the kind in :data:`EVENT_KINDS`.

Where the log goes
------------------
1. ``$STEADFAST_EVENTS`` when set (the launcher sets it for its workers);
   ``STEADFAST_EVENTS=off`` writes no file;
2. else a path given to :func:`set_default_path` (the checkpoint manager sets
   ``<checkpoint_dir>/events.jsonl``);
3. else ``steadfast_events.jsonl`` in the working directory.

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
from collections.abc import Iterator, Mapping
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
    "EventLogError",
    "current_path",
    "emit",
    "job_start",
    "parse_event",
    "process_start_time",
    "read_events",
    "register_kind",
    "set_default_path",
]

logger = logging.getLogger("steadfast.events")

EVENTS_ENV = "STEADFAST_EVENTS"
#: ``STEADFAST_EVENTS=off`` turns the file off (events still reach the logger).
EVENTS_OFF = "off"
#: The file used when neither ``$STEADFAST_EVENTS`` nor :func:`set_default_path` says.
DEFAULT_EVENTS_FILE = "steadfast_events.jsonl"

COMMON_FIELDS: tuple[str, ...] = ("time", "kind", "rank", "step", "cause", "host", "pid", "restart")

#: Every event kind with the kind-specific fields it carries. Components register their
#: kinds here (not ad hoc), so the report and the docs have one list to read.
EVENT_KINDS: dict[str, str] = {
    # health / NaN detection
    "nan_detected": "a non-finite loss or gradient on some rank; fields: source "
    "('loss'|'gradients'), local (this rank's own value was non-finite), ranks_affected, "
    "consecutive, total, action",
    "nan_rollback_recommended": "consecutive NaN steps reached max_consecutive; fields: "
    "consecutive, max_consecutive, last_good_step",
    "health_check": "a GPU or collective health check; fields: check, ok, details",
    # shutdown / signals
    "shutdown_requested": "a shutdown signal arrived; fields: signal",
    "shutdown_agreed": "ranks agreed to stop after this step; fields: ranks_signalled",
    "shutdown_forced": "graceful shutdown exceeded its timeout, process force-exited; "
    "fields: timeout_sec, exit_code",
    "shutdown_complete": "graceful shutdown finished (handler.finish())",
    "preemption_signal": "this rank received the preemption signal; fields: signal",
    "preemption_exit": "all ranks stop for preemption after this step; fields: ranks_signalled",
    # checkpoints
    "checkpoint_saved": "fields: path, bytes, seconds, blocking_seconds",
    "checkpoint_loaded": "fields: path, seconds",
    "checkpoint_corrupt": "fields: path, reason",
    "checkpoint_deleted": "fields: path",
    # monitoring / launcher
    "rank_hung": "fields: section, elapsed, timeout",
    "rank_failed": "fields: exit_code, signal",
    "restart": "fields: restart_count, reason",
    "job_requeued": "the Slurm job was requeued (cause: restarts_exhausted, or "
    "restart_elsewhere after a worker's exit 16: both spend a job retry; preempted, by "
    "the batch script of steadfast slurm: spends none); fields: slurm_job",
    "job_start": "a training process (re)started (after its restore); fields: world_size, "
    "resumed_from, process_start (epoch seconds the process began: see job_start())",
    "step_done": "a training step completed on this rank; fields: seconds (its duration), "
    "loss (optional). What the goodput report counts as productive",
    "rollback": "training state rolled back to a checkpoint (NaN burst); fields: to_step",
    "job_end": "a training process ended; fields: exit_code, reason",
    "fault_injected": "a simulated fault fired; fields: fault",
    # re-run state machine
    "rerun_result_rejected": "a validated result was rejected on this rank; fields: result, "
    "invocation",
    "rerun_verdict": "attribution of a rejected result: transient, persistent or correct; "
    "fields: verdict",
    # in-process restart (rank: the initial rank, this process's identity for the call)
    "inprocess_interrupted": "an in-process restart iteration was interrupted (cause: "
    "exception, soft_timeout, hard_timeout, rank_died, heartbeat_lost, left); fields: "
    "iteration, fault_rank, detail",
    "inprocess_restart": "this rank restarts the wrapped function in-process; fields: "
    "iteration (the new one), world_size, active_world_size, terminated, causes, seconds "
    "(from the first interruption record to the restart)",
    "inprocess_terminated": "a rank left the job for good: terminated by its monitor "
    "process on the hard timeout, or found dead; fields: iteration, terminated_rank, "
    "signal (the last signal sent, null if it was already dead)",
    "inprocess_rank_reassigned": "rank assignment gave this rank a new rank; fields: "
    "iteration, from_rank, to_rank, world_size",
    # straggler detection
    "straggler_report": "a periodic straggler report; fields: relative, individual "
    "({rank: score}), seconds",
    "straggler_detected": "scores below the thresholds; fields: ranks, relative, individual, "
    "scores",
}

_MAX_LINE = 64 * 1024  # one write stays well under any pipe/file atomicity concern


class EventLogError(ValueError):
    """An event or an event file is malformed; the message names the field or line."""


def register_kind(kind: str, description: str) -> None:
    """Add an event kind (with a description of its fields) to :data:`EVENT_KINDS`.

    Components outside this module call this once at import so that their kinds are
    documented and accepted by :func:`emit`.
    """
    if not kind or not kind.replace("_", "").isalnum() or kind != kind.lower():
        raise EventLogError(f"event kind {kind!r} must be lower_snake_case")
    EVENT_KINDS[kind] = description


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
        """A kind-specific (or common non-core) field by name."""
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
