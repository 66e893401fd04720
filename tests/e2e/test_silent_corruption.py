"""Silent data corruption in an unchanged script (issue 69): ``steadfast launch`` on a
torchrun DDP script that imports nothing of steadfast (``unchanged_train.py``), one bit
of one rank's weight or Adam moment flipped after a step (``--corrupt``, the script's
own doing: bad memory, a cosmic ray), the value still finite.

Each fault is detected (``sdc_detected``, then ``sdc_verdict`` naming the odd one out
among three replicas or more, the pair among two, with the last step every replica
agreed on before the flip and the first that disagreed after it), the workers are
stopped, not restarted (exit 80), and the report says so; before and after an in-job
restart. Clean shapes whose ranks are replicas (dropout and DataLoader workers,
``no_sync`` accumulation, bf16 autocast, ``torch.compile``, BatchNorm) are checked and
never alarm; shapes whose ranks legitimately differ (FSDP2, a 2x2 HSDP, a model per
rank) are not compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sfharness import launch_run, run_report

HERE = Path(__file__).parent
SCRIPT = HERE / "unchanged_train.py"
SHAPES = HERE / "sdc_shapes.py"
FLIP_AT = 25  # the flip follows step 25's optimizer step (the script's step index 24)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_worker_outlives_its_launcher")]


def _run(workdir: Path, nproc: int, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, f"--nproc-per-node={nproc}", "--max-restarts=2", str(SCRIPT),
        "--out", str(workdir / "out.pt"), "--snapshot", str(workdir / "snap.pt"),
        "--trace", str(workdir / "trace"), "--steps", "60", "--pace", "0.02", *extra,
    )  # fmt: skip


def _kinds(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


def _steps_trained(workdir: Path) -> int:
    return max(int(line.split()[1]) for line in (workdir / "trace").read_text().splitlines()
               if line.startswith("step "))  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "nproc", "rank", "culprits", "how"),
    [
        ("exponent", 2, 1, [0, 1], "pair"),
        ("mantissa", 3, 2, [2], "odd_one_out"),
        ("moment", 4, 1, [1], "odd_one_out"),
    ],
)
def test_a_flipped_bit_stops_the_job_with_a_verdict(
    tmp_path: Path, kind: str, nproc: int, rank: int, culprits: list[int], how: str
):
    code, evs = _run(tmp_path, nproc, "--corrupt", f"{kind}:{rank}:{FLIP_AT}")
    assert code == 80
    (seen,) = _kinds(evs, "sdc_detected")
    assert seen["cause"] == "replica_mismatch" and seen["replicas"] == list(range(nproc))
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["culprits"], verdict["cause"]) == (culprits, how)
    assert verdict["local_ranks"] == culprits and verdict["replicas"] == nproc
    # the checks every 10 steps: the last before the flip agreed, the first after did not
    assert (verdict["last_agreed_step"], verdict["first_bad_step"]) == (19, 29)
    assert not _kinds(evs, "restart")  # never trained on from the corrupted state
    assert [e["exit_code"] for e in _kinds(evs, "launcher_end")] == [80]
    assert _steps_trained(tmp_path) < 60  # stopped, not run to the end
    summary, text = run_report(tmp_path)
    assert summary["replicas"]["verdicts"][0]["culprits"] == culprits
    assert "SILENT CORRUPTION" in text and "newest step proven clean: 19" in text


def test_a_flip_after_an_in_job_restart_is_found_in_the_new_generation(tmp_path: Path):
    """Rank 0 crashes at step 8 (the group restarts from the script's snapshot of step
    5); after step 25 one bit of rank 1's weight flips: the new generation's checks find
    rank 1 the odd one out among three."""
    code, evs = _run(tmp_path, 3, "--hang", "kill:0:8", "--corrupt", f"exponent:1:{FLIP_AT}")
    assert code == 80
    (restart,) = _kinds(evs, "restart")
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["culprits"], verdict["cause"]) == ([1], "odd_one_out")
    started = [e["time"] for e in _kinds(evs, "workers_started")]
    assert len(started) == 2 and restart["time"] < started[1] < verdict["time"]
    assert verdict["last_agreed_step"] < FLIP_AT <= verdict["first_bad_step"]


def test_clean_replicas_agree_and_the_report_says_how_far(tmp_path: Path):
    code, evs = _run(tmp_path, 2, "--loader-workers", "2")
    assert code == 0
    assert not _kinds(evs, "sdc_detected") and not _kinds(evs, "sdc_verdict")
    checked = _kinds(evs, "replicas_checked")
    assert checked and checked[-1]["checks"] == 6 and checked[-1]["last_agreed_step"] == 59
    summary, text = run_report(tmp_path)
    assert summary["replicas"]["checks"] == 6
    assert "6 check(s) agreed on 1 node(s); newest step proven clean: 59" in text


@pytest.mark.parametrize(
    ("shape", "nproc", "compared"),
    [
        ("dropout", 2, True),
        ("no_sync", 2, True),
        ("bf16", 2, True),
        ("compile", 2, True),
        ("batchnorm", 2, True),
        ("fsdp2", 2, False),
        ("hsdp", 4, False),
        ("apart", 2, False),
    ],
)
def test_no_false_alarm(tmp_path: Path, shape: str, nproc: int, compared: bool):
    code, evs = launch_run(tmp_path, f"--nproc-per-node={nproc}", str(SHAPES), shape, "60")
    assert code == 0
    assert not _kinds(evs, "sdc_detected") and not _kinds(evs, "sdc_verdict")
    checked = _kinds(evs, "replicas_checked")
    if compared:  # 60 optimizer steps: 6 checks, each agreed
        assert checked and checked[-1]["checks"] == 6 and checked[-1]["replicas"] == nproc
    else:  # not DDP's replicas: nothing to compare
        assert not checked


# ---------------------------------------------------------------------------------------
# The library path: the README's second loop (CheckpointManager, a snapshot every step)


LIBRARY = HERE / "sdc_library.py"


def _library(workdir: Path, nproc: int, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, f"--nproc-per-node={nproc}", "--max-restarts=2", str(LIBRARY),
        "--ckpt", str(workdir / "ckpt"), "--out", str(workdir / "out.pt"), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The library loop's final parameters without a fault, at 2 and 3 ranks."""
    import torch

    out = {}
    for nproc in (2, 3):
        work = tmp_path_factory.mktemp(f"clean{nproc}")
        code, _ = _library(work, nproc)
        assert code == 0
        out[nproc] = torch.load(work / "out.pt")
    return out


@pytest.mark.parametrize(
    ("nproc", "culprits", "how"), [(3, [1], "odd_one_out"), (2, [0, 1], "pair")]
)
def test_the_library_rolls_back_to_the_state_proven_clean_and_ends_bit_exact(
    tmp_path: Path, fault_free: dict[int, dict[str, Any]], nproc: int, culprits: list[int],
    how: str,
):  # fmt: skip
    """Rank 1's weight flips after step 25 (once): the verdict, a roll-back to step 20
    (the disk save the check after step 20 proved clean; the memory tier's five newest
    snapshots are all newer), the steps re-done, exit 0, and the fault-free parameters."""
    import torch

    code, evs = _library(tmp_path, nproc, "--flip", "1:24")
    assert code == 0
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["culprits"], verdict["cause"], verdict["clean_step"]) == (culprits, how, 20)
    (rollback,) = _kinds(evs, "rollback")
    assert (rollback["cause"], rollback["to_step"]) == ("silent_corruption", 20)
    assert len(_kinds(evs, "restart")) == 1
    loaded = {e["rank"]: e["step"] for e in _kinds(evs, "checkpoint_loaded")}
    assert loaded == dict.fromkeys(range(nproc), 20)  # nothing newer than proven
    final = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(final[k], fault_free[nproc][k]) for k in fault_free[nproc])
    summary, _ = run_report(tmp_path)
    assert summary["replicas"]["verdicts"][0]["clean_step"] == 20


def test_a_corruption_that_comes_back_on_the_same_device_ends_the_job(tmp_path: Path):
    """The flip strikes every time step 25 is trained (a device that keeps failing): the
    first verdict rolls back, the second finds the same rank on the same host again and
    ends the job (exit 80): persistent, not trained on again."""
    code, evs = _library(tmp_path, 3, "--flip", "1:24", "--every-time")
    assert code == 80
    verdicts = _kinds(evs, "sdc_verdict")
    assert [v["culprits"] for v in verdicts] == [[1], [1]]
    assert len(_kinds(evs, "rollback")) == 1
    (end,) = _kinds(evs, "launcher_end")
    assert "persistent" in end["reason"]


# ---------------------------------------------------------------------------------------
# Compute audits: a step's pre-reduction gradients recomputed on the next rank


AUDIT = HERE / "sdc_audit.py"


def _audited(workdir: Path, nproc: int, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(workdir, f"--nproc-per-node={nproc}", str(AUDIT),
                      "--out", str(workdir / "out.pt"), *extra)  # fmt: skip


@pytest.fixture(scope="module")
def audited_clean(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The audited loop's final parameters without a fault, at 2, 3 and 4 ranks."""
    import torch

    out = {}
    for nproc in (2, 3, 4):
        work = tmp_path_factory.mktemp(f"audited{nproc}")
        code, evs = _audited(work, nproc)
        assert code == 0 and len(_kinds(evs, "compute_audited")) == 6  # 30 steps, every 5
        out[nproc] = torch.load(work / "out.pt")
    return out


@pytest.mark.parametrize(
    ("nproc", "fault", "culprit"),
    [(3, "--mercurial=1:5", 1), (3, "--activation=2:10", 2), (2, "--mercurial=1:5", 1),
     (4, "--activation=3:15", 3)],
)  # fmt: skip
def test_a_transient_compute_fault_is_found_before_the_reduction_and_the_step_re_done(
    tmp_path: Path, audited_clean: dict[int, dict[str, Any]], nproc: int, fault: str,
    culprit: int,
):  # fmt: skip
    """One rank's gradient scaled (a mercurial multiply) or its activation nudged, once,
    on an audit step: the next rank's recomputation differs, the in-place re-run does not
    (transient), every rank re-does the step, and the run ends with the fault-free
    parameters, bit for bit."""
    import torch

    code, evs = _audited(tmp_path, nproc, fault)
    assert code == 0
    (seen,) = _kinds(evs, "sdc_detected")
    assert seen["cause"] == "audit_mismatch" and seen["replicas"][0] == culprit
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["cause"], verdict["culprits"]) == ("transient", [culprit])
    assert verdict["first_bad_step"] == int(fault.rsplit(":", 1)[1])
    final = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(final[k], audited_clean[nproc][k]) for k in final)
    summary, text = run_report(tmp_path)
    assert summary["replicas"]["audits"] == 5  # six audits, one of them found the fault
    assert "each rank last audited at step 25" in text


@pytest.mark.parametrize(
    ("nproc", "culprits", "how"), [(3, [1], "odd_one_out"), (2, [0, 1], "pair")]
)
def test_a_persistent_compute_fault_is_named_and_the_job_leaves_its_hardware(
    tmp_path: Path, nproc: int, culprits: list[int], how: str
):
    """Rank 1 multiplies wrongly from step 3 on: the audit of step 5 finds it, the in-place
    re-run reproduces it, a third rank (at 3) names rank 1; the update is skipped and the
    job exits 16 for other hardware (rerun_elsewhere names the culprit's)."""
    code, evs = _audited(tmp_path, nproc, "--mercurial=1:3", "--persistent")
    assert code == 16
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["cause"], verdict["culprits"], verdict["first_bad_step"]) == (how, culprits, 5)
    assert verdict["last_agreed_step"] == 0
    assert sorted(e["rank"] for e in _kinds(evs, "rerun_elsewhere")) == culprits


# ---------------------------------------------------------------------------------------
# A Lightning run (steadfast's callbacks and SteadfastCheckpointIO, a checkpoint an epoch)


LIGHTNING = HERE / "lightning_train.py"


def _lightning(workdir: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, "--nproc-per-node=2", "--max-restarts=2", "--ft-replica-check-every=2",
        str(LIGHTNING), "--ckpt", str(workdir / "ck"), "--out", str(workdir / "out.pt"),
        "--step-sleep", "0.05", *extra,
    )  # fmt: skip


def test_a_lightning_run_rolls_back_from_a_flipped_bit_bit_exact(tmp_path: Path):
    """Rank 1's first weight flips a bit at step 5 (fail_at's bit_flip): the checks every
    2 steps find the pair apart, the job rolls back to the epoch's checkpoint at step 4
    (proven clean by the check of step 4), Lightning's ``ckpt_path="last"`` falls back to
    it, and the run ends with a fault-free run's parameters."""
    import torch

    clean = tmp_path / "clean"
    code, _ = _lightning(clean)
    assert code == 0
    code, evs = _lightning(tmp_path / "flip", "--fault", "bit_flip", "--fault-rank", "1",
                           "--fault-step", "5")  # fmt: skip
    assert code == 0
    (verdict,) = _kinds(evs, "sdc_verdict")
    assert (verdict["culprits"], verdict["cause"], verdict["clean_step"]) == ([0, 1], "pair", 4)
    assert [e["to_step"] for e in _kinds(evs, "rollback")] == [4]
    final, reference = torch.load(tmp_path / "flip" / "out.pt"), torch.load(clean / "out.pt")
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    summary, _ = run_report(tmp_path / "flip")
    assert [f["fault"] for f in summary["faults"]] == ["bit_flip"]
    assert summary["faults"][0]["detected_by"] == "sdc_detected"
