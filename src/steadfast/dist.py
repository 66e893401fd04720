"""The one place steadfast calls ``torch.distributed``'s collectives from.

It hides the one thing that differs between CPU and GPU runs (the device a collective's
tensor must live on: CPU for gloo, the current CUDA device for NCCL), and gives each
component the few primitives it needs: flags agreed by one small all-reduce, objects
gathered or broadcast, barriers with a timeout of their own. Every function also works
when ``torch.distributed`` is not initialised (a single process): the "agreement" of one
rank is its own value, a gather is a list of one.

torch is imported when a function is called, not with this module (as torch's DCP does
with its ``_DistWrapper``): the launcher and the report import steadfast without it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "WorldInfo",
    "agree_any",
    "agree_flags",
    "all_gather_object",
    "barrier",
    "barrier_with_timeout",
    "broadcast_object",
    "set_nccl_env",
    "backend_device",
    "count_true",
    "cpu_group",
    "gather_flags",
    "group_rank",
    "is_distributed",
    "member_index",
    "PendingCount",
    "PendingGather",
    "world_info",
]

ProcessGroup = Any  # torch's ProcessGroup type is not stable across versions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job (from the process group, else the environment)."""

    rank: int
    world_size: int
    local_rank: int


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default group is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def world_info() -> WorldInfo:
    """Rank, world size and local rank; works before (or without) ``init_process_group``."""
    import torch.distributed as dist

    local_rank = _env_int("LOCAL_RANK", 0)
    if is_distributed():
        return WorldInfo(dist.get_rank(), dist.get_world_size(), local_rank)
    return WorldInfo(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), local_rank)


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within ``group`` (the world rank when not distributed)."""
    import torch.distributed as dist

    if is_distributed():
        return int(dist.get_rank(group))
    return world_info().rank


def backend_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a collective tensor must live on for ``group``'s backend.

    NCCL (and any CUDA-only backend) needs the current CUDA device; gloo and MPI work on
    CPU. A mixed ``"cpu:gloo,cuda:nccl"`` group prefers CUDA when it is available, since
    that is where the training tensors are.
    """
    import torch
    import torch.distributed as dist

    if not is_distributed():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def count_true(flag: bool | torch.Tensor, group: ProcessGroup | None = None) -> int:
    """How many ranks of ``group`` passed a true ``flag`` (one all-reduce SUM).

    ``flag`` may be a Python bool or a 0-d/1-element tensor on any device; a tensor is
    reduced where it lives when that is the backend's device, so no extra host sync is
    added before the one ``.item()`` that returns the count.
    """
    import torch
    import torch.distributed as dist

    device = backend_device(group)
    if isinstance(flag, torch.Tensor):
        t = flag.detach().reshape(1).to(device=device, dtype=torch.int32)
    else:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def cpu_group(group: ProcessGroup | None = None) -> ProcessGroup | None:
    """A group over ``group``'s ranks whose collectives run on CPU tensors: ``group``
    itself when its backend has gloo, else a new gloo group over the same ranks (made by
    its members only, ``use_local_synchronization``). A small CPU collective then waits
    for no GPU stream and runs in gloo's own thread."""
    import torch.distributed as dist

    if not is_distributed() or "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


class _Landing:
    """An async collective's end, awaited without holding its ``Work`` once it has
    ended: a finished ``Work`` still held keeps its gloo group's threads alive past
    ``destroy_process_group()`` (to the interpreter's teardown, where they may hang), and
    a loop's last pending count or gather is held by an object the script never
    releases. CPU collectives only: a device's ``Work`` is kept and waited for, which
    also orders the device's stream after the collective."""

    def __init__(self, work: Any, on_cpu: bool) -> None:
        import threading

        self._work: Any = None if on_cpu else work
        self._ended = threading.Event()
        self._error: BaseException | None = None
        if on_cpu:
            work.get_future().add_done_callback(self._land)

    def _land(self, future: Any) -> None:
        try:
            future.value()
        except BaseException as exc:  # raised to the reader, in its thread
            self._error = exc
        self._ended.set()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            return
        self._ended.wait()
        if self._error is not None:
            raise self._error


class PendingCount:
    """:func:`count_true` started now (``async_op``) and read later: a flag agreed at one
    step and read at the next costs a step no wait. ``group`` must run CPU collectives
    (:func:`cpu_group`); every rank of it must start one at the same point."""

    def __init__(self, flag: bool, group: ProcessGroup | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._count = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._work = (
            _Landing(
                dist.all_reduce(self._count, op=dist.ReduceOp.SUM, group=group, async_op=True),
                on_cpu=True,
            )
            if is_distributed()
            else None
        )

    def read(self) -> int:
        """How many ranks passed a true flag (waits for the all-reduce if it still runs)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return int(self._count.item())


class PendingGather:
    """:func:`all_gather_object` of small objects started now (``async_op``) and read
    later: one all-gather of fixed slots (``slot`` bytes and a length each) instead of
    torch's two blocking collectives (the sizes, then the bytes). Every rank of ``group``
    must start one at the same point, with the same ``slot``. An object larger than its
    slot is gathered again, blocking, at :meth:`read` (every rank sees every length, so
    all take that path); :attr:`largest` (every rank's same value after :meth:`read`)
    lets a caller size the next slot. Each rank receives ``world x slot`` bytes: keep the
    slot near the objects' size on a large job."""

    def __init__(self, obj: Any, group: ProcessGroup | None = None, slot: int = 512) -> None:
        import pickle

        import torch
        import torch.distributed as dist

        self._obj, self._group = obj, group
        self._work: _Landing | None = None
        data = pickle.dumps(obj)
        self.largest = len(data)
        if not is_distributed():
            return
        mine = torch.zeros(8 + slot, dtype=torch.uint8)
        mine[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        if len(data) <= slot:
            mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(backend_device(group))
        self._slots = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self._work = _Landing(
            dist.all_gather(self._slots, mine, group=group, async_op=True),
            on_cpu=mine.device.type == "cpu",
        )

    def read(self) -> list[Any]:
        """Every rank's object, in rank order of ``group`` (waits if still gathering)."""
        import ctypes
        import pickle

        if self._work is None:
            return [self._obj]
        self._work.wait()
        self._work = None
        raw = [ctypes.string_at(s.data_ptr(), s.numel()) for s in (t.cpu() for t in self._slots)]
        sizes = [int.from_bytes(r[:8], "little") for r in raw]
        self.largest = max(sizes)
        if any(n > len(r) - 8 for n, r in zip(sizes, raw, strict=True)):
            return all_gather_object(self._obj, self._group)
        return [pickle.loads(r[8 : 8 + n]) for n, r in zip(sizes, raw, strict=True)]


def agree_any(flag: bool | torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank (one small all-reduce).

    This is how ranks reach the same decision at the same step (skip, stop, roll back)
    so that no rank leaves the others waiting in a collective.
    """
    return count_true(flag, group) > 0


def agree_flags(flags: list[bool], group: ProcessGroup | None = None) -> list[bool]:
    """For each position, True on every rank when that flag is true on any rank: several
    decisions agreed by one small all-reduce (MAX)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(
        [1 if f else 0 for f in flags], dtype=torch.int32, device=backend_device(group)
    )
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def gather_flags(flag: bool, group: ProcessGroup | None = None) -> list[bool]:
    """One flag per rank of ``group``, in rank order, on every rank (one all-gather)."""
    import torch
    import torch.distributed as dist

    if not is_distributed():
        return [bool(flag)]
    device = backend_device(group)
    size = dist.get_world_size(group)
    mine = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    out = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [bool(v) for v in torch.cat(out).tolist()]


def barrier_with_timeout(
    timeout_sec: float, reason: str = "barrier", group: ProcessGroup | None = None
) -> None:
    """A barrier that fails after ``timeout_sec`` seconds, not the process group's own
    timeout (often 30 minutes, sized for large reductions): init-path and coordination
    points should surface a wedged or misconfigured peer fast (KempnerForge's
    per-operation timeouts). Raises ``RuntimeError`` naming ``reason`` and the timeout;
    after it the group has a pending collective and must be aborted or destroyed."""
    import torch.distributed as dist

    from .config import require_number

    require_number("barrier_with_timeout.timeout_sec", timeout_sec, exclusive_minimum=0)
    if not is_distributed():
        return
    work = dist.barrier(async_op=True) if group is None else dist.barrier(group, async_op=True)
    try:
        done = work is None or work.wait(timeout=timedelta(seconds=timeout_sec)) is not False
    except RuntimeError as exc:
        raise RuntimeError(f"{reason}: barrier timed out after {timeout_sec}s ({exc})") from exc
    if not done:
        raise RuntimeError(f"{reason}: barrier timed out after {timeout_sec}s")


def member_index(group: ProcessGroup | None = None) -> int:
    """This process's position in what a gather over ``group`` returns: its rank in the
    group, or 0 when not distributed (a gather of one). Not :func:`group_rank`, which
    falls back to ``$RANK``."""
    import torch.distributed as dist

    return int(dist.get_rank(group)) if is_distributed() else 0


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order of ``group``, on every rank;
    ``[obj]`` in a single process."""
    import torch.distributed as dist

    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(
    obj: Any, src: int = 0, group: ProcessGroup | None = None, *, group_src: int | None = None
) -> Any:
    """``obj`` as rank ``src`` (a global rank; or ``group_src``, a rank of ``group``) has
    it, on every rank; ``obj`` itself in a single process. The other ranks' ``obj`` is
    ignored."""
    import torch.distributed as dist

    if not is_distributed():
        return obj
    box = [obj]
    if group_src is None:
        dist.broadcast_object_list(box, src=src, group=group)
    else:
        dist.broadcast_object_list(box, group=group, group_src=group_src)
    return box[0]


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (the process group's own timeout); nothing to
    wait for in a single process."""
    import torch.distributed as dist

    if is_distributed():
        dist.barrier(group=group)


#: The NCCL setting that turns a collective stuck past its timeout into an error (and a
#: dead peer into an abort) instead of a hang.
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def set_nccl_env() -> None:
    """Make NCCL report stuck collectives: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` when
    unset. An explicit ``0`` is the user's choice and kept, with a warning: with it, a
    collective past its timeout hangs the rank instead of failing it."""
    value = os.environ.get(NCCL_ASYNC_ERROR_HANDLING)
    if value is None or value == "":
        os.environ[NCCL_ASYNC_ERROR_HANDLING] = "1"
    elif value == "0":
        logger.warning(
            "%s=0: a collective past its timeout will hang this rank instead of failing "
            "it (hang detection must then catch it); unset it or set 1",
            f"{NCCL_ASYNC_ERROR_HANDLING}=0",
        )
