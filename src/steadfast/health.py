"""GPU and collective health checks: :func:`check_gpu_health` and
:func:`check_nccl_health`.

Parity with ``kempnerforge.resilience`` (seed 000): same names, defaults and return
values. Beyond the original, ``check_nccl_health`` works on any backend and returns False
at its timeout instead of hanging in a collective a peer never joins, and
``check_gpu_health`` leaves the current CUDA device as it was.

:class:`~steadfast.nan_detector.NaNDetector` and :class:`~steadfast.nan_detector.NaNState`
(a NaN is not node health) live in :mod:`steadfast.nan_detector`; they stay importable
from here. The launcher's node health check is
:func:`steadfast.launcher.nodes.health_check`.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import events
from .config import require_number
from .dist import backend_device, is_distributed
from .nan_detector import NaNDetector, NaNState

__all__ = ["NaNDetector", "NaNState", "check_gpu_health", "check_nccl_health"]

logger = logging.getLogger(__name__)


def check_gpu_health(device: int = 0) -> dict[str, bool | str]:
    """Run basic GPU health checks on CUDA device ``device``.

    Performs: 1. CUDA availability check, 2. a small test computation on the device,
    3. a 1 MiB memory allocation test. Never raises, and leaves the current CUDA device
    as it was (the original changed it with ``set_device``).

    Returns:
        Dict with keys ``cuda_available``, ``device_accessible``, ``compute_ok``,
        ``memory_ok`` (bools) and ``error`` (str, empty when healthy).
    """
    result: dict[str, bool | str] = {
        "cuda_available": bool(torch.cuda.is_available()),
        "device_accessible": False,
        "compute_ok": False,
        "memory_ok": False,
        "error": "",
    }
    if not result["cuda_available"]:
        result["error"] = "CUDA not available"
        return result
    try:
        count = torch.cuda.device_count()
        if not 0 <= device < count:
            raise RuntimeError(f"invalid device ordinal {device} (this node has {count})")
        with torch.cuda.device(device):
            dev = torch.device("cuda", device)
            torch.cuda.get_device_properties(device)
            result["device_accessible"] = True
            x = torch.ones(16, device=dev)
            ok = float((x + x).sum().item()) == 32.0
            if not ok:
                raise RuntimeError("test computation returned a wrong result")
            result["compute_ok"] = True
            buf = torch.empty(256 * 1024, dtype=torch.float32, device=dev)
            buf.fill_(1.0)
            torch.cuda.synchronize(dev)
            del buf, x
            result["memory_ok"] = True
    except Exception as exc:  # a health check reports, it never raises
        result["error"] = f"{type(exc).__name__}: {exc}"
        logger.error("GPU health check failed on device %d: %s", device, exc)
    healthy = not result["error"]
    events.emit(
        "health_check", cause=None if healthy else "gpu", check="gpu", ok=healthy, details=result
    )
    return result


def check_nccl_health(timeout_sec: float = 10.0, group: Any = None) -> bool:
    """Check collective communication health via a lightweight all-reduce.

    Works on any backend (NCCL on CUDA, gloo on CPU). The all-reduce is issued
    asynchronously and waited for with ``Work.wait(timeout=timedelta(seconds=timeout_sec))``
    (as KempnerForge does; gloo and NCCL both enforce it), so a peer that never joins
    makes this return False when ``timeout_sec`` passes instead of hanging for the process
    group's own timeout. After a False the group must be considered broken (a collective
    is left pending): abort or destroy it before further use. Without an initialised
    process group there is nothing to check and the answer is True.

    Returns:
        True if the all-reduce succeeded with the right sum, False on timeout or error.
    """
    require_number("check_nccl_health.timeout_sec", timeout_sec, exclusive_minimum=0)
    if not is_distributed():
        return True
    start = time.monotonic()
    cause: str | None = None
    backend = "unknown"
    try:
        backend = str(dist.get_backend(group))
        device = backend_device(group)
        t = torch.ones(1, device=device)
        work = dist.all_reduce(t, async_op=True, group=group)
        try:  # a backend reports the timeout by raising, or (older ones) returning False
            done = work is None or work.wait(timeout=timedelta(seconds=timeout_sec)) is not False
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            done = False
        if not done:
            cause = "timeout"
        elif float(t.item()) != float(dist.get_world_size(group)):
            cause = "wrong_result"
    except Exception as exc:  # report, never raise
        cause = f"error: {type(exc).__name__}: {exc}"
    ok = cause is None
    elapsed = time.monotonic() - start
    if not ok:
        logger.error("collective health check failed after %.2fs: %s", elapsed, cause)
    events.emit(
        "health_check",
        cause=cause,
        check="collective",
        ok=ok,
        details={"backend": backend, "seconds": round(elapsed, 4)},
    )
    return ok
