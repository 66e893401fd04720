"""How a replay proof compares what a restored run re-did with what the run did before
the fault: bit for bit where it can, else within a relative tolerance.

A resumed run is bit-exact when every reduction sums in the same order as before. Some
do not, and the difference is rounding, not a lost state: DDP built without
``find_unused_parameters=True`` rebuilds its gradient buckets after its first backward,
in the order gradients became ready, so with more than two ranks a restarted process's
first step sums in another order than the run that never stopped (the last bits of the
loss differ, ~1e-7 relative in float32); non-deterministic kernels (atomics, cuDNN's
autotuner) do the same on a GPU. A state the checkpoint lost (an LR scheduler, a data
position, an RNG of the script's own) moves the loss by far more. So a value within the
tolerance proves the restore, and the verdict says it was not bit for bit
(``restore_verified``'s ``exact`` and ``difference``); one beyond it is a mismatch.

The difference of two values is relative to their size: for numbers ``|a - b| /
max(|a|, |b|)``; for a floating tensor the same with its 2-norm (``||a - b|| /
max(||a||, ||b||)``: an element near zero that moved by a rounding is not a 100 %
difference); anything else (integers, RNG states, bytes, strings) is equal or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_TOLERANCE", "difference", "same"]

#: The largest relative difference a replay proof takes for rounding: a few float32
#: roundings (float32's epsilon is 1.2e-7) over the steps compared, well below what a
#: lost scheduler or data position does to a loss.
DEFAULT_TOLERANCE = 1e-5


def difference(a: Any, b: Any) -> float:
    """The relative difference of two saved values: 0.0 when they are equal bit for bit,
    ``inf`` when they differ in what is not rounding (type, shape, dtype, an integer, a
    NaN against a number); containers: their items' largest."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return math.inf
        return max((difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((difference(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # numpy's RNG state
        return 0.0 if a.tobytes() == b.tobytes() else math.inf
    if isinstance(a, float) and isinstance(b, float):
        return _number_difference(a, b)
    return 0.0 if a == b else math.inf


def same(a: Any, b: Any) -> bool:
    """Whether two saved values are equal bit for bit."""
    return difference(a, b) == 0.0


def _number_difference(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _tensor_difference(a: Any, b: Any) -> float:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return math.inf
    if a.dtype != b.dtype or a.shape != b.shape:
        return math.inf
    x, y = _flat(a), _flat(b)
    if torch.equal(_bytes(x), _bytes(y)):
        return 0.0
    if not (x.is_floating_point() or x.is_complex()):
        return math.inf
    wide = torch.float64 if x.is_floating_point() else torch.complex128
    x, y = x.to(wide), y.to(wide)
    nan = x.isnan()
    if not torch.equal(nan, y.isnan()):
        return math.inf
    x, y = x[~nan], y[~nan]
    if not torch.equal(x.isinf(), y.isinf()) or not torch.equal(x[x.isinf()], y[y.isinf()]):
        return math.inf
    finite = ~x.isinf()
    x, y = x[finite], y[finite]
    scale = max(float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y)))
    gap = float(torch.linalg.vector_norm(x - y))
    return 0.0 if gap == 0.0 else (gap / scale if scale > 0 else math.inf)


def _flat(t: Any) -> Any:
    return t.detach().cpu().contiguous().reshape(-1)


def _bytes(flat: Any) -> Any:
    import torch

    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat
