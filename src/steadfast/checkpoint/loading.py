"""Loading a checkpoint: from the memory tier when it holds the newest step, else from
disk, where each candidate is verified against its manifest (every file's size; the
checksums shared out among the ranks) before it is read. A rank that finds a candidate
corrupt reports it (``checkpoint_corrupt``) and all ranks fall back together to the next
older one; reading sharded state is collective, so every rank agrees on a candidate
before any rank reads it. Files are read with ``torch.load(weights_only=True)``: no
arbitrary pickle is ever executed."""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import events
from . import memory_restore
from .collectives import Coordinator
from .dcp import load_sharded
from .layout import (
    DCP_DIR,
    STATE_FILE,
    CheckpointError,
    candidates,
    check_files,
    older_than,
    rank_file,
    read_manifest,
)
from .memory import MemoryTier
from .proof import RestoreUnproven
from .staging import to_state_dicts

__all__ = ["LoadRequest", "Loader"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadRequest:
    """What a load asks for (see :meth:`steadfast.CheckpointManager.load`): ``path`` (None:
    the newest valid checkpoint), the ``objects`` to read sharded state into (None: a
    plain load), whether to fall back from a bad ``path``, the unpickler's setting, and
    the keys a fall-back must hold."""

    path: str | os.PathLike[str] | None
    objects: Mapping[str, Any] | None = None
    fallback: bool = False
    weights_only: bool = True
    require_keys: frozenset[str] = frozenset()
    #: the newest step the restore may take (a replay proof's ceiling; None: any)
    at_most: int | None = None
    #: tier -> the newest of its checkpoints that failed a replay proof (skipped with
    #: every older one of that tier)
    excluded: Mapping[str, int] = field(default_factory=dict)
    #: keep the memory tier's snapshots up to this step (a replay proof compares with one)
    keep: int = -1
    #: after a silent corruption's verdict, the newest step proven clean (steadfast.sdc):
    #: nothing newer is restored, whatever else is there (-1: nothing; None: no bound)
    clean: int | None = None


class Loader:
    """Loads the checkpoints of ``folder`` for the ranks of ``coord``, trying ``memory``
    (the memory tier, None when off) first."""

    def __init__(self, folder: Path, coord: Coordinator, memory: MemoryTier | None) -> None:
        self.folder = folder
        self.coord = coord
        self.memory = memory
        #: the tier of the last load (disk, memory or replica)
        self.tier = "disk"
        #: the newest step the last load could have taken, but for its bound
        self.newest = -1
        #: whether the last load kept to its bound (``at_most``): something met it
        self.bounded = False

    def load(self, request: LoadRequest) -> tuple[int, dict[str, Any], Path] | None:
        """The step, the state and the checkpoint read (see
        :meth:`steadfast.CheckpointManager.load`); None when there is none yet."""
        path, objects, fallback = request.path, request.objects, request.fallback
        weights_only, require_keys = request.weights_only, request.require_keys
        if path is None:
            tries = candidates(self.folder)
        else:
            tries = [Path(path)] + (
                older_than(self.folder, Path(path), require_keys) if fallback else []
            )
        # every rank tries the same candidates in the same order: rank 0's view
        tries = [Path(p) for p in self.coord.from_rank0([str(p) for p in tries])]
        self.tier, self.bounded = "disk", False
        if path is not None:
            if request.clean is not None:  # a framework's named one: nothing newer either
                tries = [p for p in tries if _manifest_step(p) <= request.clean]
                if not tries:
                    raise CheckpointError(
                        f"no checkpoint in {self.folder} was saved at or before step "
                        f"{request.clean}, the newest the replica checks proved clean "
                        f"($STEADFAST_CLEAN_STEP): {path} and every older one are newer"
                    )
            return self._load_disk(tries, objects, weights_only)
        excluded, at_most, clean = request.excluded, request.at_most, request.clean
        allowed = [p for p in tries if _step_of(p) > excluded.get("disk", -1)]
        after = excluded.get("memory", -1)
        holdings = self.memory.holdings() if self.memory is not None else []
        held = [s.step for s in holdings if s.step > after]
        if clean is not None:  # what a later replica check did not prove clean: never
            allowed = [p for p in allowed if _step_of(p) <= clean]
            held = [s for s in held if s <= clean]
            at_most = clean if at_most is None else min(at_most, clean)
        self.newest = max([-1, *(_step_of(p) for p in allowed)])
        if at_most is not None:  # a replay proof's bound, when something meets it
            bounded = [p for p in allowed if _step_of(p) <= at_most]
            self.bounded = self.coord.from_rank0(bool(bounded) or any(s <= at_most for s in held))
        if not self.bounded:
            at_most, bounded = clean, allowed
        left = bool(allowed or held or not (tries or holdings))
        if excluded and not self.coord.from_rank0(left):
            # checkpoints are there, but each failed a replay proof: never a fresh start
            raise RestoreUnproven(
                f"no checkpoint in {self.folder} is left to restore from: "
                + ", ".join(f"{t} up to step {s}" for t, s in sorted(excluded.items()))
                + " failed a replay proof (restore_mismatch in the event log); the job "
                "stops rather than train on a state that was not the one it lost"
            )
        why = ""  # why not from the memory tier, said in the disk load's event
        if self.memory is not None:
            newest = max((_step_of(p) for p in bounded), default=-1)
            from_memory, why = memory_restore.restore(
                self.memory, self.coord, newest, objects, at_most, after
            )
            self.newest = max(self.newest, self.memory.newest_whole)
            if from_memory is not None:
                self.memory.drop_after(max(from_memory[0], request.keep))
                self.tier = "replica" if "replica" in from_memory[2].parts else "memory"
                return from_memory
        tries = bounded
        loaded = self._load_disk(tries, objects, weights_only, why)
        if self.memory is not None:
            # the writer must not publish behind drop_after
            memory_restore.quiet_wait(self.memory)
            self.memory.drop_after(max(loaded[0] if loaded is not None else -1, request.keep))
        return loaded

    def read_plain(self, ckpt: Path) -> dict[str, Any]:
        """``ckpt``'s state as this rank saved it, verified (collective): what a replay
        proof compares the re-done state with. No ``checkpoint_loaded``: nothing is
        restored."""
        loaded = self._load_disk([ckpt], None, True, announce=False)
        if loaded is None:  # pragma: no cover - _load_disk raises when none is valid
            raise CheckpointError(f"{ckpt}: cannot be read")
        return loaded[1]

    def read_held(self, step: int) -> tuple[dict[str, Any], str]:
        """The memory tier's snapshot of ``step`` as this rank took it, verified
        (collective), and the folder read: what a replay proof compares the re-done
        state with. No ``checkpoint_loaded``: nothing is restored."""
        if self.memory is None:
            raise CheckpointError("no memory tier: no snapshot to compare with")
        got, why = memory_restore.restore(
            self.memory, self.coord, -1, None, at_most=step, after=step - 1, announce=False
        )
        if got is None:
            raise CheckpointError(f"the memory tier's snapshot of step {step}: {why}")
        return got[1], str(got[2])

    def _check_mine(self, ckpt: Path) -> tuple[dict[str, Any] | None, list[str]]:
        """Verify ``ckpt`` as far as this rank needs: every file's size, and the
        checksums of the files this rank reads plus its share of the rest."""
        manifest, problems = read_manifest(ckpt)
        if manifest is None:
            return None, problems
        names = sorted(manifest["files"])
        mine = set(names[self.coord.rank :: self.coord.world])
        mine |= {STATE_FILE, rank_file(self.coord.rank)}
        return manifest, check_files(ckpt, manifest["files"], mine)

    def _read(
        self,
        ckpt: Path,
        manifest: dict[str, Any],
        objects: Mapping[str, Any] | None,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        if manifest.get("sharded"):
            if objects is None:
                raise CheckpointError(
                    f"{ckpt} is a sharded (DCP) checkpoint: load it with restore(objects), "
                    "which reads the shards into the objects' own state dicts"
                )
            saved = manifest.get("keys", {}).get("state", [])
            state = to_state_dicts({k: objects[k] for k in saved if k in objects})
            load_sharded(state, saved, ckpt / DCP_DIR, self.coord.group)
        else:
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=weights_only)
        own = rank_file(self.coord.rank)
        if own in manifest["files"] and manifest.get("world_size", 1) == self.coord.world:
            state.update(torch.load(ckpt / own, map_location="cpu", weights_only=weights_only))
        elif any(name.startswith("rank_") for name in manifest["files"]):
            logger.warning(
                "%s was saved by %s ranks, this job has %d: per-rank state (RNG, data "
                "position) is not restored",
                ckpt,
                manifest.get("world_size"),
                self.coord.world,
            )
        return dict(state)

    def _agreed_problems(self, ckpt: Path, problems: list[str], cause: str) -> list[str]:
        """Report this rank's problems with ``ckpt`` (log, ``checkpoint_corrupt``) and
        return every rank's, so that all ranks reject or accept it together."""
        if problems:
            logger.error("checkpoint %s is corrupt: %s", ckpt, "; ".join(problems))
            events.emit(
                "checkpoint_corrupt", cause=cause, path=str(ckpt), reason="; ".join(problems)
            )
        return [p for rank_problems in self.coord.all_gather(problems) for p in rank_problems]

    def _load_disk(
        self,
        tries: list[Path],
        objects: Mapping[str, Any] | None,
        weights_only: bool,
        why: str = "",
        announce: bool = True,
    ) -> tuple[int, dict[str, Any], Path] | None:
        """The newest of ``tries`` that every rank verifies and reads; ``why``: why not
        from the memory tier (said in ``checkpoint_loaded``)."""
        if not tries:
            return None
        failures: list[str] = []
        for ckpt in tries:
            # verify, agree, then read: reading sharded state is collective, so every rank
            # must decide to read the same candidate before any rank starts
            start = time.monotonic()
            try:
                manifest, problems = self._check_mine(ckpt)
            except OSError as exc:  # EIO, a file vanishing under us...
                manifest, problems = None, [f"{ckpt}: cannot be verified ({exc})"]
            bad = self._agreed_problems(ckpt, problems, "verify")
            if bad or manifest is None:
                failures.extend(bad)
                continue
            state: dict[str, Any] | None = None
            try:
                state = self._read(ckpt, manifest, objects, weights_only)
            except CheckpointError:
                raise
            except pickle.UnpicklingError as exc:  # verified, so not damage: distrust
                raise CheckpointError(
                    f"{ckpt} holds objects the safe loader (weights_only=True) refuses: "
                    f"{exc}. Load it with weights_only=False only if you trust it"
                ) from exc
            except Exception as exc:
                problems = [f"{ckpt}: cannot be loaded ({type(exc).__name__}: {exc})"]
            bad = self._agreed_problems(ckpt, problems, "load")
            if bad or state is None:
                failures.extend(bad)
                continue
            step = int(manifest["step"])
            if not announce:
                return step, state, ckpt
            events.emit(
                "checkpoint_loaded",
                step=step,
                path=str(ckpt),
                seconds=time.monotonic() - start,
                tier="disk",
                reason=why or None,
            )
            return step, state, ckpt
        raise CheckpointError(f"no valid checkpoint in {self.folder}: " + "; ".join(failures))


def _manifest_step(path: Path) -> int:
    """The step a checkpoint's manifest says (a named one's too); a huge number where it
    cannot be read (never within a bound)."""
    manifest, _ = read_manifest(path)
    return int(manifest["step"]) if manifest is not None else 2**62


def _step_of(path: Path) -> int:
    """The step of a ``step_N`` path (-1 for another name)."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else -1
