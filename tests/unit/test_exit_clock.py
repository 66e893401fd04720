"""The watcher's exit clock (``steadfast.monitor.exits``): the agent learns that a worker
ended from the template before the watcher thread has run on a busy machine; the exit
times it reads must still hold every exit that happened (seen under ``make soak``: a
``succeeded`` generation whose last exit had no time)."""

from __future__ import annotations

import select
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from steadfast.monitor.exits import ExitClock


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kill and reap it, as the template reaps its workers: gone at once."""
    proc.kill()
    proc.wait()


@pytest.fixture
def followed() -> Iterator[tuple[ExitClock, select.poll, list[subprocess.Popen[bytes]]]]:
    """Two running workers of generation 1, followed by a clock."""
    clock, poll = ExitClock(), select.poll()
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    clock.new_generation(1)
    clock.follow(poll, {0: procs[0].pid, 1: procs[1].pid}, 1)
    yield clock, poll, procs
    for proc in procs:
        _end(proc)
    clock.close(poll)


def test_times_waits_for_the_thread_to_take_in_an_exit_that_happened(followed) -> None:
    clock, poll, procs = followed
    _end(procs[1])
    assert clock.times(settle=0) == {}  # rank 1 is gone, its exit not taken in...

    def late_thread() -> None:  # ...because the watcher thread runs 0.3 s behind
        time.sleep(0.3)
        clock.take(poll, [fd for fd, _ in poll.poll(1000)], time.monotonic())

    behind = threading.Thread(target=late_thread)
    asked = time.monotonic()
    behind.start()
    times = clock.times()
    behind.join()
    assert list(times) == [1] and times[1] >= asked + 0.3  # waited for it, not None


def test_a_generation_the_thread_has_not_followed_yet_is_waited_for_within_the_bound() -> None:
    clock, poll = ExitClock(), select.poll()
    proc = subprocess.Popen(["sleep", "60"])
    _end(proc)
    clock.new_generation(2)
    start = time.monotonic()
    assert clock.times(settle=0.2) == {}  # nothing followed: the bound ends the wait
    assert time.monotonic() - start >= 0.2
    clock.follow(poll, {0: proc.pid}, 2)  # already gone when followed: exits now
    assert list(clock.times(settle=0)) == [0]
    clock.close(poll)


def test_a_stopped_generation_keeps_the_exits_taken_in_and_takes_no_more(followed) -> None:
    clock, poll, procs = followed
    _end(procs[0])
    clock.take(poll, [fd for fd, _ in poll.poll(1000)], time.monotonic())
    clock.new_generation(2, keep=True)  # the agent stops the rest
    clock.follow(poll, {}, 2)
    _end(procs[1])
    assert list(clock.times()) == [0]  # rank 0's exit is kept; none of gen 1 is added
