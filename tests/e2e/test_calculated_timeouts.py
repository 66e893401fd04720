"""Calculated timeouts are enforced no lower than ``calculated_timeout_floor`` (1 s).

NVRx's documented pattern (back-to-back ``step`` sections, then
``calculate_and_set_section_timeouts()`` with its default ``calc_out_of_section=True``)
sees microseconds outside the sections, so the calculated out-of-section timeout is a
fraction of a millisecond. steadfast's watcher wakes at the deadline itself (it does
not poll every 5 s), so before the floor the first pause outside a section, a log line,
ended a healthy rank as hung and the launcher exited 77 (found by the migration guide's
example, docs/migrating/nvrx.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfharness import assert_none_left

SCRIPT = Path(__file__).with_name("calc_loop.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_calculated_timeout_below_the_floor_ends_no_healthy_rank(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "timeouts.json"
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
        "--nproc-per-node=2", "--max-restarts=0", f"--run-dir={run}",
        # the floor this test proves enforced; 5 s, far above a 0.3 s pause even on a
        # machine whose cores are busy (the default, 1 s, is the same mechanism)
        "--ft-calculated-timeout-floor=5",
        str(SCRIPT), "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("STEADFAST_EVENTS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert_none_left(str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e for e in evs if e["kind"] in ("rank_hung", "rank_failed")] == []
    # the client still reports what it calculated (NVRx's value: state_dict, ft_state.json)
    calculated = json.loads(out.read_text())["out_of_section"]
    assert calculated is not None and calculated < 0.3, calculated
    # and says once per rank that the watcher waits the floor instead
    assert proc.stderr.count("below calculated_timeout_floor") >= 1, proc.stderr[-3000:]
