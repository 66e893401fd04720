"""Which checkpoint a proven restore takes, and what proves it (rank 0, before the
restore; :mod:`.proof` carries the proof out). The routes, cheapest proof first:

- **losses**: the newest checkpoint leaves :data:`~.proof_log.NEEDED` logged steps to
  re-do (steps a restart re-does anyway): it is restored, their losses compared;
- **ledger**: an earlier restore of this run was proven by replay (its checkpoints hold
  every state the loop depends on) and the newest checkpoint is a disk one the ledger
  knows: it is restored and its files' digest compared with the one logged when it
  was saved; no step is re-done;
- **state** (disk): the newest is a disk checkpoint the loop saves again (one of its
  cadence, or at a step it snapshots) and an older one exists: the one before it is
  restored, and the state the loop reaches at the newest one's step is compared with
  it, object by object (with the losses logged on the way);
- **state** (memory): the newest is a memory snapshot every rank's is held for (not
  sharded), newer than the disk's, and the loop logs losses (a proof by them would
  re-do two or three steps): the one before it is restored, one step re-done, and the
  state the loop reaches at the newest one's step compared with the snapshot the tier
  kept of it;
- else the newest checkpoint that leaves ``NEEDED`` logged steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .layout import read_manifest, step_dirs
from .proof_log import NEEDED, Logged, ceiling

__all__ = ["MEMORY", "Plan", "route"]

#: ``Plan.against``'s place for the memory tier's snapshot of the step (its folders are
#: per rank and per node: each rank reads its own)
MEMORY = "memory"


@dataclass(frozen=True)
class Plan:
    """What rank 0 decided before a restore: the newest step it may take (None: any),
    the excluded checkpoints, the checkpoint to compare the re-done state with (its
    step and folder, or :data:`MEMORY`; None: the losses alone prove it), or the
    ledger route's digests (folder -> digest) and the proven restore's keys."""

    at_most: int | None
    excluded: dict[str, int]
    against: tuple[int, str] | None = None
    why: str | None = None  # why no proof was planned
    ledger: dict[str, str] = field(default_factory=dict)
    proven: list[str] | None = None


def route(
    folder: Path,
    excluded: dict[str, int],
    logged: Logged,
    held: list[int],
    budget: int,
    memory_every: int = 0,
    world: int | None = None,
    whole: int | None = None,
) -> Plan:
    """Rank 0's route for a restore (see the module's description). ``held``: the steps
    this node's memory tier holds; ``budget``: the most steps a proof may re-do that a
    newer checkpoint held; ``world``: the ranks restoring (None: not known). A state
    route needs the loop to save or snapshot again at the compared step: a save of its
    cadence (not an emergency one, nor a stop's save off the cadence: each manifest says
    how many steps it came after the loop's previous save), or a step of its snapshots'.
    ``whole``: the newest step the memory tier holds every rank's (unsharded) snapshot
    of, anywhere in the job. No proof across a change of the world size (an elastic
    round): the re-done steps split the batch another way, and their losses and state
    differ by design."""
    if budget <= 0:
        return Plan(None, excluded, why="replay proofs are off (max_proof_steps=0)")
    limit = ceiling(logged.losses)
    disk = [(s, p) for s, p in step_dirs(folder) if s > excluded.get("disk", -1)]
    held = [s for s in held if s > excluded.get("memory", -1)]
    steps = sorted({s for s, _ in disk} | set(held))
    newest_disk = read_manifest(disk[-1][1])[0] if disk else None  # its manifest
    size = newest_disk.get("world_size") if newest_disk is not None else None
    if world is not None and isinstance(size, int) and size != world:
        return Plan(None, excluded, why=f"the world size changed since the newest checkpoint "
                    f"({size} -> {world} ranks, an elastic round): the re-done steps cannot "
                    "give what they gave")  # fmt: skip
    if not steps or (limit is not None and limit >= steps[-1]):
        return Plan(limit, excluded)  # the newest, proven by the losses (or nothing)
    newest = steps[-1]
    older = [s for s in steps if s < newest]
    manifest = newest_disk if disk and disk[-1][0] == newest else None
    if manifest is not None and manifest.get("exact"):
        return Plan(None, excluded, why="the re-run state machine's checkpoint (exit 16): "
                    "resumed from exactly, its re-run is its check")  # fmt: skip
    if manifest is not None and logged.proven is not None and newest not in held:
        # the digests of the checkpoints still in the folder (the log names every save)
        saved = {os.path.abspath(p): d for p, d in logged.saved.items()}
        ledger = {a: saved[a] for _, p in disk if (a := os.path.abspath(p)) in saved}
        if os.path.abspath(disk[-1][1]) in ledger and not manifest.get("sharded"):
            return Plan(None, excluded, ledger=ledger, proven=logged.proven)
    if manifest is not None and older and newest - older[-1] <= budget:
        # the loop saves again at this step: a save of its cadence (as many steps after
        # the save before it as that one was after its own), or a snapshot step
        before = read_manifest(disk[-2][1])[0] if len(disk) > 1 else None
        since = manifest.get("since")
        cadence = before is None or since is None or before.get("since") in (None, since)
        again = (manifest.get("regular", True) and cadence) or (
            memory_every > 0 and newest % memory_every == 0
        )
        if again and not manifest.get("sharded"):
            return Plan(newest - 1, excluded, (newest, str(disk[-1][1])))
    if limit is not None and whole is not None and whole > max((s for s, _ in disk), default=-1):
        # newer held steps are torn (a rank died writing them): none can be restored
        below = [s for s in steps if s < whole]
        if below and whole - below[-1] <= budget and whole % max(memory_every, 1) == 0:
            return Plan(whole - 1, excluded, (whole, MEMORY))
    fit = [s for s in steps if limit is not None and s <= limit]
    if fit and newest - fit[-1] <= budget:
        return Plan(limit, excluded)
    if fit or (manifest is not None and older and newest - older[-1] > budget):
        why = (f"a proof would re-do more than {budget} steps a newer checkpoint held "
               "(max_proof_steps): the newest is restored unproven")  # fmt: skip
    else:
        why = (f"no older checkpoint leaves {NEEDED} logged steps to re-do, and the loop "
               "saves or snapshots at no step after it that a checkpoint holds")  # fmt: skip
    return Plan(None, excluded, why=why)
