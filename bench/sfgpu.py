"""What the benches of one process's state and the CUDA benches share: a one-rank group
on either device, and GPU work of a given length that holds the stream, not the host (a
real step's kernels, as the host sees them)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch


def spin_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds
    (measured on this device with CUDA events)."""
    probe = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # the kernel loaded
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


@contextlib.contextmanager
def one_rank_group(device: str) -> Iterator[None]:
    """A one-rank process group, gloo on the CPU and NCCL on the GPU (GPU 0), with the
    event log off, for a bench of one process's state; destroyed after."""
    import torch.distributed as dist

    os.environ["STEADFAST_EVENTS"] = "off"
    store = tempfile.mktemp(prefix="sf-bench-store-")
    backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
    if device != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.unlink(store)


def snapshot_rounds(
    mgr: Any, state: dict[str, Any], tensors: dict[str, torch.Tensor], repeats: int, device: str
) -> tuple[list[float], list[float], list[float]]:
    """``repeats`` snapshots (steps 2..repeats+1, after one that allocates the staging
    buffers), each after the state moved on, interleaved with a plain copy of the same
    bytes (pinned on a GPU): ``(stalls, landed, memcpys)`` in seconds. The stall is what
    ``snapshot()`` held the host; landed, when its copy was done on the device."""

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    pin = device != "cpu"
    floor = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in tensors.items()}
    stalls, lands, copies = [], [], []
    for step in range(1, repeats + 2):
        for v in tensors.values():  # training moves on between snapshots
            v.add_(1.0)
        sync()
        t0 = time.perf_counter()
        for k, v in tensors.items():
            floor[k].copy_(v, non_blocking=pin)
        sync()
        copy = time.perf_counter() - t0
        t0 = time.perf_counter()
        mgr.snapshot(step, state)
        stall = time.perf_counter() - t0
        sync()  # on CUDA the copy is queued on the stream, not waited for
        landed = time.perf_counter() - t0
        mgr._memory.wait()  # the write: not part of the stall
        if step > 1:  # the first snapshot allocates the staging buffers
            stalls.append(stall)
            lands.append(landed)
            copies.append(copy)
    return stalls, lands, copies
