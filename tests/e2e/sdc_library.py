"""The README's second loop (CheckpointManager with a memory snapshot every step and a
disk save every 20, NaNDetector, ShutdownHandler) for the silent corruption tests
(issue 69). ``--flip RANK:STEP``: after that step's optimizer step, one exponent bit of
one first-layer weight flips on that rank (bad memory): once per run (a marker file
beside the checkpoints), or every time the step is trained with ``--every-time`` (a
device that keeps failing). Rank 0 writes the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, NaNDetector, ShutdownHandler, events


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--flip", default="")
    p.add_argument("--every-time", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nan = NaNDetector(action="skip", max_consecutive=5)
    stop = ShutdownHandler(timeout_sec=120, agree=True)
    stop.register()
    ckpt = CheckpointManager(args.ckpt, keep_last_n=3, memory_every=1)
    state = {"model": model.module, "optim": opt, "nan": nan}
    restored = ckpt.restore(state)
    flip_rank, flip_step = (int(v) for v in args.flip.split(":")) if args.flip else (-1, -1)
    marker = os.path.join(args.ckpt, "flipped")
    for step in range(restored[0] if restored else 0, args.steps):
        loss = model(torch.randn(64, 32)).pow(2).mean()
        opt.zero_grad(), loss.backward()
        if nan.check_loss(loss, step) and nan.check_gradients(model, step):
            opt.step()
        if (
            rank == flip_rank
            and step == flip_step
            and (args.every_time or not os.path.exists(marker))
        ):
            open(marker, "w").close()
            with torch.no_grad():
                model.module.weight.view(-1).view(torch.int32)[5] ^= 1 << 23
        events.emit("step_done", step=step, loss=loss.item())
        if stop.should_shutdown(step):
            ckpt.save(step + 1, state)
            break
        ckpt.snapshot(step + 1, state)
        if (step + 1) % 20 == 0:
            ckpt.save(step + 1, state)
    stop.finish()
    ckpt.close()
    if rank == 0:
        torch.save(dict(model.module.state_dict()), args.out)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
