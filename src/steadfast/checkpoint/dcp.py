"""The glue to ``torch.distributed.checkpoint`` (DCP) for sharded state: every rank
writes its shards into ``dcp/`` (and checksums its share of the files), and reads them
back into the objects' own state dicts with a planner that unpickles nothing unsafe."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from .files import crc32_file

__all__ = ["load_sharded", "plain_values", "safe_load_planner", "save_sharded"]


def save_sharded(
    payload: Any, folder: Path, group: Any, rank: int, world: int
) -> dict[str, dict[str, int]]:
    r"""``dcp.save`` of ``payload`` into ``folder`` (collective over ``group``, None for
    one process), files fsynced; this rank's share of the files' sizes and CRCs
    (names ``dcp/...``), the shares split by rank so that each file is read once."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save(
        payload,
        storage_writer=FileSystemWriter(folder, sync_files=True),
        process_group=group,
        no_dist=group is None,
    )
    files: dict[str, dict[str, int]] = {}
    for name in sorted(os.listdir(folder))[rank::world]:
        f = folder / name
        files[f"{folder.name}/{name}"] = {"bytes": f.stat().st_size, "crc32": crc32_file(f)}
    return files


def load_sharded(state: dict[str, Any], saved: list[str], folder: Path, group: Any) -> None:
    """``dcp.load`` from ``folder`` into ``state`` (the objects' own state dicts, which
    give the shapes and shardings); the saved top-level keys ``saved`` that are plain
    values (no template needed) are loaded too."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = FileSystemReader(folder)
    plain = plain_values(reader.read_metadata())
    state.update({k: None for k in saved if k not in state and k in plain})
    dcp_load(
        state,
        storage_reader=reader,
        planner=safe_load_planner(),
        process_group=group,
        no_dist=group is None,
    )


def safe_load_planner() -> Any:
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


def plain_values(metadata: Any) -> set[str]:
    """Top-level keys a DCP checkpoint holds as plain (non-tensor) values: these can be
    loaded without a template from the caller; tensors need one to load into."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return {
        fqn
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, BytesStorageMetadata) and "." not in fqn
    }
