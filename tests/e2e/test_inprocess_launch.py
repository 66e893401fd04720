"""In-process restart under `steadfast launch`: the Wrapper restarts the function inside the
workers the launcher started, so the launcher never restarts a process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sfharness import read_events
from steadfast.report import compute_report, load_events

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def _reference() -> dict[str, torch.Tensor]:
    """The fault-free run, in this process: with 2 ranks the all-reduce is one addition
    per element, and a + b == b + a exactly, so summing the two shards' gradients here
    gives the very same bits."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from inprocess_train import _batch
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            x, y = _batch(step, rank, 2)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_exception_is_recovered_in_process_under_steadfast_launch(
    tmp_path: Path, event_log: Path
) -> None:
    out = tmp_path / "params.pt"
    proc = subprocess.run(
        [
            sys.executable, "-m", "steadfast.cli", "launch",
            "--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "0.1",
            str(ROOT / "examples" / "inprocess_train.py"),
            "--steps", str(STEPS), "--fault", "exception:1:5", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evs = read_events(event_log)
    faults = [e for e in evs if e["kind"] == "inprocess_interrupted"]
    assert [(e["cause"], e["fault_rank"]) for e in faults] == [("exception", 1)]
    restarts = [e for e in evs if e["kind"] == "inprocess_restart"]
    assert sorted(e["rank"] for e in restarts) == [0, 1]
    # the launcher saw no failure: no process was restarted
    assert not [e for e in evs if e["kind"] in ("restart", "rank_failed")]
    # every rank resumes from the same step: the fault's (rank 1 raised as step 5
    # began, after its snapshot of 5), or the one before when the interruption reached
    # rank 0 between step 4's last all-reduce and its snapshot (a busy machine: rank 0
    # descheduled there for the monitor's interval; the example's docstring says why
    # all then take the older step)
    # (the two ranks' lines may run together: they share the launcher's stdout)
    resumed = dict(re.findall(r"\[(\d)\] iteration 1: rank \d of 2, from step (\d+)", proc.stdout))
    assert len(resumed) == 2 and len(set(resumed.values())) == 1, proc.stdout
    assert resumed["1"] in ("4", "5"), proc.stdout
    got = torch.load(out, weights_only=True)
    for key, want in _reference().items():
        assert torch.equal(got[key], want), key
    # the report's restart: the fault, the restart inside the processes, the next step
    loaded, _ = load_events(event_log)
    [restart] = compute_report(loaded).restarts_phases
    assert restart["kind"] == "in-process" and "exception" in restart["what"], restart
    phases = restart["phases"]
    assert list(phases) == ["detection", "inprocess_restart", "inprocess_first_step"]
    assert phases["inprocess_restart"] > 0 and phases["inprocess_first_step"] > 0, phases
    assert sum(phases.values()) == pytest.approx(restart["seconds"], abs=1e-3)
