"""The progress guard's count and what it carries across a Slurm requeue
(steadfast.launcher.budget): read back from the run's real event log, as the next
incarnation's launcher reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadfast import events
from steadfast.launcher.budget import ProgressGuard, carried_no_progress
from steadfast.launcher.errors import NoProgressError


def test_the_count_goes_on_from_what_was_carried_and_a_step_clears_it() -> None:
    guard = ProgressGuard(limit=3, carried=2)
    guard.generation_failed(reporting=True, steps=5)  # a step: cleared
    assert guard.streak == 0
    for _ in range(3):
        guard.generation_failed(reporting=True, steps=0)
    with pytest.raises(NoProgressError, match=r"4 consecutive worker generations"):
        guard.generation_failed(reporting=False, steps=0)  # steps were seen before: counts
    carried = ProgressGuard(limit=3, carried=3)
    with pytest.raises(NoProgressError, match=r"3 of them in the job's earlier incarnations"):
        carried.generation_failed(reporting=False, steps=0)
    blind = ProgressGuard(limit=1)
    for _ in range(5):  # ranks that never report steps: nothing to count by
        blind.generation_failed(reporting=False, steps=0)
    assert blind.streak == 0
    ProgressGuard(limit=0, carried=50).generation_failed(reporting=True, steps=0)  # 0: off


def _end(incarnation: int, no_progress: int, job: str, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(incarnation))
    events.emit("launcher_end", exit_code=78, reason="requeued", no_progress=no_progress)


def test_a_requeued_incarnation_carries_the_highest_count_of_the_one_before(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "events.jsonl"))
    _end(0, 2, "77", monkeypatch)  # two launchers of incarnation 0
    _end(0, 1, "77", monkeypatch)
    _end(0, 9, "76", monkeypatch)  # another job's, in the same log
    assert carried_no_progress("77", 1) == 2
    _end(1, 4, "77", monkeypatch)
    assert carried_no_progress("77", 2) == 4  # the latest earlier incarnation's
    assert carried_no_progress("77", 1) == 2
    assert carried_no_progress("77", 0) == 0  # the first incarnation carries nothing
    assert carried_no_progress(None, 3) == 0  # not a Slurm job
    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "none.jsonl"))
    assert carried_no_progress("77", 2) == 0  # no log to tell: only ever later, not sooner
