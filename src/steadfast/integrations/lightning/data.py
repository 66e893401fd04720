"""A train dataloader that Lightning resumes mid-epoch: :func:`resumable` wraps it in a
:class:`~steadfast.DataPosition` that Lightning keeps in its checkpoint, so that a run
stopped after any batch goes on with the next one."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ...checkpoint.state import DataPosition, ResumableSampler
from ...config import ConfigError

__all__ = ["resumable"]


def resumable(loader: Iterable[Any]) -> DataPosition:
    """The train dataloader made resumable mid-epoch: Lightning keeps its position in
    the checkpoint (``fit_loop`` state) and restores it, so a run stopped after any
    batch (a SIGTERM, a crash after an ``every_n_train_steps`` save) goes on with the
    next batch instead of replaying the epoch's first ones.

    A :class:`~steadfast.DataPosition` that Lightning drives: it calls the position's
    ``set_epoch`` at each epoch's start (Lightning ends an epoch by its length, so the
    iterator never runs out to move the position on by itself), and for a loader
    without a length, whose batches Lightning draws one ahead to see the last, the
    position does not count the batch drawn but not yet trained (``lookahead=1``).
    Lightning adds no ``DistributedSampler`` to a wrapped loader: under DDP give the
    ``DataLoader`` a :class:`~steadfast.ResumableSampler` (or a ``DistributedSampler``)
    for its rank, or this raises :class:`~steadfast.ConfigError` rather than let every
    rank train on all the data; a shuffling ``RandomSampler`` is refused too (its order
    cannot be replayed on resume), while an ``IterableDataset`` that shares itself out
    is taken as it is. With a ``ResumableSampler`` no skipped sample is read. Lightning
    does not reach into a wrapped loader either to set ``worker_init_fn``
    (``seed_everything(workers=True)``): give the ``DataLoader`` its own."""
    from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler

    sampler = getattr(loader, "sampler", None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        pass  # the dataset shares itself out among the ranks and orders itself
    elif isinstance(sampler, RandomSampler):
        raise ConfigError(
            "resumable(loader): the loader shuffles with a RandomSampler (shuffle=True), "
            "whose order comes from a generator that has moved on by the time a run "
            "resumes: use ResumableSampler(len(dataset), num_replicas=WORLD_SIZE, "
            "rank=RANK, seed=...), which shuffles by seed and epoch"
        )
    elif (
        world > 1
        and sampler is not None
        and not isinstance(sampler, (ResumableSampler, DistributedSampler))
    ):
        raise ConfigError(
            f"resumable(loader): the loader's sampler is a {type(sampler).__name__}, "
            f"but the job has {world} ranks and Lightning adds no DistributedSampler to "
            "a wrapped loader: give it ResumableSampler(len(dataset), num_replicas="
            "WORLD_SIZE, rank=RANK)"
        )
    try:
        len(loader)  # type: ignore[arg-type]
        sized = True
    except TypeError:
        sized = False
    return _LightningPosition(loader, lookahead=0 if sized else 1)


class _LightningPosition(DataPosition):
    """A DataPosition whose ``sampler`` is itself as far as Lightning's per-epoch
    ``sampler.set_epoch`` goes: Lightning calls it on the train loader's ``sampler``."""

    @property
    def sampler(self) -> _EpochSetter:
        return _EpochSetter(self)


class _EpochSetter:
    def __init__(self, position: DataPosition) -> None:
        self.set_epoch = position.set_epoch
