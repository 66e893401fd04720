"""The on-disk layout of a checkpoint and its publish protocol (see
:mod:`steadfast.checkpoint.saving` for the whole save): the names, the manifest and its
verification, the atomic publish under ``step_N`` or a framework's own name, hiding a
checkpoint before deleting it, what an interrupted save left behind, and finding the
checkpoints of a directory (the one to resume from, the ones to fall back to).

Layout of ``{dir}/step_{N}/`` (plus a relative ``latest`` symlink, as
:func:`resolve_resume_path` expects):

- ``state.pt``: replicated state (model, optimizer under DDP, ...), written once by rank 0;
- ``dcp/``: sharded state (FSDP, DTensor), written by every rank through
  ``torch.distributed.checkpoint`` (DCP) instead of ``state.pt``;
- ``rank_{r}.pt``: what differs per rank: RNG streams and data position;
- ``manifest.json``: format, step, world size, the keys saved, and every file with its
  size and CRC-32.

:func:`resolve_resume_path` follows seed 000's rules: a ``{dir}/latest`` symlink that
resolves to an existing checkpoint wins; otherwise the highest ``step_N`` directory by
number (not by name: ``step_10`` is newer than ``step_9``); a broken ``latest`` falls back
to the scan. A missing directory means "nothing to resume" (the first run); a path that
exists but is not a directory is a configuration error, not a silent fresh start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .files import crc32_file, fsync_dir, write_file

__all__ = [
    "DCP_DIR",
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "NAME_MAX",
    "REMOVED_PREFIX",
    "STATE_FILE",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "CheckpointError",
    "candidates",
    "check_files",
    "discard",
    "exchange",
    "new_manifest",
    "older_than",
    "publish",
    "rank_file",
    "read_manifest",
    "remove_all",
    "remove_stale",
    "resolve_resume_path",
    "saved_keys",
    "step_dirs",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
FORMAT = "steadfast-checkpoint/1"
TMP_PREFIX = ".sf-tmp-"  # + the checkpoint's name: ".sf-tmp-step_7", ".sf-tmp-last.ckpt"
TRASH_PREFIX = ".sf-del-"  # + name + "-" + pid: hidden while replaced (may come back)
REMOVED_PREFIX = ".sf-rm-"  # + name + "-" + pid: hidden to be deleted (never comes back)
LEGACY_PREFIXES = (".tmp-step_", ".del-step_")  # what earlier versions left behind
NAME_MAX = 200  # a checkpoint name, so that the hidden names stay under NAME_MAX (255)
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """No valid checkpoint could be loaded, or a save failed; the message names the files."""


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def discard(path: Path, prefix: str = REMOVED_PREFIX) -> Path:
    """Hide a checkpoint directory by renaming it (atomic), so that a crash never exposes
    a half-deleted ``step_N``; the caller removes the returned hidden path. Hidden with
    ``TRASH_PREFIX`` (a copy being replaced), it comes back after a crash if its
    replacement never landed; with ``REMOVED_PREFIX`` it never does."""
    trash = path.with_name(f"{prefix}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    return trash


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> bool:
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


def remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- verification
def read_manifest(ckpt: Path) -> tuple[dict[str, Any] | None, list[str]]:
    manifest_path = ckpt / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return None, [f"{manifest_path}: missing"]
    except (OSError, ValueError) as exc:
        return None, [f"{manifest_path}: unreadable ({exc})"]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, [f"{manifest_path}: not a {FORMAT} manifest"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or not isinstance(manifest.get("step"), int):
        return None, [f"{manifest_path}: no step or no file list"]
    return manifest, []


def check_files(ckpt: Path, files: Mapping[str, Any], checksum: set[str] | None) -> list[str]:
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
        if (checksum is None or name in checksum) and crc32_file(f) != meta.get("crc32"):
            problems.append(f"{f}: checksum mismatch")
    return problems


def saved_keys(manifest: Mapping[str, Any]) -> list[str]:
    """The top-level keys a checkpoint holds, by its manifest."""
    keys = manifest.get("keys") or {}
    return [*keys.get("state", []), *keys.get("rank_state", [])]


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems found checking the checkpoint directory ``path`` against its manifest
    (an empty list means every file is present, of the right size and checksum)."""
    manifest, problems = read_manifest(Path(path))
    if manifest is None:
        return problems
    return check_files(Path(path), manifest["files"], None)


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
        files[name] = {"bytes": f.stat().st_size, "crc32": crc32_file(f)}
    if not files:
        raise CheckpointError(f"{ckpt}: no files to describe in a manifest")
    for folder in sorted({f.parent for f in ckpt.rglob("*") if f.is_file()}, reverse=True):
        fsync_dir(folder)
    manifest = new_manifest(step, world_size, False, {}, files)
    tmp = ckpt / f"{MANIFEST}.tmp"
    write_file(tmp, json.dumps(manifest, indent=1).encode())
    os.replace(tmp, ckpt / MANIFEST)
    fsync_dir(ckpt)
    return manifest


def publish(
    tmp: Path,
    final: Path,
    manifest: dict[str, Any],
    move_latest: bool = True,
) -> None:
    """Steps 4 of the save protocol, on rank 0 once every rank's files in ``tmp`` are
    durable: write ``manifest.json``, ``fsync``, rename ``tmp`` to ``final`` (a
    checkpoint already there is hidden first: the newer write wins), ``fsync`` the
    parent, then point ``latest`` at it by renaming a fresh symlink over it."""
    folder = final.parent
    write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    if manifest.get("sharded"):
        fsync_dir(tmp / DCP_DIR)
    fsync_dir(tmp)
    if not final.exists():
        os.rename(tmp, final)
    elif exchange(tmp, final):  # the same name saved again: the newer write wins,
        shutil.rmtree(tmp, ignore_errors=True)  # and the name is never missing
    else:  # hide the old copy (it comes back if a crash stops us here), then rename
        old = discard(final, TRASH_PREFIX)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(folder)
    if not move_latest:
        return
    link = folder / f".{LATEST}.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, folder / LATEST)
    fsync_dir(folder)


def new_manifest(
    step: int, world_size: int, sharded: bool, keys: dict[str, list[str]], files: dict[str, Any]
) -> dict[str, Any]:
    """The manifest of a checkpoint: format, step, time, world size, keys, files."""
    return {
        "format": FORMAT,
        "step": int(step),
        "time": time.time(),
        "world_size": int(world_size),
        "sharded": bool(sharded),
        "keys": keys,
        "files": dict(sorted(files.items())),
    }


def remove_stale(folder: Path) -> None:
    """Clear what an interrupted save left in ``folder``: temporary directories and
    links, and hidden checkpoints, except a copy hidden while its name was replaced
    whose new copy never landed: the newest such copy is renamed back."""
    hidden: dict[str, list[tuple[float, Path]]] = {}  # copies hidden for replacement
    for entry in folder.iterdir():
        for prefix in (TRASH_PREFIX, LEGACY_PREFIXES[1]):
            if entry.name.startswith(prefix) and entry.is_dir():
                name, _, pid = entry.name[len(prefix) :].rpartition("-")
                name = name if prefix == TRASH_PREFIX else f"step_{name}"
                manifest, _ = read_manifest(entry)
                if name and pid.isdigit() and manifest is not None:
                    hidden.setdefault(name, []).append((manifest.get("time", 0.0), entry))
    for name, copies in hidden.items():
        original = folder / name
        for _, entry in sorted(copies, key=lambda c: c[0], reverse=True):
            if not original.exists() and not verify(entry):
                # a checkpoint being replaced by a new save of the same name when the
                # job died: the new copy never landed, so the newest old one comes back
                logger.warning("recovering %s from %s", original, entry)
                os.rename(entry, original)
    for entry in sorted(folder.iterdir()):
        if (
            entry.name.startswith((TMP_PREFIX, TRASH_PREFIX, REMOVED_PREFIX, *LEGACY_PREFIXES))
            or entry.name == f".{LATEST}.tmp"
        ):
            logger.warning("removing %s left by an interrupted save", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def step_dirs(checkpoint_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N`` directory in ``checkpoint_dir``, oldest first."""
    base = Path(checkpoint_dir)
    found: list[tuple[int, Path]] = []
    for entry in base.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    found.sort(key=lambda item: item[0])
    return found


def resolve_resume_path(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """Find the latest checkpoint for auto-resume.

    Checks:
      1. ``{checkpoint_dir}/latest`` symlink (used when it resolves to a directory)
      2. Most recent ``step_N`` directory by step number

    Args:
        checkpoint_dir: Base checkpoint directory.

    Returns:
        Path to the latest checkpoint, or None if none found (or the directory does not
        exist yet).

    Raises:
        ConfigError: ``checkpoint_dir`` exists but is not a directory.
    """
    base = Path(checkpoint_dir)
    if not base.exists():
        return None
    if not base.is_dir():
        raise ConfigError(f"checkpoint_dir {str(base)!r} exists but is not a directory")
    latest = base / LATEST
    if latest.is_symlink() or latest.exists():
        try:
            resolved: Path | None = latest.resolve()
        except (OSError, RuntimeError):  # a symlink loop, or an unreadable link
            resolved = None
        if resolved is not None and resolved.is_dir():
            logger.info("Auto-resume: found latest checkpoint at %s", resolved)
            return resolved
        logger.warning(
            "Auto-resume: %s does not resolve to a checkpoint directory; scanning step_N", latest
        )
    candidates = step_dirs(base)
    if candidates:
        path = candidates[-1][1]
        logger.info("Auto-resume: found checkpoint at %s", path)
        return path
    return None


def candidates(folder: Path) -> list[Path]:
    """The ``step_N`` checkpoints of ``folder``, newest first, ``latest``'s target first."""
    if not folder.is_dir():
        return []
    found = [p for _, p in reversed(step_dirs(folder))]
    latest = folder / LATEST
    with contextlib.suppress(OSError, RuntimeError):
        target = latest.resolve() if latest.is_symlink() else None
        if target is not None and target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def older_than(folder: Path, ckpt: Path, require_keys: Collection[str]) -> list[Path]:
    """Every other checkpoint in ``folder`` (``step_N`` or named) whose manifest is
    readable, whose step is not above ``ckpt``'s and whose keys include ``ckpt``'s (when
    ``ckpt``'s manifest says them; else ``require_keys``), newest first: where a load
    with fall-back goes on."""
    manifest, _ = read_manifest(ckpt)
    bound = manifest["step"] if manifest is not None else None
    keys = set(saved_keys(manifest)) if manifest is not None else set(require_keys)
    found: list[tuple[int, float, Path]] = []
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith(".") or entry == ckpt or not entry.is_dir():
                continue
            other, _ = read_manifest(entry)
            if (
                other is not None
                and (bound is None or other["step"] <= bound)
                and keys <= set(saved_keys(other))
            ):
                with contextlib.suppress(OSError):
                    found.append((other["step"], entry.stat().st_mtime, entry))
    return [p for _, _, p in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]
