"""`steadfast watch` driven in a real terminal: a tmux of the test's own (its own server
socket, removed afterwards) runs it beside a real run of `examples/train.py` with a rank
killed mid-run, and the test reads the screen: the nodes and ranks, the steps going up,
goodput, the fault with its culprit, and the run's end, redrawn in place (the header
once, never scrolled)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sfharness import wait_for
from steadfast.report import compute_report, load_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"


class Terminal:
    """A tmux server and session of this test's own, 120 x 30."""

    def __init__(self, command: list[str]) -> None:
        if shutil.which("tmux") is None:
            if IN_CI:
                pytest.fail("tmux is not installed; CI must drive steadfast watch in it")
            pytest.skip("tmux is not installed (`make test` installs it)")
        self.socket = f"sf-watch-{uuid.uuid4().hex[:8]}"
        cmd = " ".join(subprocess.list2cmdline([c]) for c in command)
        self.tmux("new-session", "-d", "-s", "watch", "-x", "120", "-y", "30", cmd)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "watch")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _steps(screen: str) -> int:
    for line in screen.splitlines():
        if line.startswith("job "):
            return int(line.split("steps ")[1].split()[0].replace(",", ""))
    return -1


def test_watch_shows_a_running_job_and_its_fault_in_a_real_terminal(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    launch = subprocess.Popen(
        [sys.executable, "-m", "steadfast.cli", "launch", "--standalone", "--nproc-per-node=2",
         "--max-restarts=3", "--run-dir", str(run), str(TRAIN),
         "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "40", "--save-every", "5",
         "--step-sleep", "0.2", "--fault", "rank_killed:1:15"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    term = Terminal([sys.executable, "-m", "steadfast.cli", "watch", str(run),
                     "--interval", "0.5"])  # fmt: skip
    try:
        wait_for(lambda: _steps(term.screen()) > 0, timeout=120, what="steps on the screen")
        first = _steps(term.screen())
        wait_for(lambda: _steps(term.screen()) > first, timeout=60, what="the steps going up")
        wait_for(lambda: "rank_failed" in term.screen(), timeout=120, what="the fault")
        out, _ = launch.communicate(timeout=240)
        assert launch.returncode == 0, out[-3000:]
        wait_for(lambda: "a launcher ended: exit 0" in term.screen(), timeout=30,
                 what="the run's end")  # fmt: skip
        screen = term.screen()
        assert screen.count("steadfast watch") == 1  # redrawn in place, not scrolled
        assert "2 ranks" in screen and "goodput" in screen
        (fault,) = [line for line in screen.splitlines() if "rank_failed" in line]
        assert "rank 1" in fault and "SIGKILL" in fault, screen
        assert _steps(screen) >= 40
        assert all(len(line) <= 120 for line in screen.splitlines())
        # the goodput on the screen at the end is the report's, to the digit shown
        report = compute_report(*load_events(run))
        shown = re.search(r"goodput (\S+) %", screen)
        assert shown and shown.group(1) == f"{100 * report.goodput:.1f}", (screen, report)
    finally:
        term.close()
        if launch.poll() is None:
            launch.kill()
            launch.communicate()
