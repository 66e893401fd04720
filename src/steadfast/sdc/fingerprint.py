"""Fingerprints of the state that data-parallel replicas must hold bit for bit alike.

After every optimizer step, the replicas of a DDP model (each rank of its process group)
hold the same parameters and the same optimizer state, bit for bit: they started from
one broadcast and apply the same averaged gradients with the same arithmetic. A finite
bit flip in one replica's memory (a weight, an Adam moment) breaks that and nothing else
notices: the values stay finite, the loss moves a little, the gradients are still
averaged into agreement. A fingerprint of the state, compared across the replicas, does.

**What is hashed** (:class:`ReplicaState`): the module's parameters in the module's
order, then, for each, its optimizer state tensors by key, as one stream of bytes. The
state is covered in chunks of at most ``budget`` bytes: check ``n`` hashes chunk
``n % chunks``, so a state of any size is covered once every ``chunks`` checks while each
check costs at most ``budget`` bytes of reading. Every replica hashes the same chunk at
the same check (the chunk follows from the check's number and the state's size, which
the replicas share).

**How**: CRC-32 over the chunk's bytes, read in place (no copy) on the CPU: ISA-L's
(``isal``, already steadfast's for checkpoints: zlib's values at ~15 GB/s on one core
here, against zlib's ~4), else zlib's. A CRC is order-sensitive (a value moved or two values swapped
change it) and catches every single-bit and every burst error of up to 32 bits, so one
flipped bit is always found. State on an accelerator is hashed where it lives
(:func:`device_hash`: each byte times an odd weight of its position, summed modulo
2**64: order-sensitive, a single-bit change always changes the sum, integer sums are
exact whatever the kernel's order), and its 8-byte result copied out asynchronously:
no host-device synchronisation on the step's path.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_BUDGET",
    "ReplicaState",
    "Span",
    "cpu_crc",
    "crc32",
    "device_hash",
    "flip_bit",
    "group_key",
]

try:  # ISA-L's CRC-32: zlib's values, several times its speed
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib where it is missing
    from zlib import crc32 as _crc32

#: Bytes hashed per check by default: 32 MiB, about 2 ms of one core at ISA-L's speed.
DEFAULT_BUDGET = 32 << 20
_PIECE = 1 << 20  # elements per device-hash piece (its weights are made once, 8 MiB)
_MASK64 = (1 << 64) - 1
# odd, as a signed int64: pieces combined by a multiply-add modulo 2**64
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)


@dataclass(frozen=True)
class Span:
    """One check's part of the state: chunk ``chunk`` of ``chunks``, bytes ``start`` to
    ``end`` of ``total``."""

    chunk: int
    chunks: int
    start: int
    end: int
    total: int


class ReplicaState:
    """The replicated state of one model and its optimizer, as a stream of bytes in a
    fixed order (see the module docstring). ``optimizer`` may be None (the parameters
    alone); its state is left out where it is sharded across the ranks (ZeRO)."""

    def __init__(self, module: Any, optimizer: Any, budget: int = DEFAULT_BUDGET) -> None:
        if budget <= 0:
            raise ValueError(f"budget: {budget} is not a positive number of bytes")
        self.module = module
        self.optimizer = optimizer
        self.budget = int(budget)
        self.device: Any = None

    def tensors(self) -> list[Any]:
        """The state's tensors in order: parameters, then their optimizer state (only
        tensors on the parameters' device; a CPU step counter beside CUDA weights is
        left out, and it is the same count on every rank anyway)."""
        params = list(self.module.parameters())
        if not params:
            return []
        self.device = params[0].device
        out = [p.detach() for p in params if p.device == self.device]
        state = getattr(self.optimizer, "state", None)
        if state is None or type(self.optimizer).__name__ == "ZeroRedundancyOptimizer":
            return out
        for p in params:
            entry = state.get(p)
            if not entry:
                continue
            for key in sorted(entry, key=str):
                value = entry[key]
                if hasattr(value, "device") and value.device == self.device and value.numel():
                    out.append(value.detach())
        return out

    def span(self, check: int, tensors: list[Any]) -> Span:
        """The chunk that check number ``check`` covers."""
        total = sum(int(t.numel()) * int(t.element_size()) for t in tensors)
        chunks = max(1, -(-total // self.budget))
        chunk = check % chunks
        start = chunk * self.budget
        return Span(chunk, chunks, start, min(total, start + self.budget), total)


def pieces(tensors: Iterable[Any], start: int, end: int) -> Iterator[tuple[Any, int, int]]:
    """``(tensor, first byte, end byte)`` of each tensor's part in bytes ``start..end`` of
    the stream the tensors make, in order."""
    offset = 0
    for t in tensors:
        size = int(t.numel()) * int(t.element_size())
        lo, hi = max(start, offset), min(end, offset + size)
        if lo < hi:
            yield t, lo - offset, hi - offset
        offset += size
        if offset >= end:
            return


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of a buffer (ISA-L's where it is installed), continuing ``value``."""
    return int(_crc32(data, value))


def cpu_crc(tensors: list[Any], span: Span) -> int:
    """CRC-32 of the span's bytes of CPU tensors, read in place."""
    crc = 0
    for t, lo, hi in pieces(tensors, span.start, span.end):
        if not t.is_contiguous():
            t = t.contiguous()
        view = (ctypes.c_char * (hi - lo)).from_address(int(t.data_ptr()) + lo)
        crc = int(_crc32(memoryview(view), crc))
    return crc


_weights: dict[Any, Any] = {}


def _weights_on(device: Any) -> Any:
    """Odd pseudo-random int64 weights, one per byte position of a piece, on ``device``
    (made once per device from a fixed seed: every replica has the same)."""
    w = _weights.get(device)
    if w is None:
        import torch

        gen = torch.Generator().manual_seed(0x5DC)
        w = torch.randint(-(2**62), 2**62, (_PIECE,), generator=gen, dtype=torch.int64)
        w = (w * 2 + 1).to(device)
        _weights[device] = w
    return w


def device_hash(tensors: list[Any], span: Span) -> Any:
    """The span's position-weighted byte sum modulo 2**64 (see the module docstring), as
    a 0-d int64 tensor on the tensors' device: nothing waits for it here."""
    import torch

    total: Any = None
    index = 0
    for t, lo, hi in pieces(tensors, span.start, span.end):
        raw = t.contiguous().view(-1).view(torch.uint8)[lo:hi]
        for at in range(0, hi - lo, _PIECE):
            part = raw[at : at + _PIECE].to(torch.int64)
            w = _weights_on(part.device)[: part.numel()]
            s = (part * w).sum() + _signed(index * _MIX)  # the piece's place counts
            total = s if total is None else total * _MIX + s
            index += 1
    if total is None:
        return torch.zeros((), dtype=torch.int64)
    return total


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def as_unsigned(value: int) -> int:
    """A signed 64-bit sum as the unsigned value a fingerprint publishes."""
    return int(value) & _MASK64


def group_key(ranks: list[int]) -> int:
    """The key of a process group of ``ranks`` (global ranks), the same on each member:
    its size times 2**32 plus the CRC-32 of its members; exact in a float64 slot."""
    members = sorted(int(r) for r in ranks)
    return len(members) * (1 << 32) + zlib.crc32(",".join(map(str, members)).encode())


def flip_bit(tensor: Any, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of element ``index`` (of the flattened tensor) in place, as a
    cosmic ray or a bad memory cell would: the fault the tests and benches inject.
    Returns the value before and after."""
    import torch

    flat = tensor.detach().view(-1)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    before = float(flat[index])
    with torch.no_grad():
        word = flat.view(ints)
        if bit == word.element_size() * 8 - 1:  # the sign bit: xor with the minimum
            word[index] ^= torch.iinfo(ints).min
        else:
            word[index] ^= 1 << bit
    return before, float(flat[index])
