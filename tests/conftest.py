"""Shared fixtures: a per-test event log, and a leak check that runs around every test."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sfharness import (
    SPAWNED,
    children,
    shm_entries,
    shm_leaks,
    socket_count,
    start_template,
    stop_template,
)
from steadfast import events


@pytest.fixture(scope="session", autouse=True)
def rank_template() -> Iterator[int | None]:
    """The session's rank template (sfharness): the process that forks the test ranks,
    started before the first test so every leak check sees it already there."""
    pid = start_template()
    yield pid
    stop_template()


@pytest.fixture(autouse=True)
def no_leaks(rank_template: int | None) -> Iterator[None]:
    """Fail a test that leaves a child process, thread, socket or /dev/shm segment behind
    (a rank forked by the session's template counts as the test's own child). Only the
    test's own /dev/shm entries count (see :func:`sfharness.shm_leaks`): another program
    on the machine may make and remove its own at any time."""
    threads_before = set(threading.enumerate())
    sockets_before = socket_count()
    shm_before = shm_entries()
    own = {os.getpid(), *([rank_template] if rank_template is not None else [])}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        kids = children(os.getpid()) - {rank_template}
        if rank_template is not None:
            kids |= children(rank_template)
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        sockets = socket_count() - sockets_before
        shm = shm_leaks(shm_before, own | kids | SPAWNED)
        if not (kids or threads or sockets > 0 or shm) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if kids:  # named, then killed: one leak fails its own test, not every later one
        named = {pid: _command_line(pid) for pid in sorted(kids)}
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"child processes left behind (now killed): {named}")
    assert not threads, f"threads left behind: {[t.name for t in threads]}"
    assert sockets <= 0, f"{sockets} socket(s) left open"
    assert not shm, f"shared-memory segments left behind: {sorted(shm)}"


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


@pytest.fixture(autouse=True)
def event_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Route every test's events (and its children's) to a fresh file, never the repo."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    yield path
    events.set_default_path(None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``), the tests that
    share something machine-wide run in one worker, one after another:
    ``tests/slurm`` (one Slurm cluster per session, on Slurm's fixed ports) and
    ``tests/multinode`` (each test runs a bed of several launchers: two at once would
    mostly wait for each other's CPU)."""
    for item in items:
        parts = Path(str(item.path)).relative_to(Path(__file__).parent).parts
        if parts[0] in ("slurm", "multinode"):
            item.add_marker(pytest.mark.xdist_group(parts[0]))
