"""``make gpu-check`` (scripts/gpu-check.sh, scripts/gpu_check.py) where there is no GPU,
as on CI: one line and exit 0, nothing run; and its table and JSON, from a check that
has a CPU form (``tests/gpu`` here: every test skips without CUDA, and says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    # a PATH whose nvidia-smi finds no GPU (as on a machine with the driver's tools only)
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    fake.chmod(0o755)
    # no GPU listed; and, where the system has none, no nvidia-smi at all
    paths = [f"{tmp_path}:/usr/bin:/bin"]
    if not any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        paths.append("/usr/bin:/bin")
    for path in paths:
        done = subprocess.run(["/bin/bash", "scripts/gpu-check.sh"], cwd=REPO, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PATH": path})  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check"
        ]
        assert not (REPO / "gpu-check.json").exists() or "GPU_CHECK_OUT" in os.environ


@pytest.mark.timeout(300)
def test_the_table_and_the_json_say_what_ran(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--only", "tests",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
        env={**os.environ, "GPU_CHECK_REV": "abc1234"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["revision"] == "abc1234" and report["device"] == "cpu"
    (row,) = report["checks"]
    assert row["name"] == "tests" and row["ok"] is True
    counts = row["figures"]
    assert counts["tests"] > 0 and counts["skipped"] == counts["tests"]  # no CUDA here
    assert "steadfast gpu-check at abc1234" in done.stdout
    assert f"0 passed, 0 failed, {counts['skipped']} skipped" in done.stdout
    bad = subprocess.run([sys.executable, "scripts/gpu_check.py", "--only", "nope"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--only: no check nope" in bad.stderr
