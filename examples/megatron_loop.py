"""A Megatron Bridge style training loop: preemption, the re-run state machine and
checkpoints that carry both (seed 003).

    steadfast launch --nproc-per-node 2 examples/megatron_loop.py --ckpt-dir /tmp/ml

- **Preemption.** ``PreemptionHandler`` with ``exit_signal_handler=True``: a SIGTERM to
  any rank (Slurm sends it ``preempt_time`` seconds before the time limit when the job
  is submitted with ``sbatch --signal=B:TERM@60``, see ``sbatch_signal_option``) makes
  every rank save after the same step and exit 0. DataLoader workers get the handler's
  ``worker_init_fn``, so a signal to the whole process group does not kill them
  mid-batch.
- **Result attribution.** ``RerunStateMachine`` in ``validate_results`` mode checks every
  micro-batch's loss (NaN/Inf: fatal; a 10x spike: not fatal). A rejected step is re-run
  in place with the same micro-batches and RNG state; reproduced, every rank saves and
  exits 16 so the job is resubmitted on other hardware, where the step is re-run once
  more; a fatal result exits 17. ``steadfast launch`` restarts neither in place.
- **Checkpoints.** The model and optimizer are saved once; the machine's state and the
  data position go into each rank's own ``rank_state``, so a restart after exit 16
  re-runs the very step it left.

Faults to try: ``--sigterm-at STEP`` (rank 1 signals its process group after that
step's forward-backward, with SIGTERM or ``--signal``: under ``steadfast slurm`` the job
is preempted with its ``--preempt-signal``, which the handler takes as well) and
``--nan-at STEP`` (rank 1's loss is NaN at that step, on the hardware named by
``--nan-on``, default any). Rank 0 writes the final
parameters to ``--out`` when the run completes.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from steadfast import (
    CheckpointManager,
    DataPosition,
    PreemptionConfig,
    PreemptionHandler,
    ResumableSampler,
)
from steadfast.rerun import (
    HARDWARE_ID_ENV,
    RerunDataIterator,
    RerunStateMachine,
    RerunStateMachineConfig,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    p.add_argument("--rerun-mode", default="validate_results")
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--signal", default="TERM", help="what --sigterm-at sends (TERM, USR1)")
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--nan-on", default=None, help="only on this hardware id (default any)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'compute' a step")
    return p.parse_args()


def forever(position: DataPosition) -> Iterator[Any]:
    """Epoch after epoch; the position resumes mid-epoch after a restart."""
    while True:
        yield from position


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1024, 16, generator=g)
    dataset = TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True))
    sampler = ResumableSampler(len(dataset), world, rank, seed=7)
    preemption = PreemptionHandler(
        PreemptionConfig(exit_signal_handler=True, exit_signal_handler_for_dataloader=True)
    )
    loader = DataLoader(
        dataset,
        batch_size=8,
        sampler=sampler,
        num_workers=args.workers,
        worker_init_fn=preemption.dataloader_worker_init,
    )
    position = DataPosition(loader)
    machine = RerunStateMachine(
        RerunStateMachineConfig(
            rerun_mode=args.rerun_mode,
            check_for_spiky_loss=True,
            result_rejected_tracker_filename=str(args.ckpt_dir / "rerun_tracker.jsonl"),
        )
    )
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    model = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    ckpt = CheckpointManager(args.ckpt_dir, keep_last_n=2)
    state = {"model": net, "optim": opt}
    rank_state = {"rerun": machine, "data": position}  # per rank: results and data differ
    restored = ckpt.restore({**state, **rank_state})
    start = restored[0] if restored else 0
    data = RerunDataIterator(forever(position))
    nan_here = args.nan_on is None or os.environ.get(HARDWARE_ID_ENV) == args.nan_on
    code = 0
    completed = False
    with preemption:
        for step in range(start, args.steps):
            time.sleep(args.step_sleep)  # a longer step, for a signal to land mid-run
            while machine.should_run_forward_backward(data):
                opt.zero_grad(set_to_none=True)
                for _ in range(args.micro_batches):
                    bx, by = next(data)
                    loss = torch.nn.functional.mse_loss(model(bx), by) / args.micro_batches
                    if step == args.nan_at and rank == 1 and nan_here:
                        loss = loss * float("nan")
                    loss.backward()
                    machine.validate_loss(loss)
            should_checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
            if should_checkpoint:  # the step's update is not applied: resume at this step
                ckpt.save(step, state, rank_state=rank_state)
            if should_exit:  # 16: resubmit on other hardware; 17: a fatal result
                break
            opt.step()
            if step == args.sigterm_at and rank == 1:
                if os.getpgid(0) == os.getpid():  # this rank leads its group (launchers do)
                    os.killpg(0, signal.Signals["SIG" + args.signal])  # and its loader workers
                else:
                    os.kill(os.getpid(), signal.Signals["SIG" + args.signal])
            if preemption.should_exit(step):  # one small collective: every rank agrees
                ckpt.save(step + 1, state, rank_state=rank_state)
                break
            if (step + 1) % args.save_every == 0:
                ckpt.save(step + 1, state, rank_state=rank_state)
        else:
            completed = True
    ckpt.close()
    if completed and rank == 0 and args.out is not None:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.out)
    dist.destroy_process_group()
    if not completed and code == 0:
        preemption.exit()  # the seed's log line, then exit 0: the checkpoint is saved
    return code


if __name__ == "__main__":
    raise SystemExit(main())
