"""KempnerForge's resilience API, called as its users call it (seed 000), on steadfast.

Each test is ours: it calls the name the way KempnerForge's code and docs do and checks
the result against KempnerForge's documented behaviour (its own tests are run against
steadfast outside the repository; see the README's "coming from" table)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from sfharness import run_ranks
from steadfast import NaNDetector, check_nccl_health
from steadfast.dist import NCCL_ASYNC_ERROR_HANDLING, barrier_with_timeout, set_nccl_env


def test_a_bad_nan_action_is_kempnerforges_value_error() -> None:
    with pytest.raises(ValueError, match="Invalid NaN action"):
        NaNDetector(action="invalid")


def _collectives(rank: int, world: int, workdir: Path) -> dict[str, object]:
    """Both ranks: a barrier and a health check that succeed; then rank 1 stays away
    and rank 0's barrier and health check fail within their own short timeouts."""
    out: dict[str, object] = {}
    barrier_with_timeout(30.0, reason="smoke")
    out["health_ok"] = check_nccl_health(timeout_sec=30.0)
    if rank == 1:
        time.sleep(4.0)  # away: rank 0's next collectives time out
        return out
    t0 = time.monotonic()
    try:
        barrier_with_timeout(0.5, reason="DeviceMesh construction")
    except RuntimeError as exc:
        out["barrier_error"] = str(exc)
    out["barrier_seconds"] = time.monotonic() - t0
    return out


def test_per_operation_timeouts_on_a_real_group(tmp_path: Path) -> None:
    zero, one = run_ranks(_collectives, tmp_path, 2, timeout=60)
    assert zero["health_ok"] is True and one["health_ok"] is True
    assert "DeviceMesh construction" in str(zero["barrier_error"])
    assert "timed out after 0.5s" in str(zero["barrier_error"])
    assert float(str(zero["barrier_seconds"])) < 3.0  # its own timeout, not the group's


def test_nccl_async_error_handling_guard(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    monkeypatch.delenv(NCCL_ASYNC_ERROR_HANDLING, raising=False)
    set_nccl_env()
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING] == "1"  # a stuck collective fails
    monkeypatch.setenv(NCCL_ASYNC_ERROR_HANDLING, "0")
    with caplog.at_level(logging.WARNING, logger="steadfast.dist"):
        set_nccl_env()
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING] == "0"  # the user's choice is kept
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in caplog.text
