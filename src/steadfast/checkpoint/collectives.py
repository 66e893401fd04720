"""The collectives a :class:`~steadfast.checkpoint.CheckpointManager`'s ranks coordinate
with, all in one place: the agreement that opens a save, object all-gathers, rank 0's
view sent to every rank, and the point-to-point transfers of a memory-tier restore.

They run on a gloo group of the manager's own (made by the constructor, which is
therefore collective), so that the writer thread can coordinate while training uses the
default group. In a single process (``torch.distributed`` not initialised, or a single
writer: ``collective=False``) there is no group, and each of them returns the rank's own
value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..dist import all_gather_object, broadcast_object, group_rank, is_distributed
from .layout import CheckpointError

__all__ = ["Coordinator"]


class Coordinator:
    """A manager's ranks (those of ``group``, default the world) and their gloo group;
    ``collective=False``: this process alone, rank 0 of a group of one."""

    def __init__(self, group: Any, collective: bool) -> None:
        self.rank = group_rank(group) if collective else 0
        self.world = dist.get_world_size(group) if is_distributed() and collective else 1
        self.group: Any = None  # None: one process, no collective
        if is_distributed() and collective:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.group = dist.new_group(ranks=ranks, backend="gloo")

    def agree_save(self, step: int, failed: bool, sharded: bool) -> bool | None:
        """One all-reduce: every rank saves the same step (a mismatch is a bug in the
        caller's loop), rank 0 could create the temporary directory, and whether the
        save is sharded (any rank with a DTensor makes it sharded). None if rank 0
        failed."""
        if self.group is None:
            return None if failed else sharded
        t = torch.tensor([step, -step, int(failed), int(sharded)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        highest, lowest, any_failed, any_sharded = (int(v) for v in t.tolist())
        if highest != -lowest:
            raise CheckpointError(
                f"ranks disagree on the checkpoint step (this rank: {step}, "
                f"max: {highest}, min: {-lowest})"
            )
        return None if any_failed else bool(any_sharded)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        return all_gather_object(obj, self.group)

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self.group is None:
            return obj
        return broadcast_object(obj, group=self.group, group_src=0)

    def send_recv(
        self, sends: Mapping[int, torch.Tensor], recv: tuple[int, torch.Tensor] | None
    ) -> None:
        """Send each ``sends[r]`` to rank ``r`` (not to this rank) and receive into
        ``recv`` (its source rank, the buffer), all in flight together."""
        works = [dist.isend(t, r, group=self.group) for r, t in sends.items() if r != self.rank]
        if recv is not None:
            works.append(dist.irecv(recv[1], recv[0], group=self.group))
        for work in works:
            if work is not None:
                work.wait()

    def close(self, *others: Any) -> None:
        """Destroy the group, and ``others`` (groups made for the same manager); the
        collectives fall back to one process."""
        if is_distributed():
            for group in (self.group, *others):
                if group is not None:
                    dist.destroy_process_group(group)
        self.group = None
