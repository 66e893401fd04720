"""A steadfast job of someone else's runs beside the suite, as on a real node: its live
heartbeat table, memory tier, processes and sockets are not the suite's leaks, and a
leak of the suite's own is still caught and named.

The neighbour is started outside the suite's process tree (its launcher's parent exits
at once, as a job started from another shell), without the suite's tag
(``steadfast.shm``), *during* the test, and ended only after the test's own leak check
(``tests/conftest.py``'s ``no_leaks``) ran: that check must pass while it lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfharness import SUITE_TAG, children, shm_entries, shm_leaks, suite_shm, wait_for
from steadfast.monitor import HeartbeatTable
from steadfast.shm import TAG_ENV

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here"),
]

# the neighbour's script: two ranks that wait, alive, until told to stop
WAITER = """
import os, sys, time
stop, deadline = sys.argv[1], time.monotonic() + 180
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.1)
"""
# starts the launcher in a session of its own and exits: the launcher is nobody's child here
DETACH = """
import subprocess, sys
log = open(sys.argv[1], "wb")
proc = subprocess.Popen(sys.argv[2:], start_new_session=True, stdout=log, stderr=log)
print(proc.pid)
"""


class Neighbour:
    """One job of someone else's: started by :meth:`start`, stopped by :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stop_file = root / "stop"
        self.pid: int | None = None

    def start(self) -> None:
        (self.root / "waiter.py").write_text(WAITER)
        env = {k: v for k, v in os.environ.items() if k != TAG_ENV and k != "STEADFAST_EVENTS"}
        cmd = [
            sys.executable, "-m", "steadfast.cli", "launch", "--standalone",
            "--nproc-per-node=2", f"--run-dir={self.root / 'run'}",
            str(self.root / "waiter.py"), str(self.stop_file),
        ]  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", DETACH, str(self.root / "launcher.log"), *cmd],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        self.pid = int(out.stdout)

    def alive(self) -> bool:
        return self.pid is not None and Path(f"/proc/{self.pid}").exists()

    def stop(self) -> None:
        if self.pid is None:
            return
        self.stop_file.touch()
        deadline = time.monotonic() + 60
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():  # not expected: its whole session goes, nothing is left behind
            os.killpg(self.pid, signal.SIGKILL)
            wait_for(lambda: not self.alive(), 10, "the neighbour launcher to go")
            pytest.fail(f"the neighbour job did not end:\n{self.log()}")

    def log(self) -> str:
        path = self.root / "launcher.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def neighbour(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Neighbour]:
    """Stopped at the module's end: after the test's leak check, which ran beside it."""
    job = Neighbour(tmp_path_factory.mktemp("neighbour"))
    yield job
    job.stop()


def _theirs(before: set[str]) -> set[str]:
    return {n for n in shm_entries() - before if n.startswith("steadfast-") and SUITE_TAG not in n}


def test_a_neighbour_jobs_live_segments_are_not_the_suites_and_a_leak_of_its_own_is(
    neighbour: Neighbour,
) -> None:
    before = shm_entries()
    neighbour.start()
    # its heartbeat table (with its wake channel and its two rows' ask channels) and its
    # memory tier appear in /dev/shm while it runs
    wait_for(
        lambda: (
            any(n.startswith("steadfast-hbask-") for n in _theirs(before))
            and any(n.startswith("steadfast-mem-") for n in _theirs(before))
        ),
        60,
        "the neighbour's heartbeat table and memory tier",
    )
    assert neighbour.alive(), neighbour.log()
    theirs = _theirs(before)
    assert {n.split("-")[1] for n in theirs} >= {"hb", "hbwake", "hbask", "mem"}, theirs
    assert neighbour.pid not in children(os.getpid())  # nobody's child here
    # the leak check counts none of it, even where the neighbour's pid is one the suite
    # once had (pids are reused: a rank of an earlier test may have had it) ...
    assert shm_leaks(before, {os.getpid()}) == set()
    assert shm_leaks(before, {os.getpid(), neighbour.pid or 0}) == set()
    # ... and still catches and names what this session made and did not remove
    table = HeartbeatTable.create(rows=1)
    try:
        assert SUITE_TAG in table.path.name
        leaked = shm_leaks(before, {os.getpid()})
        assert table.path.name in leaked and leaked == suite_shm() - before, leaked
    finally:
        table.close()
    assert shm_leaks(before, {os.getpid()}) == set()
    assert neighbour.alive(), neighbour.log()  # still running for the leak check after this
