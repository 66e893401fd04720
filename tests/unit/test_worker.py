"""The checkpoint tiers' background worker: one thread kept between jobs, which ends at
close, when retired, and when idle (real threads)."""

from __future__ import annotations

import threading
import time

import pytest

from steadfast.checkpoint.worker import Worker


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_jobs_run_in_order_on_one_thread_kept_between_them() -> None:
    worker = Worker("test-worker")
    ran: list[tuple[int, int | None]] = []
    gate = threading.Event()
    worker.submit(lambda: gate.wait(10))
    for i in range(5):
        worker.submit(lambda i=i: ran.append((i, threading.get_ident())))
    assert ran == []  # handed over, not run: submit never waits for a job
    gate.set()
    worker.wait()
    assert [i for i, _ in ran] == [0, 1, 2, 3, 4]
    assert len({ident for _, ident in ran}) == 1
    (thread,) = _threads("test-worker")
    worker.submit(lambda: ran.append((5, threading.get_ident())))
    worker.wait()
    assert ran[-1][1] == ran[0][1] and _threads("test-worker") == [thread]
    worker.close()
    assert not thread.is_alive() and _threads("test-worker") == []


def test_close_runs_the_jobs_handed_over_first() -> None:
    worker = Worker("test-worker")
    ran: list[int] = []
    worker.submit(lambda: (time.sleep(0.2), ran.append(1)))
    worker.close()
    assert ran == [1] and _threads("test-worker") == []


def test_a_retired_worker_ends_after_its_jobs_without_the_caller_waiting() -> None:
    worker = Worker("test-worker")
    gate, ran = threading.Event(), []
    worker.submit(lambda: (gate.wait(10), ran.append(1)))
    (thread,) = _threads("test-worker")
    worker.retire()  # returns at once: the job still waits for the gate
    assert thread.is_alive() and ran == []
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and ran == [1]
    worker.submit(lambda: ran.append(2))  # a job after retiring starts a thread again
    worker.close()
    assert ran == [1, 2] and _threads("test-worker") == []


def test_an_idle_thread_ends_and_the_next_job_starts_another() -> None:
    worker = Worker("test-worker", idle=0.1)
    worker.submit(lambda: None)
    (thread,) = _threads("test-worker")
    thread.join(10)
    assert not thread.is_alive()
    ran: list[int] = []
    worker.submit(lambda: ran.append(1))
    worker.close()
    assert ran == [1] and _threads("test-worker") == []


def test_a_failing_job_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    worker = Worker("test-worker")
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("boom")

    worker.submit(fail)
    worker.submit(lambda: ran.append(1))
    worker.close()
    assert ran == [1]
    assert "test-worker: a background job failed" in caplog.text and "boom" in caplog.text
