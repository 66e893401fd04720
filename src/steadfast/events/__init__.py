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

The schema is :mod:`.schema`, the writer :mod:`.writer`, the readers :mod:`.reader`;
every name is importable from here.
"""

from __future__ import annotations

from .reader import Event, parse_event, read_events
from .schema import (
    COMMON_FIELDS,
    EVENT_KINDS,
    SLURM_FIELDS,
    EventKind,
    EventLogError,
    Kind,
    register_kind,
)
from .writer import (
    DEFAULT_EVENTS_FILE,
    EVENTS_ENV,
    EVENTS_OFF,
    current_path,
    emit,
    job_start,
    process_start_time,
    set_default_path,
)

__all__ = [
    "COMMON_FIELDS",
    "DEFAULT_EVENTS_FILE",
    "EVENTS_ENV",
    "EVENTS_OFF",
    "EVENT_KINDS",
    "Event",
    "EventKind",
    "EventLogError",
    "Kind",
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
