"""The restore from the memory tier (:mod:`~steadfast.checkpoint.memory`): the plan (the
newest step of which some node holds every rank's snapshot, and who serves each rank),
then its execution, every rank in step: each holder verifies or packs what it serves,
the holders send, each rank verifies what arrived and loads it. A faulty copy
(``checkpoint_corrupt``, cause ``memory`` or ``replica``) is dropped and the plan made
again; with no plan left, the caller reads the disk."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from .. import events
from .collectives import Coordinator
from .layout import CheckpointError
from .memory import (
    MemoryTier,
    Snapshot,
    decode,
    load_in_place,
    load_state,
    read_for_sending,
    verify_in_place,
)

__all__ = ["plan", "quiet_wait", "restore"]

logger = logging.getLogger(__name__)


def restore(
    memory: MemoryTier, coord: Coordinator, newest_disk: int
) -> tuple[int, dict[str, Any], Path] | None:
    """The restore from the memory tier: the newest step (not older than the newest
    disk checkpoint) whose snapshot of every rank some node holds, each rank's read
    from its own node or sent by the holder, verified after the transfer; a faulty
    copy (``checkpoint_corrupt``, cause ``memory`` or ``replica``) is dropped and the
    plan made again. Returns the step, the state and the snapshot read; None: no such
    step (the caller reads the disk)."""
    me = coord.rank
    quiet_wait(memory)
    offers = coord.all_gather(memory.holdings())
    bad: set[str] = set()  # the snapshots (their folders) found faulty
    while True:
        planned = plan(offers, coord.world, newest_disk, bad)
        if planned is None:
            return None
        step, choice = planned
        start = time.monotonic()
        # 1. each holder reads what it serves: its own snapshot verified in place
        # (sizes and CRC-32 through a memory map), another rank's packed for sending
        # (verified where it arrives)
        packed: dict[int, torch.Tensor] = {}
        problems: list[tuple[str, str]] = []  # (the snapshot's folder, what failed)
        for rank, (holder, snap) in choice.items():
            if holder != me:
                continue
            try:  # whatever fails here is reported: the other ranks are waiting
                if rank == me:
                    found = verify_in_place(Path(snap.path))
                else:
                    data, found = read_for_sending(Path(snap.path))
                    if data is not None and not found:
                        packed[rank] = data
            except Exception as exc:
                found = [f"{snap.path}: cannot be read ({type(exc).__name__}: {exc})"]
            if found:
                problems.append((snap.path, "; ".join(found)))
                _corrupt(snap, found)
        problems = [p for share in coord.all_gather(problems) for p in share]
        if problems:
            bad.update(path for path, _ in problems)
            continue
        # 2. the transfers, holder to rank (sizes known from phase 1)
        sizes = coord.all_gather({r: int(t.numel()) for r, t in packed.items()})
        mine_holder, mine = choice[me]
        data = None
        if mine_holder != me:
            data = torch.empty(sizes[mine_holder][me], dtype=torch.uint8)
        coord.send_recv(packed, (mine_holder, data) if data is not None else None)
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
            _corrupt(mine, found)
        faults = coord.all_gather([(mine.path, "; ".join(found))] if found else [])
        faults = [f for share in faults for f in share]
        if faults or state is None:
            bad.update(path for path, _ in faults)
            continue
        events.emit(
            "checkpoint_loaded",
            step=step,
            path=mine.path,
            seconds=time.monotonic() - start,
            tier=mine.tier,
            from_rank=mine_holder,
        )
        return step, state, Path(mine.path)


def quiet_wait(memory: MemoryTier) -> None:
    """Join the memory tier's writer before a restore; a snapshot that failed is
    logged here (the restore goes on with what is whole) rather than raised before
    a collective the other ranks have entered."""
    try:
        memory.wait()
    except CheckpointError as exc:
        logger.error("restoring after a failed memory snapshot: %s", exc)


def _corrupt(snap: Snapshot, problems: list[str]) -> None:
    reason = "; ".join(problems) or "unreadable"
    logger.error("%s snapshot %s is corrupt: %s", snap.tier, snap.path, reason)
    events.emit("checkpoint_corrupt", cause=snap.tier, path=snap.path, reason=reason)


def plan(
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
