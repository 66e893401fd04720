"""Reference training script: a plain DDP loop using steadfast's rank-local toolkit.

Run it under torchrun (or `steadfast demo`, which does):

    torchrun --standalone --nproc-per-node 2 examples/train.py --ckpt-dir runs/x/ckpt

What it shows:
- NaNDetector: a NaN injected into one rank's loss is seen by every rank at the same step
  (one all-reduce), and every rank skips that optimizer step, so replicas stay identical.
- ShutdownHandler(agree=True): a SIGTERM delivered to any one rank makes every rank save
  a checkpoint and exit after the same step.
- CheckpointManager.restore: a rerun resumes from the latest checkpoint; because the data of a
  step depends only on (seed, step, rank), the resumed run ends bit-identical to a run
  that was never interrupted.

CheckpointManager writes each checkpoint atomically with a verified manifest (the
replicated state once, by rank 0; each rank's RNG streams to its own file), and every
rank waits until it is durable.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import (
    CheckpointManager,
    NaNDetector,
    ShutdownHandler,
    events,
    log_job_info,
    world_info,
)
from steadfast.monitor import HB_TABLE_ENV, RankMonitorClient


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nan-rank", type=int, default=1, help="rank whose loss goes NaN")
    p.add_argument("--nan-steps", default="", help="comma-separated steps with a NaN loss")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (demo pace)")
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes final params")
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: nccl when every local rank has its own GPU, else gloo",
    )
    p.add_argument("--progress-dir", type=Path, default=None, help="per-rank 'pid step' files")
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL --kill-rank at this step")
    p.add_argument("--kill-rank", type=int, default=1)
    return p.parse_args()


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on (seed, step, rank): resuming replays it exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)


class _Unmonitored:
    """Stands in for RankMonitorClient when the script runs under plain torchrun."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def main() -> int:
    args = parse_args()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ft: Any = _Unmonitored()
    if os.environ.get(HB_TABLE_ENV):  # under steadfast launch: report sections
        ft = RankMonitorClient()
        ft.init_workload_monitoring()
    ft.start_section("setup")
    backend = args.backend
    if backend == "auto":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if enough_gpus else "gloo"
    dist.init_process_group(backend)
    info = world_info()
    device = torch.device("cuda", info.local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not os.environ.get(events.EVENTS_ENV):
        events.set_default_path(args.ckpt_dir / "events.jsonl")
    log_job_info()
    nan_steps = {int(s) for s in args.nan_steps.split(",") if s.strip()}

    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DDP(net.to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detector = NaNDetector(action="skip", max_consecutive=3)
    handler = ShutdownHandler(timeout_sec=60, agree=True)
    handler.register()

    ckpt = CheckpointManager(args.ckpt_dir, keep_last_n=3)
    start = 0
    resume = None
    # verified: a corrupt checkpoint falls back to an older one; RNG streams are restored too
    restored = ckpt.restore({"model": model.module, "optim": opt, "nan": detector})
    if restored is not None:
        start = restored[0]
        resume = args.ckpt_dir / f"step_{start}"  # the checkpoint actually loaded

    def save(done: int) -> None:
        ft.start_section("checkpointing")
        ckpt.save(done, {"model": model.module, "optim": opt, "nan": detector})
        ft.end_section("checkpointing")

    events.emit(
        "job_start",
        step=start,
        world_size=info.world_size,
        resumed_from=str(resume) if resume else None,
    )
    if info.rank == 0:
        print(
            f"[train] {'resuming from ' + str(resume) if resume else 'fresh start'}"
            f" at step {start}",
            flush=True,
        )

    ft.end_section("setup")
    step = start
    reason = "completed"
    for step in range(start, args.steps):
        if step == args.kill_at and info.rank == args.kill_rank and generation == 0:
            events.emit("fault_injected", step=step, cause="rank_killed", fault="rank_killed")
            print(f"[train] rank {info.rank}: SIGKILL to myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a crashed rank: the launcher restarts all
        ft.send_heartbeat()
        ft.start_section("step")
        x, y = (t.to(device) for t in batch(args.seed, step, info.rank))
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in nan_steps and info.rank == args.nan_rank:
            loss = loss * float("nan")  # a fault on one rank only
            events.emit("fault_injected", step=step, cause="nan", fault="nan_loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if detector.check_loss(loss, step):  # every rank gets the same answer
            opt.step()
        elif info.rank == 0:
            print(
                f"[train] step {step}: NaN seen by all ranks -> optimizer step skipped", flush=True
            )
        ft.end_section("step")
        if args.progress_dir is not None:
            args.progress_dir.mkdir(parents=True, exist_ok=True)
            (args.progress_dir / f"rank{info.rank}").write_text(f"{os.getpid()} {step}")
        done = step + 1
        if handler.should_shutdown(step):  # collective: all ranks stop after this step
            save(done)
            reason = "shutdown"
            if info.rank == 0:
                print(
                    f"[train] shutdown agreed after step {step}; checkpoint step_{done} saved",
                    flush=True,
                )
            break
        if done % args.save_every == 0:
            save(done)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    handler.finish()
    ckpt.close()
    ft.shutdown_workload_monitoring()
    if reason == "completed" and args.out is not None and info.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.out)
    events.emit("job_end", step=step + 1, cause=reason, exit_code=0, reason=reason)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
