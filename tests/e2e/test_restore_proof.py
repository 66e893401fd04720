"""Every restore proven by replay, end to end: ``steadfast launch`` of a plain DDP loop
(``proof_loop.py``: a LambdaLR scheduler, a data position, a loss in each
``step_done``), rank 1 SIGKILLed in a step (rank 0 finishes it: it logs one step more),
and the restart's first re-done steps compared with what the run did before the kill.

- nothing wrong: killed in step 8, the newest checkpoint (step 8) leaves one logged step
  to re-do, so step 6 is restored and the state the loop reaches at step 8 is compared
  with checkpoint 8's: ``restore_verified`` (two steps re-done for the proof, said in
  the event), and the run ends bit-exact;
- the LR scheduler, or the data position, left out of the checkpoints:
  ``restore_mismatch`` naming the step and what differs; the job does not go on (the
  restart finds no checkpoint left that has not failed a proof: exit 17);
- the memory snapshot it restores swapped for another step's (whole, checksums valid):
  killed in step 7, snapshot 6 is restored (the one before the newest, 7) and its
  re-done loss and the state at step 7 differ; the restart reads the disk tier,
  verified, bit-exact.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, launch_run

HERE = Path(__file__).parent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("no_worker_outlives_its_launcher"),
]


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


def test_a_restore_is_proven_against_the_newer_checkpoint_bit_exact(tmp_path, reference):
    code, evs = launch(tmp_path, "--kill-at", "8")
    assert code == 0
    assert [e["cause"] for e in kinds(evs, "rank_failed")] == ["signal SIGKILL"]
    [verified] = kinds(evs, "restore_verified")
    assert (verified["step"], verified["tier"], verified["route"]) == (6, "disk", "state")
    assert verified["against"] == str(tmp_path / "ck" / "step_8")
    assert verified["ranks"] == 2 and verified["proof_steps"] == 2
    assert not kinds(evs, "restore_mismatch")
    assert_bit_exact(tmp_path / "out.pt", reference)


@pytest.mark.parametrize(("forgotten", "differs"), [("scheduler", 6), ("data", 4)])
def test_a_state_the_checkpoint_lacks_is_a_mismatch_and_the_job_stops(tmp_path, forgotten, differs):
    """Killed in step 7, restored from step 4 and compared with checkpoint 6 at step 6.
    Without the scheduler (a LambdaLR) the re-done losses are right (the optimizer's
    state holds the rate of the first update) and the state at step 6 is wrong; without
    the data position the first re-done loss is already wrong."""
    code, evs = launch(tmp_path, "--kill-at", "7", "--forget", forgotten)
    assert code == 17  # failed result validation: not restarted in a loop
    [mismatch] = kinds(evs, "restore_mismatch")
    assert (mismatch["step"], mismatch["tier"]) == (4, "disk")
    assert min(d["step"] for d in mismatch["differs"]) == differs
    # rank 0 compares the replicated state it wrote, each rank its own (data, RNG)
    assert {d["rank"] for d in mismatch["differs"]} == ({0} if forgotten == "scheduler" else {0, 1})
    assert all(d["loss"] != d["logged"] for d in mismatch["differs"] if "loss" in d)
    if forgotten == "scheduler":  # the losses were right, the state at step 6 was not
        assert {tuple(d["objects"]) for d in mismatch["differs"]} == {("model", "optim")}
    assert not kinds(evs, "restore_verified")
    # the restart after the mismatch found nothing left to trust, and said so: the first
    # rank to end exits 17, and a rank still on its way to its own exit 17 then (its
    # interpreter's teardown, on a busy machine) is stopped by the launcher after it
    last = sorted(kinds(evs, "workers_exited")[-1]["exits"], key=lambda x: x["time"])
    assert last[0]["exit_code"] == 17, last
    assert all(x["exit_code"] in (17, -signal.SIGTERM) for x in last[1:]), last
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
    assert (mismatch["step"], mismatch["tier"]) == (6, "memory")  # it holds step 5's state
    assert min(d["step"] for d in mismatch["differs"]) == 6
    assert any(d["step"] == 7 and d.get("objects") for d in mismatch["differs"]), mismatch
    [verified] = kinds(evs, "restore_verified")
    assert (verified["step"], verified["tier"]) == (4, "disk")
    assert_bit_exact(tmp_path / "out.pt", reference)
