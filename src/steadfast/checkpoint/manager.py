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
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import events
from ..config import ConfigError, require_number
from ..dist import group_rank, is_distributed
from . import LATEST, step_dirs
from .state import RNGState, Stateful

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "MANIFEST",
    "STATE_FILE",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
RNG_KEY = "rng"
_FORMAT = "steadfast-checkpoint/1"
_TMP_PREFIX = ".sf-tmp-"  # + the checkpoint's name: ".sf-tmp-step_7", ".sf-tmp-last.ckpt"
_TRASH_PREFIX = ".sf-del-"  # + name + "-" + pid: hidden while replaced (may come back)
_REMOVED_PREFIX = ".sf-rm-"  # + name + "-" + pid: hidden to be deleted (never comes back)
_LEGACY_PREFIXES = (".tmp-step_", ".del-step_")  # what earlier versions left behind
_NAME_MAX = 200  # a checkpoint name, so that the hidden names stay under NAME_MAX (255)


class CheckpointError(RuntimeError):
    """No valid checkpoint could be loaded, or a save failed; the message names the files."""


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


# ---------------------------------------------------------------------- file helpers
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
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


def _rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


class _ChecksumWriter:
    """A write-only file object for ``torch.save`` that computes the CRC-32 of everything
    written while it is written: the checksum of each large chunk runs on a helper thread
    (zlib releases the GIL) at the same time as the chunk is copied to the file, so it
    costs almost nothing on top of the write (reading the file back would cost ~40%).
    Each chunk is finished before ``write`` returns, because torch reuses its buffers.
    The first ``OSError`` is kept, since torch reports it as a vague "unexpected pos"."""

    _PARALLEL_MIN = 1 << 20

    def __init__(self, fh: Any, pool: ThreadPoolExecutor) -> None:
        self._fh = fh
        self._pool = pool
        self.crc = 0
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            if len(view) < self._PARALLEL_MIN:
                self.crc = zlib.crc32(view, self.crc)
                self._fh.write(view)
            else:
                pending = self._pool.submit(zlib.crc32, view, self.crc)
                try:
                    self._fh.write(view)
                finally:
                    self.crc = pending.result()
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()


def _save_file(path: Path, obj: Any) -> dict[str, int]:
    """``torch.save`` ``obj`` to ``path`` durably; its size and CRC-32 for the manifest."""
    with open(path, "wb") as fh, ThreadPoolExecutor(1) as pool:
        writer = _ChecksumWriter(fh, pool)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        except Exception as exc:
            if writer.error is not None and writer.error is not exc:
                raise writer.error from exc
            raise
        size = os.fstat(fh.fileno()).st_size
    if size != writer.bytes:  # a short write the file object did not report
        raise OSError(f"{path}: wrote {writer.bytes} bytes, the file has {size}")
    return {"bytes": size, "crc32": writer.crc}


def _describe(exc: BaseException, where: Path) -> str:
    """One readable line for a failed write; "disk full" is said in words, not as torch's
    "unexpected pos"."""
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device or quota of {where} ({exc})"
    if code == errno.EFBIG:
        return f"file size limit exceeded writing to {where} (RLIMIT_FSIZE / ulimit -f) ({exc})"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"no permission to write to {where} ({exc})"
    with contextlib.suppress(OSError):
        if shutil.disk_usage(where if where.exists() else where.parent).free < 1 << 20:
            return f"no space left on the device of {where} ({type(exc).__name__}: {exc})"
    return f"{type(exc).__name__}: {exc}"


def _discard(path: Path, prefix: str = _REMOVED_PREFIX) -> Path:
    """Hide a checkpoint directory by renaming it (atomic), so that a crash never exposes
    a half-deleted ``step_N``; the caller removes the returned hidden path. Hidden with
    ``_TRASH_PREFIX`` (a copy being replaced), it comes back after a crash if its
    replacement never landed; with ``_REMOVED_PREFIX`` it never does."""
    trash = path.with_name(f"{prefix}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    return trash


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``), so that a name being replaced is never missing, not even for
    an instant; False where the kernel or file system cannot (the caller falls back)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return bool(done == 0)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- verification
def _manifest(ckpt: Path) -> tuple[dict[str, Any] | None, list[str]]:
    manifest_path = ckpt / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return None, [f"{manifest_path}: missing"]
    except (OSError, ValueError) as exc:
        return None, [f"{manifest_path}: unreadable ({exc})"]
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return None, [f"{manifest_path}: not a {_FORMAT} manifest"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or not isinstance(manifest.get("step"), int):
        return None, [f"{manifest_path}: no step or no file list"]
    return manifest, []


def _check_files(ckpt: Path, files: Mapping[str, Any], checksum: set[str] | None) -> list[str]:
    """Sizes of all ``files``; CRC-32 of those in ``checksum`` (all when None)."""
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
        if (checksum is None or name in checksum) and _crc32_file(f) != meta.get("crc32"):
            problems.append(f"{f}: checksum mismatch")
    return problems


def _saved_keys(manifest: Mapping[str, Any]) -> list[str]:
    """The top-level keys a checkpoint holds, by its manifest."""
    keys = manifest.get("keys") or {}
    return [*keys.get("state", []), *keys.get("rank_state", [])]


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems found checking the checkpoint directory ``path`` against its manifest
    (an empty list means every file is present, of the right size and checksum)."""
    manifest, problems = _manifest(Path(path))
    if manifest is None:
        return problems
    return _check_files(Path(path), manifest["files"], None)


def write_manifest(path: str | os.PathLike[str], step: int, world_size: int = 1) -> dict[str, Any]:
    """Seal the checkpoint directory ``path`` that a framework wrote with its own files
    (the Hugging Face Trainer's ``checkpoint-N``): every file under it is fsynced,
    then described by size and CRC-32 in a ``manifest.json`` of the manager's format,
    written last and atomically (a temporary file renamed over). From then on
    :func:`verify` checks it; a directory the framework was still writing when the job
    died has no manifest, and one damaged later fails its checksums. Returns the
    manifest. Call it once every rank's files are written."""
    ckpt = Path(path)
    files: dict[str, dict[str, int]] = {}
    for f in sorted(ckpt.rglob("*")):
        name = f.relative_to(ckpt).as_posix()
        if not f.is_file() or f.is_symlink() or name in (MANIFEST, f"{MANIFEST}.tmp"):
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[name] = {"bytes": f.stat().st_size, "crc32": _crc32_file(f)}
    if not files:
        raise CheckpointError(f"{ckpt}: no files to describe in a manifest")
    for folder in sorted({f.parent for f in ckpt.rglob("*") if f.is_file()}, reverse=True):
        _fsync_dir(folder)
    manifest = {
        "format": _FORMAT,
        "step": int(step),
        "time": time.time(),
        "world_size": int(world_size),
        "sharded": False,
        "keys": {},
        "files": files,
    }
    tmp = ckpt / f"{MANIFEST}.tmp"
    _write_file(tmp, json.dumps(manifest, indent=1).encode())
    os.replace(tmp, ckpt / MANIFEST)
    _fsync_dir(ckpt)
    return manifest


# ---------------------------------------------------------------------- state capture
def _to_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace objects that have ``state_dict()`` by their state dict."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"checkpoint state keys must be strings, got {key!r}")
        sd = getattr(value, "state_dict", None)
        out[key] = sd() if callable(sd) else value
    return out


def _is_dtensor(value: Any) -> bool:
    # a DTensor exists only if its module was imported: importing it here would cost
    # ~0.5 s on the first save of every job that has none
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _any_tensor(value: Any, pred: Callable[[torch.Tensor], bool]) -> bool:
    """Whether any tensor in the nested state ``value`` satisfies ``pred``."""
    if isinstance(value, torch.Tensor):
        return pred(value)
    if isinstance(value, Mapping):
        return any(_any_tensor(v, pred) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_any_tensor(v, pred) for v in value)
    return False


def _has_dtensor(value: Any) -> bool:
    return _any_tensor(value, _is_dtensor)


class _Stager:
    """Copies the state to host memory for an async save, into buffers kept from the
    previous save when shapes and dtypes match (pinned when the source is on CUDA).

    Reusing the buffers is what makes the stall short: a fresh 200 MB allocation costs
    page faults on every page, a copy into warm memory is a plain memcpy. The cost is one
    host copy of the state kept alive between saves (as torch's async DCP does). Tensors
    that are the same object (tied weights) stay one tensor.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: dict[str, torch.Tensor] = {}
        self._memo: dict[int, torch.Tensor] = {}
        self._devices: set[torch.device] = set()

    def stage(self, value: Any) -> Any:
        self._used, self._memo, self._devices = {}, {}, set()
        staged = self._walk(value, "")
        for device in self._devices:  # the non-blocking copies must land before writing
            torch.cuda.synchronize(device)
        self._buffers = self._used  # buffers for keys that went away are released
        return staged

    def clear(self) -> None:
        self._buffers, self._used, self._memo = {}, {}, {}

    def _copy(self, t: torch.Tensor, key: str, memo: bool = True) -> torch.Tensor:
        if memo and id(t) in self._memo:
            return self._memo[id(t)]
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            self._devices.add(t.device)
        self._used[key] = buf
        if memo:  # t is alive for the whole walk: its id cannot be reused meanwhile
            self._memo[id(t)] = buf
        return buf

    def _walk(self, value: Any, key: str) -> Any:
        if _is_dtensor(value):
            local = self._copy(value.to_local(), key, memo=False)  # a temporary: no id()
            return type(value).from_local(
                local,
                value.device_mesh,
                value.placements,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._copy(value, key)
        if isinstance(value, Mapping):
            return {k: self._walk(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, f"{key}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._walk(v, f"{key}/{i}") for i, v in enumerate(value))
        return value


def _safe_load_planner() -> Any:
    """DCP's default load planner, except that non-tensor values are unpickled with
    ``weights_only=True`` (DCP itself uses ``weights_only=False`` for them); keys present
    in the objects but not in the checkpoint are left alone (``allow_partial_load``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            safe = torch.load(value, weights_only=True)  # raises on anything not allow-listed
            again = io.BytesIO()
            torch.save(safe, again)  # only tensors, numbers, strings, containers remain
            again.seek(0)
            super().load_bytes(read_item, again)

    return SafeLoadPlanner(allow_partial_load=True)


def _dcp_plain_values(metadata: Any) -> set[str]:
    """Top-level keys a DCP checkpoint holds as plain (non-tensor) values: these can be
    loaded without a template from the caller; tensors need one to load into."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return {
        fqn
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, BytesStorageMetadata) and "." not in fqn
    }


def _dtensor_off_cpu(value: Any) -> bool:
    return _any_tensor(value, lambda t: _is_dtensor(t) and t.device.type != "cpu")


def _to_cpu(value: Any) -> Any:
    """``value`` with every (non-sharded) tensor on the CPU, without copying CPU tensors."""
    if isinstance(value, torch.Tensor) and not _is_dtensor(value):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


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
    named: bool = False  # published under a framework's name: latest stays
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
        self._stager = _Stager()  # replicated / sharded state
        self._local_stager = _Stager()  # rank_state and RNG
        if self._rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.collective or group_rank(None) == 0:
                self._remove_stale_tmp()

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
        require_number("CheckpointManager.save step", step, minimum=0, integer=True)
        if name is not None and (
            not name
            or "/" in name
            or name.startswith(".")
            or name == LATEST
            or len(os.fsencode(name)) > _NAME_MAX
        ):
            raise ConfigError(
                f"CheckpointManager.save name: {name!r} is not a plain file name "
                f"(of at most {_NAME_MAX} bytes)"
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
        sharded = self.sharded if self.sharded is not None else _has_dtensor(replicated)
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}"
        prepared = None
        if self._rank == 0 and bad_state is None and fenced is None:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                prepared = _describe(exc, tmp)
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
        run_async = self.async_save
        if run_async and sharded and _dtensor_off_cpu(replicated):
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
                payload = replicated if sharded else (_to_cpu(replicated) if writes else None)
                local = _to_cpu(local)
        except Exception as exc:
            failure = f"rank {self._rank}: snapshot failed: {type(exc).__name__}: {exc}"
        job = _SaveJob(
            step, tmp, final, payload, local, keys, sharded, start, failure, name is not None
        )
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

    def _capture(
        self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state dicts to save: replicated, and this rank's own (with its RNG)."""
        replicated = _to_state_dicts(state)
        local = _to_state_dicts(rank_state or {})
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
        saved_async, self.async_save = self.async_save, False
        keep, self.keep_last_n = self.keep_last_n, 0
        try:
            self.save(step, state, rank_state)
        finally:
            self.async_save, self.keep_last_n = saved_async, keep

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
            self._stager.clear()
            self._local_stager.clear()
            if self._coord is not None and is_distributed():
                dist.destroy_process_group(self._coord)
            self._coord = None

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
            _remove_all([_discard(target)])
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
            from torch.distributed.checkpoint.filesystem import FileSystemWriter
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            dcp_dir = tmp / DCP_DIR
            dcp_save(
                payload,
                storage_writer=FileSystemWriter(dcp_dir, sync_files=True),
                process_group=self._coord,
                no_dist=self._coord is None,
            )
            names = sorted(os.listdir(dcp_dir))
            for name in names[self._rank :: self._world]:  # checksums shared out by rank
                f = dcp_dir / name
                files[f"{DCP_DIR}/{name}"] = {"bytes": f.stat().st_size, "crc32": _crc32_file(f)}
        elif payload is not None:
            files[STATE_FILE] = _save_file(tmp / STATE_FILE, payload)
        if local:
            files[_rank_file(self._rank)] = _save_file(tmp / _rank_file(self._rank), local)
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
                mine = f"rank {self._rank}: {_describe(exc, tmp)}"
        shares = self._all_gather((files, mine))
        outcome: str | None = None
        if self._rank == 0:
            errors = [err for _, err in shares if err]
            outcome = "; ".join(errors) if errors else None
            if outcome is None:
                try:
                    _fence(final)  # again, just before latest moves
                    everything = {k: v for share, _ in shares for k, v in share.items()}
                    self._publish(job, everything)
                except CheckpointFenced as exc:
                    outcome = f"rank 0: {exc}"
                except Exception as exc:
                    outcome = f"rank 0: {_describe(exc, final)}"
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
            trash = [] if job.named else self._apply_retention(keep_step=step)
        except Exception as exc:
            logger.warning("retention after checkpoint step %d failed: %s", step, exc)
            trash = []
        if trash and blocking is None:  # sync save: do not make training wait for unlink
            self._reaper = threading.Thread(
                target=_remove_all, args=(trash,), name="steadfast-checkpoint-reaper"
            )
            self._reaper.start()
        else:
            _remove_all(trash)

    def _publish(self, job: _SaveJob, files: dict[str, dict[str, int]]) -> None:
        step, tmp, final, keys, sharded = job.step, job.tmp, job.final, job.keys, job.sharded
        manifest = {
            "format": _FORMAT,
            "step": step,
            "time": time.time(),
            "world_size": self._world,
            "sharded": sharded,
            "keys": keys,
            "files": dict(sorted(files.items())),
        }
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        if sharded:
            _fsync_dir(tmp / DCP_DIR)
        _fsync_dir(tmp)
        if not final.exists():
            os.rename(tmp, final)
        elif _exchange(tmp, final):  # the same name saved again: the newer write wins,
            shutil.rmtree(tmp, ignore_errors=True)  # and the name is never missing
        else:  # hide the old copy (it comes back if a crash stops us here), then rename
            old = _discard(final, _TRASH_PREFIX)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(self.dir)
        if job.named:  # latest stays where it is
            return
        link = self.dir / f".{LATEST}.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, self.dir / LATEST)
        _fsync_dir(self.dir)

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
                trash.append(_discard(path))
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s: %s", path, exc)
                continue
            events.emit("checkpoint_deleted", step=n, path=str(path))
        return trash

    def _remove_stale_tmp(self) -> None:
        hidden: dict[str, list[tuple[float, Path]]] = {}  # copies hidden for replacement
        for entry in self.dir.iterdir():
            for prefix in (_TRASH_PREFIX, _LEGACY_PREFIXES[1]):
                if entry.name.startswith(prefix) and entry.is_dir():
                    name, _, pid = entry.name[len(prefix) :].rpartition("-")
                    name = name if prefix == _TRASH_PREFIX else f"step_{name}"
                    manifest, _ = _manifest(entry)
                    if name and pid.isdigit() and manifest is not None:
                        hidden.setdefault(name, []).append((manifest.get("time", 0.0), entry))
        for name, copies in hidden.items():
            original = self.dir / name
            for _, entry in sorted(copies, key=lambda c: c[0], reverse=True):
                if not original.exists() and not verify(entry):
                    # a checkpoint being replaced by a new save of the same name when the
                    # job died: the new copy never landed, so the newest old one comes back
                    logger.warning("recovering %s from %s", original, entry)
                    os.rename(entry, original)
        for entry in sorted(self.dir.iterdir()):
            if (
                entry.name.startswith(
                    (_TMP_PREFIX, _TRASH_PREFIX, _REMOVED_PREFIX, *_LEGACY_PREFIXES)
                )
                or entry.name == f".{LATEST}.tmp"
            ):
                logger.warning("removing %s left by an interrupted save", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    # ------------------------------------------------------------------ loading
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

    def _check_mine(self, ckpt: Path) -> tuple[dict[str, Any] | None, list[str]]:
        """Verify ``ckpt`` as far as this rank needs: every file's size, and the
        checksums of the files this rank reads plus its share of the rest."""
        manifest, problems = _manifest(ckpt)
        if manifest is None:
            return None, problems
        names = sorted(manifest["files"])
        mine = set(names[self._rank :: self._world])
        mine |= {STATE_FILE, _rank_file(self._rank)}
        return manifest, _check_files(ckpt, manifest["files"], mine)

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
            from torch.distributed.checkpoint.filesystem import FileSystemReader
            from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

            reader = FileSystemReader(ckpt / DCP_DIR)
            saved = manifest.get("keys", {}).get("state", [])
            state = _to_state_dicts({k: objects[k] for k in saved if k in objects})
            plain = _dcp_plain_values(reader.read_metadata())
            state.update({k: None for k in saved if k not in state and k in plain})
            dcp_load(
                state,
                storage_reader=reader,
                planner=_safe_load_planner(),
                process_group=self._coord,
                no_dist=self._coord is None,
            )
        else:
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=weights_only)
        own = _rank_file(self._rank)
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

    def _older_than(self, ckpt: Path, require_keys: set[str]) -> list[Path]:
        """Every other checkpoint in ``checkpoint_dir`` (``step_N`` or named) whose
        manifest is readable, whose step is not above ``ckpt``'s and whose keys include
        ``ckpt``'s (when ``ckpt``'s manifest says them; else ``require_keys``), newest
        first: where ``load(fallback=True)`` goes on."""
        manifest, _ = _manifest(ckpt)
        bound = manifest["step"] if manifest is not None else None
        keys = set(_saved_keys(manifest)) if manifest is not None else require_keys
        found: list[tuple[int, float, Path]] = []
        if self.dir.is_dir():
            for entry in self.dir.iterdir():
                if entry.name.startswith(".") or entry == ckpt or not entry.is_dir():
                    continue
                other, _ = _manifest(entry)
                if (
                    other is not None
                    and (bound is None or other["step"] <= bound)
                    and keys <= set(_saved_keys(other))
                ):
                    with contextlib.suppress(OSError):
                        found.append((other["step"], entry.stat().st_mtime, entry))
        return [p for _, _, p in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]

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
            candidates = self._candidates()
        else:
            candidates = [Path(path)] + (
                self._older_than(Path(path), require_keys) if fallback else []
            )
        # every rank tries the same candidates in the same order: rank 0's view
        candidates = [Path(p) for p in self._from_rank0([str(p) for p in candidates])]
        if not candidates:
            return None
        failures: list[str] = []
        for ckpt in candidates:
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
                "checkpoint_loaded", step=step, path=str(ckpt), seconds=time.monotonic() - start
            )
            return step, state
        raise CheckpointError(f"no valid checkpoint in {self.dir}: " + "; ".join(failures))
