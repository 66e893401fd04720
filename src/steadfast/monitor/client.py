"""RankMonitorClient: a rank's side of hang detection (seed 002's API).

Each rank reports liveness with heartbeats and/or sections (``setup``, ``step``,
``checkpointing``...). Under ``steadfast launch`` a report is a few stores into this
rank's row of the node's shared-memory heartbeat table (see
:mod:`steadfast.monitor.table`); the launcher's watcher reads the rows and terminates a
rank that overstays a timeout. Timeouts come from the launcher's
:class:`~steadfast.FaultToleranceConfig`, or are calculated from the intervals observed
on all ranks (``safety_factor`` x the max, merged half-and-half with an earlier
calculated value) and persisted with :meth:`state_dict` / :func:`save_ft_state`, in
NVRx's ``{"current_timeouts": ...}`` form (either library's ``ft_state.json`` loads in
the other). Sections may nest or overlap, as in NVRx.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..config import ConfigError, FaultToleranceConfig
from . import table as t
from .timeouts import HeartbeatTimeouts, SectionTimeouts, merge, write_json
from .timeouts import current as current_section_timeouts

logger = logging.getLogger(__name__)

__all__ = [
    "FT_CONFIG_ENV",
    "STACK_DUMP_SIGNAL",
    "RankMonitorClient",
    "RankMonitorClientError",
    "load_ft_state",
    "save_ft_state",
]

FT_CONFIG_ENV = "STEADFAST_FT_CONFIG"
#: The watcher sends this before terminating a hung rank; the client registered
#: ``faulthandler`` on it, so every thread's Python stack reaches the rank's log.
STACK_DUMP_SIGNAL = signal.SIGUSR2
_STATE_KEYS = (
    "initial_rank_heartbeat_timeout",
    "rank_heartbeat_timeout",
    "rank_section_timeouts",
    "rank_out_of_section_timeout",
)


def _max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over all ranks (one all-reduce), when torch.distributed runs."""
    import torch
    import torch.distributed as dist

    from ..dist import backend_device, is_distributed

    if not is_distributed() or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=backend_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


class RankMonitorClientError(RuntimeError):
    """The client was used wrongly (not initialised, a section opened twice or closed
    without being open), or there is not enough data to calculate timeouts (NVRx's
    ``RankMonitorClientError``)."""


class _NotUnderLauncher(RankMonitorClientError, ConfigError):
    """``init_workload_monitoring`` outside ``steadfast launch``: both kinds of error."""


class RankMonitorClient:
    """Reports this rank's heartbeats and sections to the launcher's watcher.

    NVRx's client, with its names: ``hb_timeouts`` / ``section_timeouts`` hold the
    timeouts in force (configured, replaced by calculated ones); ``state_dict()`` is
    ``{"current_timeouts": {"heartbeat": ..., "section": ...}}`` with only calculated
    values, the same on every rank. Sections may nest or overlap; the same name cannot
    be open twice. Unlike NVRx, a section need not be named in the config first (it has
    no timeout until one is calculated), and the calculations work without
    torch.distributed (one rank's maxima).
    """

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self) -> None:
        self.cfg: FaultToleranceConfig | None = None
        self.is_initialized = False
        self._table: t.HeartbeatTable | None = None
        self._row = 0
        self._slots: Any = None
        self._index: dict[str, int] = {}
        self._open: dict[str, float] = {}  # open section -> when
        self._first_step_seen = False
        self._oos_since = 0.0  # since when no section is open (attach, or the last close)
        self._attached = 0.0
        self._last_hb = 0.0
        # observed maxima, for calculated timeouts
        self._max_first_hb = 0.0
        self._max_hb = 0.0
        self._max_section: dict[str, float] = {}
        self._max_oos = 0.0
        # learned timeouts (monitor/learned.py): the first interval of each kind in this
        # process is a warm-up, not learned; nor a heartbeat interval a section ran in
        self._hb_warm = False
        self._oos_warm = False
        self._section_since_hb = False
        self._ran: set[str] = set()
        # calculated timeouts (absent: not calculated; the configured value applies)
        self._calc: dict[str, Any] = {"rank_section_timeouts": {}}
        self._floored: set[str] = set()  # calculated timeouts said to be lifted to the floor

    # ------------------------------------------------------------------ life cycle
    def init_workload_monitoring(self) -> None:
        """Attach to this node's heartbeat table (``$STEADFAST_HB_TABLE``, row
        ``$LOCAL_RANK``) and register the stack-dump signal. Needs ``steadfast launch``."""
        if self.is_initialized:
            raise RankMonitorClientError("RankMonitorClient is already initialized")
        path = os.environ.get(t.HB_TABLE_ENV)
        if not path:
            raise _NotUnderLauncher(
                f"RankMonitorClient needs `steadfast launch` (or ft_launcher): "
                f"${t.HB_TABLE_ENV} is not set"
            )
        row = int(os.environ.get("LOCAL_RANK", "0"))
        raw = os.environ.get(FT_CONFIG_ENV)
        try:
            self.cfg = FaultToleranceConfig.from_mapping(
                json.loads(raw) if raw else {}, source=f"${FT_CONFIG_ENV}"
            )
        except ValueError as exc:
            raise ConfigError(f"${FT_CONFIG_ENV}: {exc}") from exc
        logging.getLogger("steadfast").setLevel(self.cfg.log_level)  # the FT config's level
        self._table = t.HeartbeatTable.attach(path, row)
        self._row = row
        self._slots = self._table.slots(row)
        self._index = {name: i for i, name in enumerate(self._table.names(row))}
        self._attached = self._oos_since = time.monotonic()
        with self._table.writing(row) as s:
            s[t.PID] = float(os.getpid())
            s[t.ATTACHED] = self._attached
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        self.is_initialized = True
        self._apply_calculated()

    def shutdown_workload_monitoring(self) -> None:
        """Stop being monitored (a clean exit is not a hang) and release the table."""
        if self._table is None:
            return
        self._slots[t.CLOSED] = 1.0
        faulthandler.unregister(STACK_DUMP_SIGNAL)
        self._slots = None
        self._table.close()
        self._table = None
        self.is_initialized = False

    # ------------------------------------------------------------------ hot path
    def send_heartbeat(self) -> None:
        """This rank is alive (one clock read and a few stores)."""
        s = self._slots
        if s is None:
            raise RankMonitorClientError("RankMonitorClient is not initialized")
        now = time.monotonic()
        last = self._last_hb
        if last:
            took = now - last
            if took > self._max_hb:
                self._max_hb = took
            if self._hb_warm and not self._section_since_hb:
                if took > s[t.LEARNED_HB]:
                    s[t.LEARNED_HB] = took
                s[t.LEARNED_HB + 1] += 1
            elif not self._hb_warm:  # once per process: from now on the learned applies
                s[t.WARM_KINDS] = float(int(s[t.WARM_KINDS]) | 1)
            self._hb_warm = True
        elif now - self._attached > self._max_first_hb:
            self._max_first_hb = now - self._attached
        self._section_since_hb = bool(self._open)
        s[t.HB_SECTIONS] = 1.0 if self._open else 0.0
        self._last_hb = now
        s[t.LAST_HB] = now
        s[t.HEARTBEATS] += 1

    def start_section(self, section: str) -> None:
        """Open ``section``; its timeout runs until :meth:`end_section`. Sections may
        nest or overlap; opening one that is open already is an error."""
        now = time.monotonic()
        s = self._slots
        if s is None:
            raise RankMonitorClientError("RankMonitorClient is not initialized")
        if section in self._open:
            raise RankMonitorClientError(
                f"section {section!r} is already open; close it with end_section first"
            )
        index = self._index.get(section)
        if index is None:
            index = self._register(section)
        outside = 0.0
        if not self._open:
            outside = now - self._oos_since
            if outside > self._max_oos:
                self._max_oos = outside
        self._open[section] = now
        self._section_since_hb = True
        s[t.SEQ] += 1  # this rank is its row's only writer: even on entry
        s[t.HB_SECTIONS] = 1.0
        if outside and self._first_step_seen:  # out of section is watched from here on
            if self._oos_warm:
                if outside > s[t.LEARNED_OOS]:
                    s[t.LEARNED_OOS] = outside
                s[t.LEARNED_OOS + 1] += 1
            else:  # once per process
                s[t.WARM_KINDS] = float(int(s[t.WARM_KINDS]) | 2)
            self._oos_warm = True
        s[t.OPENED + index] = now
        s[t.OPEN] += 1
        s[t.SEQ] += 1

    def end_section(self, section: str) -> None:
        """Close ``section`` (it must be open)."""
        now = time.monotonic()
        opened = self._open.pop(section, None)
        if opened is None:
            raise RankMonitorClientError(f"end_section({section!r}): that section is not open")
        took = now - opened
        if took > self._max_section.get(section, 0.0):
            self._max_section[section] = took
        s = self._slots
        index = self._index[section]
        s[t.SEQ] += 1  # this rank is its row's only writer: even on entry
        s[t.OPENED + index] = 0.0
        s[t.OPEN] -= 1
        if section in self._ran:
            if took > s[t.LEARNED_MAX + index]:
                s[t.LEARNED_MAX + index] = took
            s[t.LEARNED_N + index] += 1
        else:  # its first run in this process: a warm-up, from now on the learned applies
            self._ran.add(section)
            s[t.WARM_SECTIONS] = float(int(s[t.WARM_SECTIONS]) | 1 << index)
        if section == "step":
            self._first_step_seen = True
            s[t.STEPS] += 1
        if not self._open:
            self._oos_since = now
            if self._first_step_seen:  # out of section is watched from the first step on
                s[t.OOS_START] = now
        s[t.SEQ] += 1

    def end_all_sections(self) -> None:
        """Close every open section (nothing when none is open)."""
        for section in list(self._open):
            self.end_section(section)

    def _register(self, name: str) -> int:
        assert self._table is not None, "init_workload_monitoring() first"
        timeout = self._calc["rank_section_timeouts"].get(name)
        index = self._table.add_section(self._row, name, timeout)
        self._index[name] = index
        if timeout is not None:  # a new name with a calculated timeout (once per name)
            self._table.wake_watcher()
        return index

    # ------------------------------------------------------------------ timeouts
    @property
    def hb_timeouts(self) -> HeartbeatTimeouts | None:
        """The heartbeat timeouts in force (None before ``init_workload_monitoring``)."""
        if self.cfg is None:
            return None
        calc = self._calc
        calculated = calc.get("rank_heartbeat_timeout") is not None
        return HeartbeatTimeouts(
            initial=calc.get("initial_rank_heartbeat_timeout")
            or self.cfg.initial_rank_heartbeat_timeout,
            subsequent=calc.get("rank_heartbeat_timeout") or self.cfg.rank_heartbeat_timeout,
            were_calculated=calculated,
        )

    @property
    def section_timeouts(self) -> SectionTimeouts | None:
        """The section timeouts in force (None before ``init_workload_monitoring``)."""
        if self.cfg is None:
            return None
        return current_section_timeouts(
            self.cfg.rank_section_timeouts,
            self.cfg.rank_out_of_section_timeout,
            self._calc["rank_section_timeouts"],
            self._calc.get("rank_out_of_section_timeout"),
            seen=self._index,
        )

    def _merge(self, current: float | None, observed: float) -> float:
        assert self.cfg is not None
        return merge(self.cfg.safety_factor * observed, current)

    def _not_ready(self, skip_if_not_ready: bool) -> bool:
        if skip_if_not_ready:
            return False
        raise RankMonitorClientError("Not enough data to compute timeouts.")

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Set the heartbeat timeouts from the intervals seen on all ranks; collective
        under torch.distributed (every rank calls it). Without a first and a later
        heartbeat seen on some rank there is not enough data: RankMonitorClientError,
        or False with ``skip_if_not_ready``. True when set."""
        self._require()
        first, sub = _max_over_ranks([self._max_first_hb, self._max_hb])
        if first <= 0 or sub <= 0:
            return self._not_ready(skip_if_not_ready)
        self._calc["initial_rank_heartbeat_timeout"] = self._merge(
            self._calc.get("initial_rank_heartbeat_timeout"), first
        )
        self._calc["rank_heartbeat_timeout"] = self._merge(
            self._calc.get("rank_heartbeat_timeout"), sub
        )
        self._apply_calculated()
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Iterable[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Set the timeouts of ``selected_sections`` (default: every configured or seen
        section) and, with ``calc_out_of_section``, of the time outside any section,
        from the intervals seen on all ranks; collective under torch.distributed (every
        rank passes the same arguments). A selected section never completed on any rank
        (or no out-of-section time seen) is not enough data: RankMonitorClientError, or
        False with ``skip_if_not_ready``. True when set."""
        cfg = self._require()
        now = time.monotonic()
        if not self._open and now - self._oos_since > self._max_oos:  # the time since the
            self._max_oos = now - self._oos_since  # last section may be the longest one
        names = sorted(
            set(selected_sections)
            if selected_sections is not None
            else set(cfg.rank_section_timeouts) | set(self._max_section)
        )
        observed = _max_over_ranks([self._max_section.get(n, 0.0) for n in names] + [self._max_oos])
        if any(v <= 0 for v in observed[:-1]) or (calc_out_of_section and observed[-1] <= 0):
            return self._not_ready(skip_if_not_ready)
        calc = self._calc["rank_section_timeouts"]
        for name, value in zip(names, observed[:-1], strict=True):
            calc[name] = self._merge(calc.get(name), value)
        if calc_out_of_section:
            self._calc["rank_out_of_section_timeout"] = self._merge(
                self._calc.get("rank_out_of_section_timeout"), observed[-1]
            )
        self._apply_calculated()
        return True

    def _require(self) -> FaultToleranceConfig:
        if self.cfg is None or self._table is None:
            raise RankMonitorClientError("RankMonitorClient is not initialized")
        return self.cfg

    def _enforced(self, what: str, value: float) -> float:
        """The deadline the watcher enforces for a calculated timeout: never below
        ``calculated_timeout_floor`` (1 s). A loop of back-to-back sections sees a few
        microseconds outside them, and safety_factor x that would end a healthy rank at
        its first pause outside a section (NVRx's documented pattern with
        ``calc_out_of_section=True``: the watcher wakes at the deadline, it does not
        poll every 5 s). The calculated value itself is kept (state_dict,
        ``section_timeouts``), as NVRx computes it."""
        floor = self.cfg.calculated_timeout_floor if self.cfg is not None else 0.0
        if value >= floor:
            return value
        if what not in self._floored:
            self._floored.add(what)
            logger.warning(
                "calculated %s timeout %.3g s is below calculated_timeout_floor: %g s enforced",
                what, value, floor,
            )  # fmt: skip
        return floor

    def _apply_calculated(self) -> None:
        """Write calculated timeouts into this rank's row (the watcher reads them)."""
        if self._table is None:
            return
        calc = self._calc
        with self._table.writing(self._row) as s:
            for key, slot in (
                ("initial_rank_heartbeat_timeout", t.HB_INITIAL_TIMEOUT),
                ("rank_heartbeat_timeout", t.HB_TIMEOUT),
                ("rank_out_of_section_timeout", t.OOS_TIMEOUT),
            ):
                if calc.get(key) is not None:
                    s[slot] = self._enforced(key, float(calc[key]))
            # a calculated timeout is the user's: it is not replaced by a learned one
            learn = int(s[t.LEARN])
            if calc.get("rank_heartbeat_timeout") is not None:
                learn &= ~t.LEARN_HB
            if calc.get("rank_out_of_section_timeout") is not None:
                learn &= ~t.LEARN_OOS
            s[t.LEARN] = float(learn)
        for name, value in calc["rank_section_timeouts"].items():
            index = self._index.get(name)
            if index is None:
                index = self._register(name)
            self._slots[t.TIMEOUTS + index] = self._enforced(f"section {name}", float(value))
        if (
            any(v is not None for k, v in calc.items() if k != "rank_section_timeouts")
            or (calc["rank_section_timeouts"])
        ):
            # the watcher may sleep until a deadline of the old (longer) timeouts
            self._table.wake_watcher()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The calculated timeouts (the same on every rank), in NVRx's form, e.g. for
        ``ft_state.json``: ``{"current_timeouts": {"heartbeat": {...}, "section":
        {...}}}``, each part present only when something in it was calculated."""
        out: dict[str, Any] = {}
        hb = self.hb_timeouts
        if hb is not None and hb.were_calculated and hb.are_valid:
            out["heartbeat"] = dataclasses.asdict(hb)
        sections = self.section_timeouts
        if sections is not None and (
            sections.calculated_sections or sections.is_out_of_section_calculated
        ):
            part = dataclasses.asdict(sections)
            part["calculated_sections"] = sorted(sections.calculated_sections)
            out["section"] = part
        copy: dict[str, Any] = json.loads(json.dumps({self.CURRENT_TIMEOUTS_STATE_KEY: out}))
        return copy

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Use calculated timeouts saved by :meth:`state_dict` (NVRx's form, or the
        flat form earlier steadfast versions wrote); before or after
        ``init_workload_monitoring``. Only the calculated values are taken: a timeout
        that was configured comes from this run's config."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"ft state: expected a mapping, got {type(state).__name__}")
        if self.CURRENT_TIMEOUTS_STATE_KEY in state:
            calc = _calculated_from_nvrx(state[self.CURRENT_TIMEOUTS_STATE_KEY])
        else:
            calc = _calculated_from_flat(state)
        self._calc = calc
        self._apply_calculated()


def _calculated_from_nvrx(current: Any) -> dict[str, Any]:
    """The calculated timeouts of a ``current_timeouts`` state (NVRx's form)."""
    where = "ft state.current_timeouts"
    if not isinstance(current, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(current) - {"heartbeat", "section"})
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: ['heartbeat', 'section']")
    calc: dict[str, Any] = {"rank_section_timeouts": {}}
    hb = current.get("heartbeat")
    if hb is not None:
        if not isinstance(hb, Mapping):
            raise ConfigError(f"{where}.heartbeat: expected a mapping")
        if hb.get("were_calculated"):
            for key, name in (
                ("initial", "initial_rank_heartbeat_timeout"),
                ("subsequent", "rank_heartbeat_timeout"),
            ):
                calc[name] = _positive(f"{where}.heartbeat.{key}", hb.get(key))
    sec = current.get("section")
    if sec is not None:
        if not isinstance(sec, Mapping) or not isinstance(sec.get("section", {}), Mapping):
            raise ConfigError(f"{where}.section: expected a mapping with a 'section' mapping")
        values = sec.get("section", {})
        for name in sec.get("calculated_sections") or []:
            if name not in values:
                raise ConfigError(f"{where}.section: calculated section {name!r} has no value")
            calc["rank_section_timeouts"][str(name)] = _positive(
                f"{where}.section.section.{name}", values[name]
            )
        if sec.get("is_out_of_section_calculated"):
            calc["rank_out_of_section_timeout"] = _positive(
                f"{where}.section.out_of_section", sec.get("out_of_section")
            )
    return calc


def _calculated_from_flat(state: Mapping[str, Any]) -> dict[str, Any]:
    """The calculated timeouts of steadfast's earlier flat form."""
    unknown = sorted(set(state) - set(_STATE_KEYS))
    if unknown:
        raise ConfigError(f"ft state: unknown keys {unknown}; known: {list(_STATE_KEYS)}")
    calc: dict[str, Any] = {"rank_section_timeouts": {}}
    for key in _STATE_KEYS[:2] + _STATE_KEYS[3:]:
        value = state.get(key)
        if value is not None:
            calc[key] = _positive(f"ft state.{key}", value)
    sections = state.get("rank_section_timeouts") or {}
    if not isinstance(sections, Mapping):
        raise ConfigError("ft state.rank_section_timeouts: expected a mapping")
    for name, value in sections.items():
        calc["rank_section_timeouts"][str(name)] = _positive(
            f"ft state.rank_section_timeouts.{name}", value
        )
    return calc


def _positive(field: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{field}: expected a positive number of seconds, got {value!r}")
    return float(value)


def save_ft_state(client: RankMonitorClient, path: str | os.PathLike[str]) -> None:
    """Write ``client.state_dict()`` to ``path`` (``ft_state.json``) atomically."""
    write_json(path, client.state_dict())


def load_ft_state(client: RankMonitorClient, path: str | os.PathLike[str]) -> bool:
    """Load ``ft_state.json`` into ``client`` if it exists; False when it does not."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return False
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    try:
        client.load_state_dict(state)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return True
