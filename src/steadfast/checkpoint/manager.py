"""CheckpointManager: checkpoints that are complete and verified, or invisible.

Each is a ``{dir}/step_{N}/`` (what it holds: :mod:`~steadfast.checkpoint.layout`), or a
name a framework chose, with ``{dir}/latest`` pointing at the newest step. A crash at any
moment leaves either the previous ``latest`` or the new one, never a partial checkpoint
under a ``step_N`` name; a corrupted or truncated checkpoint is reported
(``checkpoint_corrupt``) and all ranks fall back together to the newest valid older one.

The manager is the front: it checks its arguments, owns what lives as long as it does
(the coordination group, the staging buffers, the memory tier) and hands each call to
the part that does it: :mod:`~steadfast.checkpoint.saving` (the save protocol, the
writer thread), :mod:`~steadfast.checkpoint.loading` (verification and fall-back),
:mod:`~steadfast.checkpoint.memory_restore` (the restore from the memory tier),
:mod:`~steadfast.checkpoint.retention`, :mod:`~steadfast.checkpoint.fencing` and
:mod:`~steadfast.checkpoint.collectives` (every collective the ranks coordinate with).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..config import ConfigError, require_number
from ..dist import group_rank
from ..progress.phases import loading
from ..sdc.probe import clean_step, note_save
from . import memory_restore
from .collectives import Coordinator
from .compare import DEFAULT_TOLERANCE
from .fencing import CheckpointFenced
from .layout import MANIFEST, STATE_FILE, CheckpointError, remove_stale, verify, write_manifest
from .loading import Loader, LoadRequest
from .memory import MemoryTier, ring_group
from .proof import Proof, RestoreMismatch, RestoreUnproven
from .retention import Retention, remove
from .saving import RNG_KEY, Saver, capture
from .staging import Stager, fill_in_place, has_dtensor
from .state import RNGState, Stateful
from .upload import Uploader, gpu_job

__all__ = [
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointManager",
    "MANIFEST",
    "RestoreMismatch",
    "RestoreUnproven",
    "STATE_FILE",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)


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
        memory_every: Keep a snapshot of every rank's state in host shared memory every
            this many steps (:meth:`snapshot`; 0, the default, turns the memory tier
            off): written and replicated to a rank on another node in the background,
            verified like a disk checkpoint, and restored first when it is the newest
            (:mod:`steadfast.checkpoint.memory`). Disk checkpoints (:meth:`save`) stay
            the durable tier; snapshots never move ``latest``.
        max_proof_steps: The most steps a restore may re-do only to be proven by replay
            (:mod:`~steadfast.checkpoint.proof`: the first restore of a process is
            checked against the losses its loop logged before the fault, or against a
            newer checkpoint; a mismatch is ``restore_mismatch`` and a restart without
            that checkpoint). When a proof would cost more, the newest checkpoint is
            restored and ``restore_unverified`` says why; 0 turns the proofs off.
        proof_tolerance: The relative difference a proof takes for rounding (default
            1e-5; 0: bit for bit only). Values equal bit for bit are ``exact``; within
            it, the restore is proven but ``restore_verified`` says ``exact: false``
            with the difference (a reduction that summed in another order after the
            restart: DDP without ``find_unused_parameters=True`` with more than two
            ranks); beyond it, a mismatch (:mod:`~steadfast.checkpoint.compare`).

    Sharded state is read by DCP *into* the objects' current state dicts, so each
    object must already hold tensors of the right shapes. A fresh optimizer holds no
    state yet: register the model and its optimizer as one
    :class:`~steadfast.checkpoint.ShardedTrainState` (DCP's documented pattern through
    ``get_state_dict`` / ``set_state_dict``), which creates the state to load into.

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
        memory_every: int = 0,
        max_proof_steps: int = 10,
        proof_tolerance: float = DEFAULT_TOLERANCE,
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
        self._coord = Coordinator(group, self.collective)
        #: the checkpoint the last load or restore read (after any fall-back)
        self.loaded_path: Path | None = None
        self._stager = Stager()  # replicated / sharded state
        self._local_stager = Stager()  # rank_state and RNG
        self._saver = Saver(
            self.dir,
            self._coord,
            Retention(self.dir, self.keep_last_n),
            self.sharded,
            self.rng,
            self._stager,
            self._local_stager,
        )
        if self._coord.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.collective or group_rank(None) == 0:
                remove_stale(self.dir)
        self.memory_every = require_number(
            "CheckpointManager.memory_every", memory_every, minimum=0, integer=True
        )
        self._memory: MemoryTier | None = None
        self._ring: Any = None  # the memory tier's replication group
        if self.memory_every:
            if not self.collective or group is not None:
                raise ConfigError(
                    "CheckpointManager.memory_every needs the whole world as the group "
                    "(collective=True, group=None): snapshots are replicated across nodes"
                )
            world = self._coord.world
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            ring = ring_group() if self._coord.group is not None and world > local else None
            self._ring = ring
            self._memory = MemoryTier(
                self.dir, self._coord.rank, world, local, ring, agree=self._coord.from_rank0
            )
        self._loader = Loader(self.dir, self._coord, self._memory)
        self.max_proof_steps = require_number(
            "CheckpointManager.max_proof_steps", max_proof_steps, minimum=0, integer=True
        )
        self.proof_tolerance = float(
            require_number("CheckpointManager.proof_tolerance", proof_tolerance, minimum=0)
        )
        self._proof = Proof(
            self.dir,
            self._coord,
            self._loader.read_plain,
            self.max_proof_steps,
            self.memory_every,
            self.proof_tolerance,
            self._loader.read_held,
        )

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
        self._proof.check(step, lambda: self._mine(state, rank_state))
        if self._proof.holds(step):  # not before the restore is proven
            return
        note_save(step)  # for the replica checks' proof that it is clean (steadfast.sdc)
        self._saver.save(step, state, rank_state, name, self.async_save, retain=name is None)

    def snapshot(
        self, step: int, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Snapshot ``step`` to the memory tier (every ``memory_every`` steps; other steps
        return at once); every rank calls it, with the same arguments as :meth:`save`.

        Call it after the step's optimizer update, with the number of steps done: a
        restart then resumes after the last step every rank finished, none re-done.
        Training waits only for the copy into host staging buffers; the write to
        shared memory and the replica go on in the background (at most one snapshot in
        flight: the next call waits for it, and raises its error if it failed)."""
        if self._memory is None:
            raise ConfigError("CheckpointManager.snapshot needs memory_every > 0")
        require_number("CheckpointManager.snapshot step", step, minimum=0, integer=True)
        self._proof.check(step, lambda: self._mine(state, rank_state))
        if step % self.memory_every or self._proof.holds(step):
            return
        note_save(step)
        replicated, local = capture(state, rank_state, self.rng)
        self._memory.snapshot(step, replicated, local, sharded=has_dtensor(replicated))

    def save_emergency(
        self, step: int, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None = None
    ) -> None:
        """Synchronous save for shutdown paths: waits for any async save (a failed one is
        logged, not raised: this save replaces it), skips retention."""
        try:
            self.wait()
        except CheckpointError as exc:
            logger.error("emergency save of step %d goes on after: %s", step, exc)
        self._saver.save(step, state, rank_state, None, run_async=False, retain=False)

    def wait(self) -> None:
        """Wait for the save in flight (if any) and for old checkpoints being deleted;
        raise the background save's error if it failed."""
        self._saver.wait()

    def close(self) -> None:
        """Finish the save in flight, release the staging buffers and the gloo group."""
        self._proof.close()
        try:
            self.wait()
        finally:
            try:
                if self._memory is not None:
                    self._memory.close()
            finally:
                self._stager.clear()
                self._local_stager.clear()
                self._coord.close(self._ring)
                self._ring = None

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
        # after a corruption's verdict: never newer than the state proven clean (a named
        # path too, where it may fall back: a framework's "last" after the roll-back)
        clean = self._clean() if path is None or fallback else None
        return self._load(
            LoadRequest(path, None, fallback, weights_only, frozenset(require_keys), clean=clean)
        )

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint directory ``path`` (a framework's named one, when the
        framework rotates its checkpoints): hidden by a rename first, so a crash never
        leaves it half deleted under its name. Waits for the save in flight."""
        self.wait()
        remove(Path(path), announce=self._coord.rank == 0)

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
        # after a silent corruption's verdict: nothing newer than the state proven clean,
        # which the replicas' agreement proves (steadfast.sdc), not a replay
        clean = self._clean() if path is None else None
        proving = path is None and self.collective and clean is None
        plan = self._proof.plan(self._held) if proving else None
        request = LoadRequest(path, objects, clean=clean)
        if plan is not None:
            keep = plan.against[0] if plan.against else -1
            request = LoadRequest(
                path, objects, at_most=plan.at_most, excluded=plan.excluded, keep=keep
            )
        loaded = self._load(request)
        if proving:
            self._proof.armed(
                (loaded[0], self._loader.tier, str(self.loaded_path), self._loader.newest)
                if loaded is not None
                else None,
                self._loader.bounded,
                loaded[1].keys() if loaded is not None else (),
            )
        self._saver.last_step = loaded[0] if loaded is not None else 0
        if loaded is None:
            return None
        step, state = loaded
        gpu = gpu_job()  # then into the live GPU tensors, through pinned chunks
        with loading(), Uploader() as up:
            for key, obj in objects.items():
                if key not in state:
                    logger.warning("checkpoint step %d has no %r; it is not restored", step, key)
                elif isinstance(obj, Stateful):
                    if gpu and not has_dtensor(state[key]):  # DTensors: filled already
                        state[key] = fill_in_place(obj.state_dict(), state[key], up.copy)
                    obj.load_state_dict(state[key])
        if self.rng and RNG_KEY in state and RNG_KEY not in objects:
            RNGState().load_state_dict(state[RNG_KEY])
        return step, state

    def _clean(self) -> int | None:
        """The launcher's bound after a silent corruption's verdict, rank 0's on every
        rank (a spare that joined after the verdict was never told)."""
        return self._coord.from_rank0(clean_step()) if self.collective else clean_step()

    def _held(self) -> tuple[list[int], int | None]:
        """The steps this node's memory tier holds, and the newest every rank's snapshot
        is held for (collective; for a replay proof's plan)."""
        if self._memory is None:
            return [], None
        return memory_restore.held_whole(self._memory, self._coord)

    def _mine(
        self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """What this rank saves, as a checkpoint of it reads back (for a proof): its own
        state, and on rank 0 the replicated state, which it alone writes (another rank's
        copy may differ where the loop keeps per-rank counters in it)."""
        replicated, local = capture(state, rank_state, self.rng)
        return {**(replicated if self._coord.rank == 0 else {}), **local}

    def _load(self, request: LoadRequest) -> tuple[int, dict[str, Any]] | None:
        self.wait()
        with loading():  # the checkpoint-load phase of a worker's start
            loaded = self._loader.load(request)
        if loaded is None:
            return None
        step, state, self.loaded_path = loaded
        return step, state
