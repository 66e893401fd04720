"""check_gpu_health / check_nccl_health in one process (the 2-rank cases are in tests/dist)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from steadfast import ConfigError, check_gpu_health, check_nccl_health


def test_gpu_health_without_cuda_reports_it():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by test_gpu_health_keeps_current_device")
    res = check_gpu_health()
    assert res == {
        "cuda_available": False,
        "device_accessible": False,
        "compute_ok": False,
        "memory_ok": False,
        "error": "CUDA not available",
    }


def test_gpu_health_never_raises_when_the_device_is_unusable(monkeypatch, event_log: Path):
    # A CPU-only torch that claims CUDA: every device step fails, and the check reports it.
    if torch.cuda.is_available():
        pytest.skip("real CUDA present")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res = check_gpu_health(0)
    assert res["cuda_available"] is True and res["compute_ok"] is False and res["error"]
    bad = check_gpu_health(5)
    assert "invalid device ordinal 5" in str(bad["error"])
    ev = [json.loads(x) for x in event_log.read_text().splitlines()]
    assert [e["ok"] for e in ev] == [False, False] and ev[0]["check"] == "gpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_health_on_a_real_gpu():
    res = check_gpu_health(0)
    assert res == {
        "cuda_available": True,
        "device_accessible": True,
        "compute_ok": True,
        "memory_ok": True,
        "error": "",
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_health_keeps_current_device():
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    res = check_gpu_health(0)
    assert res["compute_ok"] and res["error"] == ""
    assert torch.cuda.current_device() == last


def test_collective_health_without_a_group_is_true():
    assert check_nccl_health() is True


@pytest.mark.parametrize("bad", [0, -1.0, "10", float("nan"), float("inf")])
def test_collective_health_bad_timeout(bad):
    with pytest.raises(ConfigError, match=r"check_nccl_health\.timeout_sec"):
        check_nccl_health(timeout_sec=bad)
