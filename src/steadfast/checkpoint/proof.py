"""Every restore proven by replay: steadfast resumes bit-exact, so the steps a restart
re-does must give, bit for bit, what they gave before the fault.

How (no line of the loop changes):

- **Before the restore** (the first one of a :class:`~steadfast.CheckpointManager`: a
  process's start, an in-process restart), rank 0 reads the event log for the losses
  that ``step_done`` events carried before now (the newest value of each rank's step,
  leaving out the steps of a generation whose restore failed its proof), the state keys
  of the run's last restore proven by replay, and the ledger of the disk checkpoints'
  digests at save time (:mod:`.proof_log`). A checkpoint of step ``C`` re-does the
  steps from ``C`` on. The route, cheapest proof first (:mod:`.proof_route`): the
  newest checkpoint when it leaves :data:`NEEDED` logged steps to re-do (their losses
  compared); the newest disk checkpoint with no step re-done when an earlier restore of
  the run was proven by replay with the same state keys and its digest is the one
  logged at its save (the **ledger**: a checkpoint replaced or swapped after its save
  cannot match it); the one before the newest when the newest is a disk checkpoint the
  loop saves again (or snapshots at its step), whose state the state it reaches there
  is compared with, object by object, byte for byte (RNG streams included), with the
  losses logged on the way (**state**); the one before the newest memory snapshot
  every rank's is held for, when the loop logs losses, whose state at the newest one's
  step is compared with the snapshot the tier kept of it (**state**, from memory: one
  step re-done where the losses would re-do two or three); else the newest that
  leaves ``NEEDED`` logged steps.

  The steps a newer checkpoint held are re-done only for the proof: the
  ``restore_verified`` event says how many (``proof_steps``), the report their time.
- **While the proof is under way** nothing is saved or snapshotted (those steps were
  checkpointed before the fault; the restored checkpoint stays), and each rank keeps
  the losses of its own ``step_done`` events (:data:`steadfast.events.writer.step_listeners`).
- **At the loop's** ``snapshot`` **or** ``save`` **that completes it**, the ranks agree
  (one all-gather): ``restore_verified``, or ``restore_mismatch`` naming each rank,
  step, and the two losses or the objects that differ.
- **A mismatch is never ignored.** Rank 0 records the tier's checkpoints up to the
  restored step as excluded (``restore-excluded.json`` in the checkpoint folder; with
  the state route the disk's up to the compared one too: either may be the wrong one),
  the re-run state machine hears "a bad restore", and every rank raises
  :class:`RestoreMismatch`: the launcher restarts the workers, whose restore skips what
  is excluded (the next tier, an older checkpoint). When nothing is left to restore
  from, the restore raises :class:`RestoreUnproven`, which ends the process with exit 17
  ("failed result validation", which the launcher does not restart) and one message.

Why three losses: the optimizer's state holds the learning rate, so a state that lost
its LR scheduler (a ``LambdaLR``: a fresh one counts from 0) gives the right first loss
(the parameters were restored), the right second one (the first update used the
restored rate), and a wrong third (the fresh scheduler's first ``step()`` set the wrong
rate for the second update). The state route sees it one step after the restore.
Measured with ``tests/e2e/proof_loop.py``. The ledger route re-does nothing: what a
replay shows about the loop (its checkpoints hold every state its result depends on)
was shown by the run's earlier proof for the same keys, and what it shows about the
checkpoint (these are the bytes saved at that step) the digest logged outside the
checkpoint's folder shows.

What it cannot see, and says so (``restore_unverified``): a loop that logs no losses
and saves at no step it re-does, sharded (DCP) state on the state and ledger routes
(only the losses are compared). The ledger route trusts the earlier proof for the
rest of the run: a state the checkpoints lack that starts to matter only after it (a
schedule that turns later) is not seen by a restore the ledger proves. A rollback
inside a process (a NaN burst) re-does steps that went wrong on purpose, so only a
manager's first restore is proven.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import events
from ..events import writer
from .collectives import Coordinator
from .compare import DEFAULT_TOLERANCE, difference
from .layout import CheckpointError, read_manifest
from .proof_log import NEEDED, ceiling, digest, logged_losses, read_log
from .proof_route import MEMORY, Plan, route

__all__ = [
    "EXCLUDED_FILE",
    "resume_exactly",
    "NEEDED",
    "Plan",
    "Proof",
    "RestoreMismatch",
    "RestoreUnproven",
    "ceiling",
    "logged_losses",
    "on_bad_restore",
    "read_excluded",
]

logger = logging.getLogger(__name__)

#: Told ``(step, tier, text)`` when a restore fails its proof. The re-run state machine
#: (:mod:`steadfast.rerun.machine`) adds itself when it is imported: it uses the proof
#: (``resume_exactly``), and the proof imports nothing of it.
_BAD_RESTORE_LISTENERS: list[Callable[[int, str, str], None]] = []


def on_bad_restore(listener: Callable[[int, str, str], None]) -> None:
    """Call ``listener(step, tier, text)`` whenever a restore of this process fails its
    replay proof (once per listener, however often it is added)."""
    if listener not in _BAD_RESTORE_LISTENERS:
        _BAD_RESTORE_LISTENERS.append(listener)


#: In the checkpoint folder: tier -> the newest step of it that failed its proof.
EXCLUDED_FILE = "restore-excluded.json"
#: The exit status of a job whose every checkpoint failed its proof: the launcher's
#: "failed result validation", which it does not restart.
UNPROVEN_EXIT = 17


class RestoreMismatch(CheckpointError):
    """The restore failed its replay proof; the workers restart without that tier's
    checkpoints up to the restored step."""


class RestoreUnproven(SystemExit):
    """No checkpoint is left that has not failed a replay proof: the process ends with
    exit 17 (the launcher does not restart it) and this message."""

    def __init__(self, message: str) -> None:
        logger.error("%s", message)
        super().__init__(UNPROVEN_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


_exact = False  # the next save is one to resume from exactly


def resume_exactly() -> None:
    """The next save of this process is to be resumed from as it is, not proven by
    re-doing steps before it: the re-run state machine's checkpoint before exit 16,
    whose re-run on other hardware is its own check (an older restore would lose the
    machine's state)."""
    global _exact
    _exact = True


def take_exact() -> bool:
    """Whether the save being made is one to resume from exactly (see
    :func:`resume_exactly`); the request is used up."""
    global _exact
    exact, _exact = _exact, False
    return exact


def tier_of(tier: str) -> str:
    """The tier a checkpoint's exclusion applies to: a replica is the memory tier's."""
    return "memory" if tier == "replica" else tier


def read_excluded(folder: Path) -> dict[str, int]:
    """The excluded checkpoints: tier -> the newest step of it that failed its proof
    (every checkpoint of that tier up to it is skipped). A damaged file is an error
    naming it: it steers which checkpoints a job trusts."""
    path = folder / EXCLUDED_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot be read ({exc}); delete it to trust every tier"
        ) from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in data.items()
    ):
        raise CheckpointError(f"{path}: expected {{tier: step}}, found {data!r}")
    return data


def _exclude(folder: Path, tier: str, step: int) -> None:
    excluded = read_excluded(folder)
    excluded[tier] = max(step, excluded.get(tier, -1))
    tmp = folder / f".{EXCLUDED_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(excluded, sort_keys=True))
    os.replace(tmp, folder / EXCLUDED_FILE)


@dataclass
class _Pending:
    """A restore whose proof is under way."""

    step: int
    tier: str
    path: str
    newest: int  # the newest checkpoint there was: steps below it are the proof's cost
    horizon: int | None  # the last re-done step whose loss is compared
    expected: dict[int, Any]  # this rank's logged losses of the steps compared
    against: tuple[int, str] | None  # the checkpoint the state is compared with
    seen: dict[int, Any] = field(default_factory=dict)
    state_differs: list[str] | None = None  # None: not compared (yet)
    compared: str | None = None  # the folder the state was compared with (memory's)

    @property
    def against_tier(self) -> str:
        """The tier of the checkpoint the state is compared with."""
        return "memory" if self.against is not None and self.against[1] == MEMORY else "disk"

    @property
    def until(self) -> int:
        """The ``done`` count at which the proof is complete: the state compared with
        the newer checkpoint's, else the last compared loss logged."""
        if self.against is not None:
            return self.against[0]
        return self.horizon + 1 if self.horizon is not None else 0


class Proof:
    """The replay proofs of one manager's restores (see the module's description).
    ``read``: a disk checkpoint's state as this rank saved it (to compare with);
    ``read_held``: the memory tier's snapshot of a step as this rank took it, and the
    folder read (collective)."""

    def __init__(
        self,
        folder: Path,
        coord: Coordinator,
        read: Callable[[Path], dict[str, Any]],
        budget: int = 10,
        memory_every: int = 0,
        tolerance: float = DEFAULT_TOLERANCE,
        read_held: Callable[[int], tuple[dict[str, Any], str]] | None = None,
    ) -> None:
        self.folder, self.coord, self.read, self.budget = folder, coord, read, budget
        self.read_held = read_held
        self.tolerance = tolerance  # the relative difference taken for rounding (compare.py)
        self.memory_every = memory_every  # the loop snapshots every this many steps
        self.rank = coord.rank  # as the event log numbers it, once a restore is armed
        self.enabled = True  # only a manager's first restore is proven
        self._losses: dict[int, dict[int, Any]] = {}
        self._plan = Plan(None, {})
        self._keys: list[str] = []  # the restored state's keys (rank 0's)
        self.pending: _Pending | None = None

    def plan(self, held: Callable[[], tuple[list[int], int | None]]) -> Plan:
        """Before a restore (collective; ``held``, asked on every rank: the steps this
        node's memory tier holds, and the newest step whose every rank's snapshot the
        job's nodes hold, unsharded: collective). Rank 0 reads the log and the
        exclusions, and picks the route (:mod:`.proof_route`)."""
        mine: Plan | None = None
        steps, whole = held() if self.enabled else ([], None)
        if self.coord.rank == 0:
            excluded = read_excluded(self.folder)
            mine = Plan(None, excluded)
            if self.enabled:
                logged = read_log(writer.current_path(), time.time())
                self._losses = logged.losses
                mine = route(
                    self.folder, excluded, logged, steps, self.budget, self.memory_every,
                    self.coord.world, whole,
                )  # fmt: skip
        got: Plan = self.coord.from_rank0(mine)
        self._plan = got
        return got

    def armed(
        self,
        loaded: tuple[int, str, str, int] | None,
        bounded: bool,
        keys: Collection[str] = (),
    ) -> None:
        """After the restore (collective): ``loaded``, the step, tier and checkpoint read
        and the newest there was (None: nothing was restored); ``bounded``: the restore
        kept to the plan's bound; ``keys``: the restored state's keys."""
        if not self.enabled:
            return
        self.enabled = False  # a rollback re-does steps that went wrong on purpose
        if loaded is None or self.budget <= 0:  # nothing restored, or proofs off
            return
        step, tier, path, newest = loaded
        self._keys = sorted(keys)
        if self._plan.ledger:
            self._by_ledger(step, tier, path, newest)
            return
        plan: tuple[int | None, dict[int, dict[int, Any]]] | None = None
        if self.coord.rank == 0:
            later = sorted({s for per in self._losses.values() for s in per if s >= step})
            compared = later[:NEEDED]
            per_rank = {
                r: {s: per[s] for s in compared if s in per} for r, per in self._losses.items()
            }
            plan = (compared[-1] if len(compared) == NEEDED else None, per_rank)
            self._losses = {}
        horizon, per_rank = self.coord.from_rank0(plan)
        self.rank = int(os.environ.get("RANK", self.coord.rank))  # step_done's rank
        against = self._plan.against if bounded and self._plan.against else None
        if against is not None and against[0] <= step:
            against = None
        if horizon is None and against is None:
            if self.coord.rank == 0:
                events.emit(
                    "restore_unverified",
                    step=step,
                    tier=tier,
                    path=path,
                    reason=self._plan.why
                    or f"fewer than {NEEDED} steps with a logged loss (step_done's loss) "
                    "from this step on, and no newer checkpoint to compare with",
                )
            return
        self.pending = _Pending(
            step, tier, path, newest, horizon, per_rank.get(self.rank, {}), against
        )
        writer.step_listeners.append(self._step_done)

    def _step_done(self, record: dict[str, Any]) -> None:
        pending, step = self.pending, record.get("step")
        if pending is None or not isinstance(step, int):
            return
        if step in pending.expected and record.get("loss") is not None:
            pending.seen.setdefault(step, record["loss"])

    def close(self) -> None:
        """Stop listening (the manager closes)."""
        with contextlib.suppress(ValueError):
            writer.step_listeners.remove(self._step_done)
        self.pending = None

    def holds(self, done: int) -> bool:
        """Whether a checkpoint of ``done`` steps must not be written: it would hold a
        state the proof has not reached yet (those steps were checkpointed before the
        fault; the restored checkpoint stays)."""
        return self.pending is not None and done < self.pending.until

    def check(self, done: int, state: Callable[[], dict[str, Any]]) -> None:
        """At the loop's ``snapshot``/``save`` of ``done`` steps (collective; ``state``:
        what it saves, as this rank's state dicts): once the proof is complete, the
        verdict; raises :class:`RestoreMismatch`."""
        pending = self.pending
        if pending is None or done < pending.until:
            return
        drift = 0.0  # the largest relative difference within the tolerance
        if pending.against is not None and done == pending.against[0]:
            try:
                stored, now = self._stored(pending), state()
                gaps = {key: difference(now[key], stored[key]) for key in stored if key in now}
                pending.state_differs = sorted(k for k, g in gaps.items() if g > self.tolerance)
                drift = max((g for g in gaps.values() if g <= self.tolerance), default=0.0)
            except CheckpointError as exc:  # every rank: read_plain agrees on failures
                logger.error("the re-done state is not compared: %s", exc)
        self.close()
        differs: list[dict[str, Any]] = []
        for s, logged in sorted(pending.expected.items()):
            if s not in pending.seen:
                continue
            gap = difference(pending.seen[s], logged)
            if gap > self.tolerance:
                differs.append({"rank": self.rank, "step": s, "loss": pending.seen[s],
                                "logged": logged})  # fmt: skip
            else:
                drift = max(drift, gap)
        if pending.state_differs:
            step = pending.against[0] if pending.against else done
            differs.append({"rank": self.rank, "step": step, "objects": pending.state_differs})
        compared = sorted(s for s in pending.expected if s in pending.seen)
        shares = self.coord.all_gather(
            (differs, compared, pending.state_differs is not None, drift)
        )
        differs = [d for share in shares for d in share[0]]
        losses = len({s for share in shares for s in share[1]}) >= NEEDED
        states = all(share[2] for share in shares)
        drift = max(share[3] for share in shares)
        if differs:
            self._mismatch(pending, differs)
        if self.coord.rank != 0:
            return
        if not (losses or states):
            events.emit(
                "restore_unverified",
                step=pending.step,
                tier=pending.tier,
                path=pending.path,
                reason=f"the ranks re-did fewer than {NEEDED} of the logged steps with a "
                "loss in their step_done, and made no save or snapshot at the step of "
                "the checkpoint to compare with",
            )
            return
        events.emit(
            "restore_verified",
            step=pending.step,
            tier=pending.tier,
            path=pending.path,
            route="both" if losses and states else "losses" if losses else "state",
            steps=sorted({s for share in shares for s in share[1]}) or None,
            against=(pending.compared or pending.against[1])
            if states and pending.against
            else None,
            ranks=sum(1 for share in shares if share[1] or share[2]),
            proof_steps=max(0, pending.newest - pending.step),
            exact=drift == 0.0,
            difference=drift or None,
            keys=self._keys,
        )
        if drift:
            logger.warning(
                "the restore of step %d is proven to a relative %.2g, not bit for bit: a "
                "reduction that sums in another order after a restart (DDP without "
                "find_unused_parameters=True rebuilds its buckets; non-deterministic "
                "kernels). Build DDP with find_unused_parameters=True for bit-exact "
                "restarts", pending.step, drift,
            )  # fmt: skip

    def _stored(self, pending: _Pending) -> dict[str, Any]:
        """The state the re-done one is compared with (collective): a disk checkpoint's,
        or the memory tier's snapshot of the step (each rank its own; the event names
        the folder rank 0 read)."""
        assert pending.against is not None
        step, where = pending.against
        if where != MEMORY:
            return self.read(Path(where))
        if self.read_held is None:
            raise CheckpointError("no memory tier to compare the re-done state with")
        stored, folder = self.read_held(step)
        pending.compared = folder
        return stored

    def _mismatch(self, pending: _Pending, differs: list[dict[str, Any]]) -> None:
        tier = tier_of(pending.tier)
        first = differs[0]
        if "digest" in first:
            what = (
                f"its files' digest is {first['digest']}, the one logged when step "
                f"{first['step']} was saved {first['logged']} (checkpoint_saved): it is "
                "not the checkpoint saved under that name"
            )
        elif "objects" in first:
            other = pending.against[1] if pending.against else "the checkpoint"
            if pending.against_tier == "memory" and pending.against:
                other = f"the memory tier's snapshot of step {pending.against[0]}"
            what = (
                f"rank {first['rank']}'s state at step {first['step']} differs from "
                f"{other} in {', '.join(first['objects'])}"
            )
        else:
            what = (
                f"rank {first['rank']}'s step {first['step']} gave loss {first['loss']!r}, "
                f"before the fault {first['logged']!r}"
            )
        text = (
            f"the restore of step {pending.step} ({pending.tier}, {pending.path}) failed its "
            f"replay proof: {what}"
            + (f" (and {len(differs) - 1} more)" if len(differs) > 1 else "")
        )
        if self.coord.rank == 0:
            events.emit(
                "restore_mismatch",
                step=pending.step,
                cause="replay",
                tier=pending.tier,
                path=pending.path,
                differs=differs[:16],
            )
            _exclude(self.folder, tier, pending.step)
            if pending.against is not None:  # which of the two is wrong: both distrusted
                _exclude(self.folder, pending.against_tier, pending.against[0])
        excluded = f"the {tier} tier's checkpoints up to step {pending.step}" + (
            f" and the {pending.against_tier} tier's up to step {pending.against[0]}"
            if pending.against
            else ""
        )
        for listener in list(_BAD_RESTORE_LISTENERS):  # the re-run state machine's
            listener(pending.step, pending.tier, text)
        self.coord.all_gather(None)  # the exclusion is written before any rank restarts
        why = (
            "a checkpoint replaced or swapped after its save?"
            if "digest" in first
            else "a state the checkpoint does not hold: an LR scheduler, a data position?"
        )
        raise RestoreMismatch(
            f"{text}. The state it resumed from is not the state it lost ({why}); the "
            f"workers restart without {excluded}"
        )

    def _by_ledger(self, step: int, tier: str, path: str, newest: int) -> None:
        """The ledger route's verdict (collective): the restored disk checkpoint's
        digest against the one logged at its save, its keys against the proven
        restore's (rank 0 decides)."""
        verdict: tuple[str, Any] | None = None
        if self.coord.rank == 0:
            verdict = self._ledger_verdict(step, tier, path)
        kind, detail = self.coord.from_rank0(verdict)
        pending = _Pending(step, tier, path, newest, None, {}, None)
        if kind == "mismatch":
            self._mismatch(pending, detail)
        if self.coord.rank != 0:
            return
        if kind == "unverified":
            events.emit("restore_unverified", step=step, tier=tier, path=path, reason=detail)
            return
        events.emit(
            "restore_verified",
            step=step,
            tier=tier,
            path=path,
            route="ledger",
            digest=detail,
            ranks=self.coord.world,
            proof_steps=0,
            exact=True,
            keys=self._keys,
        )

    def _ledger_verdict(self, step: int, tier: str, path: str) -> tuple[str, Any]:
        if tier != "disk":
            return "unverified", (
                f"restored from the {tier} tier, which the ledger does not hold, where the "
                "proof planned for the newest disk checkpoint's digest"
            )
        logged = self._plan.ledger.get(os.path.abspath(path))
        manifest = read_manifest(Path(path))[0]
        if logged is None or manifest is None:
            return "unverified", "the checkpoint restored has no digest in the event log "\
                "(checkpoint_saved) to compare with"  # fmt: skip
        got = digest(manifest.get("files", {}))
        if got != logged:
            return "mismatch", [{"rank": 0, "step": step, "digest": got, "logged": logged}]
        if self._keys != self._plan.proven:
            return "unverified", (
                f"its state's keys ({', '.join(self._keys)}) are not those of the restore "
                f"proven by replay earlier in the run ({', '.join(self._plan.proven or [])})"
            )
        return "verified", got
