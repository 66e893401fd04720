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
a section the config does not name), a kind with at least
``learned_timeout_min_samples`` intervals seen gets ``learned_timeout_margin`` x the
longest of them, never below ``learned_timeout_floor`` (the heartbeat's never above its
default; a section has none). Until then the defaults apply (an unnamed section: no
timeout, as in NVRx). A timeout the config sets (a null, a named section), or one
calculated with ``calculate_and_set_*_timeouts``, is the user's and is not replaced.

Why the longest interval and not a lower quantile: the operations a learned timeout
gets wrong are the rare long ones (a checkpoint every 2,000 steps is 0.05 % of the
intervals; any quantile below the maximum drops it, and the next checkpoint is then a
false hang). The robustness is in what is left out (the warm-up) and in the margin.

Kept across restarts: the launcher merges every row's learned state when a generation
ends (the longest of each kind, the most intervals seen), preloads the next generation's
rows with it (the ranks go on adding), and writes it to ``learned_timeouts.json`` beside
the run's event log, which a launcher of the same run (the rendezvous' run id) reads at
its start (a Slurm requeue, a job started again): learning is done once per job, not
once per restart.

The worst case (docs/learned-timeouts.md): an operation longer than the timeout in force
that the job never ran before it became ready (a first evaluation pass 50x a step when
the longest interval seen is a step) is taken for a hang, once: the rank is restarted,
and that kind is back on its default until seen ``learned_timeout_min_samples`` times
again (:meth:`Learned.overran`). Wrapping such operations in a section of their own
(NVRx's section API) keeps them on the defaults until they have been seen.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, FaultToleranceConfig
from .table import LEARN_HB, LEARN_OOS, LEARN_SECTIONS, RowSnapshot
from .timeouts import write_json

__all__ = ["LEARNED_FILE", "Learned", "effective", "learn_bits", "learned_timeout"]

#: The file beside the event log that keeps what a job learned.
LEARNED_FILE = "learned_timeouts.json"

_DEFAULTS = FaultToleranceConfig.__dataclass_fields__

logger = logging.getLogger(__name__)


def learn_bits(cfg: FaultToleranceConfig) -> int:
    """The table's LEARN bits for ``cfg``: which timeouts may be learned (those the
    config leaves at their defaults)."""
    if not cfg.learn_timeouts:
        return 0
    bits = LEARN_SECTIONS  # a section the config does not name
    if cfg.rank_heartbeat_timeout == _DEFAULTS["rank_heartbeat_timeout"].default:
        bits |= LEARN_HB  # (null, no heartbeat timeout, is the user's choice)
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
    # the heartbeat's: between heartbeats with no section in them (a section's own
    # timeout times the interval it ran in), once this process sent two
    quiet = not snap.open_sections and not snap.section_since_heartbeat
    if snap.learn & LEARN_HB and snap.warm_kinds & 1 and quiet:
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
            if math.isfinite(timeout) or name in cfg.rank_section_timeouts or name == "warmup":
                continue  # the config's (a null too), or calculated: the user's
            if name not in snap.warm_sections:  # its first run in this process: the default
                continue
            state = (snap.learned_sections or {}).get(name, (0.0, 0))
            value = learned_timeout(*state, cfg, math.inf)
            if value is not None:
                learned.add(f"section:{name}")
                sections[name] = value
        changes["section_timeouts"] = sections
    return replace(snap, **changes), learned  # type: ignore[arg-type]


class Learned:
    """What a node's ranks learned, merged over its rows and generations (the launcher's):
    ``(longest, count)`` under ``heartbeat``, ``out_of_section``, ``section:<name>``."""

    def __init__(self, path: Path | None = None, run_id: str = "") -> None:
        """``path``: the file that keeps it across job restarts (None: kept in memory
        only), read now where it holds what this run (``run_id``: the rendezvous' run
        id, the same for every node and across a Slurm requeue) learned; another run's,
        or a file that is not one (a warning names it), is not used."""
        self.path = path
        self.run_id = run_id
        self.kinds: dict[str, tuple[float, int]] = {}
        self._reset: set[str] = set()  # kinds a learned timeout cut: counted anew
        if path is not None and path.exists():
            try:
                self.kinds = _read(path, run_id)
            except ConfigError as exc:
                logger.warning("%s; learning from scratch", exc)

    def merge(self, snap: RowSnapshot) -> None:
        """Take in what a row learned: the longest of each kind, the most intervals."""
        found = {"heartbeat": snap.learned_heartbeat, "out_of_section": snap.learned_out_of_section}
        found.update({f"section:{n}": v for n, v in (snap.learned_sections or {}).items()})
        for key, (longest, count) in found.items():
            if count > 0:
                _keep(self.kinds, key, longest, count)

    def overran(self, what: str, elapsed: float) -> None:
        """A rank was taken for hung by the learned timeout of ``what`` after
        ``elapsed`` seconds: that kind goes back to its default until it has been seen
        ``learned_timeout_min_samples`` times again (an operation longer than any seen
        before then completes under the default and is learned: a false hang happens
        once), and its longest is at least ``elapsed`` from now on."""
        if what in ("heartbeat", "out_of_section") or what.startswith("section:"):
            old = self.kinds.get(what, (0.0, 0))
            self.kinds[what] = (max(old[0], elapsed), 0)
            self._reset.add(what)

    def save(self) -> None:
        """Write it to :attr:`path` (atomically: a reader sees the old file or the new),
        merged with what another node of the job wrote there meanwhile."""
        if self.path is None or not self.kinds:
            return
        merged = dict(self.kinds)
        if self.path.exists():
            try:
                for key, (longest, count) in _read(self.path, self.run_id).items():
                    _keep(merged, key, longest, 0 if key in self._reset else count)
            except ConfigError:
                pass  # ours replaces a file that went bad
        kinds = {k: {"longest": v[0], "count": v[1]} for k, v in merged.items()}
        write_json(self.path, {"run_id": self.run_id, "kinds": kinds})


def _keep(kinds: dict[str, tuple[float, int]], key: str, longest: float, count: int) -> None:
    """Merge ``(longest, count)`` into ``kinds[key]``: the longest of both, the most
    intervals seen."""
    old = kinds.get(key, (0.0, 0))
    kinds[key] = (max(old[0], longest), max(old[1], count))


def _read(path: Path, run_id: str) -> dict[str, tuple[float, int]]:
    """What run ``run_id`` learned, from ``path`` (empty: another run's); a file that is
    not one is a ConfigError naming it."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a learned-timeouts file ({exc})") from exc
    if not isinstance(raw, Mapping) or not isinstance(raw.get("kinds"), Mapping):
        raise ConfigError(f"{path}: expected a JSON object with 'run_id' and 'kinds'")
    if raw.get("run_id") != run_id:
        return {}
    out: dict[str, tuple[float, int]] = {}
    for key, value in raw["kinds"].items():
        ok = isinstance(value, Mapping) and isinstance(value.get("longest"), (int, float))
        if not ok or not isinstance(value.get("count"), int):
            raise ConfigError(f"{path}: {key!r}: expected {{'longest': seconds, 'count': n}}")
        out[str(key)] = (float(value["longest"]), int(value["count"]))
    return out
