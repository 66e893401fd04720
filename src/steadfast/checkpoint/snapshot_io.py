"""A memory-tier snapshot's files as they travel and are read: packed into one byte
tensor for another node (:func:`pack`, :func:`decode`, :func:`unpack`), verified in place
on this node (:func:`verify_in_place`: sizes, then every file's CRC-32 on every core),
and loaded (:func:`load_in_place` maps the tensors from shared memory, :func:`load_file`
reads what arrived). The snapshots themselves: :mod:`steadfast.checkpoint.memory`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .files import crc32_mapped, crc32_parallel
from .flat import load_flat
from .layout import MANIFEST, TMP_PREFIX, CheckpointError, check_files, publish, read_manifest

__all__ = [
    "RANK",
    "STATE",
    "decode",
    "load_file",
    "load_in_place",
    "pack",
    "read_for_sending",
    "unpack",
    "verify_in_place",
]

#: a snapshot's files: the state it keeps (replicated once per node, or the rank's
#: shards) and the rank's own state with its RNG streams
STATE = "state.pt"
RANK = "rank.pt"


def pack(snapshot: Path) -> torch.Tensor:
    """A snapshot as one byte tensor: an 8-byte length, its manifest (JSON), then its
    files in the manifest's order."""
    manifest_bytes = (snapshot / MANIFEST).read_bytes()
    manifest = json.loads(manifest_bytes)
    sizes = [int(meta["bytes"]) for meta in manifest["files"].values()]
    out = torch.empty(8 + len(manifest_bytes) + sum(sizes), dtype=torch.uint8)
    view = out.numpy()
    view[:8] = list(len(manifest_bytes).to_bytes(8, "little"))
    view[8 : 8 + len(manifest_bytes)] = list(manifest_bytes)
    at = 8 + len(manifest_bytes)
    for name, size in zip(manifest["files"], sizes, strict=True):
        with open(snapshot / name, "rb") as fh:
            if fh.readinto(memoryview(view[at : at + size])) != size:  # type: ignore[arg-type]
                raise CheckpointError(f"{snapshot / name}: shorter than its manifest says")
        at += size
    return out


def decode(data: torch.Tensor) -> tuple[dict[str, Any], dict[str, memoryview], list[str]]:
    """``(manifest, files, problems)`` of a packed snapshot, every file checked against
    the manifest's size and CRC-32."""
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    try:
        length = int.from_bytes(view[:8], "little")
        manifest = json.loads(bytes(view[8 : 8 + length]))
        names = list(manifest["files"])
    except (ValueError, KeyError, TypeError) as exc:
        return {}, {}, [f"unreadable snapshot header ({exc})"]
    files: dict[str, memoryview] = {}
    problems: list[str] = []
    at = 8 + length
    shares = _checksum_threads()
    with ThreadPoolExecutor(shares, thread_name_prefix="steadfast-crc") as pool:
        for name in names:
            meta = manifest["files"][name]
            if not isinstance(meta, dict) or "bytes" not in meta or "crc32" not in meta:
                problems.append(f"{name}: no size or checksum in the manifest")
                break
            chunk = view[at : at + int(meta["bytes"])]
            at += int(meta["bytes"])
            if len(chunk) != int(meta["bytes"]):
                problems.append(f"{name}: {len(chunk)} bytes, manifest says {meta['bytes']}")
            elif crc32_parallel(chunk, pool, shares) != meta["crc32"]:
                problems.append(f"{name}: checksum mismatch")
            files[name] = chunk
    return manifest, files, problems


def unpack(data: torch.Tensor, folder: Path, step: int) -> list[str]:
    """Write a packed snapshot as ``folder/step_<step>`` (verified first, published by a
    rename); the problems found, if any (then nothing is written)."""
    manifest, files, problems = decode(data)
    if problems:
        return problems
    final = folder / f"step_{step}"
    tmp = folder / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, chunk in files.items():
        with open(tmp / name, "wb") as fh:
            fh.write(chunk)
    publish(tmp, final, manifest, move_latest=False)
    return []


def _checksum_threads() -> int:
    """Threads for the CRC-32s of a restore: one per core, at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def verify_in_place(snapshot: Path) -> list[str]:
    """This node's snapshot checked against its manifest without a copy into one
    buffer: sizes, then each file's CRC-32 on every core, through a memory map
    (:func:`~steadfast.checkpoint.files.crc32_mapped`)."""
    manifest, problems = _sized(snapshot)
    if manifest is None or problems:
        return problems
    shares = _checksum_threads()
    with ThreadPoolExecutor(shares, thread_name_prefix="steadfast-crc") as pool:
        for name, meta in manifest["files"].items():
            try:
                if crc32_mapped(snapshot / name, pool, shares) != meta["crc32"]:
                    problems.append(f"{snapshot / name}: checksum mismatch")
            except OSError as exc:
                problems.append(f"{snapshot / name}: cannot be read ({exc})")
    return problems


def load_in_place(snapshot: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """File ``name`` (``state.pt``, ``rank.pt``) of a (verified) snapshot of this node, its
    tensors mapped from shared memory (:func:`~.flat.load_flat`): no copy until the model
    takes them."""
    return dict(load_flat(Path(snapshot) / name, str(Path(snapshot) / name)))


def load_file(files: Mapping[str, memoryview], name: str) -> dict[str, Any]:
    """File ``name`` of a (verified) snapshot that arrived from another node."""
    return dict(load_flat(files[name], f"{name} of a snapshot from another node"))


def _sized(snapshot: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """A snapshot's manifest and the problems with its files' sizes (a checksum costs a
    read of every byte: each caller checks those where it reads them)."""
    manifest, problems = read_manifest(snapshot)
    if manifest is None:
        return None, problems
    try:
        return manifest, check_files(snapshot, manifest["files"], set())
    except (OSError, KeyError, TypeError, ValueError) as exc:
        return manifest, [f"{snapshot}: cannot be verified ({exc})"]


def read_for_sending(snapshot: Path) -> tuple[torch.Tensor | None, list[str]]:
    """A snapshot of this node packed for another rank, its sizes checked (the checksums
    are checked where it arrives, after the transfer: :func:`decode`)."""
    manifest, problems = _sized(snapshot)
    if manifest is None or problems:
        return None, problems
    try:
        return pack(snapshot), []
    except (OSError, CheckpointError) as exc:
        return None, [f"{snapshot}: cannot be read ({exc})"]
