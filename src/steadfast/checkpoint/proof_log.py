"""What a replay proof (:mod:`.proof`) reads from the run's event log before a restore,
in one pass over its tail:

- the losses each rank's ``step_done`` carried, per step (the newest of each, leaving
  out the generations whose restore failed its proof): the re-done steps are compared
  with them;
- the state keys of the newest restore proven by replay (``restore_verified``, route
  losses, state or both) that no ``restore_mismatch`` followed: that restore showed
  the checkpoints hold every state the loop's result depends on;
- the ledger: each disk checkpoint's digest at save time (``checkpoint_saved``'s
  ``digest``, the CRC-32s of its files as its manifest lists them), outside the
  checkpoint's folder, so a checkpoint that is not the one saved under its name (a
  swapped or stale folder, whole and consistent in itself) cannot match it.

A later restore whose checkpoint matches its ledger entry, with the keys the proven
restore had, is exact without a step re-done (:mod:`.proof`'s ledger route).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOG_TAIL", "NEEDED", "Logged", "ceiling", "digest", "logged_losses", "read_log"]

#: Re-done steps whose losses prove a restore (why three: :mod:`.proof`'s description).
NEEDED = 3
#: The end of the event log read (the steps a restart re-does are the last ones logged;
#: a log of a long job at scale is many GB).
LOG_TAIL = 64 << 20
#: The routes that prove a restore by replay (not by an earlier proof and the ledger).
REPLAY_ROUTES = ("losses", "state", "both")


@dataclass
class Logged:
    """What the log holds for a proof (see the module's description)."""

    #: rank -> step -> the loss of its newest ``step_done`` (a float, or a string for a
    #: non-finite one)
    losses: dict[int, dict[int, Any]] = field(default_factory=dict)
    #: the state keys of the newest restore proven by replay that nothing refuted since
    proven: list[str] | None = None
    #: when that proven restore was logged (its event's time)
    proven_at: float | None = None
    #: a disk checkpoint's folder -> its digest at its newest save
    saved: dict[str, str] = field(default_factory=dict)


def digest(files: dict[str, Any]) -> str:
    """A checkpoint's digest: its files' names, sizes and CRC-32s as its manifest lists
    them (SHA-256 of them, 16 hex digits)."""
    h = hashlib.sha256()
    for name, meta in sorted(files.items()):
        h.update(f"{name}:{meta.get('bytes')}:{meta.get('crc32')}\n".encode())
    return h.hexdigest()[:16]


def _generation(e: dict[str, Any]) -> tuple[Any, Any]:
    """The workers' generation an event comes from: its Slurm and in-job restarts."""
    return e.get("slurm_restart"), e.get("restart")


_OTHERS = (b'"restore_mismatch"', b'"restore_verified"', b'"checkpoint_saved"')


def read_log(path: str | None, before: float) -> Logged:
    """The log's losses, proven keys and ledger (see :class:`Logged`), from its last
    :data:`LOG_TAIL` bytes, of events logged before ``before``."""
    found: dict[int, dict[int, list[tuple[float, Any, tuple[Any, Any]]]]] = {}
    bad: set[tuple[Any, Any]] = set()  # generations whose restore failed its proof
    logged = Logged()
    refuted = -1.0  # the newest restore_mismatch's time
    if path is None:
        return logged
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - LOG_TAIL))
            if size > LOG_TAIL:
                f.readline()  # the first line read may be cut
            for raw in f:
                if b'"step_done"' in raw:
                    if b'"loss"' not in raw:
                        continue
                elif not any(w in raw for w in _OTHERS):
                    continue
                try:
                    e = json.loads(raw)
                except ValueError:
                    continue  # a line cut by a crash
                at, kind = e.get("time"), e.get("kind")
                if not isinstance(at, float) or at >= before:
                    continue
                if kind == "restore_mismatch":
                    bad.add(_generation(e))
                    refuted = max(refuted, at)
                elif kind == "restore_verified" and e.get("route") in REPLAY_ROUTES:
                    if isinstance(e.get("keys"), list):
                        logged.proven, logged.proven_at = list(e["keys"]), at
                elif kind == "checkpoint_saved":
                    if isinstance(e.get("path"), str) and isinstance(e.get("digest"), str):
                        logged.saved[e["path"]] = e["digest"]
                elif kind == "step_done":
                    rank, step, loss = e.get("rank"), e.get("step"), e.get("loss")
                    rank = 0 if rank is None else rank  # a process with no RANK: alone
                    if loss is None or not isinstance(rank, int) or not isinstance(step, int):
                        continue
                    found.setdefault(rank, {}).setdefault(step, []).append(
                        (at, loss, _generation(e))
                    )
    except OSError:
        return logged
    if logged.proven_at is not None and refuted > logged.proven_at:
        logged.proven = logged.proven_at = None  # a restore failed its proof since
    for rank, steps in found.items():
        for step, seen in steps.items():
            good = [(at, loss) for at, loss, gen in seen if gen not in bad]
            if good:
                logged.losses.setdefault(rank, {})[step] = max(good, key=lambda g: g[0])[1]
    return logged


def logged_losses(path: str | None, before: float) -> dict[int, dict[int, Any]]:
    """rank -> step -> the loss its newest ``step_done`` before ``before`` carried (see
    :func:`read_log`)."""
    return read_log(path, before).losses


def ceiling(losses: dict[int, dict[int, Any]]) -> int | None:
    """The newest checkpoint step that leaves :data:`NEEDED` logged steps to re-do;
    None: fewer are logged (no ceiling: nothing can prove the restore)."""
    steps = sorted({s for per_rank in losses.values() for s in per_rank})
    return steps[-NEEDED] if len(steps) >= NEEDED else None
