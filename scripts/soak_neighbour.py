"""Someone else's steadfast job for `make soak` (scripts/soak.sh): two gloo DDP ranks that
train a small model step after step, with the launcher's heartbeat table, a memory-tier
snapshot every step and an event log, until the process ``--watch`` names is gone (the
soak script, however it ended). It shares the machine with the suite as a job on a real
node would: its /dev/shm entries, processes and sockets live beside the suite's.

    steadfast launch --standalone --nproc-per-node 2 scripts/soak_neighbour.py --watch PID
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.nn
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager
from steadfast.progress.proc import running


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--watch", type=int, required=True, help="train while this pid lives")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    flag = torch.zeros(1)
    with tempfile.TemporaryDirectory(prefix="soak-neighbour-") as ckpt:
        manager = CheckpointManager(ckpt, keep_last_n=1, memory_every=1)
        state = {"model": model.module, "optim": opt}
        step = 0
        while True:
            flag.fill_(0.0 if running(args.watch) else 1.0)
            dist.all_reduce(flag)  # every rank stops after the same step
            if flag.item() > 0:
                break
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            manager.snapshot(step, state)  # the memory tier, in /dev/shm
            time.sleep(0.05)
        manager.close()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
