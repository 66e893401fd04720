"""Hang timeouts learned online, so that a user who configures none is not left with
NVRx's defaults (a first heartbeat within an hour, then 45 minutes between heartbeats:
a hang costs an hour).

What is learned, per rank, from what the rank reports anyway (no new call, and no
system call on the hot path: the rank adds each interval to two slots of its row of the
heartbeat table, :mod:`.table`): the longest run of each section, the longest time out of
sections, and the longest interval between heartbeats sent while no section was open
(a section's own timeout covers the time inside it). The first interval of each kind in
a process is left out: a warm-up (compilation, cache fills) that the next ones do not
repeat.

What applies (:func:`effective`, in the launcher's watcher): once the process has run a
kind once (its warm-up, under the default: a restarted generation compiles again, even
with what earlier ones learned preloaded), and where the config leaves a timeout at its
default (the heartbeat's at NVRx's 45 minutes, no timeout out of sections,
a section the config names no timeout for), a kind with at least
``learned_timeout_min_samples`` intervals seen gets ``learned_timeout_margin`` x the
longest of them, never below ``learned_timeout_floor`` and never above the default (an
unnamed section's default is ``rank_heartbeat_timeout``). Until then the defaults apply.
A timeout the config sets, or one calculated with ``calculate_and_set_*_timeouts``,
is the user's and is not replaced.

Why the longest interval and not a lower quantile: the operations a learned timeout
gets wrong are the rare long ones (a checkpoint every 2,000 steps is 0.05 % of the
intervals; any quantile below the maximum drops it, and the next checkpoint is then a
false hang). The robustness is in what is left out (the warm-up) and in the margin.

Kept across restarts: the launcher merges every row's learned state when a generation
ends (the longest of each kind, the most intervals seen), preloads the next generation's
rows with it (the ranks go on adding), and writes it to ``learned_timeouts.json`` beside
the run's event log, which a launcher of the same run reads at its start (a Slurm
requeue, a job started again): learning is done once per job, not once per restart.

The worst case (docs/learned-timeouts.md): an operation longer than the timeout in force
that the job never ran before it became ready (a first evaluation pass 50x a step when
the longest interval seen is a step) is taken for a hang, once: the rank is restarted,
and the interval it overran is learned as at least what it reached. Wrapping such
operations in a section of their own (NVRx's section API) keeps them on the defaults
until they have been seen.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, FaultToleranceConfig
from .table import LEARN_HB, LEARN_OOS, LEARN_SECTIONS, RowSnapshot

__all__ = ["LEARNED_FILE", "Learned", "effective", "learn_bits", "learned_timeout"]

#: The file beside the event log that keeps what a job learned.
LEARNED_FILE = "learned_timeouts.json"

_DEFAULTS = FaultToleranceConfig.__dataclass_fields__


def learn_bits(cfg: FaultToleranceConfig) -> int:
    """The table's LEARN bits for ``cfg``: which timeouts may be learned (those the
    config leaves at their defaults)."""
    if not cfg.learn_timeouts:
        return 0
    bits = LEARN_SECTIONS  # a section the config names no timeout for
    default_hb = _DEFAULTS["rank_heartbeat_timeout"].default
    if cfg.rank_heartbeat_timeout is None or cfg.rank_heartbeat_timeout == default_hb:
        bits |= LEARN_HB
    if cfg.rank_out_of_section_timeout is None:
        bits |= LEARN_OOS
    return bits


def learned_timeout(
    longest: float, count: int, cfg: FaultToleranceConfig, default: float
) -> float | None:
    """The learned timeout of a kind with ``count`` intervals, the longest ``longest``:
    None until ready; never above ``default`` (a finite default)."""
    if count < cfg.learned_timeout_min_samples or longest <= 0:
        return None
    value = max(cfg.learned_timeout_floor, cfg.learned_timeout_margin * longest)
    return min(value, default) if math.isfinite(default) else value


def effective(snap: RowSnapshot, cfg: FaultToleranceConfig) -> tuple[RowSnapshot, set[str]]:
    """``snap`` with the learned timeouts in force in place of the defaults, and which
    of its timeouts are learned (``heartbeat``, ``out_of_section``, ``section:<name>``,
    as :class:`~.watcher.Hang` names what timed out)."""
    if not snap.learn:
        return snap, set()
    learned: set[str] = set()
    changes: dict[str, object] = {}
    default = cfg.rank_heartbeat_timeout
    fallback = math.inf if default is None else float(default)
    if snap.learn & LEARN_HB and snap.warm_kinds & 1 and not snap.open_sections:
        value = learned_timeout(*snap.learned_heartbeat, cfg, snap.heartbeat_timeout)
        if value is not None:
            changes["heartbeat_timeout"] = value
            learned.add("heartbeat")
    if snap.learn & LEARN_OOS and snap.warm_kinds & 2:
        value = learned_timeout(*snap.learned_out_of_section, cfg, snap.out_of_section_timeout)
        if value is not None:
            changes["out_of_section_timeout"] = value
            learned.add("out_of_section")
    if snap.learn & LEARN_SECTIONS:
        sections = dict(snap.section_timeouts)
        for name, timeout in snap.section_timeouts.items():
            if math.isfinite(timeout) or name == "warmup":
                continue  # the config's, or calculated: the user's
            state = (snap.learned_sections or {}).get(name, (0.0, 0))
            value = None
            if name in snap.warm_sections:  # its first run in this process: the default
                value = learned_timeout(*state, cfg, fallback)
            if value is not None:
                learned.add(f"section:{name}")
            sections[name] = fallback if value is None else value
        changes["section_timeouts"] = sections
    return replace(snap, **changes), learned  # type: ignore[arg-type]


class Learned:
    """What a node's ranks learned, merged over its rows and generations (the launcher's):
    ``(longest, count)`` under ``heartbeat``, ``out_of_section``, ``section:<name>``."""

    def __init__(self, path: Path | None = None) -> None:
        """``path``: the file that keeps it across job restarts (None: kept in memory
        only); read now where it exists."""
        self.path = path
        self.kinds: dict[str, tuple[float, int]] = {}
        if path is not None and path.exists():
            self.kinds = _read(path)

    def merge(self, snap: RowSnapshot) -> None:
        """Take in what a row learned: the longest of each kind, the most intervals."""
        found = {"heartbeat": snap.learned_heartbeat, "out_of_section": snap.learned_out_of_section}
        found.update({f"section:{n}": v for n, v in (snap.learned_sections or {}).items()})
        for key, (longest, count) in found.items():
            if count <= 0:
                continue
            old = self.kinds.get(key, (0.0, 0))
            self.kinds[key] = (max(old[0], longest), max(old[1], count))

    def overran(self, what: str, elapsed: float) -> None:
        """A rank was taken for hung by the learned timeout of ``what`` after
        ``elapsed`` seconds: that kind's longest is at least that from now on."""
        if what in ("heartbeat", "out_of_section") or what.startswith("section:"):
            old = self.kinds.get(what, (0.0, 0))
            self.kinds[what] = (max(old[0], elapsed), old[1])

    def save(self) -> None:
        """Write it to :attr:`path` (atomically: a reader sees the old file or the new),
        merged with what another node of the job wrote there meanwhile."""
        if self.path is None or not self.kinds:
            return
        merged = dict(self.kinds)
        if self.path.exists():
            try:
                for key, (longest, count) in _read(self.path).items():
                    old = merged.get(key, (0.0, 0))
                    merged[key] = (max(old[0], longest), max(old[1], count))
            except ConfigError:
                pass  # ours replaces a file that went bad
        body = json.dumps({k: {"longest": v[0], "count": v[1]} for k, v in merged.items()})
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _read(path: Path) -> dict[str, tuple[float, int]]:
    """The learned state in ``path``; a file that is not one is a ConfigError naming it."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a learned-timeouts file ({exc})") from exc
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a JSON object of kinds, got {type(raw).__name__}")
    out: dict[str, tuple[float, int]] = {}
    for key, value in raw.items():
        ok = isinstance(value, Mapping) and isinstance(value.get("longest"), (int, float))
        if not ok or not isinstance(value.get("count"), int):
            raise ConfigError(f"{path}: {key!r}: expected {{'longest': seconds, 'count': n}}")
        out[str(key)] = (float(value["longest"]), int(value["count"]))
    return out
