"""CheckpointManager: checkpoints that are complete and verified, or invisible.

Layout: ``{dir}/step_{N}/`` (``state.pt`` and ``manifest.json``) plus a relative
``latest`` symlink, as :func:`steadfast.resolve_resume_path` expects.

Save protocol (replicated state, written once by rank 0):
1. serialise the state in memory and compute a CRC-32 of the bytes;
2. write it into a hidden temporary directory ``.tmp-step_{N}-{pid}``, ``fsync`` it;
3. write ``manifest.json`` (format, step, files with sizes and checksums), ``fsync``;
4. ``rename`` the directory to ``step_{N}`` and ``fsync`` the parent directory;
5. point ``latest`` at it by renaming a fresh symlink over it (atomic), ``fsync`` again;
6. every rank waits at a barrier, so none proceeds before the checkpoint is durable.

A crash at any moment leaves either the previous ``latest`` or the new one, never a
partial checkpoint under a ``step_N`` name. Loading verifies the manifest (sizes and
checksums); a corrupted or truncated checkpoint is reported (``checkpoint_corrupt``) and
the newest valid older one is used. Loading uses ``torch.load(weights_only=True)``: no
arbitrary pickle is ever executed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import events
from ..config import ConfigError, require_number
from ..dist import backend_device, group_rank, is_distributed
from . import LATEST, step_dirs

__all__ = ["CheckpointError", "CheckpointManager", "MANIFEST", "STATE_FILE"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
_FORMAT = "steadfast-checkpoint/1"
_TMP_PREFIX = ".tmp-step_"
_TRASH_PREFIX = ".del-step_"


def _discard(path: Path) -> None:
    """Delete a checkpoint directory without ever exposing a half-deleted ``step_N``:
    rename it to a hidden name (atomic) first, then remove it. A crash in between leaves
    only hidden leftovers, which the next manager removes."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name[len('step_') :]}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class CheckpointError(RuntimeError):
    """No valid checkpoint could be loaded, or a save failed; the message names the files."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _snapshot(value: Any, copy: bool) -> Any:
    """``value`` with every tensor on the CPU. With ``copy`` (async save) CPU tensors are
    cloned too, so training can go on mutating the originals while a background thread
    writes; a sync save writes CPU tensors as they are (no copy)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, Mapping):
        return {k: _snapshot(v, copy) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v, copy) for v in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(v, copy) for v in value)
    return value


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems found checking the checkpoint directory ``path`` against its manifest
    (an empty list means it is complete and intact)."""
    ckpt = Path(path)
    manifest_path = ckpt / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return [f"{manifest_path}: missing"]
    except (OSError, ValueError) as exc:
        return [f"{manifest_path}: unreadable ({exc})"]
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return [f"{manifest_path}: not a {_FORMAT} manifest"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return [f"{manifest_path}: no file list"]
    problems = []
    for name, meta in files.items():
        f = ckpt / name
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size != meta.get("bytes"):
            problems.append(f"{f}: {size} bytes, manifest says {meta.get('bytes')}")
            continue
        if _crc32_file(f) != meta.get("crc32"):
            problems.append(f"{f}: checksum mismatch")
    return problems


class CheckpointManager:
    """Saves and loads the whole training state so that no fault can lose it.

    Args:
        checkpoint_dir: Where ``step_N`` directories and ``latest`` live.
        keep_last_n: How many checkpoints to keep (<= 0 keeps all); ``latest`` and the
            save in flight are never deleted.
        async_save: Snapshot to host memory and write in a background thread; at most one
            save is in flight, :meth:`wait` joins it, and a failed background save is
            raised at the next call.
        group: Process group whose ranks save together (default: the world).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        keep_last_n: int = 3,
        async_save: bool = False,
        group: Any = None,
    ) -> None:
        self.dir = Path(checkpoint_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"checkpoint_dir {str(self.dir)!r} exists but is not a directory")
        self.keep_last_n = require_number(
            "CheckpointManager.keep_last_n", keep_last_n, integer=True
        )
        self.async_save = bool(async_save)
        self._group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: int | None = None
        if self._is_writer():
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
        if not os.environ.get(events.EVENTS_ENV):
            events.set_default_path(self.dir / "events.jsonl")

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Save ``state`` as checkpoint ``step``; every rank of the group must call it.

        Objects with ``state_dict()`` (model, optimizer, scheduler, NaNDetector, ...) are
        saved through it. Sync: returns once the checkpoint is durable and ``latest``
        points at it. Async: returns after the host snapshot; the write goes on in the
        background.
        """
        require_number("CheckpointManager.save step", step, minimum=0, integer=True)
        self._raise_background_error()
        self.wait()
        start = time.monotonic()
        self._agree_on_step(step)
        snapshot = (
            _snapshot(_to_state_dicts(state), copy=self.async_save) if self._is_writer() else None
        )
        if not self.async_save:
            self._write_and_publish(step, snapshot, start, blocking=None)
            self._barrier()
            return
        self._in_flight = step
        blocking = time.monotonic() - start
        self._thread = threading.Thread(
            target=self._background,
            args=(step, snapshot, start, blocking),
            name="steadfast-checkpoint-writer",
            daemon=False,
        )
        self._thread.start()

    def save_emergency(self, step: int, state: Mapping[str, Any]) -> None:
        """Synchronous save for shutdown paths: waits for any async save, skips retention."""
        saved_async, self.async_save = self.async_save, False
        keep, self.keep_last_n = self.keep_last_n, 0
        try:
            self.save(step, state)
        finally:
            self.async_save, self.keep_last_n = saved_async, keep

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its error if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
            self._in_flight = None
            self._barrier()
        self._raise_background_error()

    def load(self, path: str | os.PathLike[str] | None = None) -> tuple[int, dict[str, Any]] | None:
        """Load the newest valid checkpoint (or ``path``); None when there is none yet.

        Each candidate is verified against its manifest; a corrupt one emits
        ``checkpoint_corrupt`` and the next older one is tried. If checkpoints exist but
        none is valid, raises :class:`CheckpointError` naming the files.
        """
        self.wait()
        candidates = [Path(path)] if path is not None else self._candidates()
        if not candidates:
            return None
        failures: list[str] = []
        for ckpt in candidates:
            problems = verify(ckpt)
            if problems:
                failures.extend(problems)
                logger.error("checkpoint %s is corrupt: %s", ckpt, "; ".join(problems))
                events.emit(
                    "checkpoint_corrupt", cause="verify", path=str(ckpt), reason="; ".join(problems)
                )
                continue
            start = time.monotonic()
            try:
                state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
            except Exception as exc:
                failures.append(f"{ckpt / STATE_FILE}: cannot be loaded ({exc})")
                events.emit("checkpoint_corrupt", cause="load", path=str(ckpt), reason=str(exc))
                continue
            step = int(json.loads((ckpt / MANIFEST).read_text())["step"])
            events.emit(
                "checkpoint_loaded", step=step, path=str(ckpt), seconds=time.monotonic() - start
            )
            return step, state
        raise CheckpointError(
            "no valid checkpoint in " + str(self.dir) + ": " + "; ".join(failures)
        )

    # ------------------------------------------------------------------ internals
    def _is_writer(self) -> bool:
        return group_rank(self._group) == 0

    def _barrier(self) -> None:
        if is_distributed():
            dist.barrier(group=self._group)

    def _agree_on_step(self, step: int) -> None:
        """Every rank must save the same step; a mismatch is a bug in the caller's loop."""
        if not is_distributed():
            return
        t = torch.tensor([step, -step], dtype=torch.int64, device=backend_device(self._group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        highest, lowest = (int(v) for v in t.tolist())
        lowest = -lowest
        if highest != lowest:
            raise CheckpointError(
                f"ranks disagree on the checkpoint step (this rank: {step}, "
                f"max: {highest}, min: {lowest})"
            )

    def _candidates(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [p for _, p in reversed(step_dirs(self.dir))]
        latest = self.dir / LATEST
        with contextlib.suppress(OSError, RuntimeError):
            target = latest.resolve() if latest.is_symlink() else None
            if target is not None and target in found:
                found.remove(target)
                found.insert(0, target)
        return found

    def _remove_stale_tmp(self) -> None:
        for entry in self.dir.iterdir():
            if (
                entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX))
                or entry.name == f".{LATEST}.tmp"
            ):
                logger.warning("removing %s left by an interrupted save", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _background(self, step: int, snapshot: Any, start: float, blocking: float) -> None:
        try:
            self._write_and_publish(step, snapshot, start, blocking)
        except BaseException as exc:  # raised at the next call, never swallowed
            self._error = exc

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"background checkpoint save failed: {error}") from error

    def _write_and_publish(
        self, step: int, snapshot: Any, start: float, blocking: float | None
    ) -> None:
        if not self._is_writer():
            return
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"{_TMP_PREFIX}{step}-{os.getpid()}"
        try:
            tmp.mkdir(parents=True)
            state_path = tmp / STATE_FILE
            with open(state_path, "wb") as fh:  # a real file: torch's fast native writer
                torch.save(snapshot, fh)
                fh.flush()
                os.fsync(fh.fileno())
            size = state_path.stat().st_size
            crc = _crc32_file(state_path)  # read back from the page cache: ~3.5 GB/s
            manifest = {
                "format": _FORMAT,
                "step": step,
                "time": time.time(),
                "files": {STATE_FILE: {"bytes": size, "crc32": crc}},
            }
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again: the newer write wins
                _discard(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            link = self.dir / f".{LATEST}.tmp"
            link.unlink(missing_ok=True)
            link.symlink_to(final.name)
            os.replace(link, self.dir / LATEST)
            _fsync_dir(self.dir)
        except Exception as exc:  # disk full, permissions, an unpicklable value...
            shutil.rmtree(tmp, ignore_errors=True)
            (self.dir / f".{LATEST}.tmp").unlink(missing_ok=True)
            raise CheckpointError(
                f"saving checkpoint step {step} to {final} failed: {type(exc).__name__}: {exc}"
            ) from exc
        seconds = time.monotonic() - start
        events.emit(
            "checkpoint_saved",
            step=step,
            path=str(final),
            bytes=size,
            seconds=seconds,
            blocking_seconds=seconds if blocking is None else blocking,
        )
        self._apply_retention(keep_step=step)

    def _apply_retention(self, keep_step: int) -> None:
        if self.keep_last_n <= 0:
            return
        existing = step_dirs(self.dir)
        latest_target: Path | None = None
        with contextlib.suppress(OSError, RuntimeError):
            latest_target = (self.dir / LATEST).resolve()
        protected = {keep_step, self._in_flight}
        for n, path in existing[: max(0, len(existing) - self.keep_last_n)]:
            if n in protected or path.resolve() == latest_target:
                continue
            try:
                _discard(path)
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s: %s", path, exc)
                continue
            events.emit("checkpoint_deleted", step=n, path=str(path))


def _to_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace objects that have ``state_dict()`` by their state dict."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        sd = getattr(value, "state_dict", None)
        out[key] = sd() if callable(sd) else value
    return out
