"""A plain DDP loop (gloo) with an LR scheduler and a data position, which logs each
step's loss (``step_done``), for the replay proofs of restores
(``test_restore_proof.py``). Its faults: ``--kill-at K`` SIGKILLs rank 1 in step K
(once per run, once rank 0 logged step K's loss); ``--forget scheduler|data`` leaves
that object out of the checkpoints (the resume bugs the proof must catch);
``--swap-snapshots A B`` makes rank 1, just before it dies, swap every rank's memory
snapshots of steps A and B (each stays whole and consistent: its files and manifest
move together, the manifest's step is set to its new name's)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, events
from steadfast.faults import fail_at


class Position:
    """Where the data stream is: the next sample's index (a Stateful)."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


def swap(a: int, b: int) -> None:
    """Swap every rank's memory snapshots of steps ``a`` and ``b`` on this node."""
    for own in Path(os.environ["STEADFAST_MEMORY_DIR"]).glob("*/own/rank_*"):
        first, second, aside = own / f"step_{a}", own / f"step_{b}", own / ".swap"
        first.rename(aside)
        second.rename(first)
        aside.rename(second)
        for folder, step in ((first, a), (second, b)):
            manifest = folder / "manifest.json"
            data = json.loads(manifest.read_text())
            data["step"] = step
            manifest.write_text(json.dumps(data))


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.005)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--memory-every", type=int, default=0)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--forget", choices=["scheduler", "data"], default=None)
    ap.add_argument("--swap-snapshots", type=int, nargs=2, default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8**epoch)
    position = Position()
    state = {"model": model.module, "optim": opt, "sched": sched}
    rank_state = {"data": position}
    if args.forget == "scheduler":
        del state["sched"]
    if args.forget == "data":
        del rank_state["data"]
    ckpt = CheckpointManager(args.ckpt, keep_last_n=3, memory_every=args.memory_every)
    restored = ckpt.restore({**state, **rank_state})
    start = restored[0] if restored else 0
    events.job_start(start, dist.get_world_size(), str(ckpt.loaded_path) if restored else None)
    killer = None
    logged = args.ckpt.parent / "k" / "rank0_logged_the_kill_step"
    if args.kill_at is not None:
        logged.parent.mkdir(parents=True, exist_ok=True)
        killer = fail_at(1, args.kill_at, "rank_killed", once_dir=args.ckpt.parent / "k")
    for step in range(start, args.steps):
        began = time.monotonic()
        g = torch.Generator().manual_seed(1000 * position.index + rank)
        position.index += 1
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if killer is not None and rank == 1 and step == args.kill_at:
            if not (args.ckpt.parent / "k" / killer.marker).exists():
                # rank 0 logs this step's loss first: the losses a restore's proof reads
                # are the same on a busy machine (else the launcher may stop rank 0
                # before it logs, and the newest provable checkpoint is one step older)
                wait_for_file(logged, 60)
                if args.swap_snapshots:
                    swap(*args.swap_snapshots)  # snapshots A and B are written by now
            killer.check(step, rank)
        opt.step()
        sched.step()
        time.sleep(0.02)
        events.emit(
            "step_done", step=step, seconds=round(time.monotonic() - began, 6), loss=loss.item()
        )
        if killer is not None and rank == 0 and step == args.kill_at:
            logged.touch()
        done = step + 1
        if args.memory_every:
            ckpt.snapshot(done, state, rank_state)
        if done % args.save_every == 0:
            ckpt.save(done, state, rank_state)
    ckpt.close()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
