"""Slurm job info from the environment, as real Slurm sets it."""

from __future__ import annotations

import logging

import pytest

from steadfast import (
    ConfigError,
    SLURMInfo,
    get_slurm_info,
    is_slurm_job,
    is_slurm_requeue,
    log_job_info,
)

_ALL = [
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_PARTITION",
    "SLURM_ARRAY_TASK_ID",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)


def test_not_under_slurm(caplog):
    assert get_slurm_info() is None
    assert not is_slurm_job()
    assert not is_slurm_requeue()
    with caplog.at_level(logging.INFO):
        log_job_info()
    assert "Not running under SLURM" in caplog.text


def test_full_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    info = get_slurm_info()
    assert info == SLURMInfo("1234", "train", "node[01-02]", 2, 4, 0, "gpu", "7")
    assert is_slurm_job()


def test_restart_count_unset_until_first_requeue(monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    info = get_slurm_info()
    assert info is not None and info.restart_count == 0 and not info.is_requeued
    assert info.array_task_id is None
    assert not is_slurm_requeue()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert is_slurm_requeue()
    info = get_slurm_info()
    assert info is not None and info.is_requeued
    with caplog.at_level(logging.INFO):
        log_job_info()
    assert "restart #2" in caplog.text


def test_fallback_variables(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NNODES", "3")
    monkeypatch.setenv("SLURM_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2),3")
    info = get_slurm_info()
    assert info is not None
    assert (info.num_nodes, info.node_list, info.ntasks_per_node) == (3, "n[1-3]", 8)


def test_malformed_variable_names_it(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "two")
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT='two' is not an integer"):
        get_slurm_info()
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT"):
        is_slurm_requeue()
