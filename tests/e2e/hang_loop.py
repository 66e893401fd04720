"""A loop of many short ``step`` sections in which one rank hangs, once per generation,
at a random step: how late does the launcher's watcher see it? (``steadfast launch``;
the hang-lag test and ``bench/bench_hang_lag.py``.)

    steadfast launch --nproc-per-node 2 --max-restarts N \
        --ft-rank-section-timeouts step:3 hang_loop.py --hangs N [--seed S]

Each step is ~``--step-seconds`` of work and an all-reduce inside the ``step`` section
(the hung rank's peer then blocks in its all-reduce, in its section too). In generation
``g < --hangs`` rank ``--rank`` hangs at a step drawn at random from
[``--min-step``, ``--max-step``], so the hang starts at a random phase of the watcher's
reads; generation ``--hangs`` runs ``--min-step`` steps and ends. With ``--late S`` the
hung rank opens the section it hangs in S seconds after its peer opened its own: the
peer's bound passes first, while the culprit is still within its own.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.distributed as dist

from steadfast import events
from steadfast.faults import FaultKind, fail_at
from steadfast.monitor import RankMonitorClient


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hangs", type=int, default=3)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-step", type=int, default=20)
    p.add_argument("--max-step", type=int, default=300)
    p.add_argument("--step-seconds", type=float, default=0.003)
    p.add_argument("--late", type=float, default=0.0)
    args = p.parse_args()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    dist.init_process_group("gloo")
    rng = random.Random(args.seed * 7919 + generation)
    hang_step = rng.randint(args.min_step, args.max_step)
    fault = fail_at(args.rank, hang_step, FaultKind.RANK_HUNG) if generation < args.hangs else None
    events.job_start(0, dist.get_world_size())
    x = torch.ones(1)
    step = 0
    while fault is not None or step < args.min_step:
        if fault is not None and step == hang_step and rank == args.rank:
            time.sleep(args.late)  # its peer opens this step's section first: its bound too
        ft.start_section("step")
        if fault is not None:
            fault.check(step, rank)  # never returns on the hung rank at its step
        end = time.perf_counter() + args.step_seconds
        while time.perf_counter() < end:  # the step's work
            pass
        dist.all_reduce(x)
        ft.end_section("step")
        step += 1
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
