"""The names steadfast gives its /dev/shm entries: the maker's pid, then the job's tag."""

from __future__ import annotations

import os

import pytest

from steadfast.monitor import HeartbeatTable
from steadfast.monitor.table import wake_path
from steadfast.shm import TAG_ENV, shm_name, shm_tag


def test_the_tag_is_the_environments_else_the_slurm_jobs_else_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TAG_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert shm_tag() == ""
    assert shm_name("steadfast-x-") == f"steadfast-x-{os.getpid()}-"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert shm_tag() == "job4242"
    monkeypatch.setenv(TAG_ENV, "mine")
    assert shm_name("steadfast-x-") == f"steadfast-x-{os.getpid()}-mine-"


def test_a_tag_cannot_change_where_a_name_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TAG_ENV, "../a b-c/" + "d" * 40)
    assert shm_tag() == "..abcd" + "d" * 26  # no separator, no slash, 32 characters


def test_a_tables_entries_carry_the_tag(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(TAG_ENV, "tagged")
    table = HeartbeatTable.create(rows=1, directory=tmp_path)
    try:
        assert table.path.name.startswith(f"steadfast-hb-{os.getpid()}-tagged-")
        assert wake_path(table.path).name.startswith(f"steadfast-hbwake-{os.getpid()}-tagged-")
    finally:
        table.close()
