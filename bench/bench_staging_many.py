"""What a snapshot's staging costs beyond the copy itself, for a model of many tensors.

A 24-layer transformer encoder (288 parameter tensors, 0.8 M values) and its AdamW state:
1,152 tensors, 9.6 MB. Each repeat times, in one process:

- ``stage``: ``Stager.stage`` of the state dicts the memory tier stages (the product);
- ``floor``: one ``torch._foreach_copy_`` of the same tensors into buffers made before
  (the copy alone, no walk);
- ``loop``: the same copies one ``copy_`` at a time (how the staging copied before).

It prints each one's median and ``stage`` over ``floor``: what the walk (state dicts,
DTensor checks, buffer lookups) adds to the copy.

    .venv/bin/python bench/bench_staging_many.py [--repeats 50] [--layers 24]

``bench_staging.py`` measures the other end: a few large tensors, against torch's
``DefaultStager`` and a memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from steadfast.checkpoint.saving import capture
from steadfast.checkpoint.staging import Stager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 8, 64)).sum().backward()
    opt.step()
    state = {"model": net, "optim": opt}
    stager = Stager()
    replicated, _ = capture(state, None, False)
    stager.stage(replicated, shards=True)  # its buffers made once, as after a first snapshot
    srcs = [t for t in _tensors(replicated)]
    dsts = [torch.empty_like(t) for t in srcs]
    times: dict[str, list[float]] = {"stage": [], "floor": [], "loop": []}
    with torch.no_grad():
        for _ in range(args.repeats):
            replicated, _ = capture(state, None, False)
            began = time.perf_counter()
            stager.stage(replicated, shards=True)
            times["stage"].append(time.perf_counter() - began)
            began = time.perf_counter()
            torch._foreach_copy_(dsts, srcs)
            times["floor"].append(time.perf_counter() - began)
            began = time.perf_counter()
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src)
            times["loop"].append(time.perf_counter() - began)
    size = sum(t.numel() * t.element_size() for t in srcs)
    print(f"{len(srcs)} tensors, {size / 1e6:.1f} MB; median of {args.repeats}")
    median = {k: statistics.median(v) for k, v in times.items()}
    for name, value in median.items():
        print(f"{name:<6} {value * 1000:8.3f} ms")
    print(f"stage / floor: {median['stage'] / median['floor']:.2f}")


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
