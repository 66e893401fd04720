"""A DDP loop as users write it, for the replay proof's tolerance:

    steadfast launch --nproc-per-node 4 ddp_loop.py KILL_STEP [exact] [--tolerance T]

A 3-layer MLP under DDP (``find_unused_parameters=True`` only with ``exact``), Adam,
a memory snapshot every step and a disk checkpoint every 10, the loss in each
``step_done``; rank 1 is SIGKILLed at KILL_STEP, once per run. Rank 0 writes the final
parameters to ``out.pt``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, events
from steadfast.faults import FaultKind, fail_at


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kill_step", type=int)
    p.add_argument("exact", nargs="?", default="")
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    model = DDP(net, find_unused_parameters=args.exact == "exact")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = {} if args.tolerance is None else {"proof_tolerance": args.tolerance}
    ckpt = CheckpointManager("ckpt", memory_every=1, **extra)
    state = {"model": net, "optim": opt}
    restored = ckpt.restore(state)
    fault = fail_at(rank=1, step=args.kill_step, kind=FaultKind.RANK_KILLED, once_dir="faults")
    g = torch.Generator()
    for step in range(restored[0] if restored else 0, args.steps):
        fault.check(step)
        g.manual_seed(1000 * step + rank)  # the data of (step, rank): the same on a re-run
        loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        events.emit("step_done", step=step, loss=loss.item())
        ckpt.snapshot(step + 1, state)
        if (step + 1) % 10 == 0:
            ckpt.save(step + 1, state)
    ckpt.close()
    if rank == 0:
        torch.save(net.state_dict(), "out.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
