"""The memory tier's snapshot file: the state's tensors as one run of bytes after a small
header, instead of ``torch.save``'s record per tensor.

Why: a model's state is ~1,000 tensors, and ``torch.save`` pickles each in Python (its
reduce, its storage record): 21 ms for a 24-layer encoder and its AdamW state (1,152
tensors, 9.6 MB), all of it holding the GIL on the writer thread while the training
loop wants it back. Here the walk replaces each tensor of the (staged) state by a slot
``(SLOT, i)``; the skeleton and an index of ``(dtype, shape, offset)`` are one small
pickle (Python's C pickler, protocol 2, read back by the unpickler of
``torch.load(weights_only=True)``: :func:`steadfast.seam.weights_only_loads`), and the
tensors' bytes follow, each at a 64-byte boundary, written with ``os.writev`` (the GIL
released) while their CRC-32 is computed. Reading maps the file copy-on-write
(``torch.from_file``, as ``torch.load(mmap=True)`` does) and gives each tensor a storage
of its own over its bytes of the mapping.

Layout: ``MAGIC`` (8 bytes), the header's length (8, little-endian), the header, zeros to
a 64-byte boundary, then the tensors. A tensor that is the same object twice (tied
weights) is written once and read back as one tensor. A value the layout does not keep
(an object other than a dict, list, tuple, scalar, dtype, device or size; a tensor that
is not a plain contiguous CPU tensor: a subclass, a conjugate view, a quantized or
sparse one; a tuple that looks like a slot) makes the whole file an ordinary
``torch.save`` file, which :func:`load_flat` reads too.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from .. import seam
from .files import crc32, save_file
from .layout import CheckpointError
from .staging import SCALARS

__all__ = ["MAGIC", "SLOT", "load_flat", "save_flat"]

MAGIC = b"SFFLAT01"
#: the first item of the tuple that stands for a tensor in the skeleton
SLOT = "\x00steadfast.flat.slot"
_ALIGN = 64
_IOV_MAX = 1024  # Linux's limit on one writev's buffers
#: leaves kept as they are: what torch.load(weights_only=True) reads back
_LEAVES = SCALARS | {torch.dtype, torch.device, torch.Size}


class _NotFlat(Exception):
    """The state holds something the flat layout does not keep: write it whole."""


def _pad(n: int) -> int:
    return -n % _ALIGN


def _plain(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
    )


class _Hollow:
    """One walk: the skeleton of a state, its tensors collected in order."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._memo: dict[int, int] = {}

    def walk(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if not _plain(value):
                raise _NotFlat
            i = self._memo.get(id(value))
            if i is None:  # the tensor is alive for the whole walk: its id is its own
                i = self._memo[id(value)] = len(self.tensors)
                self.tensors.append(value)
            return (SLOT, i)
        kind = type(value)
        if kind is dict:
            return {k: self.walk(v) for k, v in value.items()}
        if kind is list or kind is tuple:
            if SCALARS.issuperset(map(type, value)):  # Python's RNG state: 625 ints
                if kind is tuple and len(value) == 2 and value[0] == SLOT:
                    raise _NotFlat  # the user's value would read back as a tensor
                return value
            items = [self.walk(v) for v in value]
            return items if kind is list else tuple(items)
        if kind in _LEAVES:
            return value
        raise _NotFlat


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (the tensor must outlive the view)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def save_flat(path: Path, obj: Any) -> dict[str, int]:
    """Write ``obj`` (a staged state: host tensors) to ``path`` in the flat layout, or as
    one ``torch.save`` when it holds what the layout does not keep; durably. Its size and
    CRC-32 for the manifest."""
    hollow = _Hollow()
    try:
        skeleton = hollow.walk(obj)
    except _NotFlat:
        return save_file(path, obj)
    index, at = [], 0
    for t in hollow.tensors:
        index.append((t.dtype, tuple(t.shape), at))
        at += t.nbytes + _pad(t.nbytes)
    head = pickle.dumps({"skeleton": skeleton, "index": index}, protocol=2)
    prefix = MAGIC + len(head).to_bytes(8, "little")
    zeros = bytes(_ALIGN)
    pieces: list[memoryview | bytes] = [prefix, head, zeros[: _pad(len(prefix) + len(head))]]
    for t in hollow.tensors:
        if t.numel():
            view = _bytes_of(t)
            pieces += [view, zeros[: _pad(len(view))]]
    crc = 0
    for piece in pieces:
        crc = crc32(piece, crc)
    size = sum(len(p) for p in pieces)
    with open(path, "wb") as fh:
        fd = fh.fileno()
        for first in range(0, len(pieces), _IOV_MAX):
            _write_all(fd, pieces[first : first + _IOV_MAX])
        os.fsync(fd)
        written = os.fstat(fd).st_size
    if written != size:  # a short write the file system did not report
        raise OSError(f"{path}: wrote {size} bytes, the file has {written}")
    return {"bytes": size, "crc32": crc}


def _write_all(fd: int, pieces: list[memoryview | bytes]) -> None:
    """``os.writev`` until every byte of ``pieces`` is written (a write may be short)."""
    views = [memoryview(p) for p in pieces if len(p)]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def load_flat(source: Path | memoryview, what: str) -> Any:
    """A file written by :func:`save_flat` (or ``torch.save``): from ``source``, a path
    (mapped copy-on-write: no copy until the state is loaded into the model) or the
    bytes that arrived from another node (copied once). ``what`` names it in errors."""
    if isinstance(source, Path):
        with open(source, "rb") as fh:
            prefix = fh.read(16)
            if prefix[:8] != MAGIC:
                return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            head = fh.read(int.from_bytes(prefix[8:], "little"))
        size = os.path.getsize(source)
        data = torch.from_file(str(source), shared=False, size=size, dtype=torch.uint8)
    else:
        prefix = bytes(source[:16])
        if prefix[:8] != MAGIC:
            return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
        head = bytes(source[16 : 16 + int.from_bytes(prefix[8:], "little")])
        data = torch.frombuffer(bytearray(source), dtype=torch.uint8)
    start = 16 + len(head)
    start += _pad(start)
    try:
        header = seam.weights_only_loads(head)
        tensors = [_tensor(data, start, *entry) for entry in header["index"]]
        return _fill(header["skeleton"], tensors)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError,
            RuntimeError) as exc:  # fmt: skip
        raise CheckpointError(f"{what}: a damaged snapshot file ({exc})") from exc


def _tensor(data: torch.Tensor, start: int, dtype: Any, shape: Any, at: Any) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"index entry {(dtype, shape, at)!r}")
    n = dtype.itemsize
    for d in shape:
        n *= d
    if not isinstance(at, int) or at < 0 or start + at + n > data.numel():
        raise ValueError(f"a tensor of {n} bytes at {at!r} past the file's end")
    # a storage of its own over the tensor's bytes (as torch.load(mmap=True) makes):
    # torch.set_rng_state, for one, reads a tensor's storage from its start
    own: torch.UntypedStorage = data.untyped_storage()[start + at : start + at + n]
    return torch.empty(0, dtype=dtype).set_(own).view(tuple(shape))


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if kind is dict:
        return {k: _fill(v, tensors) for k, v in value.items()}
    if kind is tuple and len(value) == 2 and value[0] == SLOT and type(value[1]) is int:
        return tensors[value[1]]
    if kind is list or kind is tuple:
        if SCALARS.issuperset(map(type, value)):
            return value
        items = [_fill(v, tensors) for v in value]
        return items if kind is list else tuple(items)
    return value
