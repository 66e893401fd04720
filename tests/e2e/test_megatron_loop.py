"""``examples/megatron_loop.py`` under ``steadfast launch``: a SIGTERM to one rank's
whole process group (the rank and its DataLoader worker) stops every rank after the
same step with a checkpoint and exit 0; the resubmitted run resumes mid-epoch, with the
re-run state machine's state, and ends with the fault-free parameters bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_loop.py"
STEPS, SIGTERM_AT = 12, 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(
    workdir: Path, ckpt: Path, *script_args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "steadfast.cli", "launch", "--nproc-per-node=2",
        "--monitor-interval=0.1", str(EXAMPLE), "--ckpt-dir", str(ckpt),
        "--steps", str(STEPS), "--out", str(workdir / "out.pt"), *script_args,
    ]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize("sig", ["TERM", "USR1"])
def test_preempted_run_resumes_to_the_fault_free_parameters(
    tmp_path: Path, event_log: Path, sig: str
):
    """TERM: Megatron Bridge's exit_signal. USR1: the job's preemption signal under
    ``steadfast slurm`` (its default), declared in $STEADFAST_PREEMPT_SIGNAL by the batch
    script: the handler, left at exit_signal=SIGTERM, takes it as well (unhandled, it
    ended the rank before its save, and the launcher exited 77)."""
    env = dict(os.environ, STEADFAST_PREEMPT_SIGNAL=sig)
    ref = _run(tmp_path / "ref", tmp_path / "ref_ckpt", env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = _run(
        tmp_path / "run", tmp_path / "ckpt", "--sigterm-at", str(SIGTERM_AT), "--signal", sig,
        env=env,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]  # a preemption stop is not a failure
    number = int(signal.Signals["SIG" + sig])
    assert f"Received signal {number}, initiating graceful stop" in first.stderr
    assert f"exiting program after receiving SIG{sig}." in first.stderr
    assert not (tmp_path / "run" / "out.pt").exists()  # it stopped early
    latest = os.readlink(tmp_path / "ckpt" / "latest")
    assert os.path.basename(latest) == f"step_{SIGTERM_AT + 1}"
    kinds = [json.loads(line) for line in event_log.read_text().splitlines()]
    signalled = [e for e in kinds if e["kind"] == "preemption_signal"]
    assert {e["rank"] for e in signalled} == {1}  # the loader worker did not die of it
    (exit_event,) = [e for e in kinds if e["kind"] == "preemption_exit"]
    assert (exit_event["step"], exit_event["ranks_signalled"]) == (SIGTERM_AT, [1])
    assert not [e for e in kinds if e["kind"] in ("rank_failed", "restart")]
    second = _run(tmp_path / "run", tmp_path / "ckpt", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    expected = torch.load(tmp_path / "ref" / "out.pt", weights_only=True)
    got = torch.load(tmp_path / "run" / "out.pt", weights_only=True)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
