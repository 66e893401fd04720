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


# ---------------------------------------------------------------------- fail_at
def test_fault_kinds_name_their_detecting_events():
    from steadfast.events import EVENT_KINDS
    from steadfast.faults import FaultKind

    for kind in FaultKind:
        assert kind.detected_by and set(kind.detected_by) <= set(EVENT_KINDS), kind
        assert kind.recovery in ("restart", "in_place", "reported", "stopped")


def test_fail_at_fires_once_per_run_with_a_marker_dir(tmp_path: Path, event_log: Path):
    from steadfast.faults import FaultKind, InjectedFaultError, fail_at

    first = fail_at(1, 3, FaultKind.EXCEPTION, once_dir=tmp_path / "once")
    assert not first.check(3, rank=0)  # another rank
    assert not first.check(2, rank=1)  # another step
    with pytest.raises(InjectedFaultError):
        first.check(3, rank=1)
    assert not first.check(3, rank=1)  # once in this process
    again = fail_at(1, 3, "exception", once_dir=tmp_path / "once")  # a restarted process
    assert not again.check(3, rank=1)
    [event] = [json.loads(x) for x in event_log.read_text().splitlines()]
    assert (event["kind"], event["fault"], event["rank"], event["step"]) == (
        "fault_injected", "exception", 1, 3)  # fmt: skip


def test_a_nan_burst_lasts_its_length_across_a_rollback():
    from steadfast.faults import parse_fault

    burst = parse_fault("nan_burst:0:5:3")
    seen = [burst.check(step, rank=0) for step in (4, 5, 6, 2, 3, 5)]  # rolled back to 2
    assert seen == [False, True, True, True, False, False]


def test_process_faults_act(tmp_path: Path):
    code = (
        "import sys\nfrom steadfast.faults import fail_at\n"
        "fail_at(0, 1, sys.argv[1]).check(1, rank=0)\nprint('survived')"
    )
    for kind, expected in (
        ("rank_killed", -signal.SIGKILL),
        ("exit", 3),
        ("sigterm", -signal.SIGTERM),
    ):
        proc = subprocess.run([sys.executable, "-c", code, kind], capture_output=True, timeout=60)
        assert proc.returncode == expected, (kind, proc.stderr)


def test_bad_fault_specs_name_the_spec():
    from steadfast.faults import parse_fault

    for spec, match in (
        ("rank_sad:1:2", "not a fault kind"),
        ("rank_killed:1", "KIND:RANK:STEP"),
        ("rank_killed:x:2", "integers"),
        ("nan_burst:1:2:0", "length"),
        ("rank_killed:1:2:3", "has no length"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_fault(spec)


def test_bad_fault_options_name_the_option():
    from steadfast.faults import fail_at

    with pytest.raises(ConfigError, match="exit_code"):
        fail_at(0, 1, "exit", exit_code=256)  # would exit 0
    with pytest.raises(ConfigError, match="freeze"):
        fail_at(0, 1, "exception", freeze=True)
