"""Bit-exact resume: a 2-rank gloo run killed mid-run resumes to the uninterrupted result."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from sfharness import Ranks, run_ranks

STEPS, SAVE_EVERY, KILL_AT = 12, 3, 8


def _train(rank: int, world: int, workdir: Path, ckpt: str, async_save: bool, kill: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadfast import CheckpointManager

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    mgr = CheckpointManager(ckpt, keep_last_n=2, async_save=async_save)
    start = 0
    loaded = mgr.load()
    if loaded is not None:
        start, state = loaded
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    for step in range(start, STEPS):
        if kill and step == KILL_AT and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crashed rank, for real
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        if (step + 1) % SAVE_EVERY == 0:
            mgr.save(step + 1, {"model": model.module, "optim": opt, "sched": sched})
    mgr.wait()
    return [p.detach().clone() for p in model.module.parameters()], start


@pytest.mark.parametrize("async_save", [False, True])
def test_killed_run_resumes_bit_exact(tmp_path: Path, async_save: bool):
    reference, _ = run_ranks(_train, tmp_path / "ref", args=(str(tmp_path / "a"), async_save, False))[0]
    crashed = Ranks(_train, tmp_path / "crash", args=(str(tmp_path / "b"), async_save, True))
    codes = crashed.wait(120)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0  # the peer fails, it does not hang
    resumed = run_ranks(_train, tmp_path / "resume", args=(str(tmp_path / "b"), async_save, False))
    (params0, start0), (params1, start1) = resumed
    assert start0 == start1 == 6  # the last checkpoint before the kill at step 8
    for a, b, ref in zip(params0, params1, reference, strict=True):
        assert torch.equal(a, ref) and torch.equal(b, ref)
