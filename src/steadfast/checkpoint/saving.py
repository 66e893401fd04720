r"""Saving a checkpoint: the save protocol, run by every rank of a manager, inline (sync,
emergency) or on the writer thread (async), one save in flight at a time.

1. rank 0 creates a hidden ``.sf-tmp-step_{N}``; all ranks agree on the step (one
   all-reduce), and no rank goes on if one was fenced, failed to capture its state, or
   (rank 0) could not create the folder;
2. each rank writes its files there, computing each file's CRC-32 while it is written,
   and ``fsync``\s them;
3. the ranks send rank 0 their file lists (one all-gather on the manager's gloo group);
4. rank 0 asks the fence again, writes ``manifest.json``, ``fsync``\s, ``rename``\s the
   directory to ``step_{N}``, ``fsync``\s the parent, then points ``latest`` at it by
   renaming a fresh symlink over it (atomic) and ``fsync``\s again
   (:func:`~steadfast.checkpoint.layout.publish`);
5. rank 0 broadcasts the outcome, so every rank returns (or raises) together; rank 0
   then applies ``keep_last_n`` (:mod:`~steadfast.checkpoint.retention`).

A crash at any moment leaves either the previous ``latest`` or the new one, never a
partial checkpoint under a ``step_N`` name: ``latest`` moves only after every rank's files
are durable. An async save first snapshots the state into host buffers
(:mod:`~steadfast.checkpoint.staging`), the only part training waits for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import events
from ..config import ConfigError, require_number
from .collectives import Coordinator
from .dcp import save_sharded
from .fencing import CheckpointFenced, fence, fenced
from .files import describe, save_file
from .layout import (
    DCP_DIR,
    LATEST,
    NAME_MAX,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    new_manifest,
    publish,
    rank_file,
)
from .proof import take_exact
from .proof_log import digest
from .retention import Retention
from .staging import Stager, dtensor_off_cpu, has_dtensor, to_cpu, to_state_dicts
from .state import RNGState

__all__ = ["RNG_KEY", "SaveJob", "Saver", "capture"]

logger = logging.getLogger(__name__)

RNG_KEY = "rng"


def capture(
    state: Mapping[str, Any], rank_state: Mapping[str, Any] | None, rng: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts to save: replicated, and this rank's own (with its RNG when
    ``rng``)."""
    replicated = to_state_dicts(state)
    local = to_state_dicts(rank_state or {})
    if rng:
        if RNG_KEY in local or RNG_KEY in replicated:
            raise ConfigError(f"checkpoint key {RNG_KEY!r} is reserved for RNG states")
        local[RNG_KEY] = RNGState().state_dict()
    both = sorted(set(replicated) & set(local))
    if both:
        raise ConfigError(f"keys in both state and rank_state: {both}")
    return replicated, local


@dataclass
class SaveJob:
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
    exact: bool = False  # to be resumed from exactly (the re-run machine asked for it)
    since: int | None = None  # steps since the loop's previous save (its cadence)
    blocking: float | None = None  # the stall of an async save; None for a sync one


class Saver:
    """The single writer of one manager's checkpoints into ``folder``: runs the save
    protocol inline or on its writer thread, at most one save in flight (:meth:`wait`
    joins it and raises its error).

    ``sharded``: DCP or not, None to decide per save; ``rng``: save the RNG streams;
    ``stager`` / ``local_stager``: the host buffers of async saves (replicated or
    sharded state; this rank's own), the manager's to release."""

    def __init__(
        self,
        folder: Path,
        coord: Coordinator,
        retention: Retention,
        sharded: bool | None,
        rng: bool,
        stager: Stager,
        local_stager: Stager,
    ) -> None:
        self.folder = folder
        self.coord = coord
        self.retention = retention
        self.sharded = sharded
        self.rng = rng
        self.stager = stager
        self.local_stager = local_stager
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: int | None = None
        #: the step of the loop's previous save (or of its restore; 0: a fresh start)
        self.last_step = 0

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        rank_state: Mapping[str, Any] | None,
        name: str | None,
        run_async: bool,
        retain: bool,
    ) -> None:
        """Save ``step`` (see :meth:`steadfast.CheckpointManager.save`): returns once it
        is published, or (``run_async``) once the host snapshot is taken."""
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
        rank = self.coord.rank
        # before anything is written (the temporary folder included): a rank whose node
        # no longer holds the rendezvous writes nothing, and every rank learns it in the
        # agreement below (no rank is left waiting in a collective)
        final = self.folder / (name or f"step_{step}")
        refused = fenced(final)
        start = time.monotonic()
        bad_state: ConfigError | None = None
        try:  # a bad key must not leave the other ranks waiting in the collective below
            replicated, local = capture(state, rank_state, self.rng)
        except ConfigError as exc:
            bad_state, replicated, local = exc, {}, {}
        sharded = self.sharded if self.sharded is not None else has_dtensor(replicated)
        tmp = self.folder / f"{TMP_PREFIX}{final.name}"
        prepared = None
        if rank == 0 and bad_state is None and refused is None:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                prepared = describe(exc, tmp)
        failed = prepared is not None or bad_state is not None or refused is not None
        agreed = self.coord.agree_save(step, failed, sharded)
        if refused is not None:
            raise CheckpointFenced(refused)
        if bad_state is not None:
            raise bad_state
        if agreed is None:
            if rank == 0:
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
        writes = sharded or rank == 0  # replicated state: rank 0 only
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
                payload = self.stager.stage(replicated) if writes else None
                local = self.local_stager.stage(local)
            else:  # sync: DCP takes device tensors as they are
                payload = replicated if sharded else (to_cpu(replicated) if writes else None)
                local = to_cpu(local)
        except Exception as exc:
            failure = f"rank {rank}: snapshot failed: {type(exc).__name__}: {exc}"
        job = SaveJob(step, tmp, final, payload, local, keys, sharded, start, failure)
        job.move_latest, job.retain, job.exact = name is None, retain, take_exact()
        job.since, self.last_step = step - self.last_step, step
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

    def wait(self) -> None:
        """Wait for the save in flight (if any) and for old checkpoints being deleted;
        raise the background save's error if it failed."""
        if self._thread is not None:
            self._thread.join()  # cleared only once joined: an interrupted join retries
            self._thread = None
            self._in_flight = None
        self.retention.wait()
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"background checkpoint save failed: {error}") from error

    def _background(self, job: SaveJob) -> None:
        try:
            self._write_and_publish(job)
        except BaseException as exc:  # raised at the next call, never swallowed
            logger.error("background checkpoint save failed: %s", exc)
            self._error = exc

    def _agree_sharded_write(self, mine: str | None) -> str | None:
        """Before the collective ``dcp.save``: if any rank's snapshot failed, no rank
        enters it (one all-gather)."""
        failed = [m for m in self.coord.all_gather(mine) if m]
        return "; ".join(failed) if failed else None

    def _write_files(
        self, tmp: Path, payload: Any, local: dict[str, Any], sharded: bool
    ) -> dict[str, dict[str, int]]:
        """This rank's share of the checkpoint, written durably into ``tmp``."""
        rank, world = self.coord.rank, self.coord.world
        files: dict[str, dict[str, int]] = {}
        if sharded:
            files.update(save_sharded(payload, tmp / DCP_DIR, self.coord.group, rank, world))
        elif payload is not None:
            files[STATE_FILE] = save_file(tmp / STATE_FILE, payload)
        if local:
            files[rank_file(rank)] = save_file(tmp / rank_file(rank), local)
        return files

    def _write_and_publish(self, job: SaveJob) -> None:
        step, tmp, final, sharded, blocking = (
            job.step,
            job.tmp,
            job.final,
            job.sharded,
            job.blocking,
        )
        rank = self.coord.rank
        files: dict[str, dict[str, int]] = {}
        mine = job.failure
        if sharded and self.coord.group is not None:  # dcp.save is collective: all or none
            mine = self._agree_sharded_write(mine)
        if mine is None:
            try:
                self.stager.settle()  # an async save's device copies have landed
                self.local_stager.settle()
                files = self._write_files(tmp, job.payload, job.local, sharded)
            except Exception as exc:  # disk full, permissions, an unpicklable value...
                mine = f"rank {rank}: {describe(exc, tmp)}"
        shares = self.coord.all_gather((files, mine))
        outcome: str | None = None
        ledger: str | None = None  # the files' digest, logged for later restores' proofs
        if rank == 0:
            errors = [err for _, err in shares if err]
            outcome = "; ".join(errors) if errors else None
            if outcome is None:
                try:
                    fence(final)  # again, just before latest moves
                    everything = {k: v for share, _ in shares for k, v in share.items()}
                    manifest = new_manifest(step, self.coord.world, sharded, job.keys, everything)
                    ledger = digest(manifest["files"])
                    # a save of the loop's cadence, not an emergency one (a replay proof
                    # compares a re-done state only at a step the loop saves again)
                    manifest["regular"] = job.retain
                    manifest["exact"] = job.exact
                    manifest["since"] = job.since
                    publish(job.tmp, job.final, manifest, move_latest=job.move_latest)
                except CheckpointFenced as exc:
                    outcome = f"rank 0: {exc}"
                except Exception as exc:
                    outcome = f"rank 0: {describe(exc, final)}"
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (self.folder / f".{LATEST}.tmp").unlink(missing_ok=True)
        outcome = self.coord.from_rank0(outcome)
        if outcome is not None:
            raise CheckpointError(f"saving checkpoint step {step} to {final} failed: {outcome}")
        if rank != 0:
            return
        seconds = time.monotonic() - job.start
        events.emit(
            "checkpoint_saved",
            step=step,
            path=str(final),
            bytes=sum(meta["bytes"] for share, _ in shares for meta in share.values()),
            seconds=seconds,
            blocking_seconds=seconds if blocking is None else blocking,
            digest=ledger,
        )
        if job.retain:
            self.retention.apply(step, self._in_flight, background=blocking is None)
