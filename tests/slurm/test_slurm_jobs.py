"""steadfast under a real Slurm: the batch script of ``steadfast slurm``, in-job restarts,
the launcher's own requeue, preemption and an operator's requeue.

Every job is ``examples/train.py`` (2 gloo ranks, DDP, checkpoints every 5 steps) run by
the script that ``steadfast slurm`` writes, submitted with ``sbatch`` to the test cluster.
Each fault test checks that the fault was detected (events with their cause), that the
job recovered (Slurm says COMPLETED), and that the final parameters equal the fault-free
run's bit for bit. Slurm facts the tests rely on are in ``scripts/slurm-localhost.sh``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from slurmcluster import REPO, Cluster

from sfharness import read_events

TRAIN = REPO / "examples" / "train.py"
STEPS = ["--steps", "30", "--save-every", "5", "--calc-timeouts-at", "-1"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The fault-free run: the same script and steps under plain ``steadfast launch``."""
    work = tmp_path_factory.mktemp("reference")
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--standalone"]
    cmd += ["--nproc-per-node=2", str(TRAIN), "--ckpt-dir", str(work / "ckpt"), *STEPS]
    cmd += ["--out", str(work / "out.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _params(work / "out.pt")


def _steadfast_slurm(
    tmp_path: Path, slurm_flags: tuple[str, ...], train_args: tuple[str, ...], env=None
) -> str:
    """``steadfast slurm`` for a 2-rank training job of ``examples/train.py``; its stdout."""
    cmd = [sys.executable, "-m", "steadfast.cli", "slurm", "--nproc-per-node=2"]
    cmd += ["--run-dir", str(tmp_path / "run"), *slurm_flags]
    cmd += [str(TRAIN), "--ckpt-dir", str(tmp_path / "ckpt"), *STEPS]
    cmd += ["--out", str(tmp_path / "out.pt"), *train_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _job_script(tmp_path: Path, *train_args: str, slurm_flags: tuple[str, ...] = ()) -> Path:
    """``steadfast slurm`` writes the batch script of a 2-rank training job."""
    script = tmp_path / "job.sbatch"
    flags = ("--job-name", tmp_path.name[:40], "--write", str(script), *slurm_flags)
    _steadfast_slurm(tmp_path, flags, train_args)
    return script


def _events(tmp_path: Path, kind: str | None = None) -> list[dict]:
    evs = read_events(tmp_path / "run" / "events.jsonl")
    return [e for e in evs if kind is None or e["kind"] == kind]


def _finish(slurm: Cluster, job: str, tmp_path: Path, timeout: float = 150) -> dict[str, str]:
    out = next((tmp_path / "run").glob("slurm-*.out"), None)
    return slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout, log=out)


def _assert_bit_exact(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = _params(tmp_path / "out.pt")
    assert out.keys() == reference.keys()
    assert all(torch.equal(out[k], reference[k]) for k in reference)  # bit for bit


#: rank 1 SIGKILLed at steps 8 and 17 (each once per run)
KILLED_TWICE = ("--fault", "rank_killed:1:8", "--fault", "rank_killed:1:17")


def _assert_proven(tmp_path: Path, start: dict, newest: int) -> None:
    """The requeued job resumed from the checkpoint its replay proof chose: ``newest``
    (the first incarnation's last), or one at most 10 steps before it (re-done to prove
    it: max_proof_steps), and its proof held; or, where no proof could be made (the stop
    came right after the first save: nothing older, and a save off the loop's cadence),
    from ``newest``, said unverified."""
    proofs = [e for e in _events(tmp_path, "restore_verified") if e["slurm_restart"] == 1]
    if not proofs:
        [unverified] = [e for e in _events(tmp_path, "restore_unverified")
                        if e["slurm_restart"] == 1]  # fmt: skip
        assert start["step"] == unverified["step"] == newest, unverified
        return
    assert len(proofs) == 1
    assert start["resumed_from"] == proofs[0]["path"]
    assert start["step"] == proofs[0]["step"] and 0 <= newest - start["step"] <= 10
    assert proofs[0]["proof_steps"] == newest - start["step"]


def _wait_event(tmp_path: Path, kind: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not _events(tmp_path, kind):
        assert time.monotonic() < deadline, f"no {kind} event in {timeout} s"
        time.sleep(0.1)


def test_a_rank_killed_twice_restarts_in_job_twice_then_succeeds(
    slurm: Cluster, tmp_path: Path, reference
):
    # --submit: steadfast slurm writes the script and hands it to sbatch itself
    flags = ("--submit", "--job-name", "killed-twice")  # --max-restarts 3: the default
    job = _steadfast_slurm(tmp_path, flags, KILLED_TWICE, env=slurm.env).strip()
    slurm.jobs.append(job)
    assert (tmp_path / "killed-twice.sbatch").is_file()
    info = _finish(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
    failed = [e for e in _events(tmp_path, "rank_failed") if e["rank"] == 1]
    assert [e["cause"] for e in failed] == ["signal SIGKILL"] * 2  # detected, with its cause
    restarts = _events(tmp_path, "restart")
    assert [e["restart_count"] for e in restarts] == [1, 2]
    assert all(e["slurm_job_id"] == job and e["slurm_restart"] == 0 for e in restarts)
    starts = [e["resumed_from"] for e in _events(tmp_path, "job_start") if e["rank"] == 0]
    # killed in step 8: checkpoint 5 leaves three logged steps, its losses prove it;
    # killed in step 17: 15 leaves two, and the run proved a restore by replay before:
    # 15 is restored, its digest the one logged at its save (the ledger), none re-done
    assert starts == [None, str(tmp_path / "ckpt" / "step_5"), str(tmp_path / "ckpt" / "step_15")]
    proofs = _events(tmp_path, "restore_verified")
    assert [(e["step"], e["route"], e["proof_steps"]) for e in proofs] == [
        (5, "losses", 0), (15, "ledger", 0)
    ]  # fmt: skip
    assert _events(tmp_path, "job_requeued") == []
    _assert_bit_exact(tmp_path, reference)


def test_restarts_spent_the_job_requeues_itself_and_resumes(
    slurm: Cluster, tmp_path: Path, reference
):
    script = _job_script(tmp_path, *KILLED_TWICE, slurm_flags=("--max-restarts=1",))
    job = slurm.sbatch(script)
    info = _finish(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    requeued = _events(tmp_path, "job_requeued")
    assert [(e["cause"], e["slurm_job"], e["slurm_restart"]) for e in requeued] == [
        ("restarts_exhausted", job, 0)
    ]
    assert len(_events(tmp_path, "restart")) == 1  # the one in-job restart, then the requeue
    starts = [e for e in _events(tmp_path, "job_start") if e["rank"] == 0]
    last = starts[-1]  # the requeued job: SLURM_RESTART_COUNT=1, from the latest checkpoint
    assert (last["slurm_job_id"], last["slurm_restart"]) == (job, 1)
    _assert_proven(tmp_path, last, newest=15)
    _assert_bit_exact(tmp_path, reference)
    report = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", "--json", "--no-timeline",
         str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    # one run across the requeue: 30 steps kept, 3 process generations (the first, the
    # in-job restart, the requeued job), and both faults detected and recovered
    assert (summary["steps_done"], summary["generations"]) == (30, 3), summary
    assert (summary["restarts"], summary["requeues"]) == (1, 1), summary
    assert summary["all_recovered"] and len(summary["faults"]) == 2, summary
    # both restarts phase by phase: in-job, then the requeue (its queue and the new
    # launcher's start, its own phase), each from the kill to the first step again
    kinds = [(r["kind"], r["what"]) for r in summary["restarts_phases"]]
    assert kinds == [("in-job", "rank 1 failed (signal SIGKILL)")] * 1 + [
        ("requeue", "rank 1 failed (signal SIGKILL)")
    ], kinds
    for restart in summary["restarts_phases"]:
        phases = restart["phases"]
        assert sum(phases.values()) == pytest.approx(restart["seconds"], abs=1e-3), restart
        assert phases["checkpoint_load"] > 0 and restart["tier"] == "disk", restart
    assert summary["restarts_phases"][1]["phases"]["requeue"] > 0


def test_preemption_signal_saves_and_the_requeued_job_resumes(
    slurm: Cluster, tmp_path: Path, reference
):
    script = _job_script(tmp_path, "--step-sleep", "0.1")
    job = slurm.sbatch(script)
    _wait_event(tmp_path, "checkpoint_saved")  # training is under way
    # what --signal=B:USR1@T does before the time limit: the signal to the batch shell only
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    info = _finish(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    asked = _events(tmp_path, "shutdown_requested")
    assert {(e["rank"], e["cause"]) for e in asked} == {(0, "SIGUSR1"), (1, "SIGUSR1")}
    agreed = _events(tmp_path, "shutdown_agreed")[0]["step"]
    saved = [e["step"] for e in _events(tmp_path, "checkpoint_saved")]
    assert agreed + 1 in saved  # the preemption save, after the step all ranks agreed on
    requeued = _events(tmp_path, "job_requeued")
    assert [(e["cause"], e["slurm_job"]) for e in requeued] == [("preempted", job)]
    last = [e for e in _events(tmp_path, "job_start") if e["rank"] == 0][-1]
    assert last["slurm_restart"] == 1
    _assert_proven(tmp_path, last, newest=agreed + 1)
    assert _events(tmp_path, "rank_failed") == []  # a planned stop, not a crash
    _assert_bit_exact(tmp_path, reference)


def test_an_operators_requeue_while_running_comes_back_and_resumes(
    slurm: Cluster, tmp_path: Path, reference
):
    script = _job_script(tmp_path, "--step-sleep", "0.1")
    job = slurm.sbatch(script)
    _wait_event(tmp_path, "checkpoint_saved")
    slurm.run("scontrol", "requeue", job)  # Slurm SIGTERMs every process of the job
    info = _finish(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    asked = _events(tmp_path, "shutdown_requested")
    assert {(e["rank"], e["cause"]) for e in asked} == {(0, "SIGTERM"), (1, "SIGTERM")}
    saved = _events(tmp_path, "checkpoint_saved")
    before = [e["step"] for e in saved if e["slurm_restart"] == 0]
    last = [e for e in _events(tmp_path, "job_start") if e["rank"] == 0][-1]
    assert (last["slurm_job_id"], last["slurm_restart"]) == (job, 1)
    _assert_proven(tmp_path, last, newest=max(before))
    assert _events(tmp_path, "job_requeued") == []  # not ours: no job retry was spent
    _assert_bit_exact(tmp_path, reference)


def test_get_slurm_info_matches_scontrol_show_job(slurm: Cluster, tmp_path: Path):
    """Before and after a requeue (``SLURM_RESTART_COUNT`` unset, then 1)."""
    script = tmp_path / "info.sbatch"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            #SBATCH --job-name=sf-info
            #SBATCH --nodes=1
            #SBATCH --ntasks-per-node=1
            #SBATCH --requeue
            #SBATCH --output={tmp_path}/info-%j.out
            n=${{SLURM_RESTART_COUNT:-0}}
            {sys.executable} -c 'import dataclasses, json, steadfast
            print(json.dumps(dataclasses.asdict(steadfast.get_slurm_info())))' \\
                > {tmp_path}/info.tmp && mv {tmp_path}/info.tmp {tmp_path}/info-$n.json
            while [ ! -e {tmp_path}/checked-$n ]; do sleep 0.1; done
            """
        )
    )
    job = slurm.sbatch(script)
    for restart in (0, 1):
        path = tmp_path / f"info-{restart}.json"
        deadline = time.monotonic() + 90
        while not path.exists():
            assert time.monotonic() < deadline, (tmp_path / f"info-{job}.out").read_text()
            time.sleep(0.1)
        info = json.loads(path.read_text())
        shown = slurm.job(job)  # while the job runs
        assert shown["JobState"] == "RUNNING"
        assert info["job_id"] == shown["JobId"] == job
        assert info["job_name"] == shown["JobName"] == "sf-info"
        assert info["node_list"] == shown["NodeList"]
        assert info["num_nodes"] == int(shown["NumNodes"]) == 1
        assert info["ntasks_per_node"] == int(shown["NumTasks"]) // int(shown["NumNodes"])
        assert info["partition"] == shown["Partition"]
        assert info["restart_count"] == int(shown["Restarts"]) == restart
        assert info["array_task_id"] is None
        assert set(info) == {f.name for f in dataclasses.fields(__import__("steadfast").SLURMInfo)}
        if restart == 0:
            slurm.run("scontrol", "requeue", job)
        else:
            (tmp_path / "checked-1").touch()
    assert slurm.wait_state(job, {"COMPLETED"}, 30)["Restarts"] == "1"


def test_an_exclusion_that_would_leave_too_few_nodes_is_not_made(
    slurm: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    """The single node of this cluster cannot be excluded from a 1-node job: the job
    could never run again. A host that is not a node of the job is not excluded either.
    (Excluding a node that is, on a cluster that has more, is test_slurm_nodes.py's.)"""
    from steadfast.slurm import exclusion_plan

    script = tmp_path / "sleep.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/sleep-%j.out\nsleep 60\n")
    job = slurm.sbatch(script)
    info = slurm.wait_state(job, {"RUNNING"}, 30)
    for name, value in slurm.env.items():
        monkeypatch.setenv(name, value)  # SLURM_CONF: scontrol reaches this cluster
    node = info["NodeList"]
    with caplog.at_level("WARNING", logger="steadfast.slurm"):
        plan = exclusion_plan(job, [node, "no-such-node"])
    assert plan is not None and (plan.added, plan.nodes) == ([], [])
    assert f"not excluding {node} from job {job}: its partition would have 0 node(s)" in (
        caplog.text
    )
    assert "cannot exclude no-such-node: not a node of job" in caplog.text


MEGATRON = REPO / "examples" / "megatron_loop.py"


def test_a_megatron_loop_saves_on_the_jobs_preemption_signal_and_resumes(
    slurm: Cluster, tmp_path: Path
):
    """Megatron Bridge's pattern (``PreemptionHandler`` left at its exit_signal, SIGTERM)
    under ``steadfast slurm``, whose preemption signal is SIGUSR1 by default: the batch
    script declares it ($STEADFAST_PREEMPT_SIGNAL) and the handler takes it as well, so
    every rank saves after the same step and the requeued job resumes bit-exact. Before,
    SIGUSR1 ended each rank (its default action) before the save."""
    steps = ["--steps", "24", "--save-every", "5", "--step-sleep", "0.1"]
    ref = tmp_path / "ref"
    ref.mkdir()
    cmd = [sys.executable, "-m", "steadfast.cli", "launch", "--standalone"]
    cmd += ["--nproc-per-node=2", str(MEGATRON), "--ckpt-dir", str(ref / "ckpt"), *steps]
    cmd += ["--out", str(ref / "out.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = tmp_path / "job.sbatch"
    cmd = [sys.executable, "-m", "steadfast.cli", "slurm", "--nproc-per-node=2"]
    cmd += ["--run-dir", str(tmp_path / "run"), "--job-name", tmp_path.name[:40]]
    cmd += ["--write", str(script), str(MEGATRON), "--ckpt-dir", str(tmp_path / "ckpt")]
    cmd += [*steps, "--out", str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = slurm.sbatch(script)
    _wait_event(tmp_path, "checkpoint_saved")  # training is under way
    slurm.run("scancel", "--signal=USR1", "--batch", job)  # what --signal=B:USR1@T sends
    info = _finish(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    signalled = _events(tmp_path, "preemption_signal")
    assert signalled and {e["cause"] for e in signalled} == {"SIGUSR1"}, signalled
    [stop] = _events(tmp_path, "preemption_exit")
    assert stop["cause"] == "SIGUSR1"
    saved = [e["step"] for e in _events(tmp_path, "checkpoint_saved")]
    assert stop["step"] + 1 in saved  # the preemption save, after the agreed step
    assert [e["cause"] for e in _events(tmp_path, "job_requeued")] == ["preempted"]
    assert _events(tmp_path, "rank_failed") == []  # a planned stop, not a crash
    _assert_bit_exact(tmp_path, _params(ref / "out.pt"))
