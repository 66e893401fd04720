"""What the re-run state machine compares and records: two results' relative difference,
the hardware a result came from, and the tracker file of rejected results and verdicts
(``result_rejected_tracker_filename``: one JSON line each, the node and device named,
for the operators and the launcher's requeue)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..dist import world_info
from .config import HARDWARE_ID_ENV

__all__ = ["as_scalar", "hardware_id", "is_inf", "is_nan", "relative_difference", "track"]


def relative_difference(a: float, b: float) -> float:
    """``|(a - b) / (a + b) * 2|``; 0 when equal or both NaN; inf when one is not finite."""
    a, b = float(a), float(b)
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if a + b == 0:
        return math.inf
    return abs((a - b) / (a + b) * 2)


def hardware_id() -> str:
    """This process's hardware: its host and device (``$STEADFAST_RERUN_HARDWARE_ID``
    where set: the tests' way to fake a move)."""
    override = os.environ.get(HARDWARE_ID_ENV)
    if override:
        return override
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            index = torch.cuda.current_device()
            device = f"cuda:{index}:{torch.cuda.get_device_properties(index).uuid}"
    except Exception:
        pass
    return f"{socket.gethostname()}/{device}"


def as_scalar(result: Any) -> float:
    """A loss (a number or a 1-element tensor, maybe with a graph) as a float."""
    return float(result.detach() if hasattr(result, "detach") else result)


def is_nan(value: Any) -> bool:
    return math.isnan(as_scalar(value))


def is_inf(value: Any) -> bool:
    return math.isinf(as_scalar(value))


def track(
    path: str | None, iteration: int, result: float | None, message: str, status: str
) -> None:
    """One line in the tracker file ``path`` (none without one)."""
    if not path:
        return
    record = {
        "time": time.time(),
        "node": socket.gethostname(),
        "device": hardware_id(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "rank": world_info().rank,
        "iteration": iteration,
        "status": status,
        "result": result,
        "message": message,
    }
    with open(Path(path), "a") as fh:
        fh.write(json.dumps(record) + "\n")
