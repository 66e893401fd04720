"""NVRx's documented section pattern, for the floor under calculated timeouts:

    steadfast launch --nproc-per-node 2 --max-restarts 0 calc_loop.py --out OUT

Back-to-back ``step`` sections (a few microseconds outside them), timeouts calculated
at step 10 with NVRx's defaults (``calc_out_of_section=True``), then a 0.3 s pause
outside any section every 5 steps (a log line, a metric flush). Rank 0 writes the
calculated timeouts, as the client reports them, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from steadfast.monitor import RankMonitorClient


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")  # first, as NVRx's examples: the group's start
    ft = RankMonitorClient()  # (seconds on a busy machine) is not out-of-section time
    ft.init_workload_monitoring()
    x = torch.ones(1)
    for step in range(args.steps):
        ft.start_section("step")
        time.sleep(0.02)
        dist.all_reduce(x)
        ft.end_section("step")
        if step == 10:
            ft.calculate_and_set_section_timeouts()  # NVRx's defaults
        if step > 10 and step % 5 == 0:
            time.sleep(0.3)  # outside any section: far past the calculated timeout
    if dist.get_rank() == 0:
        sections = ft.section_timeouts
        assert sections is not None
        with open(args.out, "w") as f:
            json.dump({"out_of_section": sections.out_of_section}, f)
    ft.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
