"""The leak check's /dev/shm part counts what the test made, and only that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfharness import shm_entries, shm_leaks
from steadfast.monitor import HeartbeatTable
from steadfast.monitor.table import ask_path, wake_path

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")


def test_a_table_left_open_is_a_leak() -> None:
    before = shm_entries()
    table = HeartbeatTable.create(rows=1)
    try:
        wake = wake_path(table.path).name  # its wake channel, and its row's ask channel
        ask = ask_path(table.path, 0).name
        assert shm_leaks(before, {os.getpid()}) == {table.path.name, wake, ask}
    finally:
        table.close()
    assert shm_leaks(before, {os.getpid()}) == set()


def test_a_segment_named_after_the_tests_pid_is_a_leak() -> None:
    before = shm_entries()
    path = SHM / f"torch_{os.getpid()}_0_sftest"
    path.write_bytes(b"x")
    try:
        assert shm_leaks(before, {os.getpid()}) == {path.name}
    finally:
        path.unlink()


def test_another_programs_segment_is_not() -> None:
    """What failed the suite on a busy machine: a multiprocessing semaphore made by a
    process that is not the test's, while the test ran."""
    before = shm_entries()
    name = "sem.mp-sftest-foreign"
    code = f"open('/dev/shm/{name}', 'wb').write(b'x')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    try:
        assert name in shm_entries() - before
        assert shm_leaks(before, {os.getpid()}) == set()
    finally:
        (SHM / name).unlink()
