"""The restore from the memory tier (:mod:`~steadfast.checkpoint.memory`): the plan (the
newest step for which some node holds every rank's own snapshot and, for replicated
state, a copy of the node-level state; who serves each), then its execution, every rank
in step: each holder verifies or packs what it serves, the holders send, each rank
verifies what arrived and loads it. The rank's own piece goes first; a rank whose own
snapshot holds no ``state.pt`` (replicated state is kept once per node) then gets the
state from its node's copy, read in place, or from another node. A faulty copy
(``checkpoint_corrupt``, cause ``memory`` or ``replica``) is dropped and the plan made
again; with no plan left, the caller reads the disk, told why."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import events
from .collectives import Coordinator
from .layout import CheckpointError
from .memory import MemoryTier, Snapshot
from .snapshot_io import (
    RANK,
    STATE,
    decode,
    load_file,
    load_in_place,
    read_for_sending,
    verify_in_place,
)
from .staging import fill_in_place, to_state_dicts
from .upload import Uploader, gpu_job

__all__ = ["Plan", "Source", "held_whole", "plan", "quiet_wait", "restore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """Where a rank gets a snapshot: the rank that serves it (itself when its node holds
    it) and the snapshot."""

    holder: int
    snap: Snapshot


@dataclass(frozen=True)
class Plan:
    """A restore as data: the step; for each rank, its own snapshot (``rank.pt``, and
    its shards when ``sharded``) and, for replicated state, the ``state.pt`` it reads
    (absent where its own snapshot holds it)."""

    step: int
    own: dict[int, Source]
    state: dict[int, Source]
    sharded: bool


def restore(
    memory: MemoryTier,
    coord: Coordinator,
    newest_disk: int,
    objects: Mapping[str, Any] | None = None,
    at_most: int | None = None,
    after: int = -1,
    announce: bool = True,
) -> tuple[tuple[int, dict[str, Any], Path] | None, str]:
    """The restore from the memory tier: the newest step (not older than the newest
    disk checkpoint) that the job's nodes hold whole, each rank's pieces read from its
    own node or sent by a holder, verified after the transfer; a faulty copy is dropped
    and the plan made again. Sharded snapshots are restored only into ``objects`` (the
    live objects, whose DTensors get their saved shards in place). Returns ``(the step,
    the state, the snapshot read)``, or None and why not (the caller reads the disk).
    ``at_most``, ``after``: the steps a replay proof allows (see :mod:`.proof`);
    ``announce``: a restore (``checkpoint_loaded``, and the tier's ``newest_whole``), not
    a proof's read of the state."""
    me = coord.rank
    sharded_ok = objects is not None
    quiet_wait(memory)
    offers = coord.all_gather(memory.holdings())
    whole = plan(offers, coord.world, -1, set(), sharded_ok, None, after)
    if announce:  # a proof's read leaves what the restore saw
        memory.newest_whole = whole.step if whole is not None else -1
    bad: set[str] = set()  # the snapshots (their folders) found faulty
    while True:
        planned = plan(offers, coord.world, newest_disk, bad, sharded_ok, at_most, after)
        if planned is None:
            return None, _why_not(memory, offers, coord.world, bad)
        start = time.monotonic()
        own = _deliver(coord, planned.own, bad)
        if own is None:
            continue
        state_from = None
        if not planned.sharded:
            # second round for every rank (collective), a piece only where needed; a
            # folder its owner verified in place in the first round is not checked again
            # by each of the node's ranks that reads its state.pt
            checked = {s.snap.path for r, s in planned.own.items() if s.holder == r}
            state_from = _deliver(coord, planned.state, bad, checked)
            if state_from is None:
                continue
        state: dict[str, Any] | None = None
        found: list[str] = []
        mine = planned.own[me].snap
        try:
            state = _read(state_from if state_from and me in planned.state else own, STATE)
            state.update(_read(own, RANK))
            if planned.sharded and objects is not None:
                live = to_state_dicts({k: objects[k] for k in state if k in objects})
                with Uploader() as up:
                    copy = up.copy if gpu_job() else None
                    state = {
                        k: fill_in_place(live[k], v, copy) if k in live else v
                        for k, v in state.items()
                    }
        except Exception as exc:
            found = [f"cannot be loaded ({type(exc).__name__}: {exc})"]
            _corrupt(mine, found)
        faults = [f for share in coord.all_gather([mine.path] if found else []) for f in share]
        if faults or state is None:
            bad.update(faults)
            continue
        if announce:
            events.emit(
                "checkpoint_loaded",
                step=planned.step,
                path=mine.path,
                seconds=time.monotonic() - start,
                tier=mine.tier,
                from_rank=planned.own[me].holder,
            )
        return (planned.step, state, Path(mine.path)), ""


def held_whole(memory: MemoryTier, coord: Coordinator) -> tuple[list[int], int | None]:
    """The steps this node's tier holds, and the newest step for which the job's nodes
    hold every rank's snapshot, when it is not sharded (None: none, or sharded: a
    replay proof cannot compare its shards). Collective."""
    quiet_wait(memory)
    mine = memory.holdings()
    whole = plan(coord.all_gather(mine), coord.world, -1, set())
    return [s.step for s in mine], whole.step if whole is not None and not whole.sharded else None


def _read(got: tuple[Path | None, dict[str, memoryview]], name: str) -> dict[str, Any]:
    path, files = got
    return load_in_place(path, name) if path is not None else load_file(files, name)


def _deliver(
    coord: Coordinator,
    sources: dict[int, Source],
    bad: set[str],
    checked: frozenset[str] | set[str] = frozenset(),
) -> tuple[Path | None, dict[str, memoryview]] | None:
    """One round of the plan's execution (collective; ``sources`` may leave ranks out):
    each holder verifies what it reads in place (unless its folder is in ``checked``,
    verified in place earlier in this attempt) or packs what it sends, the holders
    send, each rank verifies what arrived. Returns what this rank got (the snapshot's
    folder to read in place, or the files that arrived); None when any rank found a
    faulty copy (added to ``bad``: plan again)."""
    me = coord.rank
    # 1. each holder reads what it serves: a snapshot of its node that a rank of its
    # node reads, verified in place (sizes and CRC-32 through a memory map); one for a
    # rank of another node, packed for sending (verified where it arrives)
    packed: dict[int, torch.Tensor] = {}
    problems: list[str] = []  # the faulty snapshots' folders
    for rank, source in sources.items():
        if source.holder != me:
            continue
        try:  # whatever fails here is reported: the other ranks are waiting
            if rank == me:
                found = (
                    [] if source.snap.path in checked else verify_in_place(Path(source.snap.path))
                )
            else:
                data, found = read_for_sending(Path(source.snap.path))
                if data is not None and not found:
                    packed[rank] = data
        except Exception as exc:
            found = [f"{source.snap.path}: cannot be read ({type(exc).__name__}: {exc})"]
        if found:
            problems.append(source.snap.path)
            _corrupt(source.snap, found)
    everyone = [p for share in coord.all_gather(problems) for p in share]
    if everyone:
        bad.update(everyone)
        return None
    # 2. the transfers, holder to rank (sizes known from phase 1)
    sizes = coord.all_gather({r: int(t.numel()) for r, t in packed.items()})
    mine = sources.get(me)
    data = None
    if mine is not None and mine.holder != me:
        data = torch.empty(sizes[mine.holder][me], dtype=torch.uint8)
    coord.send_recv(packed, (mine.holder, data) if mine is not None and data is not None else None)
    # 3. what arrived, verified
    files: dict[str, memoryview] = {}
    found = []
    if data is not None and mine is not None:
        try:
            _, files, found = decode(data)
        except Exception as exc:
            found = [f"cannot be decoded ({type(exc).__name__}: {exc})"]
        if found:
            _corrupt(mine.snap, found)
    faults = coord.all_gather([mine.snap.path] if found and mine is not None else [])
    faults = [f for share in faults for f in share]
    if faults:
        bad.update(faults)
        return None
    if mine is not None and mine.holder == me:
        return Path(mine.snap.path), {}
    return None, files


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
    offers: list[list[Snapshot]],
    world: int,
    newest_disk: int,
    bad: set[str],
    sharded_ok: bool = True,
    at_most: int | None = None,
    after: int = -1,
) -> Plan | None:
    """The newest step, not older than ``newest_disk``, for which every rank's own
    snapshot is held by some rank (``offers[h]``: what rank ``h``'s node holds) and, for
    replicated state, some node holds a ``state.pt``; less the copies found faulty. Each
    rank is served by itself if its node holds the piece, else by a holder of its own
    snapshot before one of a replica, else the lowest rank; the state comes with the
    rank's own snapshot when that holds it. Only steps in ``(after, at_most]`` (a
    replay proof's bounds)."""
    held: dict[tuple[int, int], list[Source]] = {}
    states: dict[int, list[Source]] = {}
    sharded: dict[int, bool] = {}
    for holder, offer in enumerate(offers):
        for snap in offer:
            if snap.path in bad:  # every local rank offers the same folder
                continue
            held.setdefault((snap.rank, snap.step), []).append(Source(holder, snap))
            sharded[snap.step] = sharded.get(snap.step, False) or snap.sharded
            if snap.state:
                states.setdefault(snap.step, []).append(Source(holder, snap))
    for step in sorted(sharded, reverse=True):
        if step < newest_disk or step <= after:
            return None
        if at_most is not None and step > at_most:
            continue
        if sharded[step] and not sharded_ok:
            continue
        own: dict[int, Source] = {}
        state: dict[int, Source] = {}
        for rank in range(world):
            options = [o for o in held.get((rank, step), []) if o.snap.state or not sharded[step]]
            if not options:
                break
            own[rank] = min(options, key=lambda o: _preference(o, rank))
            if sharded[step] or own[rank].snap.state:
                continue
            copies = states.get(step)
            if not copies:
                break
            state[rank] = min(copies, key=lambda o: _preference(o, rank))
        else:
            return Plan(step, own, state, sharded[step])
    return None


def _preference(option: Source, rank: int) -> tuple[bool, bool, int]:
    return option.holder != rank, option.snap.tier != "memory", option.holder


def _why_not(memory: MemoryTier, offers: list[list[Snapshot]], world: int, bad: set[str]) -> str:
    """Why the memory tier could not restore, for the disk load's event."""
    if any(s.path not in bad for offer in offers for s in offer):
        return "memory tier: no step every rank's snapshot is held for, as new as the disk's"
    others = memory.other_world_sizes()  # a scan of the node's snapshots: once
    if others:
        sizes = ", ".join(str(n) for n in sorted(others))
        return (
            f"memory tier: its snapshots are of {sizes} ranks, this job has {world}: "
            "read from disk (sharded state resharded by DCP)"
        )
    if bad:
        return "memory tier: every copy found faulty"
    return "memory tier: no snapshot"
