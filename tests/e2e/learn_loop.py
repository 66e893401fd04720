"""A training loop with nothing configured, for the learned hang timeouts (issue 30):

    steadfast launch --nproc-per-node 2 --max-restarts 1 learn_loop.py --out OUT \
        [--sections] [--hang-step K] [--ckpt-every N --ckpt-x X] [--eval-every N --eval-x X]
        [--slowdown F]

Each step is ``--step-seconds`` (times ``1 + (F - 1) * step / steps`` with ``--slowdown
F``: slower and slower) and an all-reduce; one heartbeat per step, and with
``--sections`` the NVRx section pattern: the step, a checkpoint save and an evaluation
pass each in a section of its own. ``--ckpt-every``/``--eval-every`` add a save or an
evaluation ``--ckpt-x``/``--eval-x`` times a step long. In the first generation rank
``--hang-rank`` hangs at step ``--hang-step`` (``fault_injected``: when); the next runs
``--steps-after`` steps. Rank 0 writes the final all-reduced value to ``--out``: the same
number as a fault-free run of as many steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from steadfast import events
from steadfast.faults import FaultKind, fail_at
from steadfast.monitor import RankMonitorClient


def expected(steps: int) -> float:
    """The value a fault-free run of ``steps`` steps ends with (2 ranks)."""
    x = 1.0
    for step in range(steps):
        x = 2 * (0.5 * x + step)
    return x


def pace(step_seconds: float, slowdown: float, step: int, steps: int) -> float:
    """How long step ``step`` of ``steps`` sleeps: ``step_seconds``, slower and slower
    with ``slowdown`` > 1."""
    return step_seconds * (1 + (slowdown - 1) * step / steps)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--steps-after", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.2)
    p.add_argument("--sections", action="store_true")
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-x", type=float, default=20)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-x", type=float, default=50)
    p.add_argument("--slowdown", type=float, default=1.0)
    args = p.parse_args()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    dist.init_process_group("gloo")
    fault = None
    steps = args.steps
    if generation == 0 and args.hang_step >= 0:
        fault = fail_at(args.hang_rank, args.hang_step, FaultKind.RANK_HUNG)
    elif generation > 0:
        steps = args.steps_after
    events.job_start(0, dist.get_world_size())

    def phase(name: str, seconds: float) -> None:
        if args.sections:
            ft.start_section(name)
        time.sleep(seconds)
        if args.sections:
            ft.end_section(name)

    x = torch.ones(1, dtype=torch.float64)
    for step in range(steps):
        seconds = pace(args.step_seconds, args.slowdown, step, steps)
        if args.sections:
            ft.start_section("step")
        if fault is not None:
            fault.check(step, rank)  # never returns on the hung rank at its step
        time.sleep(seconds)
        x = 0.5 * x + step
        dist.all_reduce(x)
        if args.sections:
            ft.end_section("step")
        ft.send_heartbeat()
        if args.ckpt_every and step and step % args.ckpt_every == 0:
            phase("checkpoint", args.ckpt_x * seconds)
        if args.eval_every and step and step % args.eval_every == 0:
            phase("eval", args.eval_x * seconds)
        if args.ckpt_every or args.eval_every:
            dist.barrier()  # as a save's or an evaluation's collectives would
    if rank == 0:
        with open(args.out, "w") as fh:
            fh.write(repr(float(x)))
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
