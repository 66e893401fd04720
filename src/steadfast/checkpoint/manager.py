"""CheckpointManager: checkpoints that are complete and verified, or invisible.

Layout of ``{dir}/step_{N}/`` (plus a relative ``latest`` symlink, as
:func:`steadfast.resolve_resume_path` expects):

- ``state.pt``: replicated state (model, optimizer under DDP, ...), written once by rank 0;
- ``dcp/``: sharded state (FSDP, DTensor), written by every rank through
  ``torch.distributed.checkpoint`` (DCP) instead of ``state.pt``;
- ``rank_{r}.pt``: what differs per rank: RNG streams and data position;
- ``manifest.json``: format, step, world size, the keys saved, and every file with its
  size and CRC-32.

Save protocol:
1. rank 0 creates a hidden ``.tmp-step_{N}``; all ranks agree on the step (one all-reduce);
2. each rank writes its files there, computing each file's CRC-32 while it is written,
   and ``fsync``\\s them;
3. the ranks send rank 0 their file lists (one all-gather on a gloo group of the manager);
4. rank 0 writes ``manifest.json``, ``fsync``\\s, ``rename``\\s the directory to
   ``step_{N}``, ``fsync``\\s the parent, then points ``latest`` at it by renaming a fresh
   symlink over it (atomic) and ``fsync``\\s again;
5. rank 0 broadcasts the outcome, so every rank returns (or raises) together.

A crash at any moment leaves either the previous ``latest`` or the new one, never a
partial checkpoint under a ``step_N`` name: ``latest`` moves only after every rank's files
are durable. Loading verifies the manifest (sizes and checksums, shared out among the
ranks); a corrupted or truncated checkpoint is reported (``checkpoint_corrupt``) and all
ranks fall back together to the newest valid older one. Files are read with
``torch.load(weights_only=True)``: no arbitrary pickle is ever executed.

This module holds the coordination (who writes what, the agreements, the writer
thread, retention, the load's fall-back); the parts it coordinates are
:mod:`~steadfast.checkpoint.layout` (names, manifest, verification, the atomic publish,
clearing an interrupted save), :mod:`~steadfast.checkpoint.files` (durable writes with
the CRC computed while writing), :mod:`~steadfast.checkpoint.staging` (the host snapshot
of an async save) and :mod:`~steadfast.checkpoint.dcp` (sharded state).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import events
from ..config import ConfigError, require_number
from ..dist import group_rank, is_distributed
from .dcp import load_sharded, save_sharded
from .files import describe, save_file
from .layout import (
    DCP_DIR,
    LATEST,
    MANIFEST,
    NAME_MAX,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    candidates,
    check_files,
    discard,
    new_manifest,
    older_than,
    publish,
    rank_file,
    read_manifest,
    remove_all,
    remove_stale,
    step_dirs,
    verify,
    write_manifest,
)
from .memory import (
    MemoryTier,
    Snapshot,
    decode,
    load_in_place,
    load_state,
    read_for_sending,
    ring_group,
    verify_in_place,
)
from .staging import Stager, dtensor_off_cpu, has_dtensor, to_cpu, to_state_dicts
from .state import RNGState, Stateful

__all__ = [
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointManager",
    "MANIFEST",
    "STATE_FILE",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)

RNG_KEY = "rng"


class CheckpointFenced(CheckpointError):
    """This rank may not write: its node no longer holds the job's rendezvous (cut off
    by a partition, or the job went on without it). Nothing was written, and ``latest``
    was not moved (:mod:`steadfast.fence`)."""


def _fenced(path: Path) -> str | None:
    """Why this rank may not write ``path`` (after a ``checkpoint_fenced`` event): its
    node's launcher says the node no longer holds the job's rendezvous. None: it may."""
    from .. import fence

    reason = fence.check()
    if reason is not None:
        events.emit("checkpoint_fenced", cause="fence", path=str(path), reason=reason)
        return f"not writing {path}: {reason}"
    return None


def _fence(path: Path) -> None:
    """Raise :class:`CheckpointFenced` where :func:`_fenced` says so."""
    refused = _fenced(path)
    if refused is not None:
        raise CheckpointFenced(refused)


# ---------------------------------------------------------------------- the manager
@dataclass
class _SaveJob:
    """One save between its snapshot and its publish (run inline, or on the writer
    thread): what to write where, and what the manifest says."""

    step: int
    tmp: Path  # where the files are written
    final: Path  # the name it is published under
    payload: Any  # replicated / sharded state, on rank 0 or every rank
    local: dict[str, Any]  # this rank's own state and RNG
    keys: dict[str, list[str]]
    sharded: bool
    start: float
    failure: str | None  # the snapshot failed on this rank: said in the write phase
    move_latest: bool = True  # False for a framework's named checkpoint
    retain: bool = True  # apply keep_last_n once published
    blocking: float | None = None  # the stall of an async save; None for a sync one


class CheckpointManager:
    """Saves and restores the whole training state so that no fault can lose it.

    Args:
        checkpoint_dir: Where ``step_N`` directories and ``latest`` live (on a file
            system every rank sees).
        keep_last_n: How many checkpoints to keep (<= 0 keeps all); ``latest`` and the
            save in flight are never deleted.
        async_save: Snapshot to host memory and write in a background thread; at most one
            save is in flight, :meth:`wait` joins it, and a failed background save is
            raised at the next call.
        group: Process group whose ranks save together (default: the world).
        rng: Save (and, in :meth:`restore`, restore) every rank's RNG streams.
        sharded: Save through DCP, every rank writing its shards. ``None`` (default)
            decides per save: DCP when the state holds a ``DTensor``.
        collective: ``False`` for a single writer: this process saves and loads alone,
            with no process group and no collective (it is rank 0 of a group of one),
            for frameworks whose checkpoint hook runs on one rank only (Lightning's
            ``CheckpointIO``: :class:`steadfast.integrations.lightning.SteadfastCheckpointIO`).
            Ranks that load such checkpoints each verify them on their own. Only the
            world's rank 0 clears what an interrupted save left in ``checkpoint_dir``.
        memory_every: Keep a snapshot of every rank's state in host shared memory every
            this many steps (:meth:`snapshot`; 0, the default, turns the memory tier
            off): written and replicated to a rank on another node in the background,
            verified like a disk checkpoint, and restored first when it is the newest
            (:mod:`steadfast.checkpoint.memory`). Disk checkpoints (:meth:`save`) stay
            the durable tier; snapshots never move ``latest``.

    Sharded state is read by DCP *into* the objects' current state dicts, so each
    object must already hold tensors of the right shapes. A fresh optimizer holds no
    state yet: for sharded optimizers, register a small Stateful that uses
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``
    (DCP's documented pattern), which creates the state to load into.

    Under ``torch.distributed`` the constructor is collective (it creates a small gloo
    group used to coordinate saves, also from the background thread), so every rank of
    the world must construct the manager, in the same order as other groups.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        keep_last_n: int = 3,
        async_save: bool = False,
        group: Any = None,
        rng: bool = True,
        sharded: bool | None = None,
        collective: bool = True,
        memory_every: int = 0,
    ) -> None:
        self.dir = Path(checkpoint_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"checkpoint_dir {str(self.dir)!r} exists but is not a directory")
        self.keep_last_n = require_number(
            "CheckpointManager.keep_last_n", keep_last_n, integer=True
        )
        self.async_save = bool(async_save)
        self.rng = bool(rng)
        if sharded is not None and not isinstance(sharded, bool):
            raise ConfigError(f"CheckpointManager.sharded must be True, False or None: {sharded!r}")
        self.sharded = sharded
        self._group = group
        self.collective = bool(collective)
        self._rank = group_rank(group) if self.collective else 0
        self._world = dist.get_world_size(group) if is_distributed() and self.collective else 1
        self._coord: Any = None
        if is_distributed() and self.collective:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._coord = dist.new_group(ranks=ranks, backend="gloo")
        self._thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: int | None = None
        #: the checkpoint the last load or restore read (after any fall-back)
        self.loaded_path: Path | None = None
        self._stager = Stager()  # replicated / sharded state
        self._local_stager = Stager()  # rank_state and RNG
        if self._rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.collective or group_rank(None) == 0:
                remove_stale(self.dir)
        self.memory_every = require_number(
            "CheckpointManager.memory_every", memory_every, minimum=0, integer=True
        )
        self._memory: MemoryTier | None = None
        self._ring: Any = None  # the memory tier's replication group
        if self.memory_every:
            if not self.collective or group is not None:
                raise ConfigError(
                    "CheckpointManager.memory_every needs the whole world as the group "
                    "(collective=True, group=None): snapshots are replicated across nodes"
                )
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self._world))
            ring = ring_group() if self._coord is not None and self._world > local else None
            self._ring = ring
            self._memory = MemoryTier(
                self.dir, self._rank, self._world, local, ring, agree=self._from_rank0
            )

    # ------------------------------------------------------------------ public API
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        rank_state: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        """Save checkpoint ``step``; every rank of the group must call it.

        ``state`` is what every rank holds the same copy of (model, optimizer, scheduler,
        NaNDetector, plain values): written once by rank 0, or through DCP by every rank
        when it is sharded. ``rank_state`` is what differs per rank (a
        :class:`~steadfast.checkpoint.DataPosition`, a ``StatefulDataLoader``, your own
        objects); each rank's goes to its own file, with its RNG streams under ``"rng"``.
        Objects with ``state_dict()`` are saved through it.

        Sync: returns once the checkpoint is durable and ``latest`` points at it. Async:
        returns after the host snapshot; the write goes on in the background.

        ``name``: publish the checkpoint as ``checkpoint_dir/name`` instead of
        ``step_N``, for a framework that names its checkpoints itself (Lightning's
        ``last.ckpt``): the same atomic publish (a checkpoint of that name is replaced
        whole or not at all) and manifest, but ``latest`` does not move and
        ``keep_last_n`` leaves it alone (the framework keeps and deletes its own).
        """
        self._save(step, state, rank_state, name, self.async_save, retain=name is None)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        rank_state: Mapping[str, Any] | None,
        name: str | None,
        run_async: bool,
        retain: bool,
    ) -> None:
        require_number("CheckpointManager.save step", step, minimum=0, integer=True)
        if name is not None and (
            not name
            or "/" in name
            or name.startswith(".")
            or name == LATEST
            or len(os.fsencode(name)) > NAME_MAX
        ):
            raise ConfigError(
                f"CheckpointManager.save name: {name!r} is not a plain file name "
                f"(of at most {NAME_MAX} bytes)"
            )
        self.wait()
        # before anything is written (the temporary folder included): a rank whose node
        # no longer holds the rendezvous writes nothing, and every rank learns it in the
        # agreement below (no rank is left waiting in a collective)
        final = self.dir / (name or f"step_{step}")
        fenced = _fenced(final)
        start = time.monotonic()
        bad_state: ConfigError | None = None
        try:  # a bad key must not leave the other ranks waiting in the collective below
            replicated, local = self._capture(state, rank_state)
        except ConfigError as exc:
            bad_state, replicated, local = exc, {}, {}
        sharded = self.sharded if self.sharded is not None else has_dtensor(replicated)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        prepared = None
        if self._rank == 0 and bad_state is None and fenced is None:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                prepared = describe(exc, tmp)
        failed = prepared is not None or bad_state is not None or fenced is not None
        agreed = self._agree(step, failed, sharded)
        if fenced is not None:
            raise CheckpointFenced(fenced)
        if bad_state is not None:
            raise bad_state
        if agreed is None:
            if self._rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"saving checkpoint step {step} failed before writing: "
                + (
                    f"cannot create {tmp}: {prepared}"
                    if prepared
                    else "another rank failed (or its node was fenced)"
                )
            )
        sharded = agreed
        keys = {"state": sorted(replicated), "rank_state": sorted(local)}
        writes = sharded or self._rank == 0  # replicated state: rank 0 only
        if run_async and sharded and dtensor_off_cpu(replicated):
            # DTensor.from_local would move a host-staged shard back to its device: until
            # sharded device state has a proper host stager, such saves run synchronously
            logger.warning("async save of sharded device (DTensor) state runs synchronously")
            run_async = False
        payload: Any = None
        failure: str | None = None
        try:  # a failure here (host OOM...) is reported through the write phase's gather,
            # so that no rank is left alone in a collective
            if run_async:  # snapshot to host memory; training may then change the originals
                payload = self._stager.stage(replicated) if writes else None
                local = self._local_stager.stage(local)
            else:  # sync: DCP takes device tensors as they are
                payload = replicated if sharded else (to_cpu(replicated) if writes else None)
                local = to_cpu(local)
        except Exception as exc:
            failure = f"rank {self._rank}: snapshot failed: {type(exc).__name__}: {exc}"
        job = _SaveJob(step, tmp, final, payload, local, keys, sharded, start, failure)
        job.move_latest, job.retain = name is None, retain
        if not run_async:
            self._write_and_publish(job)
            return
        self._in_flight = step
        job.blocking = time.monotonic() - start
        self._thread = threading.Thread(
            target=self._background,
            args=(job,),
            name="steadfast-checkpoint-writer",
            daemon=False,
        )
        self._thread.start()

    def snapshot(
        self, step: int, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Snapshot ``step`` to the memory tier (every ``memory_every`` steps; other steps
        return at once); every rank calls it, with the same arguments as :meth:`save`.

        Call it after the step's optimizer update, with the number of steps done: a
        restart then resumes after the last step every rank finished, none re-done.
        Training waits only for the copy into host staging buffers; the write to
        shared memory and the replica go on in the background (at most one snapshot in
        flight: the next call waits for it, and raises its error if it failed)."""
        if self._memory is None:
            raise ConfigError("CheckpointManager.snapshot needs memory_every > 0")
        require_number("CheckpointManager.snapshot step", step, minimum=0, integer=True)
        if step % self.memory_every:
            return
        replicated, local = self._capture(state, rank_state)
        if has_dtensor(replicated):
            raise ConfigError(
                "CheckpointManager.snapshot: sharded (DTensor) state has no memory tier yet; "
                "set memory_every=0 and save it to disk"
            )
        self._memory.snapshot(step, replicated, local)

    def _capture(
        self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state dicts to save: replicated, and this rank's own (with its RNG)."""
        replicated = to_state_dicts(state)
        local = to_state_dicts(rank_state or {})
        if self.rng:
            if RNG_KEY in local or RNG_KEY in replicated:
                raise ConfigError(f"checkpoint key {RNG_KEY!r} is reserved for RNG states")
            local[RNG_KEY] = RNGState().state_dict()
        both = sorted(set(replicated) & set(local))
        if both:
            raise ConfigError(f"keys in both state and rank_state: {both}")
        return replicated, local

    def save_emergency(
        self, step: int, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Synchronous save for shutdown paths: waits for any async save (a failed one is
        logged, not raised: this save replaces it), skips retention."""
        try:
            self.wait()
        except CheckpointError as exc:
            logger.error("emergency save of step %d goes on after: %s", step, exc)
        self._save(step, state, rank_state, None, run_async=False, retain=False)

    def wait(self) -> None:
        """Wait for the save in flight (if any) and for old checkpoints being deleted;
        raise the background save's error if it failed."""
        if self._thread is not None:
            self._thread.join()  # cleared only once joined: an interrupted join retries
            self._thread = None
            self._in_flight = None
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"background checkpoint save failed: {error}") from error

    def close(self) -> None:
        """Finish the save in flight, release the staging buffers and the gloo group."""
        try:
            self.wait()
        finally:
            try:
                if self._memory is not None:
                    self._memory.close()
            finally:
                self._stager.clear()
                self._local_stager.clear()
                if is_distributed():
                    for group in (self._coord, self._ring):
                        if group is not None:
                            dist.destroy_process_group(group)
                self._coord = self._ring = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        fallback: bool = False,
        weights_only: bool = True,
        require_keys: Collection[str] = (),
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest valid checkpoint (or ``path``); None when there is none yet.

        Returns ``(step, state)``: the replicated state plus this rank's ``rank_state``
        and RNG states (under ``"rng"``), as saved (state dicts, on the CPU). Every rank
        of the group must call it. Each candidate is verified against its manifest; if
        any rank finds it corrupt, that rank emits ``checkpoint_corrupt`` and all ranks
        fall back to the next older one. If checkpoints exist but none is valid, raises
        :class:`CheckpointError` naming the files. A sharded (DCP) checkpoint needs
        templates to load into: use :meth:`restore`.

        ``fallback``: when ``path`` is corrupt (or gone), go on with the newest valid
        checkpoint in ``checkpoint_dir`` that is not newer (by its manifest's step), named
        or not, and holds the same keys (those of ``path`` when its manifest can be read,
        else ``require_keys``), instead of raising; :attr:`loaded_path` says which was
        read. ``weights_only=False`` unpickles any object (only for checkpoints you
        trust; the default executes no pickled code, and a verified checkpoint it
        refuses raises :class:`CheckpointError` saying so, not a fall-back).
        """
        return self._load(path, None, fallback, weights_only, set(require_keys))

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint directory ``path`` (a framework's named one, when the
        framework rotates its checkpoints): hidden by a rename first, so a crash never
        leaves it half deleted under its name. Waits for the save in flight."""
        self.wait()
        target = Path(path)
        if not target.exists() and not target.is_symlink():
            return
        if target.is_dir() and not target.is_symlink():
            remove_all([discard(target)])
        else:
            target.unlink()
        if self._rank == 0:
            events.emit("checkpoint_deleted", path=str(target))

    def restore(
        self, objects: Mapping[str, Any], path: str | os.PathLike[str] | None = None
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest valid checkpoint into ``objects`` and this process's RNGs.

        ``objects`` maps the keys used at :meth:`save` (of ``state`` and ``rank_state``
        alike) to live objects; each :class:`~steadfast.checkpoint.Stateful` one gets
        ``load_state_dict``. Sharded state is read with DCP straight into the objects'
        own (sharded) state dicts. Returns ``(step, state)`` like :meth:`load`, so plain
        values can be read from ``state``; None when there is no checkpoint yet.
        """
        loaded = self._load(path, objects, False, True, set())
        if loaded is None:
            return None
        step, state = loaded
        for key, obj in objects.items():
            if key not in state:
                logger.warning("checkpoint step %d has no %r; it is not restored", step, key)
            elif isinstance(obj, Stateful):
                obj.load_state_dict(state[key])
        if self.rng and RNG_KEY in state and RNG_KEY not in objects:
            RNGState().load_state_dict(state[RNG_KEY])
        return step, state

    # ------------------------------------------------------------------ coordination
    def _agree(self, step: int, failed: bool, sharded: bool) -> bool | None:
        """One all-reduce: every rank saves the same step (a mismatch is a bug in the
        caller's loop), rank 0 could create the temporary directory, and whether the
        save is sharded (any rank with a DTensor makes it sharded). None if rank 0
        failed."""
        if self._coord is None:
            return None if failed else sharded
        t = torch.tensor([step, -step, int(failed), int(sharded)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._coord)
        highest, lowest, any_failed, any_sharded = (int(v) for v in t.tolist())
        if highest != -lowest:
            raise CheckpointError(
                f"ranks disagree on the checkpoint step (this rank: {step}, "
                f"max: {highest}, min: {-lowest})"
            )
        return None if any_failed else bool(any_sharded)

    def _all_gather(self, obj: Any) -> list[Any]:
        if self._coord is None:
            return [obj]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, obj, group=self._coord)
        return out

    def _from_rank0(self, obj: Any) -> Any:
        if self._coord is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._coord, group_src=0)
        return box[0]

    # ------------------------------------------------------------------ saving
    def _background(self, job: _SaveJob) -> None:
        try:
            self._write_and_publish(job)
        except BaseException as exc:  # raised at the next call, never swallowed
            logger.error("background checkpoint save failed: %s", exc)
            self._error = exc

    def _agree_sharded_write(self, mine: str | None) -> str | None:
        """Before the collective ``dcp.save``: if any rank's snapshot failed, no rank
        enters it (one all-gather)."""
        failed = [m for m in self._all_gather(mine) if m]
        return "; ".join(failed) if failed else None

    def _write_files(
        self, tmp: Path, payload: Any, local: dict[str, Any], sharded: bool
    ) -> dict[str, dict[str, int]]:
        """This rank's share of the checkpoint, written durably into ``tmp``."""
        files: dict[str, dict[str, int]] = {}
        if sharded:
            files.update(save_sharded(payload, tmp / DCP_DIR, self._coord, self._rank, self._world))
        elif payload is not None:
            files[STATE_FILE] = save_file(tmp / STATE_FILE, payload)
        if local:
            files[rank_file(self._rank)] = save_file(tmp / rank_file(self._rank), local)
        return files

    def _write_and_publish(self, job: _SaveJob) -> None:
        step, tmp, final, sharded, blocking = (
            job.step,
            job.tmp,
            job.final,
            job.sharded,
            job.blocking,
        )
        files: dict[str, dict[str, int]] = {}
        mine = job.failure
        if sharded and self._coord is not None:  # dcp.save is collective: all or none
            mine = self._agree_sharded_write(mine)
        if mine is None:
            try:
                files = self._write_files(tmp, job.payload, job.local, sharded)
            except Exception as exc:  # disk full, permissions, an unpicklable value...
                mine = f"rank {self._rank}: {describe(exc, tmp)}"
        shares = self._all_gather((files, mine))
        outcome: str | None = None
        if self._rank == 0:
            errors = [err for _, err in shares if err]
            outcome = "; ".join(errors) if errors else None
            if outcome is None:
                try:
                    _fence(final)  # again, just before latest moves
                    everything = {k: v for share, _ in shares for k, v in share.items()}
                    publish(
                        job.tmp,
                        job.final,
                        new_manifest(step, self._world, sharded, job.keys, everything),
                        move_latest=job.move_latest,
                    )
                except CheckpointFenced as exc:
                    outcome = f"rank 0: {exc}"
                except Exception as exc:
                    outcome = f"rank 0: {describe(exc, final)}"
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (self.dir / f".{LATEST}.tmp").unlink(missing_ok=True)
        outcome = self._from_rank0(outcome)
        if outcome is not None:
            raise CheckpointError(f"saving checkpoint step {step} to {final} failed: {outcome}")
        if self._rank != 0:
            return
        seconds = time.monotonic() - job.start
        events.emit(
            "checkpoint_saved",
            step=step,
            path=str(final),
            bytes=sum(meta["bytes"] for share, _ in shares for meta in share.values()),
            seconds=seconds,
            blocking_seconds=seconds if blocking is None else blocking,
        )
        try:  # rank 0 alone: a failure here must not fail a published checkpoint
            trash = self._apply_retention(keep_step=step) if job.retain else []
        except Exception as exc:
            logger.warning("retention after checkpoint step %d failed: %s", step, exc)
            trash = []
        if trash and blocking is None:  # sync save: do not make training wait for unlink
            self._reaper = threading.Thread(
                target=remove_all, args=(trash,), name="steadfast-checkpoint-reaper"
            )
            self._reaper.start()
        else:
            remove_all(trash)

    def _apply_retention(self, keep_step: int) -> list[Path]:
        """Hide checkpoints beyond ``keep_last_n`` (rename, atomic); returns the hidden
        paths for the caller to remove."""
        if self.keep_last_n <= 0:
            return []
        existing = step_dirs(self.dir)
        latest_target: Path | None = None
        with contextlib.suppress(OSError, RuntimeError):
            latest_target = (self.dir / LATEST).resolve()
        protected = {keep_step, self._in_flight}
        trash = []
        for n, path in existing[: max(0, len(existing) - self.keep_last_n)]:
            if n in protected or path.resolve() == latest_target:
                continue
            try:
                trash.append(discard(path))
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s: %s", path, exc)
                continue
            events.emit("checkpoint_deleted", step=n, path=str(path))
        return trash

    # ------------------------------------------------------------------ loading
    def _load_memory(self, newest_disk: int) -> tuple[int, dict[str, Any]] | None:
        """The restore from the memory tier: the newest step (not older than the newest
        disk checkpoint) whose snapshot of every rank some node holds, each rank's read
        from its own node or sent by the holder, verified after the transfer; a faulty
        copy (``checkpoint_corrupt``, cause ``memory`` or ``replica``) is dropped and the
        plan made again. None: no such step (the caller reads the disk)."""
        assert self._memory is not None
        self._quiet_memory_wait()
        offers = self._all_gather(self._memory.holdings())
        bad: set[str] = set()  # the snapshots (their folders) found faulty
        while True:
            plan = _plan(offers, self._world, newest_disk, bad)
            if plan is None:
                return None
            step, choice = plan
            start = time.monotonic()
            # 1. each holder reads what it serves: its own snapshot verified in place
            # (sizes and CRC-32 through a memory map), another rank's packed for sending
            # (verified where it arrives)
            packed: dict[int, torch.Tensor] = {}
            problems: list[tuple[str, str]] = []  # (the snapshot's folder, what failed)
            for rank, (holder, snap) in choice.items():
                if holder != self._rank:
                    continue
                try:  # whatever fails here is reported: the other ranks are waiting
                    if rank == self._rank:
                        found = verify_in_place(Path(snap.path))
                    else:
                        data, found = read_for_sending(Path(snap.path))
                        if data is not None and not found:
                            packed[rank] = data
                except Exception as exc:
                    found = [f"{snap.path}: cannot be read ({type(exc).__name__}: {exc})"]
                if found:
                    problems.append((snap.path, "; ".join(found)))
                    self._memory_corrupt(snap, found)
            problems = [p for share in self._all_gather(problems) for p in share]
            if problems:
                bad.update(path for path, _ in problems)
                continue
            # 2. the transfers, holder to rank (sizes known from phase 1)
            sizes = self._all_gather({r: int(t.numel()) for r, t in packed.items()})
            mine_holder, mine = choice[self._rank]
            data = None
            if mine_holder != self._rank:
                data = torch.empty(sizes[mine_holder][self._rank], dtype=torch.uint8)
            works = [
                dist.isend(t, r, group=self._coord) for r, t in packed.items() if r != self._rank
            ]
            if data is not None:
                works.append(dist.irecv(data, mine_holder, group=self._coord))
            for work in works:
                if work is not None:
                    work.wait()
            # 3. what arrived verified, then loaded (in place: mapped, no copy)
            state: dict[str, Any] | None = None
            found = []
            try:
                if data is not None:
                    _, files, found = decode(data)
                if not found:
                    state = load_state(files) if data is not None else load_in_place(mine.path)
            except Exception as exc:
                found = [f"cannot be loaded ({type(exc).__name__}: {exc})"]
            if found:
                self._memory_corrupt(mine, found)
            faults = self._all_gather([(mine.path, "; ".join(found))] if found else [])
            faults = [f for share in faults for f in share]
            if faults or state is None:
                bad.update(path for path, _ in faults)
                continue
            self.loaded_path = Path(mine.path)
            events.emit(
                "checkpoint_loaded",
                step=step,
                path=mine.path,
                seconds=time.monotonic() - start,
                tier=mine.tier,
                from_rank=mine_holder,
            )
            return step, state

    def _quiet_memory_wait(self) -> None:
        """Join the memory tier's writer before a restore; a snapshot that failed is
        logged here (the restore goes on with what is whole) rather than raised before
        a collective the other ranks have entered."""
        assert self._memory is not None
        try:
            self._memory.wait()
        except CheckpointError as exc:
            logger.error("restoring after a failed memory snapshot: %s", exc)

    def _memory_corrupt(self, snap: Snapshot, problems: list[str]) -> None:
        reason = "; ".join(problems) or "unreadable"
        logger.error("%s snapshot %s is corrupt: %s", snap.tier, snap.path, reason)
        events.emit("checkpoint_corrupt", cause=snap.tier, path=snap.path, reason=reason)

    def _check_mine(self, ckpt: Path) -> tuple[dict[str, Any] | None, list[str]]:
        """Verify ``ckpt`` as far as this rank needs: every file's size, and the
        checksums of the files this rank reads plus its share of the rest."""
        manifest, problems = read_manifest(ckpt)
        if manifest is None:
            return None, problems
        names = sorted(manifest["files"])
        mine = set(names[self._rank :: self._world])
        mine |= {STATE_FILE, rank_file(self._rank)}
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
            load_sharded(state, saved, ckpt / DCP_DIR, self._coord)
        else:
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=weights_only)
        own = rank_file(self._rank)
        if own in manifest["files"] and manifest.get("world_size", 1) == self._world:
            state.update(torch.load(ckpt / own, map_location="cpu", weights_only=weights_only))
        elif any(name.startswith("rank_") for name in manifest["files"]):
            logger.warning(
                "%s was saved by %s ranks, this job has %d: per-rank state (RNG, data "
                "position) is not restored",
                ckpt,
                manifest.get("world_size"),
                self._world,
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
        return [p for rank_problems in self._all_gather(problems) for p in rank_problems]

    def _load(
        self,
        path: str | os.PathLike[str] | None,
        objects: Mapping[str, Any] | None,
        fallback: bool,
        weights_only: bool,
        require_keys: set[str],
    ) -> tuple[int, dict[str, Any]] | None:
        self.wait()
        if path is None:
            tries = candidates(self.dir)
        else:
            tries = [Path(path)] + (
                older_than(self.dir, Path(path), require_keys) if fallback else []
            )
        # every rank tries the same candidates in the same order: rank 0's view
        tries = [Path(p) for p in self._from_rank0([str(p) for p in tries])]
        if path is None and self._memory is not None:
            newest = max((_step_of(p) for p in tries), default=-1)
            from_memory = self._load_memory(newest)
            if from_memory is not None:
                self._memory.drop_after(from_memory[0])
                return from_memory
        loaded = self._load_disk(tries, objects, weights_only)
        if self._memory is not None and path is None:
            self._quiet_memory_wait()  # the writer must not publish behind drop_after
            self._memory.drop_after(loaded[0] if loaded is not None else -1)
        return loaded

    def _load_disk(
        self, tries: list[Path], objects: Mapping[str, Any] | None, weights_only: bool
    ) -> tuple[int, dict[str, Any]] | None:
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
            self.loaded_path = ckpt
            events.emit(
                "checkpoint_loaded",
                step=step,
                path=str(ckpt),
                seconds=time.monotonic() - start,
                tier="disk",
            )
            return step, state
        raise CheckpointError(f"no valid checkpoint in {self.dir}: " + "; ".join(failures))


def _step_of(path: Path) -> int:
    """The step of a ``step_N`` path (-1 for another name)."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else -1


def _plan(
    offers: list[list[Snapshot]], world: int, newest_disk: int, bad: set[str]
) -> tuple[int, dict[int, tuple[int, Snapshot]]] | None:
    """The newest step, not older than ``newest_disk``, for which every rank's snapshot
    is held by some rank (``offers[h]``: what rank ``h``'s node holds), less the copies
    found faulty; with, for each rank, who serves it: itself if it can, else a holder of
    its own snapshot before one of a replica, else the lowest rank."""
    held: dict[tuple[int, int], list[tuple[int, Snapshot]]] = {}
    for holder, offer in enumerate(offers):
        for snap in offer:
            if snap.path not in bad:  # every local rank offers the same folder
                held.setdefault((snap.rank, snap.step), []).append((holder, snap))
    for step in sorted({s for _, s in held}, reverse=True):
        if step < newest_disk:
            return None
        choice: dict[int, tuple[int, Snapshot]] = {}
        for rank in range(world):
            options = held.get((rank, step))
            if not options:
                break
            choice[rank] = min(options, key=lambda o: (o[0] != rank, o[1].tier != "memory", o[0]))
        else:
            return step, choice
    return None
