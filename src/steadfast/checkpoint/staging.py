"""Host staging for async saves: the state's tensors copied to host memory, into
buffers kept from one save to the next; and the state walks the manager needs (state
dicts of objects, DTensors found, tensors moved to the CPU)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import ConfigError
from ..seam import foreach_copy
from .layout import CheckpointError

__all__ = [
    "SCALARS",
    "Stager",
    "any_tensor",
    "dtensor_off_cpu",
    "fill_in_place",
    "has_dtensor",
    "is_dtensor",
    "to_cpu",
    "to_state_dicts",
]


def to_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace objects that have ``state_dict()`` by their state dict."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"checkpoint state keys must be strings, got {key!r}")
        sd = getattr(value, "state_dict", None)
        out[key] = sd() if callable(sd) else value
    return out


def is_dtensor(value: Any) -> bool:
    if type(value) is torch.Tensor:  # a plain tensor, the common case: no lookup
        return False
    # a DTensor exists only if its module was imported: importing it here would cost
    # ~0.5 s on the first save of every job that has none
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def any_tensor(value: Any, pred: Callable[[torch.Tensor], bool]) -> bool:
    """Whether any tensor in the nested state ``value`` satisfies ``pred``. A sequence
    of scalars (Python's RNG state: 625 ints) is passed over whole: a model's ~1,000
    tensors are walked at every snapshot."""
    if isinstance(value, torch.Tensor):
        return pred(value)
    if isinstance(value, Mapping):
        values: Any = value.values()
    elif isinstance(value, (list, tuple)):
        if SCALARS.issuperset(map(type, value)):
            return False
        values = value
    else:
        return False
    for v in values:  # noqa: SIM110 - any() over a generator: 0.26 ms, not 0.17, a snapshot
        if any_tensor(v, pred):
            return True
    return False


def has_dtensor(value: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist: no walk
        return False
    return any_tensor(value, is_dtensor)


class Stager:
    """Copies the state to host memory for an async save, into buffers kept from the
    previous save when shapes and dtypes match (pinned when the source is on CUDA).

    Reusing the buffers is what makes the stall short: a fresh 200 MB allocation costs
    page faults on every page, a copy into warm memory is a plain memcpy. The cost is one
    host copy of the state kept alive between saves (as torch's async DCP does). Tensors
    that are the same object (tied weights) stay one tensor.
    """

    def __init__(self) -> None:
        self._shards = False
        # the buffers by their tensor's place in the walk (a key path cost a string per
        # value; the shape and dtype are checked before a buffer is used again)
        self._buffers: list[torch.Tensor] = []
        self._used: list[torch.Tensor] = []
        self._memo: dict[int, torch.Tensor] = {}
        self._devices: set[torch.device] = set()
        self._dsts: list[torch.Tensor] = []  # the copies of a stage, made at its end
        self._srcs: list[torch.Tensor] = []
        self._landing: list[torch.cuda.Event] = []  # the last stage's device copies

    def stage(self, value: Any, shards: bool = False) -> Any:
        """``value`` copied into host buffers; ``shards``: each DTensor as its local
        shard alone (a plain tensor: what a rank keeps of sharded state), else as a
        DTensor over the staged shard. The walk collects the host tensors' copies and
        makes them in one call (:func:`steadfast.seam.foreach_copy`).

        A device tensor's copy is queued on its device's current stream and not waited
        for: the step goes on while it lands, and whoever reads the staged buffers calls
        :meth:`settle` first (the snapshot's writer thread). The stream orders the copy
        before the step's later changes of the tensor, as it orders any use of it."""
        self.settle()  # the buffers are filled again: the last stage's copies are in
        self._used, self._memo, self._devices = [], {}, set()
        self._dsts, self._srcs = [], []
        self._shards = shards
        try:
            staged = self._walk(value)
            with torch.no_grad():  # a copy of a parameter is not part of any graph
                foreach_copy(self._dsts, self._srcs)
        finally:
            self._dsts, self._srcs = [], []  # the sources are not kept alive
        self._landing = [_landed_on(device) for device in self._devices]
        self._buffers = self._used  # buffers for tensors that went away are released
        return staged

    def settle(self) -> None:
        """Wait until the last stage's device-to-host copies have landed (no-op for a
        host-only state): a stage's buffers are read only after it. Not a device
        synchronisation: the work queued after the copies goes on."""
        landing, self._landing = self._landing, []
        for event in landing:
            event.synchronize()

    def clear(self) -> None:
        self.settle()  # no copy may still be landing in a buffer given back
        self._buffers, self._used, self._memo = [], [], {}

    def _copy(self, t: torch.Tensor, memo: bool = True) -> torch.Tensor:
        if memo and id(t) in self._memo:
            return self._memo[id(t)]
        place = len(self._used)
        buf = self._buffers[place] if place < len(self._buffers) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if t.is_cuda:  # device to host one by one, as before: the fused copy is
            # proven on host tensors only (no GPU was lent to run it on)
            buf.copy_(t.detach(), non_blocking=True)
            self._devices.add(t.device)
        else:
            self._dsts.append(buf)
            self._srcs.append(t)
        self._used.append(buf)
        if memo:  # t is alive for the whole walk: its id cannot be reused meanwhile
            self._memo[id(t)] = buf
        return buf

    def _walk(self, value: Any) -> Any:
        if type(value) is torch.Tensor:  # the common case first: no DTensor test
            return self._copy(value)
        if is_dtensor(value):
            local = self._copy(value.to_local(), memo=False)  # a temporary: no id()
            if self._shards:
                return local
            return type(value).from_local(
                local,
                value.device_mesh,
                value.placements,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._copy(value)
        if isinstance(value, Mapping):
            return {k: self._walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if SCALARS.issuperset(map(type, value)):  # Python's RNG state: 625 ints
                return list(value) if isinstance(value, list) else value
            items = (self._walk(v) for v in value)
            return list(items) if isinstance(value, list) else tuple(items)
        return value


def _landed_on(device: torch.device) -> torch.cuda.Event:
    """An event on ``device``'s current stream, after the copies queued there."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


#: Values a walk leaves as they are, in a sequence of nothing else taken whole: the
#: snapshot of every step walked Python's RNG state (a tuple of 625 ints) one by one,
#: ~70 % of its staging.
SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def fill_in_place(template: Any, saved: Any, copy: Copy | None = None) -> Any:
    """``saved`` (a state as read: a snapshot's local shards, a file's CPU tensors) put
    into ``template`` (the live objects' state dicts, same world size and mesh): each
    DTensor of ``template`` gets its saved shard copied into its local tensor, and, when
    ``copy`` is given (a GPU job: :class:`~steadfast.checkpoint.upload.Uploader`), each
    GPU tensor gets its saved value of the same shape and dtype, in place; those stay in
    the result (their ``load_state_dict`` then finds its own tensors); every other value
    is ``saved``'s."""
    if is_dtensor(template):
        local = template.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(
                f"a saved shard ({got}) does not fit the live DTensor's local shard "
                f"{tuple(local.shape)}: the mesh or the sharding changed"
            )
        with torch.no_grad():
            (copy or _copy)(local, saved)
        return template
    if (
        copy is not None
        and isinstance(template, torch.Tensor)
        and template.is_cuda
        and isinstance(saved, torch.Tensor)
        and not is_dtensor(saved)
        and saved.shape == template.shape
        and saved.dtype == template.dtype
    ):
        with torch.no_grad():
            copy(template, saved)
        return template
    if isinstance(template, Mapping) and isinstance(saved, Mapping):
        return {
            k: fill_in_place(template[k], v, copy) if k in template else v for k, v in saved.items()
        }
    if (
        isinstance(template, (list, tuple))
        and isinstance(saved, (list, tuple))
        and len(template) == len(saved)
    ):
        filled = [fill_in_place(t, v, copy) for t, v in zip(template, saved, strict=True)]
        return tuple(filled) if isinstance(saved, tuple) else filled
    return saved


#: how :func:`fill_in_place` copies a saved tensor into a live one: ``(dst, src)``
Copy = Callable[[torch.Tensor, torch.Tensor], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def dtensor_off_cpu(value: Any) -> bool:
    return any_tensor(value, lambda t: is_dtensor(t) and t.device.type != "cpu")


def to_cpu(value: Any) -> Any:
    """``value`` with every (non-sharded) tensor on the CPU, without copying CPU tensors."""
    if isinstance(value, torch.Tensor) and not is_dtensor(value):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_cpu(v) for v in value)
    return value
