"""Crash consistency: a process saving in a loop is SIGKILLed at random moments."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadfast import CheckpointManager, resolve_resume_path
from steadfast.checkpoint import step_dirs, verify

_SAVER = """
import sys, torch
from steadfast import CheckpointManager
mgr = CheckpointManager(sys.argv[1], keep_last_n=3, async_save=sys.argv[2] == "async")
loaded = mgr.load()
step = loaded[0] if loaded else 0
print("ready", flush=True)
while True:
    step += 1
    mgr.save(step, {"w": torch.full((500_000,), float(step)), "step": step})
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path: Path):
    rng = random.Random(1234)
    d = tmp_path / "ckpt"
    last_step = 0
    for kill in range(30):
        mode = "async" if kill % 2 else "sync"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(d), mode], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        # every checkpoint that is visible under a step_N name is complete and intact
        for _, path in step_dirs(d):
            assert verify(path) == [], f"after kill {kill}: {path} is partial"
        latest = resolve_resume_path(d)
        loaded = CheckpointManager(d).load()
        if loaded is None:
            assert latest is None
            continue
        step, state = loaded
        assert latest is not None and latest.name == f"step_{step}"
        assert state["step"] == step and float(state["w"][0]) == float(step)
        assert step >= last_step  # progress is never lost
        last_step = step
    assert last_step > 0
