"""Fault simulation (Megatron Bridge names): the process really stops or dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadfast import ConfigError, setup_simulated_fault

_RANK = """
import sys, time
from steadfast import setup_simulated_fault
f = setup_simulated_fault(simulate_fault=True, simulated_fault_type=sys.argv[1],
                          simulated_fault_rank=0, simulated_fault_base_delay=0.2,
                          extra_delay_max=0.1)
print(f.fault_type, f.rank, flush=True)
time.sleep(30)
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("fault_type", ["rank_killed", "rank_hung"])
def test_simulated_fault_fires(event_log: Path, fault_type: str):
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK, fault_type],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RANK="0", WORLD_SIZE="2"),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().split() == [fault_type, "0"]
        if fault_type == "rank_killed":
            assert proc.wait(10) == -signal.SIGKILL
        else:
            deadline = time.monotonic() + 10
            while _state(proc.pid) != "T":  # stopped, as a hung rank looks from outside
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    [event] = [json.loads(line) for line in event_log.read_text().splitlines()]
    assert event["kind"] == "fault_injected" and event["fault"] == fault_type


def test_random_type_and_rank_are_chosen_and_validated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert setup_simulated_fault(simulate_fault=False) is None
    fault = setup_simulated_fault(
        simulate_fault=True, simulated_fault_rank=3, seed=5, simulated_fault_base_delay=60
    )
    assert fault is not None and fault.fault_type in ("rank_hung", "rank_killed")
    assert fault.rank == 3 and fault.timer is None  # armed only on the failing rank
    assert 60 <= fault.delay <= 61
    with pytest.raises(ConfigError, match="simulated_fault_type"):
        setup_simulated_fault(simulate_fault=True, simulated_fault_type="rank_sad")
    with pytest.raises(ConfigError, match="not a rank of this 4-rank job"):
        setup_simulated_fault(simulate_fault=True, simulated_fault_rank=4)
