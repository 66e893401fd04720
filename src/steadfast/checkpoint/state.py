"""What a checkpoint captures beyond model and optimizer: the protocol for objects with
state, this process's RNG streams, and the position in the data.

A bit-exact resume needs every source of nondeterminism restored exactly where it was:
the random number generators (python ``random``, numpy, torch CPU and every CUDA device),
and how far each rank got through its data. RNG and data position differ per rank, so the
:class:`~steadfast.checkpoint.CheckpointManager` saves them per rank (``rank_{r}.pt``),
while replicated state (model, optimizer under DDP) is written once.

Everything here is saved as tensors, numbers, strings and containers only, so it loads
with ``torch.load(weights_only=True)``: no pickle of arbitrary classes.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Sampler

from ..config import ConfigError, require_number

__all__ = ["DataPosition", "RNGState", "ResumableSampler", "ShardedTrainState", "Stateful"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can save and restore: ``state_dict()`` and
    ``load_state_dict(sd)``. Models, optimizers, LR schedulers, torchdata's
    ``StatefulDataLoader``, :class:`~steadfast.NaNDetector`, :class:`RNGState` and
    :class:`DataPosition` all qualify; register your own objects by giving them both
    methods (the same protocol as ``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> Any:
        """The object's state as tensors, numbers, strings and containers."""
        ...

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Restore the state returned by :meth:`state_dict`."""
        ...


def _numpy() -> Any:
    """numpy, if this process uses it: a process that never imported numpy never drew
    from its generator (and importing it just to ask would cost every save ~0.1 s)."""
    return sys.modules.get("numpy")


class ShardedTrainState:
    """A sharded model (FSDP2's ``fully_shard``, DTensor parameters) and its optimizer as
    one :class:`Stateful`, through torch's ``get_state_dict`` / ``set_state_dict``: the
    pattern DCP documents. Its ``state_dict()`` creates the optimizer's state when it has
    none yet (a fresh optimizer after a restart), so that a checkpoint, sharded on disk
    or in the memory tier, has DTensors of the right shapes to load into.

        ckpt.restore({"train": ShardedTrainState(model, optimizer)})
    """

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class RNGState:
    """The random number generators of this process: python ``random``, numpy's global
    generator (when the process has imported numpy), torch's CPU generator and, when CUDA has been
    initialised, the generator of every CUDA device.

    Saved per rank by :class:`~steadfast.checkpoint.CheckpointManager` (``rng=True``), so
    that dropout masks, random augmentations and shuffles continue exactly as in an
    uninterrupted run.
    """

    def state_dict(self) -> dict[str, Any]:
        """Capture every generator's state (CUDA only if CUDA is already initialised, so a
        CPU job never creates a CUDA context)."""
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (so available)
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the generators; a generator missing from ``state_dict`` (numpy not in
        use when saved, a CPU checkpoint on a GPU job) is left as it is."""
        py = state_dict.get("python")
        if py is not None:
            random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        if "torch" in state_dict:
            torch.set_rng_state(state_dict["torch"])
        np = _numpy()
        saved_np = state_dict.get("numpy")
        if np is not None and saved_np is not None:
            np.random.set_state(
                (
                    saved_np["kind"],
                    saved_np["keys"].numpy().astype("uint32"),
                    saved_np["pos"],
                    saved_np["has_gauss"],
                    saved_np["cached_gaussian"],
                )
            )
        cuda = state_dict.get("cuda")
        if cuda and torch.cuda.is_available():
            if len(cuda) != torch.cuda.device_count():
                logger.warning(
                    "checkpoint has RNG states for %d CUDA devices, this process sees %d; "
                    "restoring the first %d",
                    len(cuda),
                    torch.cuda.device_count(),
                    min(len(cuda), torch.cuda.device_count()),
                )
            for device, rng in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, device)


class ResumableSampler(Sampler[int]):
    """A distributed sampler that can start part-way through an epoch.

    Like ``DistributedSampler``: each of ``num_replicas`` ranks gets a disjoint share of a
    permutation that depends only on ``seed`` and the epoch (:meth:`set_epoch`), padded
    (or, with ``drop_last``, trimmed) to equal length; rank ``r`` takes positions
    ``r, r + num_replicas, ...`` of it. :meth:`skip` makes the next iteration start
    after the first ``n`` indices of this rank's share, without reading the skipped
    samples. :meth:`resume_from` starts it at a *global* position of the epoch's order
    (the samples every rank consumed together): the remainder is shared out among this
    sampler's ``num_replicas``, which need not be the number of ranks that consumed the
    first part, so an elastic job that lost (or gained) ranks goes on with no sample
    lost or seen twice. :class:`DataPosition` drives both on resume.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset_len: int = require_number(
            "ResumableSampler.dataset_len", dataset_len, minimum=1, integer=True
        )
        self.num_replicas = require_number(
            "ResumableSampler.num_replicas", num_replicas, minimum=1, integer=True
        )
        self.rank = require_number("ResumableSampler.rank", rank, minimum=0, integer=True)
        if self.rank >= self.num_replicas:
            raise ConfigError(f"ResumableSampler.rank must be < num_replicas, got {rank}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._skip = 0
        self._start = 0  # global position of the next iteration (resume_from)
        self.per_rank: int
        if self.drop_last:
            self.per_rank = self.dataset_len // self.num_replicas
        else:
            self.per_rank = -(-self.dataset_len // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next iteration uses."""
        self.epoch = int(epoch)

    def skip(self, n: int) -> None:
        """Start the next iteration after this rank's first ``n`` indices."""
        self._skip = require_number("ResumableSampler.skip", n, minimum=0, integer=True)
        self._start = 0

    def resume_from(self, position: int) -> None:
        """Start the next iteration at global position ``position`` of the epoch's
        order: the first ``position`` samples were consumed (by however many ranks);
        the rest is shared out among this sampler's ``num_replicas`` as above (padded,
        or trimmed with ``drop_last``, to equal shares). With the same number of ranks
        and a position they reached together, this is :meth:`skip` of
        ``position // num_replicas``."""
        self._start = require_number(
            "ResumableSampler.resume_from", position, minimum=0, integer=True
        )
        self._skip = 0

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return list(torch.randperm(self.dataset_len, generator=g).tolist())
        return list(range(self.dataset_len))

    @staticmethod
    def _even(order: list[int], source: list[int], per_rank: int, replicas: int) -> list[int]:
        """``order`` cut or padded (repeating ``source`` from its start, like
        ``DistributedSampler``) to ``per_rank * replicas``."""
        total = per_rank * replicas
        if total > len(order) and source:
            order = order + (source * (total // len(source) + 1))[: total - len(order)]
        return order[:total]

    def _indices(self) -> list[int]:
        order = self._order()
        full = self._even(order, order, self.per_rank, self.num_replicas)
        if not self._start:
            return full[self.rank :: self.num_replicas]
        rest = full[self._start :] if self._start < len(full) else []
        if self.drop_last:
            per_rank = len(rest) // self.num_replicas
        else:
            per_rank = -(-len(rest) // self.num_replicas)
        rest = self._even(rest, order, per_rank, self.num_replicas)
        return rest[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        indices = self._indices()
        self._start = 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        return self.per_rank


class DataPosition:
    """Where the training loop is in its data, as a checkpointable object.

    Wrap any re-iterable loader (a ``DataLoader``, a list of batches...) and iterate the
    wrapper instead; it counts the batches the *training loop* has taken, which is the
    true position even when a ``DataLoader``'s workers prefetch ahead. ``state_dict`` is
    ``{"epoch", "batches", "samples"}``: ``samples`` is the *global* position, the samples
    all ranks consumed together in the epoch (when the loader has a
    :class:`ResumableSampler` and a ``batch_size``; else None). It is the same on every
    rank, so save the position in the replicated ``state`` of
    :meth:`CheckpointManager.save <steadfast.CheckpointManager.save>`: a job that comes
    back with another number of ranks (an elastic ``--nnodes MIN:MAX`` after a lost node)
    then resumes where the epoch was, each sample once (:meth:`ResumableSampler.resume_from`).
    After ``load_state_dict``, the next iteration resumes after the batches already
    consumed: by positioning a :class:`ResumableSampler` (no data is read) when the
    loader uses one with a fixed ``batch_size``, otherwise by
    drawing and discarding them (correct for any deterministic loader, but it reads the
    data; and only correct when a re-created loader yields the epoch's batches in the
    same order, as with :class:`ResumableSampler` or any sampler whose order follows
    from its seed and ``set_epoch``, but not ``DataLoader(shuffle=True)``, whose order
    comes from a generator that has moved on since the epoch began).
    RNG draws made while positioning are undone (see :meth:`_resume`). With
    ``num_workers > 0`` the workers' seeds come from a fresh base seed, so random
    transforms inside workers do not repeat bit-exact; torchdata's
    ``StatefulDataLoader`` saves worker state too: checkpoint that loader itself instead.

    ``lookahead``: how many batches the consumer draws ahead of the one it is training
    on when it saves. A plain loop draws none; PyTorch Lightning's fit loop draws one
    ahead from a loader without a length (to know which batch is the epoch's last), so
    its copy of this state, taken in a training-batch hook, would otherwise count a
    batch never trained (:func:`steadfast.integrations.lightning.resumable` sets it).
    """

    def __init__(self, loader: Iterable[Any], lookahead: int = 0) -> None:
        self.loader = loader
        self.lookahead = require_number(
            "DataPosition.lookahead", lookahead, minimum=0, integer=True
        )
        self._live = False  # an iteration is under way (not yet exhausted)
        self.epoch = 0
        self.batches = 0
        self._resume_at = 0
        self._resume_samples: int | None = None  # a global position to resume from
        self._base_samples = 0  # global position where this iteration began
        self._base_batches = 0

    def _global(self) -> tuple[ResumableSampler, int] | None:
        """The loader's ResumableSampler and samples per step of all ranks together."""
        sampler = getattr(self.loader, "sampler", None)
        batch_size = getattr(self.loader, "batch_size", None)
        if isinstance(sampler, ResumableSampler) and batch_size:
            return sampler, int(batch_size) * sampler.num_replicas
        return None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (forwarded to the sampler). Optional:
        the position moves to the next epoch by itself when an epoch is iterated to its
        end, and each iteration tells the sampler its epoch."""
        if epoch != self.epoch:
            self.batches = 0
            self._live = False
            self._resume_at = 0
            self._resume_samples = None
        self.epoch = int(epoch)
        self._sampler_epoch()

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume_at = self._resume_at, 0
        samples, self._resume_samples = self._resume_samples, None
        self._sampler_epoch()
        position = self._global()
        if samples is not None and position is not None:  # global: any number of ranks
            sampler, per_step = position
            rng = RNGState()
            saved = rng.state_dict()
            sampler.resume_from(samples)
            it = iter(self.loader)
            rng.load_state_dict(saved)
            self._base_samples, self._base_batches = samples, samples // per_step
        else:
            it = self._resume(skip) if skip else iter(self.loader)
            per_step = position[1] if position is not None else 0
            self._base_samples, self._base_batches = skip * per_step, skip
        self.batches = self._base_batches
        self._live = True
        for batch in it:
            self.batches += 1
            yield batch
        # the epoch is complete: a checkpoint from now on means "the next one, from its
        # start", not "this one, from its start"
        self._live = False
        self.epoch, self.batches = self.epoch + 1, 0
        self._base_samples = self._base_batches = 0

    def _sampler_epoch(self) -> None:
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)

    def _resume(self, skip: int) -> Iterator[Any]:
        """An iterator positioned after ``skip`` batches. In the uninterrupted run the
        iterator was created, and the skipped batches drawn, *before* the checkpoint, so
        whatever random numbers that took (a ``DataLoader`` draws its base seed from
        torch's generator; transforms may draw more) are already in the saved RNG state:
        they are drawn here with every RNG stream put back afterwards."""
        rng = RNGState()
        saved = rng.state_dict()
        try:
            sampler = getattr(self.loader, "sampler", None)
            batch_size = getattr(self.loader, "batch_size", None)
            if isinstance(sampler, ResumableSampler) and batch_size:
                sampler.skip(skip * batch_size)  # no data is read
                return iter(self.loader)
            it = iter(self.loader)
            for _ in range(skip):
                next(it)
            return it
        finally:
            rng.load_state_dict(saved)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int | None]:
        """``{"epoch", "batches", "samples"}``: batches of the epoch this rank's loop has
        consumed (drawn, less the ``lookahead`` still in the consumer's hands), and the
        global position (None without a ResumableSampler)."""
        batches = self.batches
        if self._live:
            batches = max(self._base_batches, batches - self.lookahead)
        position = self._global()
        samples = None
        if position is not None:
            samples = self._base_samples + (batches - self._base_batches) * position[1]
        return {"epoch": self.epoch, "batches": batches, "samples": samples}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at ``state_dict``'s position on the next iteration: its global
        ``samples`` when it has them and the loader has a :class:`ResumableSampler`,
        else its ``batches`` (a position from the same number of ranks)."""
        try:
            epoch, batches = int(state_dict["epoch"]), int(state_dict["batches"])
            raw = state_dict.get("samples")
            samples = None if raw is None else int(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"DataPosition state must have int 'epoch' and 'batches': {exc}"
            ) from exc
        self.set_epoch(epoch)
        self.batches = self._resume_at = batches
        self._resume_samples = samples if self._global() is not None else None
