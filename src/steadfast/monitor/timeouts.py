"""The timeouts a rank runs with, in NVRx's shapes, and how calculated ones are merged.

:class:`HeartbeatTimeouts` and :class:`SectionTimeouts` are what
``RankMonitorClient.hb_timeouts`` / ``.section_timeouts`` hold (the configured values,
replaced by calculated ones where those exist) and what ``state_dict()`` persists under
``"current_timeouts"``, field for field as NVRx's ``fault_tolerance.data`` names them, so
an ``ft_state.json`` written by either loads in the other.

A calculated timeout is ``safety_factor x`` the longest interval seen on any rank; when
one was already calculated, the new value is merged half and half with it (an average
that follows a slowly changing job without being thrown by one outlier).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HeartbeatTimeouts", "SectionTimeouts", "merge", "write_json"]


def merge(new: float, current: float | None) -> float:
    """A newly calculated timeout merged with the one calculated before (if any)."""
    return new if current is None else 0.5 * new + 0.5 * current


@dataclass
class HeartbeatTimeouts:
    """``initial``: until the first heartbeat; ``subsequent``: between heartbeats; None
    is infinite. ``were_calculated``: from observed intervals, not the config."""

    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool | None = None

    @property
    def are_valid(self) -> bool:
        """Both are finite."""
        return self.initial is not None and self.subsequent is not None


@dataclass
class SectionTimeouts:
    """``section``: name -> timeout (None: infinite); ``out_of_section``: while no
    section is open; which of them were calculated from observed intervals."""

    section: dict[str, float | None] = field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: set[str] = field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.section = dict(self.section)
        self.calculated_sections = set(self.calculated_sections)

    @property
    def were_calculated(self) -> bool:
        """Every section's timeout and the out-of-section one were calculated."""
        return self.calculated_sections == set(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        """Every timeout is finite."""
        return all(t is not None for t in self.section.values()) and self.out_of_section is not None


def current(
    configured: Mapping[str, float | None],
    configured_oos: float | None,
    calculated: Mapping[str, float],
    calculated_oos: float | None,
    seen: Iterable[str] = (),
) -> SectionTimeouts:
    """The section timeouts in force: the configured ones (and sections seen since,
    infinite), each replaced by its calculated value where there is one."""
    names = dict.fromkeys([*configured, *seen, *calculated])
    return SectionTimeouts(
        section={n: calculated.get(n, configured.get(n)) for n in names},
        out_of_section=calculated_oos if calculated_oos is not None else configured_oos,
        calculated_sections=set(calculated),
        is_out_of_section_calculated=calculated_oos is not None,
    )


def write_json(path: str | os.PathLike[str], value: Any) -> None:
    """Write ``value`` as JSON to ``path`` durably and atomically (a unique temporary
    file beside it, synced, renamed over it): a reader, or a launcher started after a
    crash, sees the old file or the new one, never a part. How timeouts are kept:
    ``ft_state.json``, ``learned_timeouts.json``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(value, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
