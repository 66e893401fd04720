"""A user's torchrun script that knows nothing of steadfast (imports nothing from it).

It has the shape of pytorch/examples' ``ddp-tutorial-series/multinode.py``, made
CPU-only: torchrun's environment, ``init_process_group("gloo")``, DDP, a
``DistributedSampler``, and its own ``snapshot.pt`` on the shared file system, written by
global rank 0 after every epoch and loaded at start when present, so a restarted group
goes on from the last finished epoch. What steadfast gives such a script comes from the
launcher alone.

    torchrun ... plain_ddp.py --snapshot DIR/snapshot.pt --epochs 60 --out DIR/out.pt

Besides its model (``--out``, written by global rank 0 at the end), it leaves per
epoch a line ``epoch E world W rank R host H time T`` (and ``done ...`` at the end) in
``--trace`` (one file per process), which the tests read to check that every epoch ran.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--epoch-sleep", type=float, default=0.3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", required=True, help="a folder for the per-epoch lines")
    parser.add_argument(
        "--hang-at-end-on",
        default=None,
        help="(tests) on this host, the ranks never end after their last line: a teardown "
        "that hangs",
    )
    parser.add_argument(
        "--hold",
        default=None,
        help="(tests) a run that starts from no snapshot waits before epoch --hold-at while "
        "this file exists, evaluating the model every --epoch-sleep (signs of progress, no "
        "change to the state): a fault a test makes lands mid-run however slow the machine",
    )
    parser.add_argument("--hold-at", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    host = socket.gethostname()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first_epoch = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        first_epoch = snap["epochs_run"]
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(data)  # rank and world from the default group
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    os.makedirs(args.trace, exist_ok=True)
    name = os.path.join(args.trace, f"rank{rank}-restart{restart}-pid{os.getpid()}")
    with open(name, "a") as trace:
        for epoch in range(first_epoch, args.epochs):
            while args.hold and epoch == args.hold_at and first_epoch == 0 and _held(args.hold):
                with torch.no_grad():
                    model(data.tensors[0][:32])
                time.sleep(args.epoch_sleep)
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
            time.sleep(args.epoch_sleep)  # the pace of a real epoch
            if rank == 0:
                tmp = args.snapshot + ".tmp"
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "epochs_run": epoch + 1}, tmp)
                os.replace(tmp, args.snapshot)
            trace.write(f"epoch {epoch} world {world} rank {rank} host {host} time {time.time()}\n")
            trace.flush()
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        trace.write(
            f"done {args.epochs} world {world} rank {rank} host {host} time {time.time()}\n"
        )
    if args.hang_at_end_on == host:
        while True:  # stuck in its teardown, as a rank in a collective its peers left
            time.sleep(1)
    dist.destroy_process_group()


def _held(path: str) -> bool:
    """Whether ``path`` exists, as rank 0 sees it (every rank decides alike)."""
    flag = torch.tensor([os.path.exists(path) if dist.get_rank() == 0 else False])
    dist.broadcast(flag, 0)
    return bool(flag.item())


if __name__ == "__main__":
    main()
