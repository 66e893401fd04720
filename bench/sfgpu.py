"""What the benches of one process's state and the CUDA benches share: a one-rank group
on either device, and GPU work of a given length that holds the stream, not the host (a
real step's kernels, as the host sees them)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

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
