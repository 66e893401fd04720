"""Every restore proven by replay, end to end: ``steadfast launch`` of a plain DDP loop
(``proof_loop.py``: an LR scheduler, a data position, a loss in each ``step_done``),
rank 1 SIGKILLed in a step (rank 0 finishes it: it logs one step more), and the
restart's first re-done steps compared with the losses logged before the kill.

- nothing wrong: ``restore_verified``; killed in step 8, the newest checkpoint (step 8)
  left one logged step to re-do, so the restore took step 6, the newest that leaves
  three (two steps re-done only for the proof, said in the event), and the run ends
  bit-exact;
- the LR scheduler, or the data position, left out of the checkpoints:
  ``restore_mismatch`` naming the step whose loss differs; the job does not go on (the
  restart finds no checkpoint left that has not failed a proof: exit 17);
- the memory snapshot it restores swapped for another step's (whole, checksums valid):
  mismatch, and the restart reads the disk tier, verified, bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, assert_none_left, launch_run

HERE = Path(__file__).parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def no_worker_outlives_its_launcher(tmp_path: Path):
    yield
    assert_none_left(str(tmp_path))


def launch(workdir: Path, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    return launch_run(
        workdir, "--nproc-per-node=2", "--monitor-interval=0.1", "--max-restarts=3",
        str(HERE / "proof_loop.py"), "--ckpt", str(workdir / "ck"),
        "--out", str(workdir / "out.pt"), *script_args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("proof_reference")
    code, evs = launch(root)
    assert code == 0
    assert not [e for e in evs if e["kind"].startswith("restore_")]  # nothing restored
    return torch.load(root / "out.pt")


def kinds(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind]


def test_a_restore_is_proven_by_two_re_done_losses(tmp_path, reference):
    code, evs = launch(tmp_path, "--kill-at", "8")
    assert code == 0
    assert [e["cause"] for e in kinds(evs, "rank_failed")] == ["signal SIGKILL"]
    [verified] = kinds(evs, "restore_verified")
    assert (verified["step"], verified["tier"], verified["steps"]) == (6, "disk", [6, 7, 8])
    assert verified["ranks"] == 2 and verified["proof_steps"] == 2  # rank 1 logged 6 and 7
    assert verified["proof_seconds"] > 0
    assert not kinds(evs, "restore_mismatch")
    assert_bit_exact(tmp_path / "out.pt", reference)


@pytest.mark.parametrize(("forgotten", "differs"), [("scheduler", 6), ("data", 4)])
def test_a_state_the_checkpoint_lacks_is_a_mismatch_and_the_job_stops(tmp_path, forgotten, differs):
    """Killed in step 7, restored from step 4 (the newest that leaves three logged
    steps). Without the scheduler (a LambdaLR) the first two re-done losses are right
    (the optimizer's state holds the rate of the first update) and the third wrong;
    without the data position the first is wrong."""
    code, evs = launch(tmp_path, "--kill-at", "7", "--forget", forgotten)
    assert code == 17  # failed result validation: not restarted in a loop
    [mismatch] = kinds(evs, "restore_mismatch")
    assert (mismatch["step"], mismatch["tier"]) == (4, "disk")
    assert min(d["step"] for d in mismatch["differs"]) == differs
    assert {d["rank"] for d in mismatch["differs"]} == {0, 1}
    assert all(d["loss"] != d["logged"] for d in mismatch["differs"])
    assert not kinds(evs, "restore_verified")
    # the restart after the mismatch found nothing left to trust, and said so
    assert [e["exit_code"] for e in kinds(evs, "workers_exited")[-1]["exits"]] == [17, 17]
    assert (tmp_path / "ck" / "restore-excluded.json").exists()
    # no checkpoint was written from the unproven state
    saved = [e["step"] for e in kinds(evs, "checkpoint_saved")]
    assert saved == [2, 4, 6]


def test_a_swapped_memory_snapshot_is_a_mismatch_and_the_disk_tier_is_used(tmp_path, reference):
    code, evs = launch(
        tmp_path, "--kill-at", "7", "--memory-every", "1", "--save-every", "4",
        "--swap-snapshots", "5", "6",
    )  # fmt: skip
    assert code == 0
    [mismatch] = kinds(evs, "restore_mismatch")
    assert (mismatch["step"], mismatch["tier"]) == (5, "memory")
    assert min(d["step"] for d in mismatch["differs"]) == 5
    [verified] = kinds(evs, "restore_verified")
    assert (verified["step"], verified["tier"]) == (4, "disk")
    assert_bit_exact(tmp_path / "out.pt", reference)
