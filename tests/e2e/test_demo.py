"""``steadfast demo --quick`` end to end: under steadfast launch, a NaN burst and its
rollback, a killed rank and a hung rank (in-job restarts), a slowed rank (straggler
report) and a SIGTERM (stop and resume); the report shows every fault detected and
recovered, the timeline picture is written, and the final parameters are bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sffigures

REPO = Path(__file__).resolve().parents[2]
MEASURE = REPO / "tests" / "docs" / "clean_end"  # its sitecustomize measures each process


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_demo_detects_and_recovers_every_fault_bit_exact(tmp_path: Path):
    work = tmp_path / "demo"
    measure = tmp_path / "measured"  # each process's life, rank 0's steps (sffigures)
    measure.mkdir()
    path = os.pathsep.join(filter(None, [str(MEASURE), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "demo", "--quick", "--workdir", str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": path, "STEADFAST_DOCS_MEASURE": str(measure)},
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "every injected fault (5) was detected and recovered" in out
    assert "final parameters equal the fault-free run bit for bit: YES" in out
    assert "demo: PASSED" in out
    picture = work / "run" / "timeline.png"
    assert picture.read_bytes()[:4] == b"\x89PNG" and picture.stat().st_size > 10_000
    evs = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines()]

    def kinds(kind: str) -> list[dict]:
        return [e for e in evs if e["kind"] == kind]

    faults = {e["fault"]: e for e in kinds("fault_injected")}
    assert set(faults) == {"nan_burst", "rank_killed", "rank_hung", "slow_rank", "sigterm"}
    assert all(e["rank"] == 1 for e in faults.values())
    burst = faults["nan_burst"]["step"]
    nan = [(e["rank"], e["step"]) for e in kinds("nan_detected")]
    assert nan == [(1, burst), (1, burst + 1), (1, burst + 2)]  # detected where injected
    (rollback,) = {e["to_step"] for e in kinds("rollback")}
    # to the newest snapshot before the burst, the state after step burst-1 (the demo
    # runs the memory tier): the burst is done again, as designed
    assert rollback <= burst
    killed = [e for e in kinds("rank_failed") if e["cause"] == "signal SIGKILL"]
    assert killed[0]["rank"] == 1
    hung = kinds("rank_hung")  # one fault, its culprit rank 1: rank 0 only waited for it
    assert [e["rank"] for e in hung] == [1] and hung[0]["cause"] == "section:step"
    [confirmed] = kinds("hang_confirmed")
    assert confirmed["culprit"] == 1 and confirmed["where"].startswith("_strike (faults.py")
    assert [ranks for ranks in confirmed["waiting"].values()] == [[0]], confirmed
    assert [e["restart_count"] for e in kinds("restart")] == [1, 2]
    assert any(1 in e["ranks"] for e in kinds("straggler_detected"))
    assert [e["rank"] for e in kinds("shutdown_requested") if e["rank"] == 1]
    stops = {e["rank"]: e["step"] for e in kinds("job_end") if e["cause"] == "shutdown"}
    assert len(stops) == 2 and len(set(stops.values())) == 1  # both after the same step
    report = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", str(work / "run"), "--json",
         "--no-timeline"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    summary = json.loads(report.stdout)
    assert summary["all_recovered"] and 0 < summary["goodput"] < 1
    assert summary["badput"]["wasted_progress"] > 0 and summary["badput"]["restart"] > 0
    # every restore proven by replay (the kill's, the hang's, the SIGTERM's resume), and
    # what the proofs cost is in the report
    assert not kinds("restore_mismatch") and not kinds("restore_unverified")
    assert len(kinds("restore_verified")) == 3
    proofs = [r["proof"] for r in summary["restarts_phases"]]
    assert [p["status"] for p in proofs] == ["verified"] * 3
    # the kill's and the hang's by replay (steps re-done); the requeue's (the memory
    # tier left with the old launcher) by the ledger, none re-done: the kill's proof
    # was a replay, with the same keys
    assert all(p["proof_steps"] >= 1 and p["proof_seconds"] > 0 for p in proofs[:2]), proofs
    assert proofs[2]["route"] == "ledger" and proofs[2]["proof_steps"] == 0, proofs
    assert "restores proven: 3 of 3" in out
    # the figures the user reads are what the test measured: the wall time, one latency
    # for each fault (the launchers' table and the injected faults'), "other" no bulk
    wrong, measured = sffigures.check_run(work / "run" / "events.jsonl",
                                          sffigures.measured(measure))  # fmt: skip
    assert measured and not wrong, wrong
    assert summary["badput"]["other"] <= sffigures.OTHER_SHARE * summary["wall_time"], summary


def test_demo_rejects_an_unknown_fault(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "demo", "--workdir", str(tmp_path / "d"),
         "--faults", "nan,meteor"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--faults: unknown meteor; choose from nan, kill, hang, slow, sigterm" in proc.stderr


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
