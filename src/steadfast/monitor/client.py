"""RankMonitorClient: a rank's side of hang detection (seed 002's API).

Each rank reports liveness with heartbeats and/or sections (``setup``, ``step``,
``checkpointing``...). Under ``steadfast launch`` a report is a few stores into this
rank's row of the node's shared-memory heartbeat table (see
:mod:`steadfast.monitor.table`); the launcher's watcher reads the rows and terminates a
rank that overstays a timeout. Timeouts come from the launcher's
:class:`~steadfast.FaultToleranceConfig`, or are calculated from the intervals observed
on all ranks (``safety_factor`` x the max, merged half-and-half with an earlier
calculated value) and persisted with :meth:`state_dict` / :func:`save_ft_state`.
"""

from __future__ import annotations

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

__all__ = [
    "FT_CONFIG_ENV",
    "STACK_DUMP_SIGNAL",
    "RankMonitorClient",
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


class RankMonitorClient:
    """Reports this rank's heartbeats and sections to the launcher's watcher."""

    def __init__(self) -> None:
        self.cfg: FaultToleranceConfig | None = None
        self._table: t.HeartbeatTable | None = None
        self._row = 0
        self._slots: Any = None
        self._index: dict[str, int] = {}
        self._open: str | None = None
        self._open_start = 0.0
        self._first_step_seen = False
        self._oos_start = 0.0
        self._attached = 0.0
        self._last_hb = 0.0
        # observed maxima, for calculated timeouts
        self._max_first_hb = 0.0
        self._max_hb = 0.0
        self._max_section: dict[str, float] = {}
        self._max_oos = 0.0
        # calculated timeouts (None: not calculated; the configured value applies)
        self._calc: dict[str, Any] = {"rank_section_timeouts": {}}

    # ------------------------------------------------------------------ life cycle
    def init_workload_monitoring(self) -> None:
        """Attach to this node's heartbeat table (``$STEADFAST_HB_TABLE``, row
        ``$LOCAL_RANK``) and register the stack-dump signal. Needs ``steadfast launch``."""
        path = os.environ.get(t.HB_TABLE_ENV)
        if not path:
            raise ConfigError(
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
        self._attached = time.monotonic()
        with self._table.writing(row) as s:
            s[t.PID] = float(os.getpid())
            s[t.ATTACHED] = self._attached
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
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

    # ------------------------------------------------------------------ hot path
    def send_heartbeat(self) -> None:
        """This rank is alive (one clock read and a few stores)."""
        now = time.monotonic()
        last = self._last_hb
        if last:
            if now - last > self._max_hb:
                self._max_hb = now - last
        elif now - self._attached > self._max_first_hb:
            self._max_first_hb = now - self._attached
        self._last_hb = now
        s = self._slots
        s[t.LAST_HB] = now
        s[t.HEARTBEATS] += 1

    def start_section(self, name: str) -> None:
        """Enter section ``name``; its timeout runs until :meth:`end_section`."""
        now = time.monotonic()
        if self._open is not None:
            raise RuntimeError(f"section {name!r} started while {self._open!r} is open")
        index = self._index.get(name)
        if index is None:
            index = self._register(name)
        if self._first_step_seen and now - self._oos_start > self._max_oos:
            self._max_oos = now - self._oos_start
        self._open, self._open_start = name, now
        s = self._slots
        s[t.SEQ] += 1  # this rank is its row's only writer: even on entry
        s[t.SECTION] = index
        s[t.SECTION_START] = now
        s[t.SEQ] += 1

    def end_section(self, name: str) -> None:
        """Leave section ``name`` (the one open)."""
        now = time.monotonic()
        if self._open != name:
            raise RuntimeError(f"end_section({name!r}) but the open section is {self._open!r}")
        took = now - self._open_start
        if took > self._max_section.get(name, 0.0):
            self._max_section[name] = took
        self._open = None
        s = self._slots
        s[t.SEQ] += 1  # this rank is its row's only writer: even on entry
        s[t.SECTION] = -1.0
        if name == "step":
            self._first_step_seen = True
            s[t.STEPS] += 1
        if self._first_step_seen:
            self._oos_start = now
            s[t.OOS_START] = now
        s[t.SEQ] += 1

    def end_all_sections(self) -> None:
        """Leave the open section, if any."""
        if self._open is not None:
            self.end_section(self._open)

    def _register(self, name: str) -> int:
        assert self._table is not None, "init_workload_monitoring() first"
        timeout = self._calc["rank_section_timeouts"].get(name)
        index = self._table.add_section(self._row, name, timeout)
        self._index[name] = index
        if timeout is not None:  # a new name with a calculated timeout (once per name)
            self._table.wake_watcher()
        return index

    # ------------------------------------------------------------------ timeouts
    def _merge(self, current: float | None, observed: float) -> float:
        assert self.cfg is not None
        new = self.cfg.safety_factor * observed
        return new if current is None else 0.5 * new + 0.5 * current

    def calculate_and_set_hb_timeouts(self) -> bool:
        """Set the heartbeat timeouts from the intervals seen on all ranks; collective
        under torch.distributed. False (nothing set) if no rank saw two heartbeats."""
        self._require()
        first, sub = _max_over_ranks([self._max_first_hb, self._max_hb])
        if sub <= 0:
            return False
        self._calc["initial_rank_heartbeat_timeout"] = self._merge(
            self._calc.get("initial_rank_heartbeat_timeout"), first
        )
        self._calc["rank_heartbeat_timeout"] = self._merge(
            self._calc.get("rank_heartbeat_timeout"), sub
        )
        self._apply_calculated()
        return True

    def calculate_and_set_section_timeouts(
        self, selected_sections: Iterable[str] | None = None, calc_out_of_section: bool = True
    ) -> bool:
        """Set the timeouts of ``selected_sections`` (default: every configured or seen
        section) and of out-of-section time from the intervals seen on all ranks;
        collective under torch.distributed (every rank must pass the same arguments)."""
        cfg = self._require()
        names = sorted(
            set(selected_sections)
            if selected_sections is not None
            else set(cfg.rank_section_timeouts) | set(self._max_section)
        )
        observed = _max_over_ranks([self._max_section.get(n, 0.0) for n in names] + [self._max_oos])
        calc = self._calc["rank_section_timeouts"]
        changed = False
        for name, value in zip(names, observed[:-1], strict=True):
            if value > 0:
                calc[name] = self._merge(calc.get(name), value)
                changed = True
        if calc_out_of_section and observed[-1] > 0:
            self._calc["rank_out_of_section_timeout"] = self._merge(
                self._calc.get("rank_out_of_section_timeout"), observed[-1]
            )
            changed = True
        self._apply_calculated()
        return changed

    def _require(self) -> FaultToleranceConfig:
        if self.cfg is None or self._table is None:
            raise RuntimeError("RankMonitorClient: call init_workload_monitoring() first")
        return self.cfg

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
                    s[slot] = float(calc[key])
        for name, value in calc["rank_section_timeouts"].items():
            index = self._index.get(name)
            if index is None:
                index = self._register(name)
            self._slots[t.TIMEOUTS + index] = float(value)
        if (
            any(v is not None for k, v in calc.items() if k != "rank_section_timeouts")
            or (calc["rank_section_timeouts"])
        ):
            # the watcher may sleep until a deadline of the old (longer) timeouts
            self._table.wake_watcher()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The calculated timeouts (the same on every rank), e.g. for ``ft_state.json``."""
        copy: dict[str, Any] = json.loads(json.dumps(self._calc))  # a deep copy
        return copy

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Use calculated timeouts saved by :meth:`state_dict` (e.g. after a restart)."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"ft state: expected a mapping, got {type(state).__name__}")
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
        self._calc = calc
        self._apply_calculated()


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
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(client.state_dict(), fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)


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
