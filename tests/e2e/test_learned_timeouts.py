"""Hang detection with nothing configured: learned timeouts (issue 30, monitor/learned.py).

Two ranks under ``steadfast launch`` with no timeout given run learn_loop.py: a 0.2 s
step and an all-reduce, one heartbeat per step (and, in the NVRx section pattern, each
phase in a section of its own). A hang is caught within seconds of the learned timeout
instead of NVRx's default 45 minutes; the operations a learned timeout gets wrong (a
checkpoint save 20x a step, an evaluation 50x, steps slowing down 3x) raise no false
hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfharness import assert_none_left

SCRIPT = Path(__file__).with_name("learn_loop.py")
sys.path.insert(0, str(SCRIPT.parent))
from learn_loop import expected, pace  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp_path: Path, *script: str, restarts: int = 0) -> list[dict]:
    """learn_loop.py under the launcher with nothing configured; its events."""
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
        "--nproc-per-node=2", f"--max-restarts={restarts}", f"--run-dir={run}",
        str(SCRIPT), "--out", str(tmp_path / "out.txt"), *script,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("STEADFAST_EVENTS", None)  # --run-dir decides
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_none_left(str(tmp_path))
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _learned(tmp_path: Path) -> dict[str, dict]:
    return json.loads((tmp_path / "run" / "learned_timeouts.json").read_text())["kinds"]


@pytest.mark.parametrize("shape", ["heartbeats", "sections"])
def test_a_hang_is_caught_within_seconds_with_nothing_configured(tmp_path: Path, shape: str):
    """A 0.2 s/step job hangs at step 40: caught <= 10 s after the hang (by the learned
    timeout: the floor, 5 s, over 3x a step), restarted, and the run ends with the
    fault-free result."""
    extra = ["--sections"] if shape == "sections" else []
    evs = _run(tmp_path, "--hang-step", "40", "--steps-after", "5", *extra, restarts=1)
    injected = [e for e in evs if e["kind"] == "fault_injected"]
    hung = [e for e in evs if e["kind"] == "rank_hung"]
    assert [e["fault"] for e in injected] == ["rank_hung"]
    assert hung and hung[0]["learned"] is True, hung
    assert hung[0]["cause"] == ("section:step" if extra else "heartbeat")
    caught = hung[0]["time"] - injected[0]["time"]
    assert caught <= 10.0, caught
    assert [e["cause"] for e in evs if e["kind"] == "restart"] == ["worker_failure"]
    assert float((tmp_path / "out.txt").read_text()) == expected(5)
    # kept for the job's next launch: the kind the hang was caught by is back on its
    # default until seen 8 times again (the restart ran 5 steps), and at least as long
    # as the interval that was cut
    kept = _learned(tmp_path)[hung[0]["cause"]]
    assert kept["count"] < 8 and kept["longest"] >= hung[0]["elapsed"] - 0.01, kept


def test_checkpoints_and_evaluations_many_steps_long_are_no_hang(tmp_path: Path):
    """A checkpoint save 20x a step every 15 steps and an evaluation 50x a step every
    30, each in its section: the step's and the time out of sections' timeouts are
    learned (and in force) by the first save; no false hang."""
    evs = _run(tmp_path, "--sections", "--steps", "32", "--ckpt-every", "15", "--eval-every", "30")
    assert not [e for e in evs if e["kind"] in ("rank_hung", "rank_failed")]
    assert float((tmp_path / "out.txt").read_text()) == expected(32)
    kept = _learned(tmp_path)
    assert kept["section:step"]["count"] >= 8 and kept["out_of_section"]["count"] >= 8, kept
    assert kept["section:checkpoint"]["count"] >= 1  # the second save: the first warms up


def test_steps_that_slow_down_3x_gradually_are_no_hang(tmp_path: Path):
    """Steps from 0.05 s to 0.149 s over 100 steps (step k sleeps 0.05 * (1 + 2k/100)),
    heartbeats only: the learned timeout follows the longest step; no false hang."""
    evs = _run(tmp_path, "--steps", "100", "--step-seconds", "0.05", "--slowdown", "3")
    assert not [e for e in evs if e["kind"] in ("rank_hung", "rank_failed")]
    assert float((tmp_path / "out.txt").read_text()) == expected(100)
    kept = _learned(tmp_path)
    # an interval holds a whole step's sleep, so the longest is at least the sleep of
    # the last step kept (the kept record may end a step or two before the run does)
    count = kept["heartbeat"]["count"]
    last_kept_sleep = pace(0.05, 3, count - 1, 100)
    assert count >= 90 and kept["heartbeat"]["longest"] >= last_kept_sleep, kept
