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
- ``StragglerDetectionManager``: the forward pass (with ``--step-sleep``, the compute it
  stands for) is timed; a slowed rank is reported.
- ``ShutdownHandler(agree=True)``: a SIGTERM to one rank (a preemption) makes every rank
  save and exit 0 after the same step.
- events: ``job_start`` (with the process start time) and ``step_done`` for the goodput
  report (``steadfast report``); ``fault_injected`` for each injected fault. Under
  ``steadfast launch`` they go to the launcher's log (``--events`` / ``--run-dir``);
  run alone, to ``<ckpt-dir>/events.jsonl``.

Faults: ``--fault KIND:RANK:STEP[:LENGTH]``, repeatable, with the names of
``steadfast.faults.FaultKind`` (``rank_killed``, ``rank_hung``, ``exception``, ``exit``,
``nan_burst``, ``slow_rank``, ``sigterm``), injected by ``steadfast.faults.fail_at``:
each fires once per run, remembered in ``--fault-dir``, so the re-run of a step after a
restart or a rollback is clean. A NaN burst is LENGTH NaN losses in a row; a slow rank
is LENGTH forwards ``--slow-seconds`` slower.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steadfast import CheckpointManager, NaNDetector, ShutdownHandler, events, world_info
from steadfast.faults import FaultKind, InjectedFault, parse_fault
from steadfast.monitor import HB_TABLE_ENV, RankMonitorClient, load_ft_state, save_ft_state
from steadfast.straggler import NVRxStragglerDetectionConfig, StragglerDetectionManager


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument(
        "--memory-every", type=int, default=0, help="memory-tier snapshots (0: disk only)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds per step (pace), in the forward"
    )
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes final params")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--calc-timeouts-at", type=int, default=15, help="-1: keep the configured")
    p.add_argument(
        "--straggler-interval", type=float, default=2.0,
        help="seconds per straggler report (0: no straggler detection)",
    )  # fmt: skip
    p.add_argument(
        "--fault", action="append", default=[], metavar="KIND:RANK:STEP[:LENGTH]",
        help="a fault to inject once (repeatable), e.g. rank_killed:1:40, nan_burst:1:23:3",
    )  # fmt: skip
    p.add_argument("--fault-dir", type=Path, default=None, help="default: beside --ckpt-dir")
    p.add_argument("--slow-seconds", type=float, default=0.1, help="a slow_rank step's extra")
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


class Faults:
    """This run's injected faults (``fail_at``, once per run), and what they do to a step."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        once = args.fault_dir or args.ckpt_dir.parent / "faults"
        self.rank = rank
        self.planned: list[InjectedFault] = [
            parse_fault(spec, once_dir=once, seconds=args.slow_seconds) for spec in args.fault
        ]
        self.nan = False
        self.slow = 0.0

    def before_step(self, step: int) -> None:
        """Strike (a kill or a hang does not return); note a NaN loss or a slowdown."""
        self.nan, self.slow = False, 0.0
        for fault in self.planned:
            if fault.check(step, self.rank):
                if fault.kind is FaultKind.NAN_BURST:
                    self.nan = True
                elif fault.kind is FaultKind.SLOW_RANK:
                    self.slow = fault.seconds


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
    if not os.environ.get(events.EVENTS_ENV):  # run without the launcher
        events.set_default_path(args.ckpt_dir / "events.jsonl")
    faults = Faults(args, info.rank)

    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    # find_unused_parameters=True: DDP then never rebuilds its gradient buckets, so a
    # restarted run sums every gradient in the order the run that never stopped did, and
    # ends bit for bit where it would have with any number of ranks (docs/guides/
    # checkpoints.md, "Bit for bit with many ranks")
    model = DDP(net.to(device), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detector = NaNDetector(action="skip", max_consecutive=3)
    stop = ShutdownHandler(timeout_sec=60, agree=True)
    stop.register()
    stragglers = StragglerDetectionManager(
        NVRxStragglerDetectionConfig(
            enabled=args.straggler_interval > 0,
            report_time_interval=args.straggler_interval or 1.0,
            enable_logging=True,
        )
    )

    def forward(x: torch.Tensor, slow: float) -> torch.Tensor:
        out: torch.Tensor = model(x)  # no collective in the forward: it times this rank
        if args.step_sleep or slow:
            # the demo's pace stands for the model's compute, so it is timed with it:
            # the tiny model alone takes under a millisecond, whose noise (a scheduler
            # delay doubles it) a short scoring window would report as a straggler
            time.sleep(args.step_sleep + slow)  # slow: a slowed GPU
        return out

    timed_forward = stragglers.wrap_train_step(forward)

    # disk checkpoints every --save-every steps; a snapshot in host memory (replicated to
    # another node) every --memory-every, so a restart re-does (almost) nothing
    ckpt = CheckpointManager(args.ckpt_dir, keep_last_n=3, memory_every=args.memory_every)
    state = {"model": model.module, "optim": opt, "nan": detector}
    restored = ckpt.restore(state)  # verified, RNG streams included
    start = restored[0] if restored else 0
    resume = str(ckpt.loaded_path) if restored else None
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
        loss = torch.nn.functional.mse_loss(timed_forward(x, faults.slow), y)
        if faults.nan:
            loss = loss * float("nan")  # a fault on one rank only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if detector.check_loss(loss, step):  # every rank gets the same answer
            opt.step()
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
        if detector.state.consecutive_nans == 0:  # never inside a NaN burst: a
            if args.memory_every:  # rollback must land before it
                ckpt.snapshot(done, state)
            if done % args.save_every == 0:
                save(done)
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
