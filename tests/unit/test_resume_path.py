"""resolve_resume_path: seed 000's rules, with a broken `latest` falling back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from steadfast import ConfigError, resolve_resume_path


def _steps(base: Path, *ns: int) -> None:
    for n in ns:
        (base / f"step_{n}").mkdir(parents=True)


def test_missing_or_empty_dir_means_nothing_to_resume(tmp_path: Path):
    assert resolve_resume_path(tmp_path / "nope") is None
    assert resolve_resume_path(tmp_path) is None
    assert resolve_resume_path(str(tmp_path)) is None


def test_non_directory_is_a_clear_error(tmp_path: Path):
    f = tmp_path / "ckpt"
    f.write_text("not a dir")
    with pytest.raises(ConfigError, match="exists but is not a directory"):
        resolve_resume_path(f)


def test_highest_step_by_number_not_by_name(tmp_path: Path):
    _steps(tmp_path, 9, 10, 2)
    (tmp_path / "step_abc").mkdir()
    (tmp_path / "step_99.tmp").mkdir()
    (tmp_path / "step_100").write_text("a file, not a checkpoint")
    assert resolve_resume_path(tmp_path) == tmp_path / "step_10"


def test_latest_symlink_wins(tmp_path: Path):
    _steps(tmp_path, 5, 10)
    os.symlink("step_5", tmp_path / "latest")
    assert resolve_resume_path(tmp_path) == (tmp_path / "step_5").resolve()


@pytest.mark.parametrize("target", ["step_77", "a_file"])
def test_broken_latest_falls_back_to_scan(tmp_path: Path, target: str):
    _steps(tmp_path, 3, 4)
    (tmp_path / "a_file").write_text("x")
    os.symlink(target, tmp_path / "latest")
    assert resolve_resume_path(tmp_path) == tmp_path / "step_4"


def test_latest_symlink_loop_falls_back(tmp_path: Path):
    _steps(tmp_path, 1, 2)
    os.symlink("latest", tmp_path / "latest")  # points at itself
    assert resolve_resume_path(tmp_path) == tmp_path / "step_2"
