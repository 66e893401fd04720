"""What the CUDA benches share: GPU work of a given length that holds the stream, not
the host (a real step's kernels, as the host sees them)."""

from __future__ import annotations

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
