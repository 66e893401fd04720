"""The test clusters' handles: Slurm client commands, job records, waits; on a bed of
nodes, the nodes' power too."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-localhost.sh"
NODES_SCRIPT = REPO / "scripts" / "nodes-localhost.sh"
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
    #: what a client command runs through (on a bed: ``slurm-localhost.sh client``,
    #: which runs it on the controller's node)
    client: list[str] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        proc = subprocess.run(
            [*self.client, *cmd], env=self.env, capture_output=True, text=True, timeout=60
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, script: Path, *flags: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script``; the job id. The job is cancelled at the end of the test."""
        proc = subprocess.run(
            [*self.client, "sbatch", "--parsable", *flags, str(script)],
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


@dataclass
class BedCluster(Cluster):
    """A cluster across the nodes of a test bed (``slurm-localhost.sh start-bed``):
    slurmctld on node1, a slurmd on each other node, which a test can kill (a power loss)
    and bring back."""

    bed: Path = Path()
    compute: list[str] = field(default_factory=list)

    def node_script(self, *args: str) -> None:
        """``nodes-localhost.sh CMD BED ARGS`` (kill, boot, partition, heal)."""
        cmd = ["bash", str(NODES_SCRIPT), args[0], str(self.bed), *args[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"nodes-localhost.sh {' '.join(args)}: {done.stderr}"

    def states(self) -> dict[str, str]:
        """Each compute node's Slurm state (``idle``, ``mixed``, ``down*``...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def kill(self, node: str) -> None:
        """Power loss: every process of ``node`` (its slurmd, its launcher) at once."""
        self.node_script("kill", node)

    def revive(self, timeout: float = 90) -> None:
        """Power every killed node back on and start its slurmd; wait until every node
        is idle again (Slurm returns a DOWN node when its slurmd registers)."""
        for node in self.compute:
            if not (self.bed / "nodes" / node / "init.pid").exists():
                self.node_script("boot", node)
                up = subprocess.run(
                    ["bash", str(CLUSTER_SCRIPT), "node-up", str(self.root), node],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + timeout
        while set((states := self.states()).values()) != {"idle"}:
            assert time.monotonic() < deadline, f"nodes not idle after {timeout} s: {states}"
            time.sleep(0.5)
