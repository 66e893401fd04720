"""steadfast's Lightning callbacks end to end: ``lightning_train.py`` (2 gloo ranks, a
Lightning ``Trainer`` with FaultToleranceCallback, GracefulShutdownCallback, NaNCallback
and ModelCheckpoint) under ``steadfast launch``, one real fault per test.

Each fault test checks the detection (an event with its cause), the recovery (the
launcher exits 0 after an in-job restart, resumed from Lightning's last checkpoint),
the final parameters against the fault-free run bit for bit, and that ``steadfast
report`` reads the run: the fault injected, detected and recovered.
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

from sfharness import assert_none_left, read_events

SCRIPT = Path(__file__).with_name("lightning_train.py")
SLEEP = "0.05"  # seconds per step: calculated step timeouts well above the noise

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

if importlib.util.find_spec("lightning") is None:
    reason = "PyTorch Lightning is not installed (`make test` installs the dev extra)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; CI must run the Lightning tests", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(autouse=True)
def no_worker_outlives_its_launcher(tmp_path: Path):
    yield
    assert_none_left(str(tmp_path))


def launch(workdir: Path, *script_args: str) -> tuple[int, list[dict[str, Any]]]:
    """One ``steadfast launch`` of the Lightning script; (exit status, the run's events)."""
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    done = subprocess.run(
        [
            sys.executable, "-m", "steadfast.cli", "launch", "--nproc-per-node=2",
            "--monitor-interval=0.1", "--max-restarts=2", "--events", str(events),
            "--ft-param-workers_stop_timeout=5",
            str(SCRIPT), "--ckpt", str(workdir / "ck"), "--out", str(workdir / "out.pt"),
            "--step-sleep", SLEEP, *script_args,
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if done.returncode not in (0,):
        print(done.stdout[-4000:], done.stderr[-4000:])
    return done.returncode, read_events(events)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("lightning_reference")
    code, evs = launch(root)
    assert code == 0
    assert sum(e["kind"] == "step_done" for e in evs) == 2 * 16
    return torch.load(root / "out.pt")


def assert_bit_exact(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = torch.load(out)
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), f"{name} differs from the fault-free run"


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
    ("fault", "detected"),
    [
        ("rank_killed", ("rank_failed", {"cause": "signal SIGKILL"})),
        ("rank_hung", ("rank_hung", {"cause": "section:step"})),
    ],
)
def test_a_failed_rank_restarts_from_the_last_checkpoint_bit_exact(
    tmp_path, reference, fault, detected
):
    code, evs = launch(tmp_path, "--fault", fault, "--fault-rank", "1", "--fault-step", "10")
    assert code == 0
    kind, match = detected
    assert kinds(evs, kind, rank=1, **match), [e["kind"] for e in evs]
    assert kinds(evs, "restart", cause="worker_failure")
    resumed = [e for e in kinds(evs, "job_start") if e["resumed_from"]]
    assert {e["step"] for e in resumed} == {8}  # the end of epoch 1: last.ckpt
    assert_bit_exact(tmp_path / "out.pt", reference)
    verdict = report(tmp_path)
    assert [f["fault"] for f in verdict["faults"]] == [fault]
    assert verdict["faults"][0]["recovered"] and verdict["faults"][0]["detected_by"]


def test_a_nan_burst_is_skipped_then_rolled_back_bit_exact(tmp_path, reference):
    """Three NaN steps on one rank: every rank skips each (NaNCallback), and at
    max_consecutive=3 they stop so the launcher restarts them from the last checkpoint;
    the replay has no NaN and ends where the fault-free run does."""
    code, evs = launch(
        tmp_path, "--fault", "nan_burst", "--fault-rank", "1", "--fault-step", "9",
        "--fault-length", "3",
    )  # fmt: skip
    assert code == 0
    assert {e["step"] for e in kinds(evs, "nan_detected")} == {9, 10, 11}
    assert kinds(evs, "nan_rollback_recommended")
    assert kinds(evs, "restart", cause="worker_failure")
    assert_bit_exact(tmp_path / "out.pt", reference)


def test_sigterm_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    """SIGTERM to one rank: all ranks agree to stop after the same batch, save through
    the Trainer where ModelCheckpoint keeps its last checkpoint and exit 0; the next
    launch (a requeued job) resumes there and completes the run."""
    code, evs = launch(tmp_path, "--fault", "sigterm", "--fault-rank", "1", "--fault-step", "6")
    assert code == 0
    (agreed,) = kinds(evs, "shutdown_agreed")
    assert agreed["step"] == 7 and agreed["rank"] == 0
    assert len(kinds(evs, "shutdown_complete")) == 2  # both ranks saved and stopped
    assert not kinds(evs, "restart") and not kinds(evs, "rank_hung")
    stopped = max(e["step"] for e in kinds(evs, "step_done"))
    assert not (tmp_path / "out.pt").exists()  # the run is not over
    saved = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == stopped + 1  # saved after the agreed batch

    code, evs = launch(tmp_path)
    assert code == 0
    resumed = [e for e in kinds(evs, "job_start") if e["resumed_from"]]
    assert {e["step"] for e in resumed} == {stopped + 1}
    assert {e["step"] for e in kinds(evs, "step_done")} >= set(range(stopped + 1, 16))
    assert (tmp_path / "out.pt").exists()
