"""The memory tier: every rank's training state snapshotted to host shared memory on
its own node, published atomically with the same manifest and CRC-32s as a disk
checkpoint, and replicated in the background to a rank on another node.

Layout under the job's memory directory (``$STEADFAST_MEMORY_DIR``, made and removed by
``steadfast launch`` and by :class:`steadfast.inprocess.Wrapper`, a tmpfs under
``/dev/shm``), one folder per checkpoint directory of the job::

    <memory dir>/<key>/own/rank_<r>/step_<N>/      this node's ranks' snapshots
    <memory dir>/<key>/replica/rank_<r>/step_<N>/  snapshots of ranks on another node

Each ``step_<N>`` holds ``rank.pt`` (the rank's own state and RNG streams),
``manifest.json`` (step, rank, the job's identity, each file's size and CRC-32) and, where
the rank keeps the state, ``state.pt``:

- replicated state (what :meth:`CheckpointManager.save` writes once: a DDP model and its
  optimizer) is the same on every rank, so it is kept **once per node**, by the node's
  first local rank; the node's other ranks keep only their ``rank.pt``;
- sharded state (FSDP2, DTensor) differs per rank: each rank keeps its own shards, the
  local tensors of its DTensors, in its own ``state.pt``. They are restored into the
  live DTensors (same world size and mesh); a job whose world size changed reads the
  disk tier, which DCP reshards (``"shards": true`` in the manifest says a snapshot
  holds shards).

The files are in the flat layout of :mod:`.flat` (the tensors' bytes after a small
header: a model of ~1,000 tensors is written in a few plain writes, not pickled tensor by
tensor). How a snapshot's files travel, are verified and loaded: :mod:`.snapshot_io`.

Files are written into a hidden
temporary folder and renamed into place: a process killed mid-copy leaves the previous
snapshots as they were. The job's identity in every manifest (the launcher's run id and
the checkpoint directory) keeps a snapshot of another job from ever being restored.

Memory budget, per node: the five newest snapshots (a rank may publish a step while
another still writes the one before: with three, when one dies mid-write, every rank
still holds a step all share; a restore's replay proof takes a step two before the
newest one logged: two more) plus the one being written, and as many replica slots: at
most ``12 x`` (one replicated state + every local rank's own state), or for sharded
state ``12 x`` every local rank's shards and own state, in ``/dev/shm``. The first snapshot
checks that the file system has room for the node's bound and
stops with one :class:`~steadfast.ConfigError` naming the sizes if not, instead of a
failed write (or a SIGBUS) mid-run. What a kill mid-write left is cleared when the tier
starts; the directories of launchers killed outright, by the next one on the node.

Replication: rank ``r`` sends each snapshot to rank ``r + local_world_size`` (the same
local rank on the next node; ranks are numbered node by node) and receives from
``r - local_world_size``, on a gloo group of its own, from the writer thread: the
training group is never blocked. On a single node there is no other node: no replicas.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import events
from ..config import ConfigError
from ..shm import shm_name
from .files import describe
from .flat import save_flat
from .layout import (
    TMP_PREFIX,
    CheckpointError,
    discard,
    new_manifest,
    publish,
    read_manifest,
    remove_all,
    remove_stale,
)
from .proof_log import NEEDED
from .snapshot_io import RANK, STATE, pack, unpack
from .staging import Stager
from .worker import Worker

__all__ = [
    "MEMORY_DIR_ENV",
    "MemoryTier",
    "Snapshot",
    "create_memory_dir",
    "remove_memory_dir",
]

logger = logging.getLogger(__name__)

#: the job's memory directory, set by its owner (the launcher, the in-process Wrapper)
MEMORY_DIR_ENV = "STEADFAST_MEMORY_DIR"
_PREFIX = "steadfast-mem-"
#: published snapshots kept per rank and per replicated rank (plus the one being
#: written): a rank may publish a step while another is still writing the one before, so
#: with three every rank still holds a step all share when one dies mid-write; and a
#: restore's replay proof (:mod:`.proof`) takes a step NEEDED - 1 before the newest one
#: logged, which the rank one step behind must still hold: NEEDED + 2
KEEP = NEEDED + 2
#: how many snapshot sizes the tier may hold in memory per rank, with replicas
BUDGET_SLOTS = 2 * (KEEP + 1)
_RING_TIMEOUT = timedelta(seconds=120)
#: how long a new tier waits for this process's snapshot still being written to its
#: folder (:func:`_take_over`)
WRITE_WAIT = 30.0
#: the snapshot writes in flight in this process, by the folder each writes to
_writing: dict[str, threading.Event] = {}
#: the writer of the newest tier of each folder in this process
_writers: dict[str, Worker] = {}
_writing_lock = threading.Lock()


def create_memory_dir() -> Path:
    """A fresh memory directory for a job (in ``/dev/shm`` when there is one), for its
    owner to export as ``$STEADFAST_MEMORY_DIR`` and remove with
    :func:`remove_memory_dir` when the job ends. Its name carries the owner's pid, so
    that the directories of owners killed outright (SIGKILL, no clean-up) are removed
    here, by the next one made on the node."""
    base = Path("/dev/shm")
    where = base if base.is_dir() and os.access(base, os.W_OK) else Path(tempfile.gettempdir())
    for orphan in where.glob(f"{_PREFIX}*"):
        pid = orphan.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(orphan, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=shm_name(_PREFIX), dir=where))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_memory_dir(path: str | os.PathLike[str]) -> None:
    """Remove a job's memory directory and every snapshot in it."""
    shutil.rmtree(path, ignore_errors=True)


# the guard leaves its parent at once (a fork), so that it is nobody's child: killing
# the owner's children (its process group, or one by one) does not take it along
_REAPER = (
    "import os, shutil, sys\n"
    "if os.fork():\n    os._exit(0)\n"
    "os.setsid()\n"
    "sys.stdin.buffer.read()\n"
    "shutil.rmtree(sys.argv[1], True)\n"
)


class MemoryDir:
    """A job's memory directory with a guard: a small process (forked away from the
    owner's children) that removes it when its owner ends, however it ends (the owner's
    end of a pipe closes, also on SIGKILL), so that
    shared memory never outlives the launcher or the Wrapper that made it. The owner
    exports :attr:`path` as ``$STEADFAST_MEMORY_DIR`` and calls :meth:`remove`."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.path = create_memory_dir()
        self._guard = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER, str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not stopped by a Ctrl-C meant for the job
        )
        self._guard.wait()  # the first process exits at once; its fork guards

    def remove(self) -> None:
        """Remove the directory now and let the guard go (it ends at once)."""
        remove_memory_dir(self.path)
        if self._guard.stdin is not None:
            self._guard.stdin.close()


@dataclass(frozen=True)
class Snapshot:
    """A snapshot this node holds: whose state (``rank``, numbered as in the round that
    took it), which step, ``"memory"`` (the rank's own) or ``"replica"``, and where;
    ``state``: it holds a ``state.pt`` (the node's replicated state, or the rank's shards
    when ``sharded``)."""

    rank: int
    step: int
    tier: str
    path: str
    bytes: int
    state: bool = True
    sharded: bool = False


class MemoryTier:
    """One rank's memory tier (see the module's description): snapshots written and
    replicated on a thread of its own, at most one in flight.

    ``ring``: the gloo group over the world for replication (None: no replicas);
    ``agree``: rank 0's value of a string, on every rank (the job's identity, recorded
    in each manifest and checked, must be the same on every node)."""

    def __init__(
        self,
        checkpoint_dir: Path,
        rank: int,
        world: int,
        local_world: int,
        ring: Any,
        agree: Callable[[str], str] = lambda mine: mine,
    ) -> None:
        env = os.environ.get(MEMORY_DIR_ENV)
        self._owned = env is None  # no launcher: this tier's own, removed by close()
        self.root = Path(env) if env else create_memory_dir()
        # the same on every node: the launcher's run id, else rank 0's memory directory
        run = agree(os.environ.get("TORCHELASTIC_RUN_ID") or self.root.name)
        self.job = f"{run}|{checkpoint_dir.absolute()}"
        key = hashlib.sha1(self.job.encode()).hexdigest()[:12]
        self.base = self.root / key
        self.rank, self.world, self.local_world = rank, world, local_world
        self.local_rank = rank % local_world  # ranks are numbered node by node
        self.own = self.base / "own" / f"rank_{rank}"
        self.own.mkdir(parents=True, exist_ok=True)
        self.ring = ring if world > local_world else None
        self.peer = (rank + local_world) % world  # the same local rank on the next node
        self.source = (rank - local_world) % world
        self._stager = Stager()
        self._local_stager = Stager()
        # one thread for the tier's writes, kept between snapshots (daemon: a snapshot is
        # for the next restart and never holds an exit); an abandoned tier's, retired
        self._writer = Worker("steadfast-memory-writer")
        self._error: BaseException | None = None
        self._checked = False
        #: the newest step every rank's snapshot is held for, as the last restore saw
        self.newest_whole = -1
        _take_over(self.own, self._writer)  # an in-process restart's tier: its step is done
        # what a kill mid-write or mid-prune left in this rank's folders
        for folder in (self.own, self.base / "replica" / f"rank_{self.source}"):
            if folder.is_dir():
                remove_stale(folder)

    # ------------------------------------------------------------------ snapshots
    def snapshot(
        self, step: int, replicated: dict[str, Any], local: dict[str, Any], sharded: bool = False
    ) -> float:
        """Stage the state into host buffers (the only part training waits for) and
        write, publish and replicate it in the background. Returns the stall, in
        seconds. Waits for the previous snapshot first; if it failed, raises its error
        once this one is under way (so the ranks' replica exchanges stay in step).

        ``replicated`` is kept by the node's first local rank only, unless ``sharded``
        (it holds DTensors): then every rank keeps its own shards."""
        start = time.monotonic()
        failed: CheckpointError | None = None
        try:
            self.wait()
        except CheckpointError as exc:  # raised below, once this snapshot is under way:
            failed = exc  # its turn in the replica exchange must not be skipped
        if not self._checked:
            self._check_room(replicated, local, sharded)
            self._checked = True
        keeps = sharded or self.local_rank == 0
        payload = self._stager.stage(replicated, shards=True) if keeps else None
        own = self._local_stager.stage(local)
        stall = time.monotonic() - start
        written = threading.Event()
        with _writing_lock:
            _writing[str(self.own)] = written
        self._writer.submit(partial(self._background, step, payload, own, stall, sharded, written))
        if failed is not None:
            raise failed
        return stall

    def _background(
        self,
        step: int,
        payload: Any,
        local: Any,
        stall: float,
        sharded: bool,
        done: threading.Event,
    ) -> None:
        written: Path | None = None
        error: BaseException | None = None
        try:
            start = time.monotonic()
            self._stager.settle()  # the device copies the step did not wait for
            self._local_stager.settle()
            written = self._write(step, payload, local, sharded)
            seconds = time.monotonic() - start
            logger.debug("snapshot of step %d in %.3f s (stall %.3f s)", step, seconds, stall)
        except BaseException as exc:
            error = exc
        finally:
            done.set()
            with _writing_lock:
                if _writing.get(str(self.own)) is done:
                    del _writing[str(self.own)]
        if self.ring is not None:  # always: the peers wait for this rank's turn
            try:
                self._replicate(step, written)
            except BaseException as exc:
                error = error or exc
        if error is not None:  # raised at the next snapshot, never swallowed
            logger.error("memory snapshot of step %d failed: %s", step, error)
            self._error = error

    def _write(self, step: int, payload: Any, local: Any, sharded: bool) -> Path:
        final = self.own / f"step_{step}"
        tmp = self.own / f"{TMP_PREFIX}{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            files = {RANK: save_flat(tmp / RANK, local)}
            if payload is not None:
                files[STATE] = save_flat(tmp / STATE, payload)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"memory snapshot to {tmp}: {describe(exc, tmp)}") from exc
        publish(tmp, final, self._manifest(step, files, sharded), move_latest=False)
        _prune(self.own)
        return final

    def _manifest(self, step: int, files: dict[str, Any], sharded: bool) -> dict[str, Any]:
        manifest = new_manifest(step, self.world, False, {}, files)  # no DCP folder
        manifest.update(rank=self.rank, job=self.job, shards=sharded)
        return manifest

    def _check_room(self, replicated: dict[str, Any], local: dict[str, Any], sharded: bool) -> None:
        """One readable error before the first write if the memory file system cannot
        hold the tier's bound (see the module's description)."""
        state = _tensor_bytes(replicated) * (self.local_world if sharded else 1)
        size = state + self.local_world * (_tensor_bytes(local) + (1 << 20))
        slots = BUDGET_SLOTS if self.ring is not None else KEEP + 1
        need = slots * size  # the node's, in one /dev/shm
        usage = shutil.disk_usage(self.root)
        held = _folder_bytes(self.base)
        if usage.free + held < need:
            raise ConfigError(
                f"memory_every: {self.root} ({usage.free / 2**30:.2f} GiB free) cannot hold "
                f"{slots} snapshots of the node's {self.local_world} ranks' "
                f"{size / 2**30:.2f} GiB state ({need / 2**30:.2f} GiB): give /dev/shm more "
                "room (a container's "
                "--shm-size) or set memory_every=0"
            )

    # ------------------------------------------------------------------ replication
    def _replicate(self, step: int, snapshot: Path | None) -> None:
        """Send ``snapshot`` to the peer and take the source's snapshot of the same
        step, verified, as a replica (both at once: every rank sends and receives). A
        rank without a snapshot this time (its write failed) still takes its turn and
        sends an empty one, so that no peer waits for it."""
        out = torch.empty(0, dtype=torch.uint8)
        if snapshot is not None:
            with contextlib.suppress(OSError, CheckpointError):
                out = pack(snapshot)
        header = torch.tensor([step, out.numel()], dtype=torch.int64)
        theirs = torch.empty(2, dtype=torch.int64)
        _exchange(header, theirs, self.peer, self.source, self.ring)
        their_step, size = (int(v) for v in theirs.tolist())
        incoming = torch.empty(size, dtype=torch.uint8)
        _exchange(
            out if out.numel() else None, incoming if size else None,
            self.peer, self.source, self.ring,
        )  # fmt: skip
        if not size:
            return
        folder = self.base / "replica" / f"rank_{self.source}"
        folder.mkdir(parents=True, exist_ok=True)
        problems = unpack(incoming, folder, their_step)
        if problems:
            events.emit(
                "checkpoint_corrupt",
                cause="replica",
                path=str(folder / f"step_{their_step}"),
                reason="; ".join(problems),
            )
            return
        _prune(folder)

    # ------------------------------------------------------------------ restore
    def drop_after(self, step: int) -> None:
        """Forget every snapshot (own and replicas) newer than ``step``, the step the job
        resumed from: those states will be computed again, and a stale one must never
        be taken together with a fresh one of the same step."""
        trash = []
        for snap in self.holdings():
            if snap.step > step:
                with contextlib.suppress(OSError):
                    trash.append(discard(Path(snap.path)))
        remove_all(trash)

    def other_world_sizes(self) -> set[int]:
        """The world sizes of this job's snapshots on this node taken by a round of
        another size (an elastic change): they are not restored, the disk is."""
        return {n for n in self._scan()[1] if n != self.world}

    def holdings(self) -> list[Snapshot]:
        """Every snapshot of this job this node holds, own and replicas, by its manifest
        (not yet verified: the files are checked when read)."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[Snapshot], set[int]]:
        found: list[Snapshot] = []
        sizes: set[int] = set()
        for tier, sub in (("memory", "own"), ("replica", "replica")):
            top = self.base / sub
            if not top.is_dir():
                continue
            for folder in sorted(top.iterdir()):
                for entry in sorted(folder.glob("step_*")):
                    manifest, _ = read_manifest(entry)
                    if manifest is None or manifest.get("job") != self.job:
                        continue
                    sizes.add(int(manifest.get("world_size", 0)))
                    if manifest.get("world_size") != self.world:  # its rank.pt is for
                        continue  # another numbering: the disk path skips it too
                    size = sum(int(m.get("bytes", 0)) for m in manifest["files"].values())
                    found.append(
                        Snapshot(
                            int(manifest["rank"]),
                            manifest["step"],
                            tier,
                            str(entry),
                            size,
                            state=STATE in manifest["files"],
                            sharded=bool(manifest.get("shards")),
                        )
                    )
        return found, sizes

    # ------------------------------------------------------------------ lifetime
    def wait(self) -> None:
        """Wait for the snapshot in flight; raise its error if it failed."""
        self._writer.wait()
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"memory snapshot failed: {error}") from error

    def close(self) -> None:
        """Finish the snapshot in flight and release the staging buffers; a tier that
        made its own memory directory (no launcher) removes it."""
        try:
            self.wait()
        finally:
            self._writer.close()
            with _writing_lock:
                if _writers.get(str(self.own)) is self._writer:
                    del _writers[str(self.own)]
            self._stager.clear()
            self._local_stager.clear()
            if self._owned:
                remove_memory_dir(self.root)


# ---------------------------------------------------------------------- helpers
def _take_over(folder: Path, writer: Worker) -> None:
    """Wait, at most :data:`WRITE_WAIT`, for a snapshot this process is still writing to
    ``folder``, retire the writer of the tier that wrote it (its last job still runs) and
    make ``writer`` the folder's. An in-process restart abandons the tier of the loop
    that raised (its snapshot of the last step done may still be on its thread: under
    load, seen to take longer than the restart); without the wait the new tier's
    clean-up removes that write's temporary folder, and the restore goes back one step
    more than it must. Only the local write is waited for: the replica exchange needs
    the peers."""
    with _writing_lock:
        pending = _writing.get(str(folder))
        previous, _writers[str(folder)] = _writers.get(str(folder)), writer
    if previous is not None:
        previous.retire()
    if pending is not None and not pending.wait(WRITE_WAIT):
        logger.warning(
            "a snapshot to %s still being written after %.0f s: not waited for", folder, WRITE_WAIT
        )


def ring_group() -> Any:
    """The gloo group replication runs on (collective: every rank creates it)."""
    return dist.new_group(backend="gloo", timeout=_RING_TIMEOUT)


def _exchange(
    out: torch.Tensor | None, into: torch.Tensor | None, dst: int, src: int, group: Any
) -> None:
    """Send ``out`` to ``dst`` and receive ``into`` from ``src`` at once (either may be
    None: nothing to send, nothing to receive)."""
    works = []
    if out is not None:
        works.append(dist.isend(out, dst, group=group))
    if into is not None:
        works.append(dist.irecv(into, src, group=group))
    for work in works:
        if work is not None:
            work.wait()


def _prune(folder: Path) -> None:
    """Keep the ``KEEP`` newest published snapshots in ``folder``."""
    steps = sorted((int(p.name[5:]), p) for p in folder.glob("step_*") if p.name[5:].isdigit())
    old = steps[: max(0, len(steps) - KEEP)]
    trash = []
    for _, path in old:
        with contextlib.suppress(OSError):
            trash.append(discard(path))
    remove_all(trash)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``; a folder removed meanwhile (the node's
    other ranks prune their snapshots while this one counts) is skipped, not an error."""
    total = 0
    for root, _, files in os.walk(folder):  # os.walk skips what it cannot list
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total
