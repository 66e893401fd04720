"""What a launcher says of a worker that outlived the job's end: whether that process
still ran (and where it waited), or had exited without the launcher learning it (issue
36 asked which it was: the event now says)."""

from __future__ import annotations

import subprocess

from sfharness import wait_for
from steadfast.launcher.job_end import process_state


def test_a_worker_is_told_running_zombie_or_gone():
    child = subprocess.Popen(["sleep", "30"])
    try:
        seen: list[tuple[str, str | None]] = []  # one read: a second may catch it awake
        wait_for(lambda: seen.append(process_state(child.pid)) or seen[-1][1] is not None,
                 timeout=10, what="asleep")  # fmt: skip
        state, wchan = seen[-1]
        assert state == "running" and wchan  # asleep in the kernel: where it waits
        child.kill()
        # killed, not yet reaped by its parent (this process): the launcher's view of a
        # worker the template never reaped
        wait_for(lambda: process_state(child.pid)[0] == "zombie", timeout=10, what="zombie")
    finally:
        child.kill()
        child.wait()
    # reaped: no such process any more
    assert process_state(child.pid) == ("gone", None)
