"""The demo's training script, and a reference for a DDP loop that uses every rank-local
feature of steadfast at once. Run it under ``steadfast launch`` (``steadfast demo``
does, with faults):

    steadfast launch --standalone --nproc-per-node 2 examples/train.py --ckpt-dir runs/x/ckpt

What it uses:
- ``RankMonitorClient``: heartbeats and ``setup`` / ``step`` / ``checkpointing``
  sections; the ``step`` timeout is calculated from the steps seen (``--calc-timeouts-at``)
  and kept across restarts in ``ft_state.json``, so a hung rank is caught in seconds.
- ``CheckpointManager``: atomic, verified checkpoints with the RNG streams; a restarted
  or resumed run continues bit-exact (the data of a step depends only on seed, step, rank).
- ``NaNDetector(action="skip")``: every rank skips a step whose loss is NaN on any rank;
  after ``max_consecutive`` such steps every rank rolls back to the latest checkpoint.
- ``StragglerDetectionManager``: the forward pass is timed; a slowed rank is reported.
- ``ShutdownHandler(agree=True)``: a SIGTERM to one rank (a preemption) makes every rank
  save and exit 0 after the same step.
- events: ``job_start`` (with the process start time) and ``step_done`` for the goodput
  report (``steadfast report``); ``fault_injected`` for each injected fault.

Faults (``--fault-rank``, default the last rank; each fires once per run, remembered in
``--fault-dir``, so the re-run of a step after a restart or rollback is clean):
``--nan-burst STEP`` (``--nan-len`` NaN losses in a row), ``--kill-at STEP[,STEP...]``
(SIGKILL, once at each), ``--hang-at STEP`` (stuck in the step), ``--slow-at STEP``
(``--slow-steps`` steps ``--slow-seconds`` slower).
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

from steadfast import CheckpointManager, NaNDetector, ShutdownHandler, events, world_info
from steadfast.monitor import HB_TABLE_ENV, RankMonitorClient, load_ft_state, save_ft_state
from steadfast.straggler import NVRxStragglerDetectionConfig, StragglerDetectionManager


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pace)")
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes final params")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--calc-timeouts-at", type=int, default=15, help="-1: keep the configured")
    p.add_argument("--straggler-interval", type=float, default=2.0, help="seconds per report")
    p.add_argument("--fault-rank", type=int, default=-1, help="-1: the last rank")
    p.add_argument("--fault-dir", type=Path, default=None, help="default: beside --ckpt-dir")
    p.add_argument("--nan-burst", type=int, default=-1)
    p.add_argument("--nan-len", type=int, default=3)
    p.add_argument("--kill-at", type=_steps, default=[], help="STEP[,STEP...]: one kill each")
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--slow-at", type=int, default=-1)
    p.add_argument("--slow-steps", type=int, default=20)
    p.add_argument("--slow-seconds", type=float, default=0.1)
    return p.parse_args()


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on (seed, step, rank): resuming replays it exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)


class _Unmonitored:
    """Stands in for RankMonitorClient when the script runs under plain torchrun."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Faults:
    """Injected faults, each firing once per run (a marker file per fault)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank = args, rank
        self.target = args.fault_rank if args.fault_rank >= 0 else world - 1
        self.dir = args.fault_dir or args.ckpt_dir.parent / "faults"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nan_left = 0
        self.slow_left = 0

    def fire(self, name: str, at: int, step: int, marker: str | None = None) -> bool:
        """True once: on the fault rank, at step ``at``, the first time any run gets there."""
        if at < 0 or step != at or self.rank != self.target:
            return False
        try:
            os.close(os.open(self.dir / (marker or name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        events.emit("fault_injected", step=step, cause=name, fault=name)
        print(f"[train] rank {self.rank}: injecting {name} at step {step}", flush=True)
        return True

    def before_step(self, step: int) -> None:
        a = self.args
        for at in a.kill_at:
            if self.fire("rank_killed", at, step, marker=f"rank_killed@{at}"):
                os.kill(os.getpid(), signal.SIGKILL)  # a crashed rank: the launcher restarts all
        if self.fire("rank_hung", a.hang_at, step):
            while True:  # stuck inside the step: the watcher's step timeout catches it
                time.sleep(3600)
        if self.fire("nan_burst", a.nan_burst, step):
            self.nan_left = a.nan_len
        if self.fire("slow_rank", a.slow_at, step):
            self.slow_left = a.slow_steps

    def nan_now(self) -> bool:
        if self.nan_left > 0:
            self.nan_left -= 1
            return True
        return False

    def slow_now(self) -> float:
        if self.slow_left > 0:
            self.slow_left -= 1
            return float(self.args.slow_seconds)
        return 0.0


def main() -> int:
    args = parse_args()
    ft: Any = _Unmonitored()
    if os.environ.get(HB_TABLE_ENV):  # under steadfast launch: report sections
        ft = RankMonitorClient()
        ft.init_workload_monitoring()
        load_ft_state(ft, args.ckpt_dir / "ft_state.json")  # timeouts calculated earlier
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
    faults = Faults(args, info.rank, info.world_size)

    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DDP(net.to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detector = NaNDetector(action="skip", max_consecutive=3)
    stop = ShutdownHandler(timeout_sec=60, agree=True)
    stop.register()
    stragglers = StragglerDetectionManager(
        NVRxStragglerDetectionConfig(
            enabled=True, report_time_interval=args.straggler_interval, enable_logging=True
        )
    )

    def forward(x: torch.Tensor, slow: float) -> torch.Tensor:
        out: torch.Tensor = model(x)  # no collective in the forward: it times this rank
        if slow:
            time.sleep(slow)  # a slowed GPU
        return out

    timed_forward = stragglers.wrap_train_step(forward)

    ckpt = CheckpointManager(args.ckpt_dir, keep_last_n=3)
    state = {"model": model.module, "optim": opt, "nan": detector}
    restored = ckpt.restore(state)  # verified, RNG streams included
    start = restored[0] if restored else 0
    resume = str(args.ckpt_dir / f"step_{start}") if restored else None
    events.job_start(start, info.world_size, resume)
    if info.rank == 0:
        print(f"[train] {'resuming from ' + resume if resume else 'fresh start'}", flush=True)

    def save(done: int) -> None:
        ft.start_section("checkpointing")
        ckpt.save(done, state)
        ft.end_section("checkpointing")

    ft.end_section("setup")
    step = start
    reason = "completed"
    while step < args.steps:
        began = time.monotonic()
        ft.send_heartbeat()
        ft.start_section("step")
        faults.before_step(step)
        x, y = (t.to(device) for t in batch(args.seed, step, info.rank))
        loss = torch.nn.functional.mse_loss(timed_forward(x, faults.slow_now()), y)
        if faults.nan_now():
            loss = loss * float("nan")  # a fault on one rank only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if detector.check_loss(loss, step):  # every rank gets the same answer
            opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # the demo's pace: stands for more compute
        ft.end_section("step")
        events.emit(
            "step_done", step=step, seconds=round(time.monotonic() - began, 6), loss=loss.item()
        )
        if detector.should_rollback:  # every rank: the NaN checks were agreed
            back = ckpt.restore(state)
            to_step = back[0] if back else 0
            detector.reset()
            events.emit("rollback", step=step, cause="nan_burst", to_step=to_step)
            if info.rank == 0:
                print(f"[train] NaN burst: rolled back from step {step} to {to_step}", flush=True)
            step = to_step
            continue
        stragglers.check(step)  # a report every --straggler-interval s (collective)
        if step == args.calc_timeouts_at:
            ft.calculate_and_set_section_timeouts(["step"], calc_out_of_section=False)
            if info.rank == 0:
                save_ft_state(ft, args.ckpt_dir / "ft_state.json")
        done = step + 1
        if stop.should_shutdown(step):  # collective: all ranks stop after this step
            save(done)
            reason = "shutdown"
            break
        if done % args.save_every == 0 and detector.state.consecutive_nans == 0:
            save(done)  # never inside a NaN burst: a rollback must land before it
        step = done

    stop.finish()
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
