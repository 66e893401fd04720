"""steadfast's framework callbacks end to end, for PyTorch Lightning
(``lightning_train.py``: a ``Trainer`` with steadfast's FaultToleranceCallback,
GracefulShutdownCallback and NaNCallback, and ModelCheckpoint at each epoch end) and the
Hugging Face ``Trainer`` (``hf_train.py``: the same three callbacks, a checkpoint every
2 steps): 2 gloo ranks under ``steadfast launch``, one real fault per test.

Each fault test checks the detection (an event with its cause), the recovery (the
launcher exits 0 after an in-job restart, resumed from the framework's last
checkpoint), the final parameters against the fault-free run bit for bit, and that
``steadfast report`` reads the run: the fault injected, detected and recovered.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sfharness import assert_bit_exact, launch_run
from steadfast import CheckpointManager
from steadfast.checkpoint import verify

HERE = Path(__file__).parent
SLEEP = "0.05"  # seconds per step: calculated step timeouts well above the noise
#: framework -> (its package, the training script)
FRAMEWORKS = {
    "lightning": ("lightning", HERE / "lightning_train.py"),
    "transformers": ("transformers", HERE / "hf_train.py"),
}
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("no_worker_outlives_its_launcher"),
]


@pytest.fixture(params=sorted(FRAMEWORKS), scope="module")
def framework(request: pytest.FixtureRequest) -> str:
    package, _ = FRAMEWORKS[request.param]
    if importlib.util.find_spec(package) is None:
        reason = f"{package} is not installed (`make test` installs the dev extra)"
        if IN_CI:
            pytest.fail(f"{reason}; CI must run the {request.param} tests")
        pytest.skip(reason)
    return str(request.param)


def launch(framework: str, workdir: Path, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    """One ``steadfast launch`` of the framework's script; (exit status, the events)."""
    return launch_run(
        workdir, "--nproc-per-node=2", "--monitor-interval=0.1", "--max-restarts=2",
        "--ft-param-workers_stop_timeout=5",
        str(FRAMEWORKS[framework][1]), "--ckpt", str(workdir / "ck"),
        "--out", str(workdir / "out.pt"), "--step-sleep", SLEEP, *script_args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(framework: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp(f"{framework}_reference")
    code, evs = launch(framework, root)
    assert code == 0
    assert sum(e["kind"] == "step_done" for e in evs) == 2 * 16
    return torch.load(root / "out.pt")


def report(workdir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "steadfast.cli", "report", "--json", "--no-timeline",
         str(workdir / "events.jsonl")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return json.loads(done.stdout)


def kinds(evs: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize(
    ("fault", "detected", "damaged"),
    [
        ("rank_killed", ("rank_failed", {"cause": "signal SIGKILL"}), False),
        ("rank_hung", ("rank_hung", {"cause": "section:step"}), True),
    ],
)
def test_a_failed_rank_restarts_from_the_last_checkpoint_bit_exact(
    framework, tmp_path, reference, fault, detected, damaged
):
    """Rank 1 fails at step 11 (killed, or hung and caught by the step timeout) and every
    rank restarts from the last checkpoint: Lightning's at the end of epoch 1 (step 8),
    the Trainer's every 2 steps (10). With ``damaged``, rank 0 first flips a byte of the
    newest checkpoint (step 10): Lightning (SteadfastCheckpointIO) finds ``last.ckpt``'s
    checksum wrong on every rank and reads ``epoch=1-step=8.ckpt`` (the newest valid
    one, the same step); the Trainer's ``checkpoint-10`` fails its manifest and
    ``last_verified_checkpoint`` resumes from ``checkpoint-8``. Bit-exact either way:
    with the frameworks' own loading the flipped byte would be trained on silently."""
    extra = ["--corrupt-last-at", "10"] if damaged else []
    code, evs = launch(
        framework, tmp_path, "--fault", fault, "--fault-rank", "1", "--fault-step", "11",
        *extra,
    )  # fmt: skip
    assert code == 0
    kind, match = detected
    assert kinds(evs, kind, rank=1, **match), [e["kind"] for e in evs]
    assert kinds(evs, "restart", cause="worker_failure")
    resumed = [e for e in kinds(evs, "job_start") if e["resumed_from"]]
    assert {e["step"] for e in resumed} == {8 if framework == "lightning" or damaged else 10}
    ck = tmp_path / "ck"
    if damaged:
        bad = ck / ("last.ckpt" if framework == "lightning" else "checkpoint-10")
        corrupt = kinds(evs, "checkpoint_corrupt", path=str(bad))
        assert corrupt and all("checksum mismatch" in e["reason"] for e in corrupt)
        if framework == "lightning":  # both ranks read the valid one in the folder
            read = kinds(evs, "checkpoint_loaded", path=str(ck / "epoch=1-step=8.ckpt"))
            assert len(read) == 2
    else:
        assert not kinds(evs, "checkpoint_corrupt")
    assert_bit_exact(tmp_path / "out.pt", reference)
    verdict = report(tmp_path)
    assert [f["fault"] for f in verdict["faults"]] == [fault]
    assert verdict["faults"][0]["recovered"] and verdict["faults"][0]["detected_by"]


def test_a_nan_burst_is_skipped_then_rolled_back_bit_exact(framework, tmp_path, reference):
    """Three NaN steps on one rank: every rank skips each (NaNCallback), and at
    max_consecutive=3 they stop so the launcher restarts them from the last checkpoint;
    the replay has no NaN and ends where the fault-free run does."""
    code, evs = launch(
        framework, tmp_path, "--fault", "nan_burst", "--fault-rank", "1", "--fault-step", "9",
        "--fault-length", "3",
    )  # fmt: skip
    assert code == 0
    assert {e["step"] for e in kinds(evs, "nan_detected")} == {9, 10, 11}
    assert kinds(evs, "nan_rollback_recommended")
    assert kinds(evs, "restart", cause="worker_failure")
    resumed = [e for e in kinds(evs, "job_start") if e["resumed_from"]]
    assert {e["step"] for e in resumed} == {8}  # before the burst: no save during it
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_sigterm_stops_every_rank_after_the_same_step_and_the_next_run_resumes(
    framework, tmp_path, reference
):
    """SIGTERM to one rank in step 6: all ranks agree to stop after the same step (that
    one: the NaN check of step 6's gradients carries the flag, so the ranks agree at its
    end, at global step 7, with no count of the handler's own), save there and exit 0;
    the next launch (a requeued job) resumes from that checkpoint and completes the run,
    bit-exact although the stop is mid-epoch: the Trainer skips the batches its
    epoch already trained, and Lightning restores the position of the ``resumable``
    loader (with a plain DataLoader it would replay the epoch's first batches)."""
    code, evs = launch(
        framework, tmp_path, "--fault", "sigterm", "--fault-rank", "1", "--fault-step", "6"
    )
    assert code == 0
    (agreed,) = kinds(evs, "shutdown_agreed")
    assert agreed["step"] == 7 and agreed["rank"] == 0
    assert len(kinds(evs, "shutdown_complete")) == 2  # both ranks saved and stopped
    assert not kinds(evs, "restart") and not kinds(evs, "rank_hung")
    assert not (tmp_path / "out.pt").exists()  # the run is not over
    if framework == "lightning":  # through SteadfastCheckpointIO: a verified directory
        assert verify(tmp_path / "ck" / "last.ckpt") == []
        step, saved = CheckpointManager(tmp_path / "ck", collective=False).load(
            tmp_path / "ck" / "last.ckpt"
        )
        assert step == saved["global_step"] == 7
    else:
        assert (tmp_path / "ck" / "checkpoint-7").is_dir()

    code, evs = launch(framework, tmp_path)
    assert code == 0
    resumed = [e for e in kinds(evs, "job_start") if e["resumed_from"]]
    assert {e["step"] for e in resumed} == {7}
    assert {e["step"] for e in kinds(evs, "step_done") if e["time"] > resumed[0]["time"]} == set(
        range(7, 16)
    )
    assert_bit_exact(tmp_path / "out.pt", reference)
    verdict = report(tmp_path)
    assert [f["fault"] for f in verdict["faults"]] == ["sigterm"]


def test_a_slow_rank_is_reported_as_a_straggler(framework, tmp_path):
    """Rank 1's forwards slow down for 20 steps: the report (every second) names it.
    Under both frameworks the forward is timed (where no collective makes rank 0 wait for
    rank 1), so its *relative* score (against the other ranks) singles it out."""
    code, evs = launch(
        framework, tmp_path, "--epochs", "8", "--straggler", "--fault", "slow_rank",
        "--fault-rank", "1", "--fault-step", "6", "--fault-length", "20",
        "--fault-seconds", "0.2",
    )  # fmt: skip
    assert code == 0
    found = kinds(evs, "straggler_detected")
    assert found, [e["kind"] for e in evs]
    assert all(e["relative"] == [1] for e in found), found
