"""The demo end to end under steadfast launch: 2 gloo ranks, a NaN, a killed rank and its
in-job restart, a real SIGTERM, a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_detects_recovers_and_matches_bit_for_bit(tmp_path: Path):
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "demo", "--workdir", str(work), "--steps", "24",
         "--save-every", "8", "--nan-steps", "5", "--kill-at", "10", "--sigterm-at", "13",
         "--step-sleep", "0.05"],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "final parameters equal the fault-free run bit for bit: YES" in out
    assert "all 2 ranks stopped after the same step: yes" in out
    evs = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines()]
    nan = [e for e in evs if e["kind"] == "nan_detected"]
    assert [(e["rank"], e["step"]) for e in nan] == [(1, 5)]  # detected where injected
    killed = [e for e in evs if e["kind"] == "rank_failed" and e["cause"] == "signal SIGKILL"]
    assert [e["rank"] for e in killed] == [1]
    assert [e["restart_count"] for e in evs if e["kind"] == "restart"] == [1]
    # the demo's SIGTERM reached rank 1 after the restart (rank 0's came from the launcher
    # stopping the survivors of the kill)
    assert 1 in [e["rank"] for e in evs if e["kind"] == "shutdown_requested"]
    stops = {
        e["rank"]: e["step"] for e in evs if e["kind"] == "job_end" and e["cause"] == "shutdown"
    }
    assert len(stops) == 2 and len(set(stops.values())) == 1
    resumed = [e for e in evs if e["kind"] == "job_start" and e["resumed_from"]]
    assert len(resumed) == 4  # after the in-job restart, and after the stop
    assert resumed[0]["resumed_from"].endswith("step_8")  # the checkpoint before the kill
    assert resumed[-1]["resumed_from"].endswith(f"step_{stops[0]}")  # resumed where it stopped


def test_demo_rejects_bad_sigterm_step(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "demo", "--workdir", str(tmp_path / "d"),
         "--steps", "10", "--sigterm-at", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--sigterm-at must be between 1 and 8" in proc.stderr


def test_health_command_on_a_cpu_node():
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "health", "--allow-no-cuda"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    result = json.loads(proc.stdout)
    assert set(result) == {
        "cuda_available",
        "device_accessible",
        "compute_ok",
        "memory_ok",
        "error",
    }
    assert proc.returncode == 0
