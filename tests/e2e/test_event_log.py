"""One owner for a run's event log: the launcher decides it and every worker inherits it.

Run with ``STEADFAST_EVENTS`` unset (the other tests set it for every test, which is how
the split went unseen): the launcher's ``rank_failed`` and ``restart`` and the ranks'
``step_done`` must land in one file, and ``steadfast report`` on the run's directory
must show the failure, the restart and the steps in one report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfharness import assert_none_left
from steadfast.events import DEFAULT_EVENTS_FILE

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("STEADFAST_EVENTS", None)
    return env


def _launch(cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
        "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=0.05", *flags,
        str(TRAIN), "--ckpt-dir", str(cwd / "ckpt"), "--steps", "24", "--save-every", "5",
        "--calc-timeouts-at", "-1", "--fault", "rank_killed:1:12",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=cwd)
    assert_none_left(str(cwd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _report(path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", str(path), "--json", "--no-timeline"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_a_plain_launch_writes_one_log_that_the_report_reads(tmp_path: Path) -> None:
    _launch(tmp_path)
    logs = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    assert logs == [Path(DEFAULT_EVENTS_FILE)]  # none under the checkpoint directory
    evs = [json.loads(line) for line in (tmp_path / DEFAULT_EVENTS_FILE).open()]
    kinds = {e["kind"] for e in evs}
    assert {"rank_failed", "restart", "step_done", "job_start", "fault_injected"} <= kinds
    # the survivor went down after rank 1: recorded as stopped, not as a second fault
    assert [e["rank"] for e in evs if e["kind"] == "rank_failed"] == [1]
    assert {e["rank"] for e in evs if e["kind"] == "rank_stopped"} <= {0}
    # the backend the launcher used: one node's default is steadfast's own, not the
    # "static" torchrun's parser gives before the launcher chooses
    [start] = [e for e in evs if e["kind"] == "launcher_start"]
    assert start["rdzv_backend"] == "steadfast", start
    report = _report(tmp_path)
    [fault] = report["faults"]
    assert (fault["fault"], fault["rank"], fault["step"]) == ("rank_killed", 1, 12)
    assert fault["detected_by"] == "rank_failed" and fault["recovered"], fault
    assert report["restarts"] == 1 and report["generations"] == 2
    # killed in step 12: checkpoint 10 leaves two logged steps (10, 11), fewer than a
    # replay proof compares, so 5 is restored and the state at 10 proven equal to 10's
    assert report["steps_done"] == 24 and report["steps_redone"] == 7  # 5-11 again
    [restart] = report["restarts_phases"]
    assert restart["proof"]["status"] == "verified" and restart["proof"]["proof_steps"] == 5
