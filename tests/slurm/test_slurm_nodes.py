"""steadfast under a real Slurm of several nodes: the batch script of ``steadfast slurm``
on two nodes of the bed's cluster (``slurm_bed``: slurmctld on node1, slurmd on
node2..node5, each node its own network, host name and processes).

Every job is ``tests/e2e/ft_train.py``, two gloo ranks per node (DDP), checkpoints every 2
steps on the shared file system, submitted with ``sbatch`` on the controller's node.
Each fault test checks that the fault was detected (events with their cause, naming the
node), what Slurm did (``scontrol show job``: the state, ``Restarts``, the nodes,
``ExcNodeList``), and that the final parameters equal a fault-free run's bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from slurmcluster import REPO, BedCluster

from sfharness import assert_bit_exact

TRAIN = REPO / "tests" / "e2e" / "ft_train.py"
STEPS = 30
#: the launchers' node watch: a lost node is seen at once (a reset) or in 2 s (silence),
#: and the survivors wait 8 s for a spare before the job is requeued
LAUNCHER = [
    "--ft-node-heartbeat-interval=0.25",
    "--ft-node-heartbeat-timeout=2",
    "--ft-node-lost-timeout=8",
]

#: ranks per node: more than one, as users run them (DDP stays bit-exact across resumes)
PER_NODE = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The fault-free run: the same ranks of ft_train.py on one host, the same steps."""
    work = tmp_path_factory.mktemp("reference")
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--standalone"]
    cmd += [f"--nproc-per-node={2 * PER_NODE}", str(TRAIN), "--ckpt", str(work / "ck")]
    cmd += ["--out", str(work / "out.pt"), "--steps", str(STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(work / "out.pt", weights_only=True)


def _read(path: Path) -> list[dict[str, Any]]:
    """The event log so far (a line being written this instant is left for later)."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


class Job:
    """One ``steadfast slurm`` job of this module: its folders, its events, its record."""

    def __init__(
        self,
        slurm: BedCluster,
        tmp_path: Path,
        *train: str,
        spares: int = 0,
        backend: str = "steadfast",
        slurm_args: tuple[str, ...] = (),
    ) -> None:
        self.slurm, self.tmp = slurm, tmp_path
        self.run_dir = tmp_path / "run"
        script = tmp_path / "job.sbatch"
        cmd = [sys.executable, "-m", "steadfast.cli", "slurm", "--nodes=2"]
        cmd += [f"--nproc-per-node={PER_NODE}"]
        cmd += [f"--spare-nodes={spares}", "--max-restarts=3", "--run-dir", str(self.run_dir)]
        cmd += [f"--rdzv-backend={backend}"]
        cmd += ["--job-name", tmp_path.name[:40], "--write", str(script)]
        cmd += [f"--launcher-arg={arg}" for arg in LAUNCHER]
        cmd += list(slurm_args)
        cmd += [str(TRAIN), "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "out.pt")]
        cmd += ["--steps", str(STEPS), *train]
        made = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        self.said = made.stderr
        self.id = slurm.sbatch(script)

    def events(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in _read(self.run_dir / "events.jsonl")
            if (kind is None or e["kind"] == kind) and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_event(self, kind: str, timeout: float = 90, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not (found := self.events(kind, **match)):
            assert time.monotonic() < deadline, f"no {kind} {match} in {timeout} s\n{self.out()}"
            time.sleep(0.1)
        return found[0]

    def out(self) -> str:
        outs = sorted(self.run_dir.glob("slurm-*.out"))
        return outs[0].read_text()[-6000:] if outs else ""

    def record(self) -> dict[str, str]:
        return self.slurm.job(self.id)

    def nodes(self) -> list[str]:
        """The job's nodes now (``scontrol show hostnames`` of its NodeList)."""
        listed = self.slurm.run("scontrol", "show", "hostnames", self.record()["NodeList"])
        return listed.stdout.split()

    def finish(self, timeout: float = 240) -> dict[str, str]:
        return self.slurm.wait_state(
            self.id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout, log=next(
                iter(sorted(self.run_dir.glob("slurm-*.out"))), None
            )
        )  # fmt: skip

    def resumed_elsewhere(self, away_from: str, exact: bool = False) -> set[str]:
        """The requeued job (Slurm incarnation 1) ran on two nodes, ``away_from`` not
        among them, from the save before the first incarnation's last one, the state it
        reached there proven equal to the last one (the restore's replay proof: the
        loop logs no losses); with ``exact``, from the last one itself (the re-run
        machine's, resumed as it is); its nodes."""
        again = set(self.hosts_of(1).values())
        assert away_from not in again and len(again) == 2, again
        saved = [e["step"] for e in self.events("checkpoint_saved") if e["slurm_restart"] == 0]
        before, last = sorted(set(saved))[-2:]
        resumed = {e["resumed_from"] for e in self.events("job_start") if e["slurm_restart"] == 1}
        assert resumed == {str(self.tmp / "ck" / f"step_{last if exact else before}")}
        if not exact:
            [proof] = [e for e in self.events("restore_verified") if e["slurm_restart"] == 1]
            assert proof["against"] == str(self.tmp / "ck" / f"step_{last}")
        return again

    def hosts_of(self, incarnation: int) -> dict[int, str]:
        """rank -> host of the training processes of Slurm incarnation ``incarnation``."""
        starts = self.events("job_start", slurm_job_id=self.id)
        return {e["rank"]: e["host"] for e in starts if (e["slurm_restart"] or 0) == incarnation}


def _training_nodes(job: Job) -> tuple[str, str]:
    """(the batch host, the other node that trains), once every rank started."""
    deadline = time.monotonic() + 90
    while len(hosts := job.hosts_of(0)) < 2 * PER_NODE:
        assert time.monotonic() < deadline, job.out()
        time.sleep(0.1)
    batch = job.record()["BatchHost"]
    (other,) = set(hosts.values()) - {batch}
    assert batch in hosts.values(), (batch, hosts)  # the first node trains too
    return batch, other


def test_a_rank_killed_on_one_node_restarts_both_nodes_in_job(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    job = Job(slurm_bed, tmp_path, "--fault", "rank_killed", "--fault-rank", "3",
              "--fault-step", "7")  # fmt: skip
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, job.out())
    # each node's launcher names the first of its own ranks to go down: the other node's
    # ranks lost their peer (exit 1); the fault is rank 3's SIGKILL (a node's second rank)
    (failed,) = job.events("rank_failed", cause="signal SIGKILL")
    assert failed["rank"] == 3
    hosts = job.hosts_of(0)
    assert sorted(list(hosts.values()).count(h) for h in set(hosts.values())) == [2, 2]
    assert failed["host"] == hosts[3]  # seen by the launcher of rank 3's node
    restarts = job.events("restart")
    assert {e["host"] for e in restarts} == set(hosts.values())  # both nodes restarted
    assert {e["restart_count"] for e in restarts} == {1}
    assert job.events("job_requeued") == []
    # the newest save (6) proves the restore of the one before it (replay proof)
    resumed = [e["resumed_from"] for e in job.events("job_start") if e["restart"] == 1]
    assert resumed == [str(tmp_path / "ck" / "step_4")] * 2 * PER_NODE
    [proof] = job.events("restore_verified")
    assert proof["route"] == "state" and proof["against"] == str(tmp_path / "ck" / "step_6")
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_a_lost_node_requeues_the_job_away_from_it(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    """node B is killed: the job is requeued away from it, and resumes on two other
    nodes. Then it is preempted there and requeued once more: the report reads the three
    incarnations as one run, with their nodes."""
    job = Job(slurm_bed, tmp_path, "--graceful", "--step-sleep", "0.2")
    batch, other = _training_nodes(job)
    job.wait_event("checkpoint_saved", step=6)
    slurm_bed.kill(other)  # power loss: its slurmd, launcher and rank at once
    job.wait_event("checkpoint_saved", slurm_restart=1, timeout=150)
    assert job.record()["ExcNodeList"] == other  # Slurm keeps the job away from it
    slurm_bed.run("scancel", "--signal=USR1", "--batch", job.id)
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, job.out())
    (lost,) = job.events("node_lost")
    assert (lost["node"], lost["cause"], lost["host"]) == (other, "connection_reset", batch)
    requeued = job.events("job_requeued")
    assert [(e["cause"], e["excluded"], e["slurm_restart"]) for e in requeued] == [
        ("node_lost", [other], 0), ("preempted", [], 1)
    ]  # fmt: skip
    assert requeued[0]["host"] == batch  # the launcher of SLURM_PROCID 0
    # the requeued job: two nodes Slurm gave it, the lost one not among them (the node
    # left may be one: it is still busy with the old job until the lost one is DOWN)
    again = job.resumed_elsewhere(other)
    assert_bit_exact(tmp_path / "out.pt", reference)
    report = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", "--json", "--no-timeline",
         str(job.run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert (summary["steps_done"], summary["requeues"]) == (STEPS, 2), summary
    incs = summary["incarnations"]
    assert [(i["slurm_restart"], i["requeued"], i["lost"], i["excluded"]) for i in incs] == [
        (0, "node_lost", [other], [other]), (1, "preempted", [], []), (2, None, [], [])
    ]  # fmt: skip
    assert set(incs[0]["nodes"]) == {batch, other} and set(incs[1]["nodes"]) == again
    assert set(summary["nodes"]) == {batch, other} | again | set(incs[2]["nodes"])


@pytest.mark.parametrize("backend", ["steadfast", "c10d"])
def test_the_first_node_lost_slurm_requeues_the_job_itself(
    slurm_bed: BedCluster, tmp_path: Path, reference, backend: str
):
    """The batch host is powered off: the batch script, srun and the rendezvous store go
    with it (steadfast's rendezvous, or torch's c10d: the store lives in the first node's
    launcher either way), and no launcher is left to requeue (the survivor is cut off
    from the store and its peer at once). Slurm ends the job (NODE_FAIL) once the node is
    DOWN and requeues it itself: the run resumes elsewhere from the last save. This is
    why a job without spares is not --no-kill."""
    job = Job(slurm_bed, tmp_path, "--step-sleep", "0.2", backend=backend)
    batch, other = _training_nodes(job)
    job.wait_event("checkpoint_saved", step=6)
    slurm_bed.kill(batch)
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, job.out())
    (isolated,) = job.events("node_isolated")  # what the survivor can tell
    assert (isolated["host"], isolated["cause"]) == (other, "partition")
    assert job.events("job_requeued") == []  # Slurm's requeue: no job retry spent
    job.resumed_elsewhere(batch)
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_a_lost_node_with_a_spare_in_the_allocation_is_not_requeued(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    job = Job(slurm_bed, tmp_path, "--step-sleep", "0.2", spares=1)
    batch, other = _training_nodes(job)
    allocated = job.nodes()
    assert len(allocated) == 3  # 2 that train and the spare
    (spare,) = set(allocated) - {batch, other}
    job.wait_event("checkpoint_saved", step=6)
    slurm_bed.kill(other)
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, job.out())
    (lost,) = job.events("node_lost")
    assert (lost["node"], lost["cause"]) == (other, "connection_reset")
    joined = job.wait_event("node_joined", node=spare)
    assert joined["cause"] == "spare" and joined["replaced"] == [other]
    assert job.events("job_requeued") == []
    after = {e["host"] for e in job.events("job_start") if e["time"] > lost["time"]}
    assert after == {batch, spare}
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_exit_16_moves_the_doubted_rank_to_other_hardware(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    """node3's "GPU" returns a NaN loss at step 5 on every attempt. The re-run state
    machine reproduces it in place and exits 16; the job is requeued away from node3, the
    step is re-run on another node for real (no faked hardware id), the NaN is not
    reproduced there, and the verdict is a persistent fault of node3."""
    job = Job(slurm_bed, tmp_path, "--rerun", "--nan-on-host", "node3", "--fault-step", "5")
    slurm_bed.wait_state(job.id, {"RUNNING"}, 60)
    first = job.nodes()
    assert first == ["node2", "node3"], first  # Slurm places it on the first idle nodes
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, job.out())
    rejected = job.events("rerun_result_rejected")
    assert {(e["host"], e["step"]) for e in rejected} == {("node3", 5)}
    elsewhere = job.events("rerun_elsewhere")  # each of node3's ranks asks it
    assert [(e["host"], e["hardware"]) for e in elsewhere] == [("node3", "node3/cpu")] * PER_NODE
    assert {e["exit_code"] for e in job.events("rank_failed")} == {16}
    (requeued,) = job.events("job_requeued")
    assert (requeued["cause"], requeued["excluded"]) == ("restart_elsewhere", ["node3"])
    assert info["ExcNodeList"] == "node3"
    job.resumed_elsewhere("node3", exact=True)  # the machine's save before its exit 16
    assert [e["verdict"] for e in job.events("rerun_verdict")] == ["persistent"] * 2 * PER_NODE
    tracker = [json.loads(line) for line in (tmp_path / "ck" / "rerun_tracker.jsonl").open()]
    blamed = {(t["node"], t["device"]) for t in tracker if t["status"] == "rejected"}
    assert blamed == {("node3", "node3/cpu")}  # who to blame
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_preemption_across_nodes_saves_on_both_and_resumes(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    job = Job(slurm_bed, tmp_path, "--graceful", "--step-sleep", "0.2")
    batch, other = _training_nodes(job)
    job.wait_event("checkpoint_saved", step=4)
    # what --signal=B:USR1@T does before the time limit: the signal to the batch shell only
    slurm_bed.run("scancel", "--signal=USR1", "--batch", job.id)
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, job.out())
    asked = job.events("shutdown_requested")
    assert {(e["host"], e["cause"]) for e in asked} == {(batch, "SIGUSR1"), (other, "SIGUSR1")}
    agreed = {e["step"] for e in job.events("shutdown_agreed")}
    assert len(agreed) == 1  # every rank stops after the same step
    (step,) = agreed
    saved = job.events("checkpoint_saved", step=step + 1)
    assert {e["host"] for e in saved if e["slurm_restart"] == 0} >= {batch}
    (requeued,) = job.events("job_requeued")
    assert (requeued["cause"], requeued["excluded"]) == ("preempted", [])
    resumed = {e["resumed_from"] for e in job.events("job_start") if e["slurm_restart"] == 1}
    assert resumed == {str(tmp_path / "ck" / f"step_{step + 1}")}
    assert job.events("rank_failed") == []  # a planned stop, not a crash
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_a_node_that_failed_twice_in_two_jobs_is_left_out_of_the_third(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    """The node ledger across jobs: node2 fails its health check (a bad DIMM, its check
    says) in two jobs that were placed on it; each time its launcher records the fault in
    the ledger on the shared file system and leaves the job (exit 74), which is then
    cancelled. The third job, written with the site's threshold of two faults, excludes
    node2 from its allocation (``--exclude``), runs on two other nodes and ends bit-exact;
    ``steadfast nodes`` names node2 first, with both faults' evidence."""
    ledger = tmp_path / "ledger"
    check = tmp_path / "check.sh"
    check.write_text('#!/bin/sh\n[ "$(hostname)" != node2 ] || { echo "DIMM B3: ECC"; exit 1; }\n')
    check.chmod(0o755)
    for attempt in (1, 2):
        work = tmp_path / f"job{attempt}"
        work.mkdir()
        job = Job(slurm_bed, work, slurm_args=(
            f"--node-ledger={ledger}", "--sbatch=--nodelist=node2",
            f"--launcher-arg=--ft-node-health-check={check}",
        ))  # fmt: skip
        unhealthy = job.wait_event("node_unhealthy", timeout=120)
        assert (unhealthy["host"], unhealthy["cause"]) == ("node2", "command")
        assert "DIMM B3: ECC" in unhealthy["reason"]
        slurm_bed.run("scancel", job.id)
        job.finish()
    work = tmp_path / "job3"
    work.mkdir()
    third = Job(slurm_bed, work, slurm_args=(
        f"--node-ledger={ledger}", "--node-ledger-max-faults=2",
        f"--launcher-arg=--ft-node-health-check={check}",
    ))  # fmt: skip
    assert "keeps node2 out of the job" in third.said
    info = third.finish()
    assert info["JobState"] == "COMPLETED", third.out()
    assert "node2" in info["ExcNodeList"] and "node2" not in third.nodes(), info
    assert not third.events("node_unhealthy")
    assert_bit_exact(work / "out.pt", reference)
    listed = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "nodes", "--ledger", str(ledger), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    worst = json.loads(listed.stdout)["nodes"][0]
    assert (worst["node"], worst["faults"]) == ("node2", 2)
    assert {e["cause"] for e in worst["evidence"]} == {"health_check"}
    assert len(worst["jobs"]) == 2 and worst["node_hours"] > 0


def test_a_requeue_leaves_out_the_jobs_node_that_the_ledger_now_keeps_out(
    slurm_bed: BedCluster, tmp_path: Path, reference
):
    """A node of a running job crosses the site's threshold (another job's launcher
    recorded a fault of it meanwhile: here, written into the ledger by the test). When
    the job's restarts are spent and the launcher requeues it, the requeue excludes that
    node as it excludes a lost one: the job comes back on other nodes and ends bit-exact."""
    from steadfast.ledger import Entry, Fault, FileLedger, Stint

    ledger = tmp_path / "ledger"
    job = Job(slurm_bed, tmp_path, "--fault", "exception", "--fault-rank", "0",
              "--fault-step", "26", "--step-sleep", "0.25", slurm_args=(
                  f"--node-ledger={ledger}", "--node-ledger-max-faults=1", "--max-restarts=0",
              ))  # fmt: skip
    _, other = _training_nodes(job)
    now = time.time()
    fault = Fault(other, "another-job", now, "hardware_signal", "rank 3 died of SIGBUS")
    stint = Stint(other, "another-job", now - 60, now)
    FileLedger(ledger).publish("elsewhere", Entry("elsewhere", [stint], [fault]))
    info = job.finish()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.out()
    (requeued,) = job.events("job_requeued")
    assert requeued["cause"] == "restarts_exhausted" and requeued["excluded"] == [other]
    assert other in info["ExcNodeList"] and other not in set(job.hosts_of(1).values())
    assert not job.events("node_unhealthy")  # kept out by Slurm, not refused on arrival
    assert_bit_exact(tmp_path / "out.pt", reference)
