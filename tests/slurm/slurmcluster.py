"""The single-node test cluster's handle: Slurm client commands, job records, waits."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-localhost.sh"
#: Job states after which a job runs no more (a requeued job passes through PENDING).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


@dataclass
class Cluster:
    """The running test cluster: its folder and the environment that reaches it."""

    root: Path
    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, script: Path, *flags: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script``; the job id. The job is cancelled at the end of the test."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *flags, str(script)],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=script.parent,
        )
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (empty once Slurm forgot the job)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(re.findall(r"(\S+?)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}

    def wait_state(
        self, job_id: str, states: set[str], timeout: float, log: Path | None = None
    ) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.25)
        tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
        raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {info}\n{tail}")

    def cancel_all(self, timeout: float = 40.0) -> None:
        """Cancel this test's jobs and wait until none of them has a process left."""
        for job in self.jobs:
            self.run("scancel", job, check=False)
        deadline = time.monotonic() + timeout
        for job in self.jobs:
            while self.job(job).get("JobState") not in FINAL_STATES | {None}:
                if time.monotonic() > deadline:
                    raise AssertionError(f"job {job} did not end: {self.job(job)}")
                time.sleep(0.2)
        self.jobs.clear()
