"""Preemption (Megatron Bridge): SIGTERM to one rank; both ranks save and exit after the
same step, and the resumed run ends with the fault-free parameters."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from sfharness import run_ranks

STEPS, SIGNAL_AT = 12, 5


def _train(rank: int, world: int, workdir: Path, ckpt: str, preempt: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadfast import CheckpointManager, PreemptionConfig, PreemptionHandler

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(ckpt)
    restored = mgr.restore({"model": model.module, "optim": opt})
    start = restored[0] if restored else 0
    stopped = None
    with PreemptionHandler(PreemptionConfig(exit_signal_handler=True)) as pre:
        for step in range(start, STEPS):
            if preempt and rank == 1 and step == SIGNAL_AT:
                os.kill(os.getpid(), signal.SIGTERM)  # Slurm signals one task first
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if pre.should_exit(step):  # every rank, the same step
                mgr.save(step + 1, {"model": model.module, "optim": opt})
                stopped = step
                break
    mgr.close()
    return [p.detach().clone() for p in model.module.parameters()], start, stopped


def test_preempted_rank_stops_everyone_and_the_run_resumes_bit_exact(
    tmp_path: Path, event_log: Path
):
    reference = run_ranks(_train, tmp_path / "ref", args=(str(tmp_path / "a"), False))[0][0]
    first = run_ranks(_train, tmp_path / "run1", args=(str(tmp_path / "b"), True))
    assert [r[2] for r in first] == [SIGNAL_AT, SIGNAL_AT]  # both after the same step
    resumed = run_ranks(_train, tmp_path / "run2", args=(str(tmp_path / "b"), False))
    for params, start, stopped in resumed:
        assert start == SIGNAL_AT + 1 and stopped is None
        assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    kinds = [json.loads(line) for line in event_log.read_text().splitlines()]
    assert [e["rank"] for e in kinds if e["kind"] == "preemption_signal"] == [1]
    exits = [e for e in kinds if e["kind"] == "preemption_exit"]
    assert len(exits) == 1 and exits[0]["ranks_signalled"] == [1] and exits[0]["step"] == SIGNAL_AT
