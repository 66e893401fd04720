"""A DDP loop with steadfast's compute audits (issue 69, ``steadfast.sdc.ComputeAudit``):
every 5 steps one rank's pre-reduction gradients are recomputed by the next rank.
Faults (the script's own doing, on one rank, from one step):

- ``--mercurial R:S``: rank R's local gradient of the first weight is scaled by 1.5
  before DDP's all-reduce (a core that multiplies wrongly);
- ``--activation R:S``: rank R's first layer output is nudged by 1e-3 (a bad activation);

once (transient: the re-computations are clean), or at every computation from step S on
with ``--persistent``. Rank 0 writes the final parameters to ``--out``; the exit code is
the audit's (16 after a persistent fault). ``--every`` (5) steps between audits;
``--pace`` seconds a forward stands for (the bench's 100 ms step).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import events
from steadfast.sdc import ComputeAudit


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mercurial", default="")
    p.add_argument("--activation", default="")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--pace", type=float, default=0.0, help="seconds a forward stands for")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(32, 1))  # fmt: skip
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # dropout differs per rank

    def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        time.sleep(args.pace)  # the compute a real model's forward would do
        return torch.nn.functional.mse_loss(module(x), y)

    audit = ComputeAudit(model, loss_fn, every=args.every)
    fault = {"on": False, "left": 0}
    kind = "mercurial" if args.mercurial else "activation"
    spec = args.mercurial or args.activation
    f_rank, f_step = (int(v) for v in spec.split(":")) if spec else (-1, -1)
    if rank == f_rank and kind == "mercurial":
        net[0].weight.register_hook(lambda g: g * 1.5 if _strike(fault) else g)
    if rank == f_rank and kind == "activation":
        net[0].register_forward_hook(lambda m, i, out: out + 1e-3 if _strike(fault) else out)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
        if step == f_step:
            fault["on"], fault["left"] = True, 10**9 if args.persistent else 1
        with audit.step(step, batch):
            loss = loss_fn(model, batch)
            opt.zero_grad()
            loss.backward()
        if audit.passed:
            opt.step()
        events.emit("step_done", step=step, loss=float(loss))
        _, leave, code = audit.should_checkpoint_and_exit()  # nothing to save here
        if leave:
            dist.destroy_process_group()
            return code
    if rank == 0:
        torch.save(dict(net.state_dict()), args.out)
    dist.destroy_process_group()
    return 0


def _strike(fault: dict[str, object]) -> bool:
    if not fault["on"] or not fault["left"]:
        return False
    fault["left"] = int(fault["left"]) - 1  # type: ignore[call-overload]
    return True


if __name__ == "__main__":
    sys.exit(main())
