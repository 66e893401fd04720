"""A job's budgets under a real Slurm's requeues (steadfast.launcher.budget): the
no-progress count goes on across requeues instead of starting again, and a preemption's
requeue spends nothing, so a job preempted again and again still finishes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from slurmcluster import REPO, Cluster

from sfharness import read_events, wait_for

TRAIN = REPO / "examples" / "train.py"
NO_PROGRESS = Path(__file__).with_name("no_progress.py")
STEPS = ["--steps", "30", "--save-every", "5", "--calc-timeouts-at", "-1"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _write(tmp_path: Path, *args: str) -> Path:
    script = tmp_path / "job.sbatch"
    cmd = [sys.executable, "-m", "steadfast.cli", "slurm", "--nproc-per-node=2",
           "--run-dir", str(tmp_path / "run"), "--job-name", tmp_path.name[:40],
           "--write", str(script), *args]  # fmt: skip
    made = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    return script


def _events(tmp_path: Path, kind: str) -> list[dict]:
    path = tmp_path / "run" / "events.jsonl"
    return [e for e in read_events(path) if e["kind"] == kind] if path.exists() else []


def test_no_progress_across_two_requeues_stops_the_job_with_76(slurm: Cluster, tmp_path: Path):
    """Every generation fails before its first step. With one in-job restart per
    incarnation, each incarnation adds two to the count; the job retries would requeue it
    5 times, but the count goes on across requeues: 2, 4, then the first generation of
    the third incarnation is the fifth, over max_no_progress_restarts=4: exit 76, with
    the reason, after two requeues (a count that started again each time would never get
    there, and the job would crash-loop through all its retries)."""
    script = _write(
        tmp_path, "--max-restarts=1", "--num-job-retries-on-failure=5",
        "--launcher-arg=--ft-max-no-progress-restarts=4", str(NO_PROGRESS),
    )  # fmt: skip
    job = slurm.sbatch(script)
    out = next(iter(sorted((tmp_path / "run").glob("slurm-*.out"))), None)
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 300, log=out)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "2", info
    assert info["ExitCode"].startswith("76:"), info
    requeued = _events(tmp_path, "job_requeued")
    assert [(e["cause"], e["slurm_restart"]) for e in requeued] == [
        ("restarts_exhausted", 0), ("restarts_exhausted", 1)
    ]  # fmt: skip
    ends = _events(tmp_path, "launcher_end")
    assert [(e["slurm_restart"], e["exit_code"], e["no_progress"]) for e in ends] == [
        (0, 78, 2), (1, 78, 4), (2, 76, 5)
    ], ends  # fmt: skip
    reason = ends[-1]["reason"]
    assert "5 consecutive worker generations completed no step" in reason
    assert "4 of them in the job's earlier incarnations" in reason


def test_a_job_preempted_three_times_still_finishes(slurm: Cluster, tmp_path: Path):
    """Three preemptions (the time limit's signal, as --signal=B:USR1 sends it), each in
    a new incarnation once it saved: each requeue is a preemption's, spends no job retry
    (num_job_retries_on_failure=0 here: a failure would end the job) and no in-job
    restart, and the job finishes its 30 steps, bit for bit as a run that never
    stopped."""
    script = _write(
        tmp_path, "--max-restarts=0", "--num-job-retries-on-failure=0", str(TRAIN),
        "--ckpt-dir", str(tmp_path / "ckpt"), *STEPS, "--out", str(tmp_path / "out.pt"),
        "--step-sleep", "0.3",
    )  # fmt: skip
    job = slurm.sbatch(script)
    out = next(iter(sorted((tmp_path / "run").glob("slurm-*.out"))), None)
    for incarnation in range(3):
        wait_for(
            lambda i=incarnation: any(
                e["slurm_restart"] == i for e in _events(tmp_path, "checkpoint_saved")
            ),
            timeout=120,
            what=f"a save in incarnation {incarnation}",
        )
        slurm.run("scancel", "--signal=USR1", "--batch", job)
        wait_for(
            lambda i=incarnation: len(_events(tmp_path, "job_requeued")) > i,
            timeout=120,
            what=f"the requeue of incarnation {incarnation}",
        )
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 200, log=out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "3", info
    requeued = _events(tmp_path, "job_requeued")
    assert [(e["cause"], e["slurm_restart"]) for e in requeued] == [
        ("preempted", i) for i in range(3)
    ]
    assert _events(tmp_path, "rank_failed") == [] and _events(tmp_path, "restart") == []
    assert all(e["no_progress"] == 0 for e in _events(tmp_path, "launcher_end"))
    reference = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "launch", "--standalone", "--nproc-per-node=2",
         str(TRAIN), "--ckpt-dir", str(tmp_path / "ref"), *STEPS,
         "--out", str(tmp_path / "ref.pt")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    want = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
