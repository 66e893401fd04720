"""Crash consistency: a process saving in a loop is SIGKILLed at random moments."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from sfharness import fork_when_ready
from steadfast import CheckpointManager, resolve_resume_path
from steadfast.checkpoint import step_dirs, verify


def _start_saver(d: Path, mode: str) -> int:
    """A process that saves checkpoints in a loop; its pid once it saves."""

    def loop(ready) -> None:
        mgr = CheckpointManager(d, keep_last_n=3, async_save=mode == "async")
        loaded = mgr.load()
        step = loaded[0] if loaded else 0
        ready()
        while True:
            step += 1
            mgr.save(step, {"w": torch.full((500_000,), float(step)), "step": step})

    return fork_when_ready(loop)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path: Path):
    rng = random.Random(1234)
    d = tmp_path / "ckpt"
    last_step = 0
    for kill in range(30):
        mode = "async" if kill % 2 else "sync"
        pid = _start_saver(d, mode)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
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
