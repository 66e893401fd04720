"""Shared fixtures: a per-test event log, and a leak check that runs around every test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sfharness import (
    COV_CONTEXT_ENV,
    SPAWNED,
    children,
    cover_as,
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
    spawned_before = set(SPAWNED)  # an earlier test's rank's pid may be another's now
    yield
    deadline = time.monotonic() + 5.0
    while True:
        kids = children(os.getpid()) - {rank_template}
        if rank_template is not None:
            kids |= children(rank_template)
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        sockets = socket_count() - sockets_before
        shm = shm_leaks(shm_before, own | kids | (SPAWNED - spawned_before))
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


#: the folders whose tests share something machine-wide: ``tests/slurm`` (one Slurm
#: cluster per session, on Slurm's fixed ports) and ``tests/multinode`` (each test runs a
#: bed of several launchers: two at once would mostly wait for each other's CPU)
ONE_WORKER = ("slurm", "multinode")

#: the folder that mostly waits (on Slurm's timers: a node declared DOWN, a requeue; 2-5
#: CPU-s in a 30-90 s test): given a third worker, it has that worker to itself, beside
#: two for the rest, which is CPU-bound on two cores
WAITS = "slurm"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n N``), the tests of each folder of :data:`ONE_WORKER` run
    in one worker, one after another; every other test goes wherever a worker is free.
    With three workers or more, the worker that runs :data:`WAITS` runs nothing else and
    ends with it: its waits overlap the CPU-bound rest instead of taking a CPU-bound
    worker's turn. A scheduler of our own, not ``--dist loadgroup``: that one marks a
    group in each test's id, which pytest 9.2's structured ids silently ignore
    (pytest-xdist#1386: every test then goes anywhere, and two workers started two Slurm
    clusters on the same ports)."""
    from xdist.scheduler import LoadScopeScheduling

    class MachineWide(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/", 2)
            if len(parts) == 3 and parts[0] == "tests" and parts[1] in ONE_WORKER:
                return f"tests/{parts[1]}"
            return nodeid

        def _assign_work_unit(self, node: Any) -> None:
            waits = f"tests/{WAITS}"
            if len(self.nodes) >= 3 and waits in self.workqueue:  # the first to ask
                self.workqueue.move_to_end(waits, last=False)
                super()._assign_work_unit(node)
                node.shutdown()  # it has all it will get: it runs that, then ends
                return
            super()._assign_work_unit(node)

    return MachineWide(config, log)


# The quick tier's measurement (scripts/quick_tier.py measure) sets these: each test's
# code, in this process and in every process it starts, is covered under the test's id,
# and each test's seconds (setup, call and teardown) are written at the end.
TIMES_ENV = "STEADFAST_TEST_TIMES"
_seconds: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if COV_CONTEXT_ENV not in os.environ:
        return
    os.environ[COV_CONTEXT_ENV] = item.nodeid  # read by each process coverage starts in
    cover_as(item.nodeid)


#: make pytest's folder for what a failed run keeps (scripts/pytest-kept.sh)
RESULTS_ENV = "STEADFAST_TEST_RESULTS"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if TIMES_ENV in os.environ:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    folder = os.environ.get(RESULTS_ENV)
    # written by the main process alone (xdist's workers send it their reports), as each
    # fails: a run cut short (CI's limit, a kill) keeps the names
    if folder and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
        why = str(crash or report.longrepr or "").strip().splitlines()[:1]
        line = f"{report.nodeid} ({report.when})" + (f": {why[0][:200]}" if why else "")
        with open(Path(folder, "failed.txt"), "a") as fh:
            fh.write(line + "\n")
        with open(Path(folder, "failures.log"), "a") as fh:  # the whole of each, as it came
            fh.write(f"===== {line}\n{report.longreprtext}\n")


# What each test costs in CPU (scripts/test_cpu.py reads it): STEADFAST_TEST_CPU=DIR
# makes each pytest process write DIR/cpu-<worker>.json, each test's CPU seconds (user and
# system, of this process and of every process it started and reaped: the launchers and
# their templates and ranks; not a Slurm job's, whose processes are slurmd's) and wall
# seconds, setup and teardown included, and when it started (seconds since the epoch:
# what ran beside what, and which worker waited at the end). Most of the suite is
# CPU-bound on two cores (the Slurm folder mostly waits): this says where its CPU goes.
CPU_ENV = "STEADFAST_TEST_CPU"
_cpu: dict[str, tuple[float, float, float]] = {}


def _cpu_seconds() -> float:
    import resource

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if CPU_ENV not in os.environ:
        yield
        return
    cpu, wall, start = _cpu_seconds(), time.monotonic(), time.time()
    yield
    _cpu[item.nodeid] = (_cpu_seconds() - cpu, time.monotonic() - wall, start)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(TIMES_ENV)
    if path and _seconds:
        Path(path).write_text(json.dumps(_seconds, indent=0, sort_keys=True))
    folder = os.environ.get(CPU_ENV)
    if folder and _cpu:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"cpu-{worker}.json").write_text(json.dumps(_cpu, indent=0, sort_keys=True))
