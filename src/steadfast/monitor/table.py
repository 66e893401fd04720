"""The node's heartbeat table: one row per local rank in a shared-memory file.

The launcher creates the table (a file in ``/dev/shm``, mapped by every process) and
passes its path to the workers (``$STEADFAST_HB_TABLE``); each rank's
:class:`~steadfast.monitor.RankMonitorClient` maps it and writes only its own row
(``$LOCAL_RANK``). A heartbeat or a section change is a handful of plain memory stores
and a read of the monotonic clock (a vDSO call, not a system call): no socket, no pickle,
no lock. The launcher's watcher thread reads the rows.

A row is an array of float64 slots followed by a small area of section names. Writers
bracket every update with a sequence counter (odd while writing, a seqlock), so a
reader never acts on a half-written row. ``time.monotonic()`` is CLOCK_MONOTONIC,
shared by all processes of the node, so the watcher can compare its own clock with the
timestamps the ranks wrote.

Beside the table lies its *wake channel*, a FIFO (``steadfast-hbwake-...``) that the
watcher waits on. A rank writes one byte to it only when it sets calculated or loaded
timeouts (a handful of times per run), which may be shorter than the ones the watcher,
asleep until a deadline computed from the old timeouts, last read; it looks again at
once. The hot path (heartbeats and sections) never touches it.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..progress.layout import ASK_PREFIX as _ASK_PREFIX
from ..progress.layout import ask_path
from ..shm import shm_name

__all__ = ["HB_TABLE_ENV", "HeartbeatTable", "RowSnapshot", "ask_path"]

HB_TABLE_ENV = "STEADFAST_HB_TABLE"

# float64 slot indices of a row
SEQ = 0  # seqlock: odd while the row is being written
PID = 1  # the rank's pid once attached (0 = not yet)
ATTACHED = 2  # monotonic time of init_workload_monitoring
LAST_HB = 3  # monotonic time of the last heartbeat (0 = none yet)
OPEN = 4  # how many sections are open now (sections may nest or overlap, as in NVRx)
LEARN = 5  # which timeouts may be learned: a bit mask of LEARN_* (the launcher sets it)
OOS_START = 6  # monotonic time the rank left its last open section (0: before the first step)
STEPS = 7  # completed "step" sections
HB_INITIAL_TIMEOUT = 8
HB_TIMEOUT = 9
OOS_TIMEOUT = 10
NAMES = 11  # number of section names in the row
CLOSED = 12  # 1 once shutdown_workload_monitoring ran
HEARTBEATS = 13  # heartbeats sent
# the kinds this process has run once (warmed up): bit i for section i; WARM_KINDS: 1 the
# heartbeat, 2 the time out of sections (a learned timeout applies only once warmed up)
WARM_SECTIONS = 14
WARM_KINDS = 15
TIMEOUTS = 16  # TIMEOUTS + i: the timeout of section i (inf = none)
MAX_SECTIONS = 32
OPENED = TIMEOUTS + MAX_SECTIONS  # OPENED + i: when section i was opened (0 = closed)
# learned timeouts (monitor/learned.py): the longest interval seen and how many were seen,
# for the heartbeat, the time out of sections and each section; the launcher preloads
# them from its earlier generations, the rank adds to them
LEARNED_HB = OPENED + MAX_SECTIONS  # longest heartbeat interval, then the count (+1)
LEARNED_OOS = LEARNED_HB + 2  # longest time out of sections, then the count (+1)
LEARNED_MAX = LEARNED_OOS + 2  # LEARNED_MAX + i: the longest run of section i
LEARNED_N = LEARNED_MAX + MAX_SECTIONS  # LEARNED_N + i: runs of section i seen
HB_SECTIONS = LEARNED_N + MAX_SECTIONS  # 1: a section ran since the last heartbeat
SLOTS = HB_SECTIONS + 1
#: section slots a preload of learned names leaves free for the rank's own new sections
_PRELOAD_FREE = 8
NAME_BYTES = 48
#: the client's slots and names in the first page, the progress area (steadfast.progress:
#: what a worker's hooks see without the script's help) in the second; whole pages per
#: row, so no false sharing between ranks
PROGRESS_OFFSET = 4096
ROW_BYTES = 8192
_NAMES_OFFSET = SLOTS * 8

assert _NAMES_OFFSET + MAX_SECTIONS * NAME_BYTES <= PROGRESS_OFFSET


_TABLE_PREFIX = "steadfast-hb-"
#: A wake channel without its table is removed only when older than this (seconds).
_ORPHAN_AGE = 60.0
_WAKE_PREFIX = "steadfast-hbwake-"


def wake_path(table: str | os.PathLike[str]) -> Path:
    """The wake channel (a FIFO) of the table at ``table``."""
    path = Path(table)
    return path.with_name(_WAKE_PREFIX + path.name.removeprefix(_TABLE_PREFIX))


def _remove_orphans(base: Path) -> None:
    """Remove tables left by launchers that died without cleaning up (SIGKILL, OOM).
    A live launcher holds an exclusive ``flock`` on its table for its whole life, so a
    table that can be locked has no owner; this holds across pid namespaces that share
    ``/dev/shm``, where a pid check would not."""
    for entry in base.glob(_TABLE_PREFIX + "*"):
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its launcher is alive
        finally:
            os.close(fd)
        entry.unlink(missing_ok=True)
        wake_path(entry).unlink(missing_ok=True)
        for ask in base.glob(f"{_ASK_PREFIX}{entry.name.removeprefix(_TABLE_PREFIX)}-*"):
            ask.unlink(missing_ok=True)  # its rows' ask channels, at once too
    for fifo in [*base.glob(_WAKE_PREFIX + "*"), *base.glob(_ASK_PREFIX + "*")]:
        # a channel whose table is gone
        name = fifo.name.removeprefix(_WAKE_PREFIX)
        if fifo.name.startswith(_ASK_PREFIX):
            name = fifo.name.removeprefix(_ASK_PREFIX).rsplit("-", 1)[0]
        table = fifo.with_name(_TABLE_PREFIX + name)
        with contextlib.suppress(OSError):
            if not table.exists() and time.time() - fifo.lstat().st_mtime > _ORPHAN_AGE:
                fifo.unlink()


#: LEARN bits: the heartbeat's timeout, the time out of sections', the sections' (those
#: the config names no timeout for)
LEARN_HB, LEARN_OOS, LEARN_SECTIONS = 1, 2, 4

_MAX_SPINS = 10_000  # a live writer finishes in well under a microsecond


def _inf(value: float | None) -> float:
    return math.inf if value is None else float(value)


@dataclass(frozen=True)
class RowSnapshot:
    """A consistent copy of one row, as the watcher sees it."""

    pid: int
    attached: float
    last_heartbeat: float
    #: the open sections: name -> monotonic time it was opened
    open_sections: dict[str, float]
    out_of_section_start: float
    steps: int
    heartbeats: int
    initial_heartbeat_timeout: float
    heartbeat_timeout: float
    out_of_section_timeout: float
    section_timeouts: dict[str, float]
    closed: bool
    #: LEARN bits, and the learned state: (longest interval, intervals seen)
    learn: int = 0
    learned_heartbeat: tuple[float, int] = (0.0, 0)
    learned_out_of_section: tuple[float, int] = (0.0, 0)
    learned_sections: dict[str, tuple[float, int]] | None = None
    #: sections this process ran once, and WARM_KINDS bits
    warm_sections: frozenset[str] = frozenset()
    warm_kinds: int = 0
    #: a section ran since the last heartbeat (its interval is the section's to time)
    section_since_heartbeat: bool = False


class HeartbeatTable:
    """A shared-memory table of ``rows`` rank rows (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], rows: int, owner: bool) -> None:
        self.path = Path(path)
        self.rows = rows
        self.owner = owner
        fd = os.open(self.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < rows * ROW_BYTES:
                raise ConfigError(
                    f"{self.path}: heartbeat table has {size} bytes, {rows} rows need "
                    f"{rows * ROW_BYTES}"
                )
            self._map = mmap.mmap(fd, rows * ROW_BYTES)
            if owner:  # held until close(): the table is alive (see _remove_orphans)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        # the mapping keeps the memory; a rank keeps no descriptor, the owner its lock
        self._lock_fd: int | None = fd if owner else None
        if not owner:
            os.close(fd)
        self._view = memoryview(self._map)
        self._slots: list[Any] = [
            self._view[r * ROW_BYTES : r * ROW_BYTES + _NAMES_OFFSET].cast("d") for r in range(rows)
        ]
        self._progress: list[tuple[Any, memoryview]] = []
        for r in range(rows):
            area = self._view[r * ROW_BYTES + PROGRESS_OFFSET : (r + 1) * ROW_BYTES]
            self._progress.append((area.cast("d"), area))

    # ------------------------------------------------------------------ life cycle
    @classmethod
    def create(cls, rows: int, directory: str | os.PathLike[str] | None = None) -> HeartbeatTable:
        """Create a zeroed table (the launcher); :meth:`close` unlinks it."""
        base = Path(directory) if directory else Path("/dev/shm")
        if not base.is_dir():
            base = Path(tempfile.gettempdir())
        _remove_orphans(base)
        path = base / f"{shm_name(_TABLE_PREFIX)}{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, rows * ROW_BYTES)
        finally:
            os.close(fd)
        table = cls(path, rows, owner=True)  # locked: another launcher's sweep spares it
        try:
            os.mkfifo(wake_path(path), 0o600)  # its table exists first, for the same reason
            for row in range(rows):
                os.mkfifo(ask_path(path, row), 0o600)
        except BaseException:
            table.close()
            raise
        return table

    @classmethod
    def attach(cls, path: str | os.PathLike[str], row: int) -> HeartbeatTable:
        """Map an existing table (a rank); only ``row`` is written by this process."""
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise ConfigError(f"${HB_TABLE_ENV}={path}: cannot open the table ({exc})") from exc
        rows = size // ROW_BYTES
        if not 0 <= row < rows:
            raise ConfigError(f"${HB_TABLE_ENV}={path}: has {rows} rows, no row {row}")
        return cls(path, rows, owner=False)

    def close(self) -> None:
        """Unmap; the creator also removes the file, its wake and ask channels first,
        so that nothing is left in /dev/shm should unmapping fail (a view still held)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
            wake_path(self.path).unlink(missing_ok=True)
            for row in range(self.rows):
                ask_path(self.path, row).unlink(missing_ok=True)
        try:
            for slots in self._slots:
                slots.release()
            self._slots = []
            for floats, area in self._progress:
                floats.release()
                area.release()
            self._progress = []
            self._view.release()
            self._map.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ------------------------------------------------------------------ wake channel
    def open_wake_reader(self) -> int:
        """A non-blocking descriptor on the wake channel for the watcher to poll (the
        caller closes it). Opened read-write, so that it never reads end-of-file when no
        rank has it open."""
        fd = os.open(wake_path(self.path), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"{wake_path(self.path)}: the wake channel is not a FIFO")
        return fd

    def wake_watcher(self) -> None:
        """Make the watcher read the rows now (a rank calls it after it lowered a
        timeout). Never blocks; a channel that is full already wakes the watcher, and
        one with no watcher (a table without one, in tests) is ignored."""
        try:
            fd = os.open(wake_path(self.path), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # ENXIO: no reader; ENOENT: an older table, or gone
            return
        try:
            with contextlib.suppress(OSError):  # EAGAIN: full, a wake is pending anyway
                os.write(fd, b"w")
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ writers
    def progress_area(self, row: int) -> tuple[Any, memoryview]:
        """``row``'s progress area (steadfast.progress lays it out): its float64 slots
        and its bytes (the same memory), valid until :meth:`close`."""
        return self._progress[row]

    def slots(self, row: int) -> Any:
        """The float64 slots of ``row`` (writers store into it directly)."""
        return self._slots[row]

    @contextmanager
    def writing(self, row: int) -> Iterator[Any]:
        """Bracket a multi-slot update of ``row`` with the seqlock (odd while writing;
        a count left odd by a writer that died mid-update is made odd, not even)."""
        s = self._slots[row]
        s[SEQ] = float(int(s[SEQ]) | 1)
        try:
            yield s
        finally:
            s[SEQ] += 1

    def reset(
        self,
        row: int,
        config_timeouts: Mapping[str, float | None],
        initial_hb: float | None,
        hb: float | None,
        oos: float | None,
        learn: int = 0,
        learned: Mapping[str, tuple[float, int]] | None = None,
    ) -> None:
        """Empty ``row`` for a new worker, with the configured timeouts (launcher);
        ``learn``: the LEARN bits; ``learned``: what earlier generations learned, as
        ``(longest, count)`` under ``heartbeat``, ``out_of_section`` and ``section:<name>``."""
        area = self._progress[row][1]
        area[:] = bytes(len(area))  # a new worker's progress (steadfast.progress)
        with self.writing(row) as s:
            for i in range(1, SLOTS):
                s[i] = 0.0
            s[HB_INITIAL_TIMEOUT] = _inf(initial_hb)
            s[HB_TIMEOUT] = _inf(hb)
            s[OOS_TIMEOUT] = _inf(oos)
            for i in range(MAX_SECTIONS):
                s[TIMEOUTS + i] = math.inf
            base = row * ROW_BYTES + _NAMES_OFFSET
            self._view[base : base + MAX_SECTIONS * NAME_BYTES] = bytes(MAX_SECTIONS * NAME_BYTES)
            for name, timeout in config_timeouts.items():
                self._add_name(row, name, timeout)
            s[LEARN] = float(learn)
            for key, (longest, count) in (learned or {}).items():
                if key == "heartbeat":
                    s[LEARNED_HB], s[LEARNED_HB + 1] = longest, count
                elif key == "out_of_section":
                    s[LEARNED_OOS], s[LEARNED_OOS + 1] = longest, count
                elif key.startswith("section:"):
                    name = key.removeprefix("section:")
                    names = self._names(row)
                    if name in names:
                        index = names.index(name)
                    elif len(names) < MAX_SECTIONS - _PRELOAD_FREE:
                        index = self._add_name(row, name, None)
                    else:
                        continue
                    s[LEARNED_MAX + index], s[LEARNED_N + index] = longest, count

    def _add_name(self, row: int, name: str, timeout: float | None) -> int:
        s = self._slots[row]
        index = int(s[NAMES])
        encoded = name.encode()
        if index >= MAX_SECTIONS:
            raise ConfigError(f"at most {MAX_SECTIONS} section names, got {name!r} too")
        if not encoded or len(encoded) > NAME_BYTES:
            raise ConfigError(f"section name {name!r} must be 1..{NAME_BYTES} bytes")
        base = row * ROW_BYTES + _NAMES_OFFSET + index * NAME_BYTES
        self._view[base : base + NAME_BYTES] = encoded.ljust(NAME_BYTES, b"\0")
        s[TIMEOUTS + index] = _inf(timeout)
        s[NAMES] = float(index + 1)
        return index

    def add_section(self, row: int, name: str, timeout: float | None = None) -> int:
        """Register a section name in ``row`` (a rank, once per new name); its index."""
        with self.writing(row):
            return self._add_name(row, name, timeout)

    def names(self, row: int) -> list[str]:
        """The section names of ``row``, by index."""
        return self._names(row)

    def _names(self, row: int) -> list[str]:
        out = []
        for i in range(int(self._slots[row][NAMES])):
            base = row * ROW_BYTES + _NAMES_OFFSET + i * NAME_BYTES
            out.append(bytes(self._view[base : base + NAME_BYTES]).rstrip(b"\0").decode())
        return out

    # ------------------------------------------------------------------ reader
    def snapshot(self, row: int) -> RowSnapshot:
        """A consistent copy of ``row`` (retries while a writer is mid-update)."""
        s = self._slots[row]
        spins = 0
        while True:
            before = s[SEQ]
            if int(before) % 2 and spins < _MAX_SPINS:
                spins += 1
                os.sched_yield()
                continue  # a writer is mid-update; one that died mid-update is waited
                # for only _MAX_SPINS times, then its row is read as it is
            values = s.tolist()
            names = self.names(row)
            if s[SEQ] == before or spins >= _MAX_SPINS:
                break
            spins += 1
        return RowSnapshot(
            pid=int(values[PID]),
            attached=values[ATTACHED],
            last_heartbeat=values[LAST_HB],
            open_sections={
                n: values[OPENED + i] for i, n in enumerate(names) if values[OPENED + i] > 0
            },
            out_of_section_start=values[OOS_START],
            steps=int(values[STEPS]),
            heartbeats=int(values[HEARTBEATS]),
            initial_heartbeat_timeout=values[HB_INITIAL_TIMEOUT],
            heartbeat_timeout=values[HB_TIMEOUT],
            out_of_section_timeout=values[OOS_TIMEOUT],
            section_timeouts={n: values[TIMEOUTS + i] for i, n in enumerate(names)},
            closed=bool(values[CLOSED]),
            learn=int(values[LEARN]),
            learned_heartbeat=(values[LEARNED_HB], int(values[LEARNED_HB + 1])),
            learned_out_of_section=(values[LEARNED_OOS], int(values[LEARNED_OOS + 1])),
            learned_sections={
                n: (values[LEARNED_MAX + i], int(values[LEARNED_N + i]))
                for i, n in enumerate(names)
            },
            warm_sections=frozenset(
                n for i, n in enumerate(names) if int(values[WARM_SECTIONS]) >> i & 1
            ),
            warm_kinds=int(values[WARM_KINDS]),
            section_since_heartbeat=bool(values[HB_SECTIONS]),
        )
