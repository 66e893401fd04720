"""Small helpers over ``torch.distributed`` shared by every in-loop component.

They hide the one thing that differs between CPU and GPU runs (the device a collective's
tensor must live on: CPU for gloo, the current CUDA device for NCCL) and give each
component the few agreement primitives it needs, so that no module hard-codes ``"cuda"``.
All of them also work when ``torch.distributed`` is not initialised (a single process):
the "agreement" of one rank is its own value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "WorldInfo",
    "agree_any",
    "backend_device",
    "count_true",
    "gather_flags",
    "group_rank",
    "is_distributed",
    "world_info",
]

ProcessGroup = Any  # torch's ProcessGroup type is not stable across versions


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job (from the process group, else the environment)."""

    rank: int
    world_size: int
    local_rank: int


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def world_info() -> WorldInfo:
    """Rank, world size and local rank; works before (or without) ``init_process_group``."""
    local_rank = _env_int("LOCAL_RANK", 0)
    if is_distributed():
        return WorldInfo(dist.get_rank(), dist.get_world_size(), local_rank)
    return WorldInfo(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), local_rank)


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within ``group`` (the world rank when not distributed)."""
    if is_distributed():
        return int(dist.get_rank(group))
    return world_info().rank


def backend_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a collective tensor must live on for ``group``'s backend.

    NCCL (and any CUDA-only backend) needs the current CUDA device; gloo and MPI work on
    CPU. A mixed ``"cpu:gloo,cuda:nccl"`` group prefers CUDA when it is available, since
    that is where the training tensors are.
    """
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
    device = backend_device(group)
    if isinstance(flag, torch.Tensor):
        t = flag.detach().reshape(1).to(device=device, dtype=torch.int32)
    else:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def agree_any(flag: bool | torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank (one small all-reduce).

    This is how ranks reach the same decision at the same step (skip, stop, roll back)
    so that no rank leaves the others waiting in a collective.
    """
    return count_true(flag, group) > 0


def agree_flags(flags: list[bool], group: ProcessGroup | None = None) -> list[bool]:
    """For each position, True on every rank when that flag is true on any rank: several
    decisions agreed by one small all-reduce (MAX)."""
    t = torch.tensor(
        [1 if f else 0 for f in flags], dtype=torch.int32, device=backend_device(group)
    )
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def gather_flags(flag: bool, group: ProcessGroup | None = None) -> list[bool]:
    """One flag per rank of ``group``, in rank order, on every rank (one all-gather)."""
    if not is_distributed():
        return [bool(flag)]
    device = backend_device(group)
    size = dist.get_world_size(group)
    mine = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    out = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [bool(v) for v in torch.cat(out).tolist()]
