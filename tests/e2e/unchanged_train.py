"""A torchrun script that imports nothing of steadfast (issue 37: "your script,
unchanged"): ``init_process_group("gloo")``, DDP, Adam, a ``DataLoader``, and its own
``snapshot.pt`` (written by rank 0 every ``--snapshot-every`` steps, loaded at start),
so a restarted group goes on from it. Each step's batch comes from a generator seeded by
the step and the rank, so a resumed run ends bit for bit where a fault-free one does.

The faults and loads a test asks for are the script's own doing, never steadfast's:

- ``--hang sleep:R:S``: rank R sleeps for an hour inside step S (after its forward;
  the others wait in DDP's all-reduce); ``--hang loader:R:S``: rank R's DataLoader
  worker never returns batch S; ``--hang kill:R:S``: rank R kills itself (SIGKILL) in
  step S, a crash. Once per run (a marker beside the snapshot).
- ``--eval-every K --eval-seconds E``: every K steps every rank computes for E seconds
  (an evaluation that does not call the model).
- ``--save-at S --save-seconds E``: at step S rank 0 writes a file for E seconds (a
  save on slow storage) while the others wait in ``barrier()``.
- ``--slow-rank R --slow-from S``: rank R's forward takes twice the pace from step S on
  (the time it began goes into ``--trace``).
- ``--compile``: ``torch.compile`` on the model and on the optimizer's step (no DDP),
  with ``--compile-backend`` (``aot_eager`` by default: no C++ build in the tests);
  dynamo's counters go into ``--trace`` at the end.
- ``--corrupt KIND:R:S``: after step S's optimizer step, one bit of rank R's state
  flips, as bad memory or a cosmic ray would flip it: ``exponent`` (the lowest exponent
  bit of a first-layer weight: the value halves or doubles, finite), ``mantissa`` (its
  highest mantissa bit), ``moment`` (the same bit of the weight's Adam second moment).
  Once per run (a marker beside the snapshot).
- ``--cuda``: on the rank's GPU (``LOCAL_RANK``), over NCCL (the batches are still made
  on the CPU, then moved).

Rank 0 writes the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Model(torch.nn.Module):
    def __init__(self, pace: float) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.pace = pace  # the compute this tiny model stands for (seconds per forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pace:
            time.sleep(self.pace)
        return self.body(x)


class Batches(Dataset):
    """Batch ``i`` of this rank, from a generator seeded by (step, rank)."""

    def __init__(self, first: int, steps: int, rank: int, stuck_at: int | None) -> None:
        self.first, self.steps, self.rank, self.stuck_at = first, steps, rank, stuck_at

    def __len__(self) -> int:
        return self.steps - self.first

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.first + i
        if step == self.stuck_at:
            time.sleep(3600)  # a DataLoader worker that never returns this batch
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


def flip_bit(model: torch.nn.Module, optimizer: torch.optim.Optimizer, kind: str) -> None:
    """One bit of element 5 of the first weight (or of its Adam second moment) flipped."""
    weight = model.body[0].weight
    target = optimizer.state[weight]["exp_avg_sq"] if kind == "moment" else weight
    bit = {"exponent": 23, "mantissa": 22, "moment": 22}[kind]
    with torch.no_grad():
        target.view(-1).view(torch.int32)[5] ^= 1 << bit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--snapshot", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pace", type=float, default=0.05)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--hang", default="none")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-seconds", type=float, default=0.0)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--save-seconds", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=-1)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-backend", default="aot_eager")
    p.add_argument("--corrupt", default="none")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()

    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(args.pace).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    first = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True, map_location=device)
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        first = snap["steps"]
    kind, hang_rank, hang_step = [*args.hang.split(":"), "-1", "-1"][:3]
    marker = args.snapshot + ".hang-done"
    hangs = kind != "none" and int(hang_rank) == rank and not os.path.exists(marker)
    stuck_at = int(hang_step) if hangs and kind == "loader" else None
    if hangs:
        open(marker, "w").close()  # once per run: the restarted group does not hang
    flip, flip_rank, flip_step = [*args.corrupt.split(":"), "-1", "-1"][:3]
    flips = flip != "none" and int(flip_rank) == rank
    flips = flips and not os.path.exists(args.snapshot + ".flip-done")
    if args.compile:
        net = torch.compile(model, backend=args.compile_backend)
        step_fn = torch.compile(optimizer.step, backend=args.compile_backend)
    else:
        net = DistributedDataParallel(model)
        step_fn = optimizer.step
    data = Batches(first, args.steps, rank, stuck_at)
    loader = DataLoader(data, batch_size=None, num_workers=args.loader_workers)
    with open(args.trace, "a", buffering=1) as trace:  # line by line: a test reads it live
        for i, (x, y) in enumerate(loader):
            step = first + i
            x, y = x.to(device), y.to(device)
            if step == args.slow_from and rank == args.slow_rank:
                model.pace *= 2
                trace.write(f"slow {time.time()}\n")
                trace.flush()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            if hangs and kind in ("sleep", "kill") and step == int(hang_step):
                trace.write(f"hang {time.time()}\n")
                trace.flush()
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            loss.backward()
            step_fn()
            done = step + 1
            if flips and done == int(flip_step):
                open(args.snapshot + ".flip-done", "w").close()
                flip_bit(model, optimizer, flip)
                trace.write(f"flip {time.time()}\n")
            if args.eval_every and done % args.eval_every == 0:
                a = torch.randn(128, 128)
                until = time.monotonic() + args.eval_seconds
                while time.monotonic() < until:  # every rank evaluates
                    a = torch.tanh(a @ a)
            if done == args.save_at:
                if rank == 0:  # a save on slow storage: rank 0 alone writes
                    until = time.monotonic() + args.save_seconds
                    with open(args.snapshot + ".slow", "wb") as fh:
                        while time.monotonic() < until:
                            fh.write(os.urandom(1 << 16))
                            time.sleep(0.05)
                dist.barrier()  # the others wait for it here
            if rank == 0 and done % args.snapshot_every == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "steps": done}, args.snapshot + ".tmp")
                os.replace(args.snapshot + ".tmp", args.snapshot)
            trace.write(f"step {done} {time.time()}\n")
        if args.compile:
            import torch._dynamo.utils as dynamo_utils

            counters = {k: dict(v) for k, v in dynamo_utils.counters.items()}
            trace.write("dynamo " + json.dumps(counters, sort_keys=True) + "\n")
    if rank == 0:
        torch.save(dict(model.state_dict()), args.out)
    # DDP's reducer first, while c10d still holds the group: a reducer that drops the
    # group's last reference joins gloo's threads holding the GIL, and one of them may
    # need it to free a finished work (torch 2.13; seen in forked workers: see
    # docs/architecture.md)
    del net, step_fn
    dist.barrier()
    dist.destroy_process_group()
    del world


if __name__ == "__main__":
    main()
