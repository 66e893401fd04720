"""Writing the event log: where it goes (``$STEADFAST_EVENTS``, a path the script set,
or the working directory's default), and :func:`emit`, one atomic ``O_APPEND`` write of
one JSON line per event, safe from many processes and from a signal handler (see
:mod:`steadfast.events`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from .schema import COMMON_FIELDS, EVENT_KINDS, EventLogError

logger = logging.getLogger("steadfast.events")

EVENTS_ENV = "STEADFAST_EVENTS"
#: ``STEADFAST_EVENTS=off`` turns the file off (events still reach the logger).
EVENTS_OFF = "off"
#: The file used when neither ``$STEADFAST_EVENTS`` nor :func:`set_default_path` says.
DEFAULT_EVENTS_FILE = "steadfast_events.jsonl"

_MAX_LINE = 64 * 1024  # one write stays well under any pipe/file atomicity concern


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


#: Called with each ``step_done`` record this process emits: steadfast.progress notes
#: that the script counts its own steps (so that the launcher does not count them
#: again), a restore's replay proof reads the re-done steps' losses.
step_listeners: list[Callable[[dict[str, Any]], None]] = []
#: Called with every record this process emits (the launcher's node ledger).
record_listeners: list[Callable[[dict[str, Any]], None]] = []


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
    if kind == "step_done":
        for listener in list(step_listeners):
            listener(record)
    for listener in list(record_listeners):
        listener(record)
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
